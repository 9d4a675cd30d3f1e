"""Prefill tokens/s, ours against llama.cpp, on the same K-quant GGUF file (the 1B shape's random weights quantized
by llama.cpp: bench/gguf_file.py), measured in turn.

    python bench/prefill_ab.py [--kinds q4_k_m,q6_k] [--tokens 256] [--rounds 3] [--widened]

Ours: the file as our import keeps it (its blocks), the default dtype for this CPU, a prompt of `--tokens` into a
fresh KV cache (the kernel's prefill_blocks multiplies the blocks by x rounded to int8; with `--widened`, also
as before it, 8 MB of rows of blocks at a time widened for F.linear, in turn with the others). llama.cpp:
llama-cpp-python's `eval` of the same tokens in one batch, its cache reset each round. Best of `--rounds`, each
system in turn.
"""

from __future__ import annotations

import argparse
import sys
import time
from unittest.mock import patch

import torch
from common import machine, random_checkpoint, random_prompt
from gguf_file import gguf_checkpoint, imported_checkpoint

import model  # noqa: E402
import model.linear  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3.2-1b")
    p.add_argument("--kinds", default="q4_k_m,q6_k")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--widened", action="store_true", help="also ours with the blocks widened for F.linear")
    args = p.parse_args()
    import llama_cpp

    torch.set_num_threads(args.threads)
    folder = random_checkpoint(args.shape)
    print(f"{args.shape}, {machine()['cpu']}, {args.threads} threads, {args.tokens} tokens, best of {args.rounds}\n")
    names = ["ours", *(["ours widened"] if args.widened else []), "llama.cpp"]
    print("| file | " + " | ".join(f"{name} tok/s" for name in names) + " | "
          + " | ".join(f"{name} / llama.cpp" for name in names[:-1]) + " |")
    print("|---" * (2 * len(names)) + "|")
    for kind in args.kinds.split(","):
        ours = model.load_checkpoint(imported_checkpoint(folder, args.shape, kind))
        llm = llama_cpp.Llama(model_path=str(gguf_checkpoint(folder, args.shape, kind)), n_ctx=args.tokens + 8,
                              n_batch=args.tokens, n_ubatch=args.tokens, n_threads=args.threads,
                              n_threads_batch=args.threads, verbose=False)
        prompt = random_prompt(llm.n_vocab(), args.tokens)

        def ours_prefill():
            cache = model.KVCache(ours.config, args.tokens + 8, dtype=ours.dtype)
            with torch.inference_mode():
                ours.model(torch.tensor([prompt]), kv_cache=cache, last_only=True)

        def ours_widened():  # the blocks widened for F.linear, as where the kernel has no prefill_blocks
            with patch.object(model.linear, "prefill_ops", lambda x: None):
                ours_prefill()

        def llama_cpp_prefill():
            llm.reset()
            llm.eval(prompt)

        systems = {"ours": ours_prefill, **({"ours widened": ours_widened} if args.widened else {}),
                   "llama.cpp": llama_cpp_prefill}
        best = dict.fromkeys(systems, 0.0)
        for _ in range(args.rounds):
            for name, run in systems.items():
                started = time.perf_counter()
                run()
                best[name] = max(best[name], args.tokens / (time.perf_counter() - started))
        figures = " | ".join(f"{best[name]:.1f}" for name in systems)
        ratios = " | ".join(f"{best[name] / best['llama.cpp']:.2f}x" for name in systems if name != "llama.cpp")
        print(f"| {kind} | {figures} | {ratios} |")
        del llm, ours
    return 0


if __name__ == "__main__":
    sys.exit(main())
