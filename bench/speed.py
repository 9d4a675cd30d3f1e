"""Prefill and decode speed of our engine against transformers (and llama.cpp), on the same random weights.

    python bench/speed.py [--shape llama3.2-1b] [--threads N] [--only ours,transformers] [--device cuda]

Every system runs in its own fresh process, on one random bf16 checkpoint of the preset's shape, with
the same prompt of random ids. Per system: load time, peak RSS, time to first token (TTFT) of the
first request after loading ("cold": pages of the mapped file are read, kernels are primed) and of
later ones, prefill tokens/s and decode tokens/s:

    t1 = time to generate 1 token   (median of --repeats; = TTFT)    prefill tok/s = prompt / t1
    tN = time to generate N tokens  (greedy, stop tokens disabled)    decode tok/s = (N - 1) / (tN - t1)

With --device cuda (or mps) ours and transformers run on that GPU (llama.cpp rows are skipped: the bench's
llama-cpp-python is a CPU build), the bandwidth is the GPU's, and the peak GPU memory is reported too. Two
rows run only there: ours without CUDA graphs ("no graphs"), and transformers with a static cache and
torch.compile ("compiled", its fastest configuration).

The machine's read bandwidth (x.sum() over 1 GB, best of 6) gives the decode ceiling: one token
reads every weight matrix once, so no engine decodes faster than bandwidth / those bytes (for our
int8 and int4 rows the bf16 embedding table is not among them: only its quantized copy, the output head,
is read).
Results: a table on stdout, bench/results/<shape>.json, and docs/benchmarks-<shape>.png.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch  # noqa: E402  (imported by common after its path fix)
from common import (
    RESULTS,
    ROOT,
    engine_version,
    machine,
    memory_mb,
    n_params,
    ran_as_worker,
    random_checkpoint,
    random_prompt,
    run_worker,
    tensor_bytes,
    worker_arguments,
    write_result,
)

from model.checkpoint import torch_dtype  # noqa: E402
from model.config import LlamaConfig  # noqa: E402


@dataclass(frozen=True)
class Runner:
    name: str
    system: str  # "ours", "transformers" or "llama.cpp"
    options: dict = field(default_factory=dict)  # ours: load_checkpoint keywords (dtype by name; fused=False: op by op)
    baseline: str | None = None  # the row this one's ratios are taken against
    warmup_tokens: int = 0  # an untimed generation after the cold one (e.g. to compile the decode step)
    gpu_only: bool = False  # a row that compares something only a GPU has (CUDA graphs); skipped on the CPU


# One line per system; `options` of an `ours` row are load_checkpoint's keywords, so an engine option is one
# more line here (or `--variant` on the command line).
RUNNERS = [
    Runner("ours bf16", "ours", {"dtype": "bfloat16"}, baseline="transformers bf16"),
    Runner("ours bf16 op by op", "ours", {"dtype": "bfloat16", "fused": False}, baseline="transformers bf16"),
    Runner("ours fp32", "ours", {"dtype": "float32"}, baseline="transformers fp32"),
    Runner("ours int8", "ours", {"dtype": "bfloat16", "quantize": "int8"}, baseline="transformers bf16"),
    Runner("ours int4", "ours", {"dtype": "bfloat16", "quantize": "int4"}, baseline="transformers bf16"),
    Runner("ours bf16 compiled", "ours", {"dtype": "bfloat16", "compile": True}, baseline="transformers bf16",
           warmup_tokens=8),
    # On CUDA, ours decodes in CUDA graphs over static KV slots by default (model/static_decode.py); this
    # row is the same model op by op, and "ours bf16 compiled" fuses the step's small ops before capture.
    Runner("ours bf16 no graphs", "ours", {"dtype": "bfloat16", "graphs": False}, baseline="transformers bf16",
           gpu_only=True),
    Runner("transformers bf16", "transformers", {"dtype": "bfloat16"}),
    # transformers' fastest configuration on a GPU: a static cache and its forward compiled with CUDA graphs
    Runner("transformers bf16 compiled", "transformers", {"dtype": "bfloat16", "cache": "static", "compile": True},
           warmup_tokens=8, gpu_only=True),
    Runner("transformers fp32", "transformers", {"dtype": "float32"}),
    Runner("llama.cpp bf16", "llama.cpp", {"gguf": "bf16"}),
    Runner("llama.cpp f16", "llama.cpp", {"gguf": "f16"}),
    Runner("llama.cpp q8_0", "llama.cpp", {"gguf": "q8_0"}),
    Runner("llama.cpp q4_0", "llama.cpp", {"gguf": "q4_0"}),  # llama-quantize's recipe: Q6_K head
    Runner("llama.cpp q4_0 pure", "llama.cpp", {"gguf": "q4_0-pure"}),  # every matrix Q4_0, the head too
]


# ---------------------------------------------------------------------------------------------------------
# Workers: one system in one process


def timed_runs(run, prompt: list[int], spec: dict) -> dict:
    """run(n) -> (seconds, new token ids). Cold TTFT, then medians of t1 and tN."""
    n, repeats, budget = spec["new_tokens"], spec["repeats"], spec["budget_s"]
    cold, _ = run(1)
    warmup_s = run(spec["warmup_tokens"])[0] if spec.get("warmup_tokens") else 0.0
    t1 = [cold] if cold > budget else []  # too slow to repeat: the cold run is the sample
    while len(t1) < repeats and (not t1 or sum(t1) + t1[0] < budget):
        t1.append(run(1)[0])
    tn, tokens = [], []
    while len(tn) < spec["decode_repeats"] and (not tn or sum(tn) + tn[0] < budget):
        seconds, tokens = run(n)
        tn.append(seconds)
    first, full = statistics.median(t1), statistics.median(tn)
    # tN <= t1 happens only when something else took the CPU during the 1-token runs: no figure then.
    return {"cold_ttft_s": cold, "warmup_s": warmup_s, "ttft_s": first, "t1_s": t1, "tn_s": tn,
            "prefill_tps": len(prompt) / first, "decode_tps": (n - 1) / (full - first) if full > first else 0.0,
            "tokens": tokens[:16]}


def work_ours(spec: dict, prompt: list[int]) -> dict:
    import model

    options = dict(spec["options"])
    dtype = torch_dtype(options.pop("dtype"))
    fused = options.pop("fused", True)  # False: decode runs the reference, op by op (Llama.fused_decode)
    start = time.perf_counter()
    ckpt = model.load_checkpoint(spec["folder"], dtype=dtype, device=spec["device"], **options)
    ckpt.model.fused_decode = fused
    load_s, after_load = time.perf_counter() - start, memory_mb()

    def run(n):
        start = time.perf_counter()
        gen = model.generate(ckpt, prompt, max_new_tokens=n, temperature=0.0, stop_ids=set())
        for _ in gen:
            pass
        assert len(gen.tokens) == n, (len(gen.tokens), gen.finish_reason)
        return time.perf_counter() - start, gen.tokens

    return {"load_s": load_s, "rss_after_load_mb": after_load["rss"], "weight_bytes": tensor_bytes(ckpt.model),
            "decode_bytes": decode_bytes(ckpt.model), **timed_runs(run, prompt, spec)}


def decode_bytes(net) -> int:
    """Bytes one decode step reads: every weight matrix (and int8/int4 scales and offsets) once; the
    embedding table only where it is also the output head. Norms are too small to count."""
    from model.linear import Linear
    return sum(m.weight.nbytes + sum(b.nbytes for b in (m.scale, m.offset) if b is not None)
               for m in net.modules() if isinstance(m, Linear))


def work_transformers(spec: dict, prompt: list[int]) -> dict:
    import transformers

    options = spec["options"]
    start = time.perf_counter()
    net = transformers.LlamaForCausalLM.from_pretrained(spec["folder"], dtype=torch_dtype(options["dtype"]))
    net = net.to(spec["device"]).eval()
    if options.get("compile"):  # as transformers' docs give it for a static cache
        net.forward = torch.compile(net.forward, mode="reduce-overhead", fullgraph=True)
    load_s, after_load = time.perf_counter() - start, memory_mb()
    ids = torch.tensor([prompt], device=spec["device"])
    extra = {"cache_implementation": options["cache"]} if options.get("cache") else {}

    def run(n):
        start = time.perf_counter()
        out = net.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0, **extra)
        synchronize(spec["device"])
        seconds = time.perf_counter() - start
        assert out.shape[1] == len(prompt) + n, out.shape
        return seconds, out[0, len(prompt):].tolist()

    return {"load_s": load_s, "rss_after_load_mb": after_load["rss"], "weight_bytes": tensor_bytes(net),
            "version": transformers.__version__, **timed_runs(run, prompt, spec)}


def work_llama_cpp(spec: dict, prompt: list[int]) -> dict:
    import llama_cpp
    import numpy as np

    path = spec["gguf_path"]
    start = time.perf_counter()
    llm = llama_cpp.Llama(model_path=path, n_ctx=len(prompt) + spec["new_tokens"] + 16, n_batch=len(prompt),
                          n_ubatch=len(prompt), n_threads=spec["threads"], n_threads_batch=spec["threads"],
                          verbose=False)
    load_s, after_load = time.perf_counter() - start, memory_mb()

    n_vocab = llm.n_vocab()

    def greedy() -> int:  # logits of the last evaluated token (llama-cpp-python no longer keeps them)
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))))

    def run(n):
        start = time.perf_counter()
        llm.reset()  # the next eval drops the cached positions
        llm.eval(prompt)
        tokens = [greedy()]
        while len(tokens) < n:
            llm.eval([tokens[-1]])
            tokens.append(greedy())
        return time.perf_counter() - start, tokens

    return {"load_s": load_s, "rss_after_load_mb": after_load["rss"], "weight_bytes": Path(path).stat().st_size,
            "version": llama_cpp.__version__, **timed_runs(run, prompt, spec)}


def synchronize(device: str) -> None:
    """Wait for the GPU's queued work (a no-op on the CPU), so a host clock times it."""
    if device == "cuda":
        torch.cuda.synchronize()
    elif device == "mps":
        torch.mps.synchronize()


