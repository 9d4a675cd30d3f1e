"""Prefill speed by chunk size: what the engine's PREFILL_CHUNK costs against one pass over the prompt.

    python bench/prefill_chunk.py [--shape llama3.2-1b] [--prompt 1024] [--chunks 64,128,256,512,1024]

One fresh process holds our model and transformers' on the same random bf16 checkpoint
(bench/common.py) and prefills the same `--prompt` random ids, in rounds: per round, our model in
each chunk size (each chunk one forward pass into a KV cache, as the engine runs a prompt) and
transformers' forward over the whole prompt, taken in turn, so bandwidth drift touches each system
alike. Reported: the median seconds per system and prefill tokens/s against transformers'.

A chunk is also how long the other streams wait (the engine runs one chunk between two decode
steps), so the smallest chunk that costs little is the one to pick.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch  # noqa: E402  (imported by common after its path fix)
from common import machine, ran_as_worker, random_checkpoint, random_prompt, run_worker, worker_arguments, write_result


def worker(spec: dict, out: str) -> None:
    import transformers

    import model
    from model.kv_cache import KVCache

    torch.set_num_threads(spec["threads"])
    ckpt = model.load_checkpoint(spec["folder"], dtype=torch.bfloat16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(spec["folder"], dtype=torch.bfloat16).eval()
    prompt = random_prompt(ckpt.config.vocab_size, spec["prompt"])
    ids = torch.tensor([prompt])

    @torch.inference_mode()
    def ours(chunk: int) -> float:
        cache = KVCache(ckpt.config, len(prompt), dtype=ckpt.dtype)
        started = time.perf_counter()
        for start in range(0, len(prompt), chunk):
            ckpt.model(ids[:, start:start + chunk], start_pos=start, kv_cache=cache, last_only=True)
        return time.perf_counter() - started

    @torch.inference_mode()
    def theirs() -> float:
        started = time.perf_counter()
        hf(input_ids=ids, logits_to_keep=1, use_cache=True)
        return time.perf_counter() - started

    times: dict[str, list[float]] = {}
    ours(spec["chunks"][0]), theirs()  # warm up: pages of the mapped file, oneDNN's primitives
    for _ in range(spec["rounds"]):
        for chunk in spec["chunks"]:
            times.setdefault(f"ours chunk {chunk}", []).append(ours(chunk))
        times.setdefault("transformers", []).append(theirs())
    write_result(out, {"times": times, "compute_dtype": str(ckpt.model.compute_dtype)})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama3.2-1b")
    p.add_argument("--prompt", type=int, default=1024, help="prompt tokens (default 1024)")
    p.add_argument("--chunks", default="64,128,256,512,1024")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    worker_arguments(p)
    args = p.parse_args()
    if ran_as_worker(args, worker):
        return 0
    chunks = [int(c) for c in args.chunks.split(",")]
    spec = {"folder": str(random_checkpoint(args.shape)), "prompt": args.prompt, "chunks": chunks,
            "rounds": args.rounds, "threads": args.threads}
    result = run_worker(Path(__file__), spec, idle_wait=60)
    if "error" in result:
        print(result["error"], file=sys.stderr)
        return 1
    about = machine()
    print(f"{args.shape}, {args.prompt}-token prompt, {args.threads} threads, {about['cpu']}; "
          f"compute {result['compute_dtype']}; other load {result['other_load_cores']:.2f} cores")
    theirs = statistics.median(result["times"]["transformers"])
    print("| prefill | median s | tokens/s | vs transformers |")
    print("|---|---|---|---|")
    for name, seconds in result["times"].items():
        median = statistics.median(seconds)
        print(f"| {name} | {median:.3f} | {args.prompt / median:.1f} | {theirs / median:.2f}x |")
    out = Path(__file__).parent / "results" / f"prefill_chunk-{args.shape}.json"
    write_result(str(out), {"shape": args.shape, "prompt": args.prompt, "machine": about, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
