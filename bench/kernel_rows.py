"""What a row more costs a decode step: the fused layers (decode_layers) and the output head of one model for
1, 2, 4 and 8 rows of x (a speculative check: rows at consecutive positions of one cache), this tree's kernel
beside another checkout's, in one process.

    python bench/kernel_rows.py [--baseline TREE] [--shape default|llama3.2-1b] [--dtype bfloat16]
                                [--quantize int8|int4] [--rows 1,2,4,8] [--rounds 15] [--threads 1]

--baseline: a checkout of another commit (a git worktree); its csrc/ is compiled with this tree's flags under
another name, so both builds load side by side and take the same weights, cache and x. Each round times both,
in turn (the order alternating), --iters calls each; a figure is the median over rounds of the thread's CPU
time per call on 1 thread (other processes on the machine take wall time, not this), of wall time on more. `--shape default`: the default model's
own weights as served (its Q4_1 blocks, its Q8_0 head). "a row more": (step of M rows - step of 1) / (M - 1),
as a share of the 1-row step. Prints a table; writes bench/results/kernel_rows.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch  # noqa: E402  (imported by common after its path fix)
from common import CACHE, RESULTS, cpu_busy_s, machine, random_checkpoint

import model  # noqa: E402
from model.decode_step import decode_layers  # noqa: E402
from model.kernels import build, cflags, configured  # noqa: E402
from model.options import DEFAULT_MODEL_NAME, DEFAULT_WEIGHTS_DIR  # noqa: E402


def baseline_ops(tree: Path, march: str):
    """The ops of `tree`'s csrc/ built with -march=`march` under a name of their own (cached by its sources)."""
    from torch.utils.cpp_extension import load

    csrc = tree / "model" / "csrc"
    sources = sorted(p for p in csrc.iterdir() if p.suffix in (".cpp", ".h"))
    digest = hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in sources)).hexdigest()[:16]
    name = "llama_kernels_baseline_" + march.replace("-", "_")
    folder = CACHE / "kernel-baselines" / f"{name}-{digest}"
    folder.mkdir(parents=True, exist_ok=True)
    load(name=name, sources=[str(p) for p in sources if p.suffix == ".cpp"], extra_cflags=cflags(march),
         build_directory=str(folder), is_python_module=False)
    return getattr(torch.ops, name)


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def head(ops, net, h: torch.Tensor) -> torch.Tensor:
    """The output head's product, as Llama.logits makes it (fp32 logits), through `ops`."""
    out = net.output
    if out.weight.dtype == torch.int8:
        return ops.matvec_int8(h, [out.weight], [out.scale], True)
    if out.weight.dtype == torch.uint8:
        return ops.matvec_int4(h, [out.weight], [out.scale.half()], [None if out.offset is None else out.offset.half()],
                               True)
    return ops.matvec_bf16(h, [out.weight], True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.split("\n")[2:]))
    p.add_argument("--baseline", type=Path, default=None, help="another checkout to compare with")
    p.add_argument("--shape", default="default", help="default (the default model's own weights) or a preset")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantize", default=None, help="passed to load_checkpoint: int8 or int4")
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--context", type=int, default=200, help="positions already in the cache")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--iters", type=int, default=5, help="calls of each part per round")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    march = configured().march
    builds = {"this tree": build(march).ops}
    if args.baseline:
        builds = {"baseline": baseline_ops(args.baseline.resolve(), march)} | builds
    folder = DEFAULT_WEIGHTS_DIR / DEFAULT_MODEL_NAME if args.shape == "default" else random_checkpoint(args.shape)
    ckpt = model.load_checkpoint(folder, dtype=getattr(torch, args.dtype),
                                 **({"quantize": args.quantize} if args.quantize else {}))
    net, config = ckpt.model, ckpt.config
    cache = model.KVCache(config, args.context + 16, dtype=ckpt.dtype)
    prompt = [(i * 37) % 1000 + 100 for i in range(args.context)]
    info = machine()
    load_before = os.getloadavg()[0]
    print(f"{args.shape} ({args.dtype}{', ' + args.quantize if args.quantize else ''}), {info['cpu']}, "
          f"{args.threads} thread(s), -march={march}: " + ", ".join(f"{k} {b.path()}" for k, b in builds.items())
          + f"; context {args.context}; load average {load_before:.2f}", flush=True)
    names = list(builds)
    clock = time.thread_time if args.threads == 1 else time.perf_counter  # CPU time: the calling thread's alone
    results = []
    start, busy, ours = time.perf_counter(), cpu_busy_s(), own_cpu_s()
    with torch.inference_mode():
        net(torch.tensor([prompt]), kv_cache=cache, last_only=True)
        cache.extend(prompt)
        for rows in map(int, args.rows.split(",")):
            positions = list(range(cache.length, cache.length + rows))
            x = net.tok_embeddings(torch.tensor(prompt[:rows])).to(net.compute_dtype)  # (rows, dim)
            net.ensure_rope(max(positions) + 1)
            rope = net.rope.at(positions, x.dtype)
            h = net.norm(x)
            times = {(name, part): [] for name in names for part in ("layers", "head")}
            for r in range(args.rounds + 1):  # round 0 warms up
                for name in names if r % 2 else names[::-1]:
                    t0 = clock()
                    for _ in range(args.iters):
                        decode_layers(net, x, rope, [cache] * rows, positions, ops=builds[name])
                    t1 = clock()
                    for _ in range(args.iters):
                        head(builds[name], net, h)
                    t2 = clock()
                    if r:
                        times[(name, "layers")].append((t1 - t0) / args.iters)
                        times[(name, "head")].append((t2 - t1) / args.iters)
            row = {"rows": rows} | {f"{name} {part} ms": 1e3 * statistics.median(v)
                                    for (name, part), v in times.items()}
            for name in names:
                row[f"{name} step ms"] = row[f"{name} layers ms"] + row[f"{name} head ms"]
            results.append(row)
    load_after = os.getloadavg()[0]
    other = max(0.0, (cpu_busy_s() - busy) - (own_cpu_s() - ours)) / (time.perf_counter() - start)
    one = results[0]
    print("\n| rows | " + " | ".join(f"{name}: layers / head / step ms | a row more" for name in names) + " |")
    print("|---|" + "---|---|" * len(names))
    for row in results:
        cells = []
        for name in names:
            step, first = row[f"{name} step ms"], one[f"{name} step ms"]
            more = f"{(step - first) / (row['rows'] - 1) / first:.0%}" if row["rows"] > 1 else "-"
            cells.append(f"{row[f'{name} layers ms']:.2f} / {row[f'{name} head ms']:.2f} / {step:.2f} | {more}")
        print(f"| {row['rows']} | " + " | ".join(cells) + " |")
    if len(names) == 2:
        print("\nthis tree / baseline, step: " + ", ".join(
            f"{row['rows']} rows {row['baseline step ms'] / row['this tree step ms']:.2f}x" for row in results))
    print(f"load average {load_before:.2f} -> {load_after:.2f}; other processes ~{other:.2f} cores meanwhile")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "kernel_rows.json"
    out.write_text(json.dumps({"machine": info, "shape": args.shape, "dtype": args.dtype, "quantize": args.quantize,
                               "march": march, "threads": args.threads,
                               "paths": {k: b.path() for k, b in builds.items()},
                               "load_average": [load_before, load_after], "rows": results}, indent=2))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
