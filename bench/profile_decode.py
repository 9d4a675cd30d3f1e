"""Where our engine's decode time goes: torch.profiler over a few decode steps, top ops by self CPU time
(by self GPU time with --device cuda).

    python bench/profile_decode.py [--shape llama3.2-1b] [--dtype bfloat16] [--quantize int8|int4] [--steps 16]
                                   [--op-by-op] [--device cuda]

Loads the random checkpoint of the shape, prefills a prompt, runs 24 decode steps timed one by one
(it prints the first three and the median of the rest, so a one-time cost such as a kernel loaded or
compiled on first use shows apart from the steady step), then profiles `--steps` more, each the same
call `generate` makes (`model.decode(token, [kv_cache])` then greedy argmax). --op-by-op: the
reference decode (Llama.fused_decode off), one ATen op at a time.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch  # noqa: E402  (imported by common after its path fix)
from common import random_checkpoint, random_prompt
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import model  # noqa: E402
from model.options import DTYPES  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.split("\n")[2:]))
    p.add_argument("--shape", default="llama3.2-1b")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES.values()))
    p.add_argument("--quantize", default=None, help="passed to load_checkpoint: int8 or int4")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--op-by-op", action="store_true", help="decode without the fused step: the reference")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = p.parse_args()
    gpu = args.device == "cuda"

    torch.set_num_threads(args.threads)
    options = {"quantize": args.quantize} if args.quantize else {}
    ckpt = model.load_checkpoint(random_checkpoint(args.shape), dtype=args.dtype, device=args.device,
                                 **options)
    net, config = ckpt.model, ckpt.config
    net.fused_decode = not args.op_by_op
    prompt = random_prompt(config.vocab_size, args.prompt_tokens)
    warmup = 24  # timed one by one before the profile
    cache = model.KVCache(config, args.prompt_tokens + warmup + args.steps + 1, dtype=ckpt.dtype,
                          device=args.device)

    @torch.inference_mode()
    def step(ids: list[int], start_pos: int) -> int:
        if len(ids) == 1:
            logits = net.decode(torch.tensor(ids, device=args.device), [cache])[0]
        else:
            logits = net(torch.tensor([ids], device=args.device), start_pos=start_pos, kv_cache=cache,
                         last_only=True)[0, -1]
        cache.tokens += ids
        return int(logits.argmax())

    token = step(prompt, 0)
    pos = len(prompt)
    times = []
    for _ in range(warmup):  # first calls prime kernels and touch the mapped weights
        start = time.perf_counter()
        token, pos = step([token], pos), pos + 1  # int(): waits for the GPU
        times.append(time.perf_counter() - start)
    rest = sorted(times[3:])[len(times[3:]) // 2]
    print(f"decode steps before the profile: first three {', '.join(f'{1e3 * t:.1f}' for t in times[:3])} ms, "
          f"median of the next {len(times) - 3} {1e3 * rest:.2f} ms ({1 / rest:.1f} tok/s)")
    start = time.perf_counter()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(args.steps):
            token, pos = step([token], pos), pos + 1
    seconds = time.perf_counter() - start
    print(f"{args.shape} {args.dtype}{' ' + args.quantize if args.quantize else ''}"
          f"{' op by op' if args.op_by_op else ''}, {args.threads} threads: {args.steps} decode steps in {seconds:.2f} s "
          f"({args.steps / seconds:.2f} tok/s under the profiler)\n")
    order = "self_cuda_time_total" if gpu else "self_cpu_time_total"
    print(prof.key_averages(group_by_input_shape=True).table(sort_by=order, row_limit=args.top,
                                                             max_name_column_width=32,
                                                             max_shapes_column_width=40))
    return 0


if __name__ == "__main__":
    sys.exit(main())
