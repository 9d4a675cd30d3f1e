"""The GPU check's measurements besides the tests, into one JSON (bench/on_gpu.sh runs it):

    python bench/gpu_check.py --shape llama3.2-1b --out OUT/check-1b.json [--kinds bf16,int8,int4]
    python bench/gpu_check.py --dry-run --checkpoint DIR --out OUT/check.json    # the same on the CPU, small

For each kind (bf16, int8, int4 weights, q4_k: the layers' matrices in a GGUF's Q4_K blocks, which a GPU repacks
for torch's int4 product at load) of a random checkpoint of the shape:
- `load`: seconds to load (graphs captured and kernels compiled within it), which step ops the static decode
  step took (model/step_ops.py: "triton" or "torch"), the graphs captured, the weights' bytes;
- `replays`: the step of one row replayed alone (its CUDA graph), GPU time per step from CUDA events, the
  kernels a replay launches and the ten that take the most GPU time (torch.profiler over 5 replays), and the
  share of the measured copy bandwidth that reading the weights once a step makes;
- `eager`: the reference decode op by op (no graph) at a new key length each step;
- `one_stream`: a greedy reply through `generate` (prompt, then `--new` tokens, speculation off): decode
  tokens/s, and the time per token against the GPU time per step (what the host adds); `one_stream_chat_sampling`
  the same with a chat's sampling (temperature 0.7, top-p 0.9, repetition penalty 1.1);
- `streams`: `--streams` rows decoded together in static slots (greedy on the device): tokens/s in all;
- `served`: `--streams` requests at once through the app's engine in this process (its batches, chunked prefill,
  slots, speculation): time to first token and decode rate of each, tokens/s in all, and how many engine steps
  queued the next before reading its tokens (app/engine/ahead.py); `served_one` (bf16) one request the same way,
  beside `one_stream` through generate: what the engine adds.
A part that fails records its error and the others go on. Figures are what this machine did, this run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

import torch
from common import q4_k_checkpoint, random_checkpoint, random_prompt, tensor_bytes

import model
from model.generation import generate
from model.blocks import is_blocks
from model.packed import is_packed
from model.sampling import SamplingParams
from model.static_decode import new_cache

QUANTIZE = {"bf16": None, "int8": "int8", "int4": "int4", "q4_k": None}  # q4_k: a GGUF's blocks (q4_k_checkpoint)


def versions(device: torch.device) -> dict:
    found = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": str(device)}
    try:
        import triton
        found["triton"] = triton.__version__
    except ImportError:
        found["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        found |= {"gpu": props.name, "capability": list(torch.cuda.get_device_capability(device)),
                  "memory_gb": round(props.total_memory / 2**30, 1), "cudnn": torch.backends.cudnn.version()}
    return found


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, mib: int) -> float:
    """GB/s read by copying a buffer of `mib` MiB (read once, written once), best of 5."""
    a = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        synchronize(device)
        start = time.perf_counter()
        b.copy_(a)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return a.nbytes / best / 1e9


def prefilled(ckpt, prompt: list[int], max_len: int):
    cache = new_cache(ckpt.model, max_len, device=ckpt.device, dtype=ckpt.dtype)
    with torch.inference_mode():
        logits = ckpt.model(torch.tensor([prompt], device=ckpt.device), kv_cache=cache, last_only=True)[0, -1]
    cache.tokens.extend(prompt)
    return cache, logits


def replays(ckpt, prompt: list[int], bandwidth: float) -> dict:
    """The one-row step: GPU time from CUDA events (perf_counter on the CPU), kernels per step from the profile."""
    net, device = ckpt.model, ckpt.device
    cache, logits = prefilled(ckpt, prompt, len(prompt) + 64)
    token = logits.argmax().view(1)
    run = lambda: net.decode(token, [cache], positions=[len(prompt)])  # noqa: E731  (the same position each time)
    with torch.inference_mode():
        for _ in range(3):
            run()
        synchronize(device)
        n = 20
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(n):
                run()
            end.record()
            synchronize(device)
            step_ms = begin.elapsed_time(end) / n
        else:
            start = time.perf_counter()
            for _ in range(n):
                run()
            step_ms = (time.perf_counter() - start) * 1e3 / n
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(5):
                run()
            synchronize(device)
    kernels, gpu_us = Counter(), Counter()
    for event in prof.events():
        on_gpu = device.type == "cuda" and event.device_type == torch.autograd.DeviceType.CUDA
        if on_gpu or (device.type != "cuda" and event.device_type == torch.autograd.DeviceType.CPU
                      and event.name.startswith("aten::")):
            kernels[event.name] += 1
            gpu_us[event.name] += event.device_time if on_gpu else event.cpu_time
    weights = tensor_bytes(net)  # what a step reads: every weight once (fused q|k|v: views, counted once)
    return {"step_ms": round(step_ms, 4), "kernels_per_step": sum(kernels.values()) / 5,
            "top": [{"name": name[:90], "us_per_step": round(us / 5, 1), "calls_per_step": kernels[name] / 5}
                    for name, us in gpu_us.most_common(10)],
            "weights_mb": round(weights / 1e6, 1),
            "bandwidth_share": round(weights / (step_ms / 1e3) / 1e9 / bandwidth, 3) if bandwidth else None,
            "graphs": len(getattr(net.static, "graphs", {}) or {})}


def eager(ckpt, prompt: list[int], steps: int = 16) -> dict:
    """The reference decode, op by op (a cache of its own, not a slot): milliseconds a step over `steps` steps,
    each at a new key length, the first three apart. Where attention built a plan for each new length (cuDNN's
    SDPA, left out on CUDA: model/llama.py), every step would pay for one."""
    net, device = ckpt.model, ckpt.device
    cache = model.KVCache(ckpt.config, len(prompt) + steps + 1, device=device, dtype=ckpt.dtype)
    with torch.inference_mode():
        token = net(torch.tensor([prompt], device=device), kv_cache=cache, last_only=True)[0, -1].argmax().view(1)
        cache.tokens.extend(prompt)
        times = []
        for _ in range(steps):
            synchronize(device)
            start = time.perf_counter()
            token = net.decode(token, [cache])[0].argmax().view(1)
            synchronize(device)
            times.append(time.perf_counter() - start)
            cache.tokens.append(0)
    rest = sorted(times[3:])
    return {"first_ms": [round(t * 1e3, 2) for t in times[:3]], "median_ms": round(rest[len(rest) // 2] * 1e3, 3)}


# What a chat asks for: temperature, top-p and the repetition penalty Ollama and llama.cpp apply by default.
CHAT_SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1, seed=1)


def one_stream(ckpt, prompt: list[int], new: int, sampling: SamplingParams | None = None) -> dict:
    """One reply through generate, greedy (or `sampling`), speculation off."""
    reply = generate(ckpt, prompt, max_new_tokens=new, sampling=sampling or SamplingParams(), stop_ids=set(),
                     speculate="off")
    for _ in reply:
        pass
    return {"decode_tok_s": round(reply.stats.tokens_per_second, 2), "new_tokens": reply.stats.new_tokens,
            "in_slot": reply.kv_cache.slot is not None, "ttft_s": round(reply.stats.time_to_first_token, 4)}


def streams(ckpt, prompt: list[int], rows: int, steps: int) -> dict:
    """`rows` sequences in slots (where free) decoded together, greedy on the device, `steps` steps."""
    net, device = ckpt.model, ckpt.device
    caches, firsts = zip(*(prefilled(ckpt, prompt, len(prompt) + steps + 1) for _ in range(rows)))
    tokens = torch.stack([logits.argmax() for logits in firsts])
    with torch.inference_mode():
        synchronize(device)
        start = time.perf_counter()
        for i in range(steps):
            logits = net.decode(tokens, list(caches), positions=[len(prompt) + i] * rows)
            tokens = logits.argmax(-1)
        synchronize(device)
    seconds = time.perf_counter() - start
    return {"rows": rows, "in_slots": sum(cache.slot is not None for cache in caches),
            "tok_s": round(rows * steps / seconds, 2), "step_ms": round(seconds / steps * 1e3, 3)}


def served(path: Path, kind: str, device: torch.device, rows: int, new: int) -> dict:
    """`rows` requests at once through the app's engine (app/engine/core.py, in this process, without its
    sockets): its batches, chunked prefill, slots and speculation as the app runs them; greedy, the model loaded
    by the engine as the app loads it. Per request: time to first token and decode rate; in all: tokens/s, and
    how many of the engine's steps queued the next before reading its tokens."""
    from app.engine.core import Engine
    from app.messages import ChatMessage, Done, EngineConfig, Failed, Generate, ReplySettings

    events: list = []
    engine = Engine(EngineConfig(checkpoint=str(path), device=device.type, quantize=QUANTIZE[kind] or "off",
                                 kv_disk_mb=0, dtype="float32" if device.type == "cpu" else "auto"), events.append)
    engine.start()

    steps = {"steps": 0, "queued_ahead": 0}  # engine steps, and those that queued the next one before reading

    def run() -> None:
        while engine.busy or engine.models.loading or engine.preparing:
            if not engine.busy:
                time.sleep(0.002)
            engine.wait_for_prompts()
            engine.step()
            steps["steps"] += 1
            steps["queued_ahead"] += bool(engine._ahead)  # (app/engine/ahead.py)

    try:
        run()  # the default model loads at start
        words = "river stone light paper window garden music number silver morning".split()
        settings = ReplySettings(max_new_tokens=new, temperature=0.0)
        requests = [Generate(f"s{i}", path.name, settings, [ChatMessage("user", f"Request {i}: " + " ".join(
            words[(i * 7 + j) % len(words)] for j in range(60)))]) for i in range(rows)]
        start = time.perf_counter()
        for request in requests:
            engine.handle(request)
        run()
        seconds = time.perf_counter() - start
    finally:
        engine.close()
    ends = [e for e in events if isinstance(e, Done | Failed)]
    failed = [e.message for e in ends if isinstance(e, Failed)]
    done = [e for e in ends if isinstance(e, Done)]
    return {"rows": rows, "failed": failed, **steps,
            "tok_s": round(sum(d.stats.new_tokens for d in done) / seconds, 2),
            "decode_tok_s_each": [round(d.stats.tokens_per_second, 2) for d in done],
            "ttft_s_each": [round(d.stats.time_to_first_token, 3) for d in done]}