def work_bandwidth(spec: dict) -> dict:
    """Best x.sum() over a 1 GB float32 tensor: on all threads and on one, or on the GPU."""
    device = spec.get("device", "cpu")
    x = torch.ones(2**28, device=device)  # 1 GiB
    result = {"bytes": x.nbytes}
    if device != "cpu":
        best = float("inf")
        for _ in range(20):
            synchronize(device)
            start = time.perf_counter()
            x.sum().item()
            best = min(best, time.perf_counter() - start)
        result["gbps"] = x.nbytes / best / 1e9
        return result
    for threads in sorted({spec["threads"], 1}, reverse=True):
        torch.set_num_threads(threads)
        best = float("inf")
        for _ in range(6):
            start = time.perf_counter()
            x.sum().item()
            best = min(best, time.perf_counter() - start)
        result[f"gbps_{threads}_threads"] = x.nbytes / best / 1e9
    result["gbps"] = result[f"gbps_{spec['threads']}_threads"]
    return result


WORKERS = {"ours": work_ours, "transformers": work_transformers, "llama.cpp": work_llama_cpp}


def worker(spec: dict, out: str) -> None:
    torch.set_num_threads(spec["threads"])
    if spec["system"] == "bandwidth":
        write_result(out, work_bandwidth(spec))
        return
    prompt = random_prompt(spec["vocab_size"], spec["prompt_tokens"])
    result = WORKERS[spec["system"]](spec, prompt)
    result["peak_rss_mb"] = memory_mb()["hwm"]  # not ru_maxrss: a child inherits its parent's
    if spec.get("device") == "cuda":
        result["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    write_result(out, result)


# ---------------------------------------------------------------------------------------------------------
# The parent: run each system, print, save, chart


def parse_variant(text: str) -> Runner:
    """'ours x:dtype=bfloat16,quantize=int8' -> an `ours` runner with those load_checkpoint keywords."""
    name, _, opts = text.partition(":")
    options = {}
    for item in filter(None, opts.split(",")):
        key, _, value = item.partition("=")
        options[key] = {"true": True, "false": False}.get(value.lower(), int(value) if value.isdigit() else value)
    options.setdefault("dtype", "bfloat16")
    baseline = "transformers fp32" if options["dtype"] == "float32" else "transformers bf16"
    return Runner(name.strip(), "ours", options, baseline=baseline)


def selected(runners: list[Runner], only: str | None, skip: str | None) -> list[Runner]:
    def matches(r, words):
        return any(w.strip() and w.strip() in r.name for w in words.split(","))
    return [r for r in runners if (not only or matches(r, only)) and not (skip and matches(r, skip))]


REFERENCES = ("transformers fp32", "ours fp32")  # the greedy tokens others are compared with
DISTURBED = 0.25  # cores used by other processes above which a row is marked in the chart
GPU_WARMUP_TOKENS = 16


def quieter(new: dict, old: dict | None) -> bool:
    """Whether `new` is the better measurement of a row: no error, and less disturbed (0.05 cores of slack)."""
    if old is None or "error" in old:
        return True
    if "error" in new:
        return False
    return new["other_load_cores"] <= max(old["other_load_cores"], 0.05)


def ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def agreement(tokens: list[int], reference: list[int]) -> int:
    """How many leading greedy tokens two systems share."""
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))


