"""Prefill and decode over growing contexts, KV cache in bf16 against q8, beside llama.cpp, in one run.

    python bench/long_context.py [--lengths 512,2048,4096,7680] [--new 64] [--threads 2] [--rounds 1]
                                 [--llama-cpp f16,q8_0] [--shape llama3.2-1b] [--out FILE]

The default model as the app serves it (its own Q4_1 blocks, the decode kernel, LLAMA_KV_TYPE bf16 and q8 in
turn), a random prompt of each length prefilled in the engine's chunks, then `--new` greedy decode steps,
one sequence, speculation off: prefill tokens/s and decode tokens/s. `--llama-cpp`: llama.cpp
(llama-cpp-python) on the same GGUF file (the one the default model was converted from), the same prompt and
steps, with its KV cache in each of the given types (f16, q8_0; `q8_0` runs with flash attention, which
llama.cpp needs for a quantized V cache). Each length runs every set-up in turn before the next length, so all
share the machine's state of the moment; `--rounds` repeats that and keeps each set-up's best. Also reported:
the KV bytes a token takes and the bytes a decode step reads (weights + KV at that length).

`--shape`: a LlamaConfig preset's shape with random weights (bench/common.random_checkpoint) instead of the
default model: ours quantizes them to int8 at load, llama.cpp reads the same weights as a Q8_0 GGUF
(bench/gguf_file.py), 8 bits a weight each.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402
from common import machine, random_prompt  # noqa: E402

from model.checkpoint import load_checkpoint  # noqa: E402
from model.kv_cache import KVCache  # noqa: E402
from model.options import DEFAULT_CACHE_DIR, DEFAULT_MODEL_NAME, DEFAULT_WEIGHTS_DIR  # noqa: E402

GGUF = DEFAULT_CACHE_DIR / f"{DEFAULT_MODEL_NAME}.Q4_1.gguf"


def ours(checkpoint, prompt: list[int], new: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) of one sequence: the prompt in the engine's chunks, then greedy steps."""
    model = checkpoint.model
    cache = KVCache(checkpoint.config, len(prompt) + new + 1, dtype=checkpoint.dtype, kv_type=model.kv_type)
    with torch.inference_mode():
        started = time.perf_counter()
        while cache.length < len(prompt):
            chunk = prompt[cache.length:cache.chunk_end(len(prompt))]
            logits = model(torch.tensor([chunk]), start_pos=cache.length, kv_cache=cache, last_only=True)
            cache.extend(chunk)
        prefill = time.perf_counter() - started
        token = int(logits[0, -1].argmax())
        started = time.perf_counter()
        for _ in range(new):
            logits = model.decode(torch.tensor([token]), [cache])
            cache.extend([token])
            token = int(logits[0].argmax())
        decode = time.perf_counter() - started
    return len(prompt) / prefill, new / decode


def llama_cpp(gguf: Path, kv: str, n_ctx: int, threads: int):
    import llama_cpp
    types = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0}
    return llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                           n_threads_batch=threads, type_k=types[kv], type_v=types[kv], flash_attn=kv != "f16",
                           verbose=False)


def theirs(llm, prompt: list[int], new: int) -> tuple[float, float]:
    import numpy as np
    llm.reset()
    llm._ctx.kv_cache_clear() if hasattr(llm._ctx, "kv_cache_clear") else None
    started = time.perf_counter()
    llm.eval(prompt)
    prefill = time.perf_counter() - started
    n_vocab = llm.n_vocab()
    token = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))))
    started = time.perf_counter()
    for _ in range(new):
        llm.eval([token])
        token = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))))
    decode = time.perf_counter() - started
    return len(prompt) / prefill, new / decode


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="512,2048,4096,7680")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--llama-cpp", default="", help="llama.cpp KV types to run beside ours: f16, q8_0")
    p.add_argument("--shape", default="", help="a preset's shape, random weights (8-bit), instead of the default model")
    p.add_argument("--kv", default="bf16,q8", help="our KV types to run")
    p.add_argument("--out", default="bench/results/long_context.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [int(n) for n in args.lengths.split(",")]
    kvs = args.kv.split(",")
    if args.shape:
        from common import random_checkpoint
        from gguf_file import gguf_checkpoint
        folder = random_checkpoint(args.shape)
        gguf = gguf_checkpoint(folder, args.shape, "q8_0") if args.llama_cpp else None
        options = {"dtype": torch.bfloat16, "quantize": "int8"}
    else:
        folder, gguf, options = DEFAULT_WEIGHTS_DIR / DEFAULT_MODEL_NAME, GGUF, {"widen": "auto"}
    n_ctx = max(lengths) + args.new + 16
    setups = {f"ours {kv}": load_checkpoint(folder, kv_type=kv, **options) for kv in kvs}
    for kv in filter(None, args.llama_cpp.split(",")):
        setups[f"llama.cpp {kv}"] = llama_cpp(gguf, kv, n_ctx, args.threads)
    checkpoint = setups[f"ours {kvs[0]}"]
    weights = sum(t.nbytes for t in checkpoint.model.state_dict().values()
                  if t.data_ptr() != checkpoint.model.tok_embeddings.weight.data_ptr())
    per_token = {kv: KVCache.bytes_per_position(checkpoint.config, kv, checkpoint.dtype) for kv in ("bf16", "q8")}
    print(f"[bench] {machine()['cpu']}, {args.threads} threads; weights read a step {weights / 1e6:.0f} MB; KV a "
          f"token: {per_token['bf16'] / 1024:.1f} KB ({checkpoint.dtype}), q8 {per_token['q8'] / 1024:.1f} KB")
    results = []
    for n in lengths:
        prompt = random_prompt(checkpoint.config.vocab_size, n, seed=n)
        best: dict[str, tuple[float, float]] = {}
        for _ in range(args.rounds):
            for name, setup in setups.items():
                run = ours if name.startswith("ours") else theirs
                pre, dec = run(setup, prompt, args.new)
                old = best.get(name, (0.0, 0.0))
                best[name] = (max(old[0], pre), max(old[1], dec))
        for name, (pre, dec) in best.items():
            kv = "q8" if name.endswith("q8") else "bf16"
            read = weights + n * per_token[kv] if name.startswith("ours") else None
            results.append({"length": n, "setup": name, "prefill_tps": pre, "decode_tps": dec, "step_bytes": read})
            print(f"  {n:6d} tokens  {name:16s} prefill {pre:8.1f} tok/s  decode {dec:7.1f} tok/s"
                  + (f"  ({read / 1e6:.0f} MB a step)" if read else ""), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine(), "args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
