"""Prefill tokens/s, ours against llama.cpp, on the same K-quant GGUF file (the 1B shape's random weights quantized
by llama.cpp: bench/gguf_file.py), measured in turn.

    python bench/prefill_ab.py [--kinds q4_k_m,q6_k] [--tokens 256] [--rounds 3]

Ours: the file as our import keeps it (its blocks), the default dtype for this CPU, a prompt of `--tokens` into a
fresh KV cache (the prefill widens 8 MB of rows of blocks at a time for F.linear). llama.cpp: llama-cpp-python's
`eval` of the same tokens in one batch, its cache reset each round. Best of `--rounds`, each system in turn.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from common import machine, random_checkpoint, random_prompt
from gguf_file import gguf_checkpoint, imported_checkpoint

import model  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3.2-1b")
    p.add_argument("--kinds", default="q4_k_m,q6_k")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    import llama_cpp

    torch.set_num_threads(args.threads)
    folder = random_checkpoint(args.shape)
    print(f"{args.shape}, {machine()['cpu']}, {args.threads} threads, {args.tokens} tokens, best of {args.rounds}\n")
    print("| file | ours tok/s | llama.cpp tok/s | ours / llama.cpp |\n|---|---|---|---|")
    for kind in args.kinds.split(","):
        ours = model.load_checkpoint(imported_checkpoint(folder, args.shape, kind))
        llm = llama_cpp.Llama(model_path=str(gguf_checkpoint(folder, args.shape, kind)), n_ctx=args.tokens + 8,
                              n_batch=args.tokens, n_ubatch=args.tokens, n_threads=args.threads,
                              n_threads_batch=args.threads, verbose=False)
        prompt = random_prompt(llm.n_vocab(), args.tokens)
        best = {"ours": 0.0, "llama.cpp": 0.0}
        for _ in range(args.rounds):
            cache = model.KVCache(ours.config, args.tokens + 8, dtype=ours.dtype)
            started = time.perf_counter()
            with torch.inference_mode():
                ours.model(torch.tensor([prompt]), kv_cache=cache, last_only=True)
            best["ours"] = max(best["ours"], args.tokens / (time.perf_counter() - started))
            llm.reset()
            started = time.perf_counter()
            llm.eval(prompt)
            best["llama.cpp"] = max(best["llama.cpp"], args.tokens / (time.perf_counter() - started))
        print(f"| {kind} | {best['ours']:.1f} | {best['llama.cpp']:.1f} | {best['ours'] / best['llama.cpp']:.2f}x |")
        del llm, ours
    return 0


if __name__ == "__main__":
    sys.exit(main())