def print_table(rows: list[dict], bandwidth: dict) -> None:
    by_name = {r["name"]: r for r in rows}
    reference = next((by_name[n] for n in REFERENCES if "tokens" in by_name.get(n, {})), None)
    print("| system | load s | peak RSS MB | cold TTFT s | TTFT s | prefill tok/s | decode tok/s "
          "| decode % of ceiling (tok/s) | prefill vs baseline | decode vs baseline | greedy tokens = reference "
          "| other load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['name']} | {r['error']} |" + " |" * 10)
            continue
        same = f"{agreement(r['tokens'], reference['tokens'])}/{len(r['tokens'])}" if reference else "-"
        base = by_name.get(r.get("baseline") or "", {})
        ceiling = bandwidth["gbps"] * 1e9 / r.get("decode_bytes", r["weight_bytes"])
        r["ceiling_tps"], r["of_ceiling"] = ceiling, r["decode_tps"] / ceiling
        print(f"| {r['name']} | {r['load_s']:.1f} | {r['peak_rss_mb']:.0f} | {r['cold_ttft_s']:.2f} | "
              f"{r['ttft_s']:.2f} | {r['prefill_tps']:.1f} | {r['decode_tps']:.2f} | "
              f"{100 * r['of_ceiling']:.0f}% of {ceiling:.1f} | "
              f"{ratio(r['prefill_tps'], base.get('prefill_tps'))} | "
              f"{ratio(r['decode_tps'], base.get('decode_tps'))} | "
              f"{same} | {r['other_load_cores']:.2f} |")
    print("\nother load: cores used by other processes during the row (0 = a quiet machine)")
    if reference:
        print(f"greedy tokens = reference: leading tokens of the decode run equal to {reference['name']}'s")


