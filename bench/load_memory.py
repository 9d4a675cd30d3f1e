"""Peak resident memory while loading a bf16 checkpoint: our loader against the naive one.

    python bench/load_memory.py [--shape llama3.2-1b] [--check] [--fp32-activations]

Ways (each in a fresh process, so peaks never mix):
  ours-bf16    model.load_checkpoint(folder, dtype=bfloat16): meta device + mmap + assign
  naive-bf16   Llama(config) built on CPU in bf16, safetensors.torch.load_file, load_state_dict
  ours-fp32    model.load_checkpoint(folder, dtype=float32)
  naive-fp32   the same naive steps with the model built in fp32
  ours-int8    model.load_checkpoint(folder, dtype=bfloat16, quantize="int8")
  ours-int4    model.load_checkpoint(folder, dtype=bfloat16, quantize="int4")
  ours-q4_k_m  model.load_checkpoint of the weights quantized by llama.cpp to Q4_K_M and imported (ours-q6_k: Q6_K);
               only when named in --ways (needs llama-cpp-python)

Peak RSS (VmHWM of /proc/self/status) is read after loading and again after a 512-token prefill (in
the engine's chunks, into a KV cache) and 128 decoded tokens, which touch every memory-mapped page. It counts file-backed pages of the mapping too (RssFile): the page
cache may already hold the file, but pages count once this process maps and touches them. (ru_maxrss
is kept in the JSON but not used: Linux carries it over from the parent process across fork and
exec, so a child can report its parent's peak.)
Requirement: peak <= 1.15 x weight bytes (in the run dtype) + 300 MB. --check exits 1 when an
`ours` row fails it.

--fp32-activations runs every way as on a CPU without bf16 arithmetic (AVX2 only, e.g. Zen 3): the
engine then computes in fp32 over the stored bf16 weights, and the decode kernel is the AVX2 build
(-march=znver3). Which memory a way holds depends on that choice of code path, not on the CPU that
runs it, so this measures the AVX2 machine's peak on any x86 CPU with AVX2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch  # noqa: E402  (imported by common after its path fix)
from common import (
    MB,
    engine_version,
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

WAYS = {  # name: (loader, load_checkpoint keywords); the file is always bf16
    "ours-bf16": ("ours", {"dtype": "bfloat16"}),
    "naive-bf16": ("naive", {"dtype": "bfloat16"}),
    "ours-fp32": ("ours", {"dtype": "float32"}),
    "naive-fp32": ("naive", {"dtype": "float32"}),
    "ours-int8": ("ours", {"dtype": "bfloat16", "quantize": "int8"}),
    "ours-int4": ("ours", {"dtype": "bfloat16", "quantize": "int4"}),
}
# The same weights quantized by llama.cpp to a GGUF kind and imported as our import keeps them (K-quants: the file's
# blocks, memory-mapped; bench/gguf_file.py, which needs llama-cpp-python): only when named in --ways.
GGUF_WAYS = {"ours-q4_k_m": "q4_k_m", "ours-q6_k": "q6_k"}
SLACK, OVERHEAD_MB = 1.15, 300.0
PROMPT_TOKENS, NEW_TOKENS = 512, 128


def load_ours(folder: Path, dtype: torch.dtype, **options):
    import model
    return model.load_checkpoint(folder, dtype=dtype, **options).model


def load_naive(folder: Path, dtype: torch.dtype):
    from safetensors.torch import load_file

    from model.checkpoint import compute_dtype, hf_to_ours
    from model.llama import Llama

    config = LlamaConfig.from_hf_config(folder / "config.json")
    torch.set_default_dtype(dtype)  # parameters are created in the run dtype, not fp32 then cast
    net = Llama(config)
    torch.set_default_dtype(torch.float32)
    state = {hf_to_ours(k): v for k, v in load_file(folder / "model.safetensors").items()}
    net.load_state_dict(state, strict=False)  # copies (and casts) into the model's own tensors
    del state
    net.tie_weights()
    net.compute_dtype = compute_dtype(dtype, torch.device("cpu"))  # the engine's policy for activations
    for norm in (m for m in net.modules() if isinstance(m, torch.nn.RMSNorm)):
        norm.weight.data = norm.weight.data.to(net.compute_dtype)
    net.setup_rope(2048)
    return net.eval().requires_grad_(False)


def worker(spec: dict, out: str) -> None:
    torch.set_num_threads(spec["threads"])
    if spec["fp32_activations"]:
        import model.checkpoint
        model.checkpoint.has_native_bf16 = lambda: False  # the engine's dtype policy asks this
    folder, options = Path(spec["folder"]), dict(spec["options"])
    dtype = torch_dtype(options.pop("dtype"))
    before = memory_mb()
    start = time.perf_counter()
    net = load_ours(folder, dtype, **options) if spec["loader"] == "ours" else load_naive(folder, dtype)
    load_s = time.perf_counter() - start
    after_load = memory_mb()
    generate(net, random_prompt(net.config.vocab_size, PROMPT_TOKENS), NEW_TOKENS)
    after_run = memory_mb()
    write_result(out, {"load_s": load_s, "compute_dtype": str(net.compute_dtype),
                       "weight_bytes": tensor_bytes(net), "before": before, "after_load": after_load,
                       "after_run": after_run})


@torch.inference_mode()
def generate(net, prompt: list[int], new_tokens: int) -> None:
    """The engine's work on one request: the prompt in PREFILL_CHUNK chunks into a KV cache, then one
    token at a time (greedy)."""
    from model.generation import PREFILL_CHUNK
    from model.kv_cache import KVCache

    cache = KVCache(net.config, len(prompt) + new_tokens, dtype=net.compute_dtype)
    for start in range(0, len(prompt), PREFILL_CHUNK):
        chunk = prompt[start:start + PREFILL_CHUNK]
        logits = net(torch.tensor([chunk]), start_pos=start, kv_cache=cache, last_only=True)[:, -1]
        cache.tokens.extend(chunk)
    for _ in range(new_tokens):
        token = int(logits.argmax())
        logits = net.decode(torch.tensor([token]), [cache])
        cache.tokens.append(token)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.split("\n")[2:]))
    p.add_argument("--shape", default="llama3.2-1b", help="a LlamaConfig preset (default: llama3.2-1b)")
    p.add_argument("--ways", default="all",
                   help=f"comma list among {', '.join([*WAYS, *GGUF_WAYS])} (default: all but the GGUF ways)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--check", action="store_true", help="exit 1 if one of our rows fails the requirement")
    p.add_argument("--fp32-activations", action="store_true",
                   help="compute as on a CPU without bf16 arithmetic, with the AVX2 kernel build")
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--idle-wait", type=float, default=60.0,
                   help="before each way, wait up to this many seconds for other processes to go quiet")
    worker_arguments(p)
    args = p.parse_args()
    if ran_as_worker(args, worker):
        return 0

    folder = random_checkpoint(args.shape)
    config = LlamaConfig.preset(args.shape)
    file_mb = (folder / "model.safetensors").stat().st_size / MB
    wanted = None if args.ways == "all" else set(args.ways.split(","))
    rows = []
    engine = engine_version()
    if args.fp32_activations:
        os.environ["LLAMA_KERNEL_MARCH"] = "znver3"  # the workers inherit it: the AVX2 build
    print(f"{args.shape}: {n_params(config) / 1e9:.3f} B parameters, file {file_mb:.0f} MB (bf16), "
          f"{args.threads} threads{', fp32 activations, AVX2 kernels' if args.fp32_activations else ''}; "
          f"engine at {engine}")
    ways = {**WAYS, **{name: ("ours", {"dtype": "bfloat16"}) for name in GGUF_WAYS if wanted and name in wanted}}
    for name, (loader, options) in ways.items():
        if wanted and name not in wanted:
            continue
        way_folder = folder
        if name in GGUF_WAYS:  # made before the worker starts, so its memory is not the worker's
            from gguf_file import imported_checkpoint
            way_folder = imported_checkpoint(folder, args.shape, GGUF_WAYS[name])
        r = run_worker(Path(__file__), {"loader": loader, "options": options, "folder": str(way_folder),
                                        "threads": args.threads, "fp32_activations": args.fp32_activations},
                       idle_wait=args.idle_wait)
        rows.append({"way": name, "loader": loader, "options": options, **r})

    header = ("| way | compute | load s | peak RSS after load MB | peak RSS after prefill + decode MB "
              "| of which file-backed MB | weight MB | peak / weights | limit MB | verdict |")
    print()
    print(header)
    print("|" + "---|" * header.count(" | ") + "---|")
    failed = False
    for r in rows:
        if "error" in r:
            print(f"| {r['way']} | {r['error']} |")
            failed |= r["loader"] == "ours"
            continue
        weights = r["weight_bytes"] / MB
        peak = r["after_run"]["hwm"]
        limit = SLACK * weights + OVERHEAD_MB
        ok = peak <= limit
        r.update(peak_mb=peak, weight_mb=weights, limit_mb=limit, passed=ok)
        failed |= r["loader"] == "ours" and not ok
        print(f"| {r['way']} | {r['compute_dtype'].removeprefix('torch.')} | {r['load_s']:.1f} | "
              f"{r['after_load']['hwm']:.0f} | {peak:.0f} | {r['after_run']['file']:.0f} | {weights:.0f} | "
              f"{peak / weights:.2f} | "
              f"{limit:.0f} | {'PASS' if ok else 'FAIL'} |")
    print(f"\nlimit = {SLACK} x weight bytes as loaded + {OVERHEAD_MB:.0f} MB; "
          f"RSS of the process before loading (torch and model imported): {rows[0]['before']['rss']:.0f} MB"
          if rows and "before" in rows[0] else "")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"shape": args.shape, "engine": engine, "rows": rows,
                                         "fp32_activations": args.fp32_activations}, indent=2))
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    sys.exit(main())
