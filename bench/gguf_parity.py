"""Our logits against llama.cpp's on the same K-quant GGUF file: the 1B shape's random weights quantized by
llama.cpp's own quantizer (bench/gguf_file.py), read by llama-cpp-python and by us (as our import keeps it).

    python bench/gguf_parity.py [--kinds q4_k_m,q5_k_m,q6_k] [--prompt-tokens 64] [--steps 16]
    python bench/gguf_parity.py --shape default [--kinds q4_1,q4_k_m,q5_k_m,q6_k]

`--shape default`: real weights, the default model's (SmolLM2-135M-Instruct, its Q4_1 GGUF as it ships), quantized
again by llama.cpp to each kind (`--allow-requantize`; q4_1: the file as it ships), read by us in place (the GGUF as
a checkpoint), the prompt a chat question tokenized by llama.cpp: real logits are not the near-ties of random ones.

Per file: the largest difference of the last position's logits over the logits' spread (their standard deviation),
fp32 activations on our side, by our prefill (x rounded to int8 per 256 as llama.cpp rounds it, where the kernel has
prefill_blocks; else the blocks widened, x as it is) and with the prompt through our decode steps (x rounded alike); and the greedy continuation of both,
token by token, with the first step where they part and whether llama.cpp's best led its second there by less than
our difference (a near-tie). Random weights: logits of random models are close together, so ties come often.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from common import CACHE, OPTIONS, machine, random_checkpoint, random_prompt
from gguf_file import gguf_checkpoint, imported_checkpoint, llama_quantize

import model  # noqa: E402


CHAT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France, and why is it famous?<|im_end|>\n<|im_start|>assistant\n")


def default_model_file(kind: str) -> Path:
    """The default model's GGUF (its real weights, Q4_1 as it ships) or llama.cpp's requantization of it to `kind`."""
    from model.convert.prepare_default import default_gguf

    source = default_gguf(OPTIONS.cache_dir)
    if kind == "q4_1":
        return source
    path = CACHE / f"smollm2-135m-real-{kind}.gguf"
    if not path.is_file():
        llama_quantize(source, path.with_suffix(".partial"), kind, requantize=True).rename(path)
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3.2-1b")
    p.add_argument("--kinds", default="q4_k_m,q5_k_m,q6_k")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    import llama_cpp

    torch.set_num_threads(args.threads)
    folder = None if args.shape == "default" else random_checkpoint(args.shape)
    info = machine()
    print(f"{args.shape}, {info['cpu']}, {args.threads} threads, decode kernel {model.kernels.decode_path()}\n")
    print("| file | max diff of the last logits / spread, prefill | the same, the prompt through decode steps | our "
          "decode steps against our prefill | greedy tokens the same before they part | first apart at | llama.cpp's "
          "lead there / spread |")
    print("|---|---|---|---|---|---|---|")
    for kind in args.kinds.split(","):
        if folder is None:  # the default model's real weights: the GGUF read in place
            path = default_model_file(kind)
            ours = model.load_checkpoint(path, dtype=torch.float32)
        else:
            path = gguf_checkpoint(folder, args.shape, kind)
            # bf16: the file llama.cpp's converter writes of the checkpoint, ours the checkpoint itself (no blocks)
            ours = model.load_checkpoint(folder if kind == "bf16" else imported_checkpoint(folder, args.shape, kind),
                                         dtype=torch.float32)
        # its KV cache in f32, as ours is here (f16 by default: a rounding of its own at every position)
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=args.prompt_tokens + args.steps + 8, n_batch=512,
                              n_threads=args.threads, n_threads_batch=args.threads, logits_all=False, verbose=False,
                              type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, flash_attn=False)
        n_vocab = llm.n_vocab()
        prompt = random_prompt(n_vocab, args.prompt_tokens) if folder is not None else llm.tokenize(
            CHAT.encode(), add_bos=False, special=True)

        def theirs_next(ids: list[int]) -> np.ndarray:
            llm.eval(ids)
            return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,)).copy()

        cache = model.KVCache(ours.config, args.prompt_tokens + args.steps + 8, dtype=torch.float32)
        stepped = model.KVCache(ours.config, args.prompt_tokens + 8, dtype=torch.float32)
        with torch.inference_mode():
            mine = ours.model(torch.tensor([prompt]), kv_cache=cache, last_only=True)[0, -1].double().numpy()
            for token in prompt:  # the prompt through decode steps: the kernel, x rounded to int8 per 256 as llama.cpp's
                by_steps = ours.model.decode(torch.tensor([token]), [stepped])[0].double().numpy()
                stepped.tokens.append(token)
        cache.tokens = list(prompt)
        theirs = theirs_next(prompt)
        spread = theirs.std()
        first_diff = np.abs(mine - theirs).max() / spread
        stepped_diff = np.abs(by_steps - theirs).max() / spread
        own_diff = np.abs(by_steps - mine).max() / spread  # our two paths: x rounded per 256, and not
        mean_diff = np.abs(mine - theirs).mean() / spread
        correlation = np.corrcoef(mine, theirs)[0, 1]
        ours_tokens, theirs_tokens, apart, lead = [], [], None, None
        for step in range(args.steps):
            a, b = int(mine.argmax()), int(theirs.argmax())
            ours_tokens.append(a)
            theirs_tokens.append(b)
            if a != b and apart is None:
                top = np.sort(theirs)[-2:]
                apart, lead = step, (top[1] - top[0]) / spread
            with torch.inference_mode():
                mine = ours.model.decode(torch.tensor([a]), [cache])[0].double().numpy()
            cache.tokens.append(a)
            theirs = theirs_next([b])
        same = args.steps if apart is None else apart  # (after they part, each goes on from its own token)
        print(f"| {kind} | {first_diff:.4f} (mean {mean_diff:.4f}, correlation {correlation:.6f}) | {stepped_diff:.4f} | "
              f"{own_diff:.4f} | "
              f"{same} of {args.steps} | {'-' if apart is None else apart} | "
              f"{'-' if lead is None else f'{lead:.4f}'} |")
        del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
