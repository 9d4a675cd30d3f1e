"""Does decode slow down in a long-lived process? Many replies in one process, each one's speed.

    python bench/drift.py [--shape llama3.2-1b | default] [--replies 120] [--new-tokens 64] [--threads 2]

Loads the checkpoint once (the random one of a preset's shape, or `default`: the embedded default
model) and generates --replies greedy replies in a row in this process, as a server does, each to a
prompt of its own (about 60 tokens), reading its decode tokens/s. Beside every 10th reply, the
machine's read bandwidth (`x.sum()` over 1 GB, 2 threads), so that a slower machine is told apart
from a slower process. The target (issue 13): the last 20 replies average >= 0.95x the first 20;
the ratio is also given against the bandwidth read next to them. Writes bench/results/drift-<shape>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch  # noqa: E402
from common import RESULTS, ROOT, machine, random_checkpoint

sys.path.insert(0, str(ROOT / "tests"))

from support.servers import DEFAULT_MODEL  # noqa: E402

from model.checkpoint import load_checkpoint  # noqa: E402
from model.generation import generate  # noqa: E402


def bandwidth_gb_s() -> float:
    x = torch.ones(2**28)  # 1 GiB of float32
    x.sum()
    started = time.perf_counter()
    for _ in range(3):
        x.sum()
    return 3 * x.nbytes / (time.perf_counter() - started) / 1e9


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama3.2-1b")
    p.add_argument("--replies", type=int, default=120)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    folder = DEFAULT_MODEL if args.shape == "default" else random_checkpoint(args.shape)
    ckpt = load_checkpoint(folder)
    rows = []
    for i in range(args.replies):
        text = f"Reply {i}: " + " ".join(f"word{(i * 7 + j) % 97}" for j in range(40))
        ids = ckpt.chat_format.encode_dialog([{"role": "user", "content": text}])
        reply = generate(ckpt, ids, max_new_tokens=args.new_tokens, temperature=0.0, stop_ids=set())
        list(reply)
        row = {"reply": i + 1, "decode_tps": reply.stats.tokens_per_second, "at_s": time.monotonic()}
        if i % 10 == 0:
            row["bandwidth_gb_s"] = bandwidth_gb_s()
        rows.append(row)
        print(f"  reply {i + 1:4d}: {row['decode_tps']:6.2f} tok/s"
              + (f"   bandwidth {row['bandwidth_gb_s']:.1f} GB/s" if "bandwidth_gb_s" in row else ""), flush=True)
    first, last = rows[:20], rows[-20:]
    speed = statistics.mean(r["decode_tps"] for r in last) / statistics.mean(r["decode_tps"] for r in first)
    bw_first = statistics.mean(r["bandwidth_gb_s"] for r in first if "bandwidth_gb_s" in r)
    bw_last = statistics.mean(r["bandwidth_gb_s"] for r in last if "bandwidth_gb_s" in r)
    print(f"\nlast 20 / first 20 replies: {speed:.3f}x (target >= 0.95); bandwidth beside them: "
          f"{bw_first:.1f} -> {bw_last:.1f} GB/s ({bw_last / bw_first:.3f}x)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"drift-{args.shape}.json"
    out.write_text(json.dumps({"shape": args.shape, "machine": machine(), "settings": vars(args), "rows": rows,
                               "last_over_first": speed, "bandwidth_last_over_first": bw_last / bw_first}, indent=2))
    print(f"results: {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
