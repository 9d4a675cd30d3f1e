"""Prefill through quantized matrices (each widened a block of rows at a time for F.linear: csrc/dequantize.cpp),
this tree's kernel build against another checkout's, in one process, in turn.

    python bench/prefill_widen.py --baseline TREE [--models default,int4,int8] [--tokens 40,100,200]
                                  [--rounds 5] [--threads 2]

--baseline: a checkout of another commit (a git worktree); its csrc/ is built with this tree's flags under another
name (bench/kernel_rows.py's baseline_ops), so both builds run on the same weights and prompt. default: the default
model as served (its Q4_1 blocks as int4 with offsets, its Q8_0 head as int8); int4, int8: random weights of the 1B
shape quantized at load. Each round prefills a prompt of each length into a fresh KV cache once with each build
(the order alternating); a figure is the median over rounds, in ms. Activations are this CPU's default (fp32
without bf16 arithmetic). Writes bench/results/prefill_widen.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from common import RESULTS, machine, random_checkpoint
from kernel_rows import baseline_ops

import model.linear  # noqa: E402
from model import KVCache, load_checkpoint  # noqa: E402
from model.kernels import kernels  # noqa: E402
from model.options import DEFAULT_MODEL_NAME, DEFAULT_WEIGHTS_DIR  # noqa: E402


def load(name: str):
    if name == "default":
        return load_checkpoint(DEFAULT_WEIGHTS_DIR / DEFAULT_MODEL_NAME, widen="auto")
    return load_checkpoint(random_checkpoint("llama3.2-1b"), quantize=name)


def prefill_ms(ckpt, ids: torch.Tensor, ops) -> float:
    model.linear.kernels = lambda: ops  # the widening and the few rows' products (the last token's) of this build
    cache = KVCache(ckpt.config, ids.shape[1] + 1, dtype=ckpt.dtype)
    started = time.perf_counter()
    with torch.inference_mode():
        ckpt.model(ids, 0, cache, last_only=True)
    return (time.perf_counter() - started) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", type=Path, required=True)
    p.add_argument("--models", default="default,int4,int8")
    p.add_argument("--tokens", default="40,100,200")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ours = kernels()
    builds = {"baseline": baseline_ops(args.baseline.resolve(), "native"), "this tree": ours}
    info = machine()
    print(f"{info['cpu']}, {ours.path()}, {args.threads} threads, median of {args.rounds}\n")
    print("| model | activations | prompt tokens | baseline ms | this tree ms | speed-up |\n|---|---|---|---|---|---|")
    rows = []
    for name in args.models.split(","):
        ckpt = load(name)
        generator = torch.Generator().manual_seed(0)
        for n in (int(t) for t in args.tokens.split(",")):
            ids = torch.randint(100, 1000, (1, n), generator=generator)
            times = {build: [] for build in builds}
            for ops in builds.values():  # a first run of each, not counted
                prefill_ms(ckpt, ids, ops)
            for r in range(args.rounds):
                for build in (list(builds) if r % 2 == 0 else list(reversed(builds))):
                    times[build].append(prefill_ms(ckpt, ids, builds[build]))
            base, this = statistics.median(times["baseline"]), statistics.median(times["this tree"])
            dtype = str(ckpt.dtype).removeprefix("torch.")
            print(f"| {name} | {dtype} | {n} | {base:.1f} | {this:.1f} | {base / this:.2f}x |", flush=True)
            rows.append({"model": name, "activations": dtype, "tokens": n, "baseline_ms": base, "this_ms": this})
        del ckpt
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "prefill_widen.json").write_text(json.dumps({"machine": info, "threads": args.threads,
                                                            "rounds": args.rounds, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
