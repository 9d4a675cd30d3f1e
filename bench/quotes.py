"""Does the default model give back what it is asked to quote or edit, under its repetition penalty?

    python bench/quotes.py [--asks held-out|tuning] [--tokens 256] [--threads 2] [--out FILE] [--show]

Every ask of bench/speculative.py's copy sets (text or code to give back, whole or with a change) is answered
greedily through `model.generate` by the default model (real weights, as served) three ways:

    none        repetition penalty 1 (off)
    llama.cpp   the checkpoint's penalty (1.1) on every id of the last 64, as llama.cpp applies it
    ours        the same penalty, sparing an id that continues a run of the prompt the reply quotes
                (model/sampling.py, QuotedRuns; `QUOTE_RUN = 0` turns the sparing off, which is how the
                llama.cpp row is run)

and scored by the share of the given text's lines (sentences, for prose) that the reply holds word for
word. An edit changes some lines on purpose (the renamed variable's), so 1.0 is not the aim for every ask;
a translation (Python to JavaScript) or a table keeps almost none in any way. Loops are what the penalty is
for: bench/loops.py counts them.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent)]

from common import machine  # noqa: E402
from speculative import GROUNDED, HELD_OUT_COPY  # noqa: E402

import torch  # noqa: E402

from model import generate, load_checkpoint, sampling  # noqa: E402
from model.generation import sampling_defaults  # noqa: E402
from model.options import DEFAULT_MODEL_NAME, DEFAULT_WEIGHTS_DIR  # noqa: E402

WAYS = ("none", "llama.cpp", "ours")


def given_lines(ask: str) -> list[str]:
    """The lines of the text an ask hands over (after its first blank line, or its colon), prose cut at sentences."""
    text = ask.split("\n\n", 1)[1] if "\n\n" in ask else ask.split(": ", 1)[1]
    pieces = re.split(r"(?<=[.!?])\s+|\n", text)
    return [p.strip() for p in pieces if p.strip()]


def kept(ask: str, reply: str) -> float:
    lines = given_lines(ask)
    return sum(line in reply for line in lines) / len(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--asks", choices=("held-out", "tuning"), default="held-out")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, help="write every reply and score as JSON")
    p.add_argument("--show", action="store_true", help="print every reply")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    asks = HELD_OUT_COPY if args.asks == "held-out" else GROUNDED
    ckpt = load_checkpoint(DEFAULT_WEIGHTS_DIR / DEFAULT_MODEL_NAME, widen="auto")  # as the engine loads it
    defaults = sampling_defaults(ckpt)
    spare = sampling.QUOTE_RUN
    rows = []
    for name, ask in asks.items():
        ids = ckpt.chat_format.encode_dialog([{"role": "user", "content": ask}])
        row = {"ask": name}
        for way in WAYS:
            sampling.QUOTE_RUN = 0 if way == "llama.cpp" else spare
            penalty = 1.0 if way == "none" else defaults.repetition_penalty
            params = sampling.SamplingParams(repetition_penalty=penalty)  # greedy
            reply = "".join(generate(ckpt, ids, max_new_tokens=args.tokens, sampling=params, speculate="off"))
            row[way] = {"kept": kept(ask, reply), "reply": reply}
            if args.show:
                print(f"--- {name}, {way}\n{reply}")
        sampling.QUOTE_RUN = spare
        rows.append(row)
        print(f"{name:24s} " + "  ".join(f"{way} {row[way]['kept']:.2f}" for way in WAYS), flush=True)
    print(f"\nmachine: {machine()['cpu']}; penalty {defaults.repetition_penalty} over the last 64 ids, greedy, "
          f"{args.tokens} tokens at most, {args.asks} asks")
    print("| ask | " + " | ".join(WAYS) + " |\n|---|" + "---|" * len(WAYS))
    for row in rows:
        print(f"| {row['ask']} | " + " | ".join(f"{row[way]['kept']:.2f}" for way in WAYS) + " |")
    print("| **mean** | " + " | ".join(f"**{statistics.mean(r[way]['kept'] for r in rows):.2f}**" for way in WAYS)
          + " |")
    if args.out:
        args.out.write_text(json.dumps({"machine": machine(), "asks": args.asks, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