def chart(rows: list[dict], shape: str, bandwidth: dict, path: Path) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no chart: matplotlib is not installed (pip install matplotlib)"
    rows = [r for r in rows if "error" not in r]
    names = [r["name"] for r in rows][::-1]
    colors = ["tab:blue" if r["system"] == "ours" else "tab:gray" if r["system"] == "transformers"
              else "tab:orange" for r in rows][::-1]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 0.5 * len(rows) + 1.6), sharey=True)
    for ax, key, title in ((left, "prefill_tps", f"prefill tokens/s ({rows[0]['prompt_tokens']}-token prompt)"),
                           (right, "decode_tps", f"decode tokens/s ({rows[0]['new_tokens']} new tokens)")):
        values = [r[key] for r in rows][::-1]
        marks = [" *" if r["other_load_cores"] > DISTURBED else "" for r in rows][::-1]
        ax.barh(names, values, color=colors)
        for y, (v, mark) in enumerate(zip(values, marks)):
            ax.text(v, y, f" {v:.1f}{mark}", va="center", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.margins(x=0.18)
    drawn = set()
    for r in rows:  # one dashed line per distinct weight size of ours: the decode ceiling
        if r["system"] == "ours" and round(r["ceiling_tps"], 1) not in drawn:
            drawn.add(round(r["ceiling_tps"], 1))
            right.axvline(r["ceiling_tps"], color="tab:red", linestyle="--", linewidth=0.8)
            right.text(r["ceiling_tps"], len(rows) - 0.5, f" ceiling {r['name'].split()[-1]}", color="tab:red",
                       fontsize=7, va="top")
    fig.suptitle(f"{shape}, random weights, {rows[0]['threads']} threads; "
                 f"read bandwidth {bandwidth['gbps']:.1f} GB/s", fontsize=10)
    if any(r["other_load_cores"] > DISTURBED for r in rows):
        fig.text(0.01, 0.01, f"* measured while other processes used more than {DISTURBED} cores", fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return f"chart: {path.relative_to(ROOT)}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.split("\n")[2:]))
    p.add_argument("--shape", default="llama3.2-1b",
                   help="a LlamaConfig preset: llama3.2-1b (default), llama3.2-3b, smollm2-135m, ...")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="default: all cores")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="runs of the 1-token generation (median)")
    p.add_argument("--decode-repeats", type=int, default=1, help="runs of the N-token generation (median)")
    p.add_argument("--budget", type=float, default=40.0,
                   help="stop repeating a measurement once it has used this many seconds (default 40)")
    p.add_argument("--only", help="comma list: run only systems whose name contains one of these")
    p.add_argument("--skip", help="comma list: skip systems whose name contains one of these")
    p.add_argument("--variant", action="append", default=[], metavar="'NAME:key=value,...'",
                   help="add an `ours` row with these load_checkpoint keywords, e.g. "
                        "'ours compiled:dtype=bfloat16,compile=true' (repeatable)")
    p.add_argument("--hf-cache", default=None,
                   help="transformers cache_implementation (default: its dynamic cache; 'static' also works)")
    p.add_argument("--idle-wait", type=float, default=120.0,
                   help="before each system, wait up to this many seconds for other processes to go quiet")
    p.add_argument("--retries", type=int, default=1,
                   help=f"measure a system again (up to this many times) when other processes used more than "
                        f"{DISTURBED} cores during its run; the quieter measurement is kept (default 1)")
    p.add_argument("--merge", action="store_true",
                   help="merge into bench/results/<shape>.json: keep its rows that this run does not "
                        "measure, and of two measurements of a row the one less disturbed by other processes "
                        "(for our engine, the one of the current model/ code)")
    p.add_argument("--no-chart", action="store_true")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "mps"),
                   help="where ours and transformers run (default: cpu)")
    worker_arguments(p)
    args = p.parse_args()
    if ran_as_worker(args, worker):
        return 0

    config = LlamaConfig.preset(args.shape)
    runners = selected(RUNNERS + [parse_variant(v) for v in args.variant], args.only, args.skip)
    folder = random_checkpoint(args.shape)
    common = {"folder": str(folder), "threads": args.threads, "vocab_size": config.vocab_size,
              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "repeats": args.repeats,
              "decode_repeats": args.decode_repeats, "budget_s": args.budget, "device": args.device}
    info = machine()
    if args.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    print(f"{args.shape}: {n_params(config) / 1e9:.3f} B parameters; {info['cpu']}, {args.threads} threads, "
          f"torch {info['torch']} ({info['torch_cpu_capability']})"
          + (f"; on {info.get('gpu', args.device)}" if args.device != "cpu" else ""), flush=True)
    bandwidth = run_worker(Path(__file__), {"system": "bandwidth", "threads": args.threads, "device": args.device},
                           idle_wait=args.idle_wait)
    where = args.device if args.device != "cpu" else f"{args.threads} threads"
    print(f"read bandwidth: {bandwidth['gbps']:.1f} GB/s on {where}"
          f" ({bandwidth.get('gbps_1_threads', 0):.1f} on 1; other load {bandwidth['other_load_cores']:.2f} cores)",
          flush=True)

    rows = []
    for r in runners:
        # On a GPU the first decode steps of a process load (or JIT-compile) the kernels of one-row products:
        # a reply of 16 tokens first, so tN times the steady step (the cold TTFT still shows the first load).
        warmup = r.warmup_tokens if args.device == "cpu" else max(r.warmup_tokens, GPU_WARMUP_TOKENS)
        spec = common | {"system": r.system, "options": r.options, "warmup_tokens": warmup}
        if r.gpu_only and args.device == "cpu":
            print(f"{r.name}: skipped, it compares what only a GPU has", flush=True)
            continue
        if r.system == "llama.cpp":
            if args.device != "cpu":
                print(f"{r.name}: skipped, the bench runs llama.cpp on the CPU only", flush=True)
                continue
            if importlib.util.find_spec("llama_cpp") is None:
                print(f"{r.name}: skipped, llama-cpp-python is not installed", flush=True)
                continue
            from gguf_file import gguf_checkpoint
            spec["gguf_path"] = str(gguf_checkpoint(folder, args.shape, r.options["gguf"]))
        if r.system == "transformers" and args.hf_cache:
            spec["options"] = r.options | {"cache": args.hf_cache}
        print(f"{r.name} ...", flush=True)
        result = run_worker(Path(__file__), spec, idle_wait=args.idle_wait)
        for _ in range(args.retries):  # measured while other processes were busy: try again, keep the quieter
            if "error" in result or result["other_load_cores"] <= DISTURBED:
                break
            print(f"  other processes used {result['other_load_cores']:.2f} cores meanwhile; measuring again",
                  flush=True)
            again = run_worker(Path(__file__), spec, idle_wait=args.idle_wait)
            result = again if quieter(again, result) else result
        rows.append({"name": r.name, "system": r.system, "options": spec["options"], "baseline": r.baseline,
                     "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"), "engine": engine_version(),
                     "threads": args.threads, "prompt_tokens": args.prompt_tokens,
                     "new_tokens": args.new_tokens, **result})
        if "error" not in result:
            gpu = f", peak GPU memory {result['peak_gpu_mb']:.0f} MB" if "peak_gpu_mb" in result else ""
            print(f"  load {result['load_s']:.1f} s, prefill {result['prefill_tps']:.1f} tok/s, "
                  f"decode {result['decode_tps']:.2f} tok/s, peak RSS {result['peak_rss_mb']:.0f} MB{gpu}", flush=True)

    out = RESULTS / f"{args.shape}{'' if args.device == 'cpu' else '-' + args.device}.json"
    if args.merge and out.is_file():
        order = [r.name for r in RUNNERS]
        stored = json.loads(out.read_text())
        if not quieter(bandwidth, stored["bandwidth"]):
            bandwidth = stored["bandwidth"]
        merged = {r["name"]: r for r in stored["rows"]}
        for r in rows:
            old = merged.get(r["name"])
            newer_engine = old is not None and r["system"] == "ours" and r["engine"] != old.get("engine")
            if newer_engine or quieter(r, old):
                merged[r["name"]] = r
        rows = sorted(merged.values(), key=lambda r: order.index(r["name"]) if r["name"] in order else len(order))
    print()
    print_table(rows, bandwidth)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"shape": args.shape, "config": asdict(config), "parameters": n_params(config),
                               "machine": info, "bandwidth": bandwidth, "settings": common,
                               "rows": rows}, indent=2, default=str))
    print(f"\nresults: {out.relative_to(ROOT)}")
    if not args.no_chart:
        print(chart(rows, args.shape, bandwidth, ROOT / "docs" / f"benchmarks-{args.shape}.png"))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
