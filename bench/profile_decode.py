"""Where our engine's decode time goes: torch.profiler over a few decode steps, top ops by self CPU time.

    python bench/profile_decode.py [--shape llama3.2-1b] [--dtype bfloat16] [--quantize int8|int4] [--steps 16]
                                   [--op-by-op]

Loads the random checkpoint of the shape, prefills a prompt, runs two untimed decode steps, then
profiles `--steps` more, each the same call `generate` makes (`model.decode(token, [kv_cache])` then
greedy argmax). --op-by-op: the reference decode (Llama.fused_decode off), one ATen op at a time.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch  # noqa: E402  (imported by common after its path fix)
from common import DTYPES, random_checkpoint, random_prompt
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import model  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.split("\n")[2:]))
    p.add_argument("--shape", default="llama3.2-1b")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--quantize", default=None, help="passed to load_checkpoint: int8 or int4")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--op-by-op", action="store_true", help="decode without the fused step: the reference")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    options = {"quantize": args.quantize} if args.quantize else {}
    ckpt = model.load_checkpoint(random_checkpoint(args.shape), dtype=DTYPES[args.dtype], **options)
    net, config = ckpt.model, ckpt.config
    net.fused_decode = not args.op_by_op
    prompt = random_prompt(config.vocab_size, args.prompt_tokens)
    cache = model.KVCache(config, args.prompt_tokens + args.steps + 2, dtype=ckpt.dtype)

    @torch.inference_mode()
    def step(ids: list[int], start_pos: int) -> int:
        if len(ids) == 1:
            logits = net.decode(torch.tensor(ids), [cache])[0]
        else:
            logits = net(torch.tensor([ids]), start_pos=start_pos, kv_cache=cache, last_only=True)[0, -1]
        cache.tokens += ids
        return int(logits.argmax())

    token = step(prompt, 0)
    pos = len(prompt)
    for _ in range(2):  # warm-up: first calls prime kernels and touch the mapped weights
        token, pos = step([token], pos), pos + 1
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(args.steps):
            token, pos = step([token], pos), pos + 1
    seconds = time.perf_counter() - start
    print(f"{args.shape} {args.dtype}{' ' + args.quantize if args.quantize else ''}"
          f"{' op by op' if args.op_by_op else ''}, {args.threads} threads: {args.steps} decode steps in {seconds:.2f} s "
          f"({args.steps / seconds:.2f} tok/s under the profiler)\n")
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=args.top,
                                                             max_name_column_width=32,
                                                             max_shapes_column_width=40))
    return 0


if __name__ == "__main__":
    sys.exit(main())
