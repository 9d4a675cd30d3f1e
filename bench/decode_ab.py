"""Decode speed of several weight formats side by side in one process, their steps taken in turn.

    python bench/decode_ab.py [--shape llama3.2-1b] [--variants bf16,int8,int4,int4-op-by-op] [--rounds 12] [--steps 8]
    python bench/decode_ab.py --variants int4,llama.cpp-q4_0,llama.cpp-q4_0-pure   (llama-cpp-python installed)
    python bench/decode_ab.py --shape default --variants bf16,blocks   (the default model: widened, its Q4_1)

On a machine shared with other work, runs of one format after another (bench/speed.py) see different
loads; here each round times `--steps` decode steps of every format, one format after the other, so
they share the load of the moment. Per format: the fastest round's tokens/s (the least disturbed) and
the median round's, GB/s of weights read per step (bench/speed.py's decode_bytes) and the ratio to
the first format. Random weights of the shape (bench/common.py), or with `--shape default` the
default model's own (real weights: its GGUF's Q4_1 blocks, which `blocks` keeps and the others widen
first), greedy, one sequence. Steps go
through Llama.decode, as generation's do: the fused decode step, or with `-op-by-op` the reference.
`llama.cpp-<kind>` is llama.cpp (llama-cpp-python) on the same weights as a GGUF file of that kind
(bench/gguf_file.py), a token at a time through Llama.eval, its bytes a step taken as the file's size;
`gguf-<kind>` is ours on that same file, as our import keeps it (q4_k_m, q5_k_m, q6_k, q3_k_m, q2_k: llama.cpp's blocks).

    python bench/decode_ab.py --variants gguf-q4_k_m,llama.cpp-q4_k_m,gguf-q6_k,llama.cpp-q6_k
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
from model.options import DEFAULT_MODEL_NAME, DEFAULT_WEIGHTS_DIR  # noqa: E402

# load_checkpoint's keywords: weights quantized in the file are widened first, but by `blocks`, which keeps them
VARIANTS = {"bf16": {"widen": True}, "int8": {"quantize": "int8", "widen": True},
            "int4": {"quantize": "int4", "widen": True}, "blocks": {}}
LLAMA_CPP = "llama.cpp-"  # a variant's name: this + a GGUF kind of bench/gguf_file.py
GGUF = "gguf-"  # a variant's name: this + a GGUF kind: ours on that file
OP_BY_OP = "-op-by-op"  # a variant's name + this: the same weights, decode steps by the reference (fused=False)


def llama_cpp_run(folder, args, kind: str) -> dict:
    """A run whose `llm(ids)` evaluates ids in llama.cpp and returns the greedy next token."""
    import llama_cpp
    import numpy as np
    from gguf_file import gguf_checkpoint

    path = gguf_checkpoint(folder, args.shape, kind)
    n_ctx = args.prompt_tokens + args.rounds * args.steps + 16
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=args.prompt_tokens, n_threads=args.threads,
                          n_threads_batch=args.threads, verbose=False)
    n_vocab = llm.n_vocab()

    def next_token(ids: list[int]) -> int:
        llm.eval(ids)
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))))

    prompt = random_prompt(n_vocab, args.prompt_tokens)
    return {"llm": next_token, "bytes": path.stat().st_size, "token": 0, "prompt": prompt, "times": []}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.split("\n")[2:]))
    p.add_argument("--shape", default="llama3.2-1b", help="a model preset (model/config.py), or default")
    p.add_argument("--variants", default="bf16,int8,int4")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=8, help="decode steps per format per round")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--ceiling", action="store_true",
                   help="also read 1 GiB (x.sum()) each round, in turn: the best is the read ceiling")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    folder = DEFAULT_WEIGHTS_DIR / DEFAULT_MODEL_NAME if args.shape == "default" else random_checkpoint(args.shape)
    runs = {}
    for name in args.variants.split(","):
        if name.startswith(LLAMA_CPP):
            runs[name] = llama_cpp_run(folder, args, name.removeprefix(LLAMA_CPP))
            continue
        if name.startswith(GGUF):
            from gguf_file import imported_checkpoint
            ckpt = model.load_checkpoint(imported_checkpoint(folder, args.shape, name.removeprefix(GGUF)),
                                         dtype=torch.bfloat16)
        else:
            ckpt = model.load_checkpoint(folder, dtype=torch.bfloat16, **VARIANTS[name.removesuffix(OP_BY_OP)])
        ckpt.model.fused_decode = not name.endswith(OP_BY_OP)
        config = ckpt.config
        prompt = random_prompt(config.vocab_size, args.prompt_tokens)
        cache = model.KVCache(config, args.prompt_tokens + args.rounds * args.steps + 2, dtype=ckpt.dtype)
        runs[name] = {"ckpt": ckpt, "cache": cache, "token": 0, "prompt": prompt, "times": []}

    @torch.inference_mode()
    def step(run: dict, ids: list[int]) -> None:
        if "llm" in run:
            run["token"] = run["llm"](ids)
            return
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
    ones, reads = (torch.ones(2**28), []) if args.ceiling else (None, [])  # 1 GiB of float32
    for _ in range(args.rounds):
        for run in runs.values():
            start = time.perf_counter()
            for _ in range(args.steps):
                step(run, [run["token"]])
            run["times"].append((time.perf_counter() - start) / args.steps)
        if ones is not None:
            start = time.perf_counter()
            ones.sum()
            reads.append(ones.nbytes / (time.perf_counter() - start) / 1e9)

    info = machine()
    ceiling = (f"; read ceiling (x.sum() of 1 GiB, best / median round) {max(reads):.1f} / "
               f"{statistics.median(reads):.1f} GB/s") if reads else ""
    print(f"{args.shape}, {info['cpu']}, {args.threads} threads, torch {info['torch']}, decode kernel "
          f"{model.kernels.decode_path()}; {args.rounds} rounds of {args.steps} steps{ceiling}\n")
    print("| weights | GB read a step | tok/s (best round) | tok/s (median) | weight GB/s (best) | vs " +
          f"{next(iter(runs))} (best) | vs {next(iter(runs))} (median) |")
    print("|---|---|---|---|---|---|---|")
    first = next(iter(runs.values()))
    for name, run in runs.items():
        nbytes = run["bytes"] if "llm" in run else decode_bytes(run["ckpt"].model)
        best, median = min(run["times"]), statistics.median(run["times"])
        of_ceiling = f" ({100 * nbytes / best / 1e9 / max(reads):.0f}% of the ceiling)" if reads else ""
        print(f"| {name} | {nbytes / 1e9:.2f} | {1 / best:.2f} | {1 / median:.2f} | "
              f"{nbytes / best / 1e9:.1f}{of_ceiling} | {min(first['times']) / best:.2f}x | "
              f"{statistics.median(first['times']) / median:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
