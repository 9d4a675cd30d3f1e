"""Decode steps through this tree's kernel build against another checkout's, in one process, in turn: what
running a step's layers as one team of threads (csrc/team.h) changes against a parallel region per product.

    python bench/decode_team.py --baseline TREE [--models default,int4] [--threads 2,1] [--batch 1]
                                [--rounds 30] [--steps 20]
    OMP_WAIT_POLICY=PASSIVE python bench/decode_team.py --baseline TREE   (OpenMP's idle threads asleep at once)

--baseline: a checkout of another commit (a git worktree), built with this tree's flags under another name
(bench/kernel_rows.py's baseline_ops). default: the default model as served (its Q4_1 blocks as int4 with offsets,
its Q8_0 head as int8); int4, int8, bf16: random weights of the 135M shape quantized at load. `--batch` sequences
of 64 cached positions each, decoded together (the same position at every step, so no step's cache grows).
Each round takes `--steps` steps with one build and then with the other (the order alternating), and a figure
is the median over rounds, in ms a step, with the best round beside it. Activations are this CPU's default.
Writes bench/results/decode_team.json.
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

import model.decode_step  # noqa: E402
import model.linear  # noqa: E402
from model import KVCache, load_checkpoint  # noqa: E402
from model.kernels import kernels  # noqa: E402
from model.options import DEFAULT_MODEL_NAME, DEFAULT_WEIGHTS_DIR  # noqa: E402

CACHED = 64


def load(name: str):
    if name == "default":
        return load_checkpoint(DEFAULT_WEIGHTS_DIR / DEFAULT_MODEL_NAME, widen="auto")
    return load_checkpoint(random_checkpoint("smollm2-135m"), quantize=None if name == "bf16" else name)


def steps_ms(ckpt, caches, tokens, ops, steps: int) -> float:
    model.linear.kernels = lambda: ops  # the output head's product
    model.decode_step.kernels = lambda: ops  # the layers
    started = time.perf_counter()
    with torch.inference_mode():
        for _ in range(steps):
            ckpt.model.decode(tokens, caches)  # (writes position CACHED again: the caller records no tokens)
    return (time.perf_counter() - started) / steps * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", type=Path, required=True)
    p.add_argument("--models", default="default")
    p.add_argument("--threads", default="2,1")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    ours = kernels()
    builds = {"baseline": baseline_ops(args.baseline.resolve(), "native"), "this tree": ours}
    info = machine()
    print(f"{info['cpu']}, {ours.path()}, batch {args.batch}, {args.rounds} rounds of {args.steps} steps\n")
    print("| model | threads | baseline ms (best / median) | this tree ms (best / median) | speed-up (median) |\n"
          "|---|---|---|---|---|")
    rows = []
    for name in args.models.split(","):
        ckpt = load(name)
        caches = []
        for i in range(args.batch):
            cache = KVCache(ckpt.config, CACHED + 1, dtype=ckpt.dtype)
            with torch.inference_mode():
                ckpt.model(torch.randint(100, 1000, (1, CACHED), generator=torch.Generator().manual_seed(i)), 0, cache,
                           last_only=True)
            cache.tokens = [0] * CACHED
            caches.append(cache)
        tokens = torch.arange(5, 5 + args.batch)
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            times = {build: [] for build in builds}
            for ops in builds.values():  # a first run of each, not counted
                steps_ms(ckpt, caches, tokens, ops, 5)
            for r in range(args.rounds):
                for build in (list(builds) if r % 2 == 0 else list(reversed(builds))):
                    times[build].append(steps_ms(ckpt, caches, tokens, builds[build], args.steps))
            base, this = (statistics.median(times[b]) for b in builds)
            print(f"| {name} | {threads} | {min(times['baseline']):.3f} / {base:.3f} | "
                  f"{min(times['this tree']):.3f} / {this:.3f} | {base / this:.2f}x |", flush=True)
            rows.append({"model": name, "threads": threads, "baseline_ms": times["baseline"],
                         "this_ms": times["this tree"]})
        del ckpt
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "decode_team.json").write_text(json.dumps({"machine": info, "batch": args.batch, "rows": rows,
                                                          "steps": args.steps}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
