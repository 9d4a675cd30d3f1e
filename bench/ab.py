"""The engine of another commit against the working tree's, measured side by side: prefill and decode speed.

    python bench/ab.py --baseline 9b7c470 [--shape smollm2-135m | --checkpoint DIR] [--rounds 6] [--threads N]

The baseline commit is checked out into a temporary git worktree (removed afterwards). Each round runs
the same measurement (bench/ab_worker.py, this tree's copy) once in a fresh process of each version, the
baseline first in odd rounds and second in even ones, so both see the machine's load of the moment; on
shared machines whose memory bandwidth drifts by 15% over minutes, only such ratios compare. Both
versions read one random checkpoint of the shape (bench/common.py) and the same prompts:

    prefill   a 512-token prompt in the engine's two chunks of 256 into a KV cache: tokens/s
    decode 1  64 greedy steps of one sequence (Llama.decode, as the engine): tokens/s
    decode 8  32 steps of 8 sequences of 40-110 prompt tokens, decoded together: tokens/s in all
    decode at N   with `--context N`: 32 steps of one sequence over a KV cache (`--kv bf16|q8`) of N positions
                  (a prefilled chunk of 256 copied along it, so no long prefill is timed or waited for)

A first, untimed run of each version builds its kernel. Per version the median over rounds; the ratio
is this tree's over the baseline's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, machine, random_checkpoint

WORKER = Path(__file__).with_name("ab_worker.py")
MEASURES = ("prefill", "decode_1", "decode_8")


def run(tree: Path, folder: Path, threads: int, extra: list[str]) -> dict:
    out = subprocess.run([sys.executable, str(WORKER), "--root", str(tree), "--checkpoint", str(folder),
                          "--threads", str(threads), *extra], capture_output=True, text=True, cwd=tree, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"the worker failed in {tree}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="a commit (or branch, tag) to measure against")
    p.add_argument("--shape", default="smollm2-135m", help="a model preset (model/config.py)")
    p.add_argument("--checkpoint", help="a checkpoint folder instead of the shape's random one (an imported GGUF)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--context", type=int, default=0, help="also decode over a KV cache of this many positions")
    p.add_argument("--kv", default="bf16", help="that cache's type (LLAMA_KV_TYPE): bf16 or q8")
    args = p.parse_args()
    extra = ["--context", str(args.context), "--kv", args.kv] if args.context else []
    measures = (*MEASURES, f"decode_at_{args.context}") if args.context else MEASURES
    folder = Path(args.checkpoint).resolve() if args.checkpoint else random_checkpoint(args.shape)
    results: dict[str, list[dict]] = {"baseline": [], "this tree": []}
    with tempfile.TemporaryDirectory(prefix="ab-") as scratch:
        tree = Path(scratch) / "baseline"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.baseline],
                       check=True, capture_output=True)
        try:
            for where in (tree, ROOT):  # untimed: builds each version's kernel (a minute or two, once)
                run(where, folder, args.threads, extra)
            for i in range(args.rounds):
                order = [("baseline", tree), ("this tree", ROOT)]
                for name, where in order if i % 2 == 0 else order[::-1]:
                    results[name].append(run(where, folder, args.threads, extra))
                    print(f"round {i + 1} {name}: " + ", ".join(f"{k} {results[name][-1][k]:.1f}" for k in measures),
                          file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
    cpu = machine()["cpu"]
    kv = f", KV cache {args.kv}" if args.context else ""
    print(f"{args.checkpoint or args.shape}, {args.threads} threads, {cpu}, {args.rounds} rounds{kv}, medians (tokens/s):")
    print(f"| measure | baseline {args.baseline} | this tree | ratio |")
    print("|---|---|---|---|")
    for k in measures:
        base = statistics.median(r[k] for r in results["baseline"])
        ours = statistics.median(r[k] for r in results["this tree"])
        print(f"| {k} | {base:.1f} | {ours:.1f} | {ours / base:.3f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
