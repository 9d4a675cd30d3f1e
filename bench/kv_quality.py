"""What a q8 KV cache costs in answers: bf16 keys and values against q8, on the default model's real weights.

    python bench/kv_quality.py [--threads 2] [--only perplexity,agreement,needle] [--out FILE]

1. Perplexity of a long text (tests/support/needle.py's `long_text()`: the GFDL 1.3 and Apache 2.0 licences,
   about 7,500 tokens, within the model's 8,192) read through the KV cache in the engine's prefill chunks:
   every chunk attends over the keys and values the earlier chunks left in the cache, in either type.
2. Greedy agreement: 12 everyday questions answered (64 tokens at most, temperature 0) with each cache type:
   how many replies are the same text, and the common prefix of the others, in tokens.
3. A needle in a haystack (tests/support/needle.py): a sentence with a password placed at 10%, 50% and 90% of
   a 6,000-token document, the question at the end; found when the greedy reply names the password.

The default model is loaded as served (its Q4_1 blocks and the decode kernel, speculation off); the model
reads no other text in between.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

import torch  # noqa: E402
from common import machine  # noqa: E402
from support.needle import PLACES, found, long_text, needle_prompt  # noqa: E402

from model.checkpoint import load_checkpoint  # noqa: E402
from model.generation import generate  # noqa: E402
from model.kv_cache import KVCache  # noqa: E402
from model.options import DEFAULT_MODEL_NAME, DEFAULT_WEIGHTS_DIR  # noqa: E402

QUESTIONS = ["What is the capital of France?", "How do I boil an egg?", "Write a haiku about autumn.",
             "What is 17 times 23?", "Explain photosynthesis in one paragraph.",
             "Give me three tips for sleeping better.", "What is the difference between a list and a tuple in Python?",
             "Who wrote Pride and Prejudice?", "Translate 'good morning' into Spanish.", "Why is the sky blue?",
             "Suggest a name for a pet goldfish.", "How many legs does a spider have?"]


def answer(checkpoint, ids: list[int], max_new_tokens: int = 24) -> str:
    reply = generate(checkpoint, ids, max_new_tokens=max_new_tokens, temperature=0.0, max_context=8192,
                     speculate="off")
    return "".join(reply)


def perplexity(checkpoint, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ids[1:], read in the engine's chunks through a KV cache."""
    model = checkpoint.model
    cache = KVCache(checkpoint.config, len(ids), dtype=checkpoint.dtype, kv_type=model.kv_type)
    nll, count = 0.0, 0
    with torch.inference_mode():
        while cache.length < len(ids):
            start, chunk = cache.length, ids[cache.length:cache.chunk_end(len(ids))]
            logits = model(torch.tensor([chunk]), start_pos=start, kv_cache=cache)[0]  # (chunk, vocab)
            cache.extend(chunk)
            targets = torch.tensor(ids[start + 1:start + 1 + len(chunk)])
            logp = torch.log_softmax(logits[:len(targets)].float(), -1)
            nll -= float(logp.gather(1, targets[:, None]).sum())
            count += len(targets)
    return math.exp(nll / count)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", default="perplexity,agreement,needle")
    p.add_argument("--out", default="bench/results/kv_quality.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    only = set(args.only.split(","))
    folder = DEFAULT_WEIGHTS_DIR / DEFAULT_MODEL_NAME
    models = {kv: load_checkpoint(folder, widen="auto", kv_type=kv) for kv in ("bf16", "q8")}
    tokenizer = models["bf16"].tokenizer
    result: dict = {"machine": machine()}
    print(f"[bench] {result['machine']['cpu']}, {args.threads} threads, activations {models['bf16'].dtype}")
    if "perplexity" in only:
        ids = tokenizer.encode(long_text())[:8000]
        result["perplexity"] = {kv: perplexity(m, ids) for kv, m in models.items()}
        ppl = result["perplexity"]
        print(f"perplexity over {len(ids)} tokens: bf16 KV {ppl['bf16']:.4f}, q8 KV {ppl['q8']:.4f} "
              f"({(ppl['q8'] / ppl['bf16'] - 1) * 100:+.2f}%)", flush=True)
    if "agreement" in only:
        rows = []
        for question in QUESTIONS:
            ids = models["bf16"].chat_format.encode_dialog([{"role": "user", "content": question}])
            replies = {kv: generate(m, ids, max_new_tokens=64, temperature=0.0, speculate="off")
                       for kv, m in models.items()}
            for reply in replies.values():
                "".join(reply)
            a, b = replies["bf16"].tokens, replies["q8"].tokens
            rows.append({"question": question, "same": a == b, "common": common_prefix(a, b), "tokens": len(a)})
            print(f"  {question[:40]:40s} same: {a == b}  common prefix {rows[-1]['common']} of {len(a)}", flush=True)
        result["agreement"] = rows
        print(f"greedy agreement: {sum(r['same'] for r in rows)} of {len(rows)} replies the same", flush=True)
    if "needle" in only:
        rows = []
        for place in PLACES:
            ids = needle_prompt(models["bf16"], place)
            for kv, m in models.items():
                started = time.perf_counter()
                reply = answer(m, ids)
                rows.append({"place": place, "kv": kv, "tokens": len(ids), "found": found(reply), "reply": reply,
                             "seconds": time.perf_counter() - started})
                print(f"  needle at {place:.0%} of {len(ids)} tokens, {kv} KV: found {found(reply)}  {reply!r}",
                      flush=True)
        result["needle"] = rows
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