def part(found: dict, name: str, fn, *args) -> None:
    """found[name] = fn(*args), or the error it raised: one part failing leaves the others to run."""
    start = time.perf_counter()
    try:
        found[name] = fn(*args)
    except Exception as e:  # noqa: BLE001  (recorded for the report, then the next part runs)
        found[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
    found[name + "_s"] = round(time.perf_counter() - start, 2)
    print(f"[gpu_check] {name}: {json.dumps(found[name])[:400]}", flush=True)


def check_kind(path: Path, kind: str, device: torch.device, args, bandwidth: float) -> dict:
    found: dict = {}
    start = time.perf_counter()
    try:
        ckpt = model.load_checkpoint(path, device=device, quantize=QUANTIZE[kind], graphs=True,
                                     dtype=torch.float32 if device.type == "cpu" else None)  # (CPU: steps run eagerly)
    except Exception as e:  # noqa: BLE001
        return {"load": {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}}
    synchronize(device)
    static = ckpt.model.static
    found["load"] = {"seconds": round(time.perf_counter() - start, 2), "graphs": len(static.graphs) if static else 0,
                     "step_ops": static.ops.name if static else None, "dtype": str(ckpt.dtype),
                     "packed": sum(is_packed(getattr(m, "scale", None)) for m in ckpt.model.modules()),
                     "blocks": sum(is_blocks(getattr(m, "weight", None)) for m in ckpt.model.modules())}
    print(f"[gpu_check] {kind} load: {found['load']}", flush=True)
    prompt = random_prompt(ckpt.config.vocab_size, args.prompt)
    part(found, "replays", replays, ckpt, prompt, bandwidth)
    part(found, "eager", eager, ckpt, prompt)
    part(found, "one_stream", one_stream, ckpt, prompt, args.new)
    part(found, "one_stream_chat_sampling", one_stream, ckpt, prompt, args.new, CHAT_SAMPLING)
    part(found, "streams", streams, ckpt, prompt, args.streams, args.new // 4)
    one, step = found.get("one_stream", {}), found.get("replays", {})
    if one.get("decode_tok_s") and step.get("step_ms"):
        found["host_ms_per_token"] = round(1e3 / one["decode_tok_s"] - step["step_ms"], 4)
    del ckpt, static
    if device.type == "cuda":
        torch.cuda.empty_cache()
    part(found, "served", served, path, kind, device, args.streams, args.new // 2)
    if kind == "bf16":  # one request through the engine, beside one_stream through generate: the engine's own cost
        part(found, "served_one", served, path, kind, device, 1, args.new // 2)
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama3.2-1b")
    p.add_argument("--checkpoint", help="a checkpoint folder instead of the shape's random one")
    p.add_argument("--kinds", default="bf16,int8,int4")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--dry-run", action="store_true", help="on the CPU, small: proves the script runs")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = torch.device("cpu" if args.dry_run else "cuda")
    if args.dry_run:
        args.prompt, args.new, args.streams = min(args.prompt, 24), min(args.new, 8), min(args.streams, 2)
    path = Path(args.checkpoint) if args.checkpoint else random_checkpoint(args.shape)
    result = {"versions": versions(device), "shape": args.checkpoint or args.shape,
              "prompt_tokens": args.prompt, "new_tokens": args.new}
    result["copy_gb_s"] = round(copy_bandwidth(device, 16 if args.dry_run else 1024), 1)
    for kind in args.kinds.split(","):
        result[kind] = check_kind(q4_k_checkpoint(path) if kind == "q4_k" else path, kind, device, args,
                                  result["copy_gb_s"])
        Path(args.out).write_text(json.dumps(result, indent=1))  # what is done so far, if a limit stops us
    print(json.dumps({kind: {k: v for k, v in result[kind].items() if k in ("load", "host_ms_per_token")}
                      for kind in args.kinds.split(",")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
