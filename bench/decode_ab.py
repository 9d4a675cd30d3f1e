"""Decode speed of several weight formats side by side in one process, their steps taken in turn.

    python bench/decode_ab.py [--shape llama3.2-1b] [--variants bf16,int8,int4,int4-op-by-op] [--rounds 12] [--steps 8]

On a machine shared with other work, runs of one format after another (bench/speed.py) see different
loads; here each round times `--steps` decode steps of every format, one format after the other, so
they share the load of the moment. Per format: the fastest round's tokens/s (the least disturbed) and
the median round's, GB/s of weights read per step (bench/speed.py's decode_bytes) and the ratio to
the first format. Random weights of the shape (bench/common.py), greedy, one sequence. Steps go
through Llama.decode, as generation's do: the fused decode step, or with `-op-by-op` the reference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch  # noqa: E402  (imported by common after its path fix)
from common import machine, random_checkpoint, random_prompt
from speed import decode_bytes

import model  # noqa: E402

VARIANTS = {"bf16": {}, "int8": {"quantize": "int8"}, "int4": {"quantize": "int4"}}
OP_BY_OP = "-op-by-op"  # a variant's name + this: the same weights, decode steps by the reference (fused=False)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.split("\n")[2:]))
    p.add_argument("--shape", default="llama3.2-1b")
    p.add_argument("--variants", default="bf16,int8,int4")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=8, help="decode steps per format per round")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    folder = random_checkpoint(args.shape)
    runs = {}
    for name in args.variants.split(","):
        ckpt = model.load_checkpoint(folder, dtype=torch.bfloat16, **VARIANTS[name.removesuffix(OP_BY_OP)])
        ckpt.model.fused_decode = not name.endswith(OP_BY_OP)
        config = ckpt.config
        prompt = random_prompt(config.vocab_size, args.prompt_tokens)
        cache = model.KVCache(config, args.prompt_tokens + args.rounds * args.steps + 2, dtype=ckpt.dtype)
        runs[name] = {"ckpt": ckpt, "cache": cache, "token": 0, "prompt": prompt, "times": []}

    @torch.inference_mode()
    def step(run: dict, ids: list[int]) -> None:
        net, cache = run["ckpt"].model, run["cache"]
        if len(ids) == 1:  # a decode step, as generation takes it
            logits = net.decode(torch.tensor(ids), [cache])[0]
        else:
            logits = net(torch.tensor([ids]), start_pos=cache.length, kv_cache=cache, last_only=True)[0, -1]
        cache.tokens += ids
        run["token"] = int(logits.argmax())

    for run in runs.values():
        step(run, run["prompt"])
        step(run, [run["token"]])  # warm-up: the first decode step primes the kernels
    for _ in range(args.rounds):
        for run in runs.values():
            start = time.perf_counter()
            for _ in range(args.steps):
                step(run, [run["token"]])
            run["times"].append((time.perf_counter() - start) / args.steps)

    info = machine()
    print(f"{args.shape}, {info['cpu']}, {args.threads} threads, torch {info['torch']}, decode kernel "
          f"{model.kernels.decode_path()}; {args.rounds} rounds of {args.steps} steps\n")
    print("| weights | GB read a step | tok/s (best round) | tok/s (median) | weight GB/s (best) | vs " +
          f"{next(iter(runs))} (best) | vs {next(iter(runs))} (median) |")
    print("|---|---|---|---|---|---|---|")
    first = next(iter(runs.values()))
    for name, run in runs.items():
        nbytes = decode_bytes(run["ckpt"].model)
        best, median = min(run["times"]), statistics.median(run["times"])
        print(f"| {name} | {nbytes / 1e9:.2f} | {1 / best:.2f} | {1 / median:.2f} | {nbytes / best / 1e9:.1f} | "
              f"{min(first['times']) / best:.2f}x | {statistics.median(first['times']) / median:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
