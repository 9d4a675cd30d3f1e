"""Decode speed with the loaded weights in 4 KB pages against 2 MB pages, in one process.

    python bench/huge_pages.py [--shape default|llama3.2-1b] [--quantize none,int8,int4] [--rounds 6] [--new-tokens 128]

Per weight format, two copies of the model are loaded: one as `load_checkpoint` leaves it (converted
weights moved into 2 MB pages, model/memory.py) and one with the move skipped (4 KB pages). They
decode the same greedy reply in turn, the order alternating, so both share the machine's memory
state of the moment (it moves by 15% over minutes); the ratio is taken per pair and the medians are
reported. Weights mapped straight from a file (a bf16 file loaded as bf16) are not moved: expect
1.00x there.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from unittest import mock

import torch
from common import machine, random_checkpoint

import model.checkpoint
from model.checkpoint import load_checkpoint
from model.generation import generate
from model.options import DEFAULT_MODEL_NAME, DEFAULT_WEIGHTS_DIR

PROMPT = "Tell me a story about a dragon and a knight who become friends."


def decode_rate(ckpt, ids: list[int], new_tokens: int) -> float:
    reply = generate(ckpt, ids, max_new_tokens=new_tokens, temperature=0.0, stop_ids=set())
    list(reply)
    return reply.stats.tokens_per_second


def compare(folder, quantize: str | None, rounds: int, new_tokens: int) -> dict:
    with mock.patch.object(model.checkpoint, "move_to_huge_pages", lambda tensors: 0):
        small = load_checkpoint(folder, quantize=quantize)
    huge = load_checkpoint(folder, quantize=quantize)
    ids = huge.chat_format.encode_dialog([{"role": "user", "content": PROMPT}])
    for ckpt in (small, huge):
        decode_rate(ckpt, ids, 8)  # warm-up: the kernel's threads, the KV cache's first pages
    rates = {"4 KB": [], "2 MB": []}
    for i in range(rounds):
        order = [("4 KB", small), ("2 MB", huge)]
        for name, ckpt in order if i % 2 == 0 else order[::-1]:
            rates[name].append(decode_rate(ckpt, ids, new_tokens))
    pairs = [b / a for a, b in zip(rates["4 KB"], rates["2 MB"])]
    return {"quantize": quantize or "none", "4 KB": statistics.median(rates["4 KB"]),
            "2 MB": statistics.median(rates["2 MB"]), "ratio": statistics.median(pairs), "pairs": pairs}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="default", help="default (the embedded model's fp32 file) or a preset")
    p.add_argument("--quantize", default="none,int8,int4")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    folder = DEFAULT_WEIGHTS_DIR / DEFAULT_MODEL_NAME if args.shape == "default" else random_checkpoint(args.shape)
    info = machine()
    print(f"{info['cpu']}, {args.threads} threads; {args.shape}, {args.new_tokens} new tokens, {args.rounds} pairs")
    print("| weights | 4 KB pages tok/s | 2 MB pages tok/s | 2 MB / 4 KB (median of pairs) | pairs |")
    print("|---|---|---|---|---|")
    for quantize in args.quantize.split(","):
        row = compare(folder, None if quantize == "none" else quantize, args.rounds, args.new_tokens)
        print(f"| {row['quantize']} | {row['4 KB']:.2f} | {row['2 MB']:.2f} | {row['ratio']:.3f}x | "
              + ", ".join(f"{r:.3f}" for r in row["pairs"]) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
