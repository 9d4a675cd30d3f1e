"""What the speculation policy could give, and what it gives, on the default model's own replies, at any step cost.

    python bench/speculation_replay.py [--asks tuning|held-out] [--penalty model|1.0] [--row-costs 0.42,0.15,0.05]
                                       [--replies FILE]

Greedy replies do not depend on the guesses (model/speculation.py checks them as plain decoding samples), so
each ask's reply is generated once (`model.generate`, speculation off, the checkpoint's sampling defaults at
temperature 0 or `--penalty 1.0`; kept in `--replies FILE` to replay again) and then replayed step by step with
a step of r rows costing 1 + c (r - 1) steps of one row, for each row cost c in `--row-costs` (measured: ~0.42
for the default model's 4-bit blocks on AVX2, 0.09-0.17 on AVX-512 with VNNI, a few hundredths on a GPU):

    policy   model/speculation.py's Speculation over PromptLookup, as the engine runs it: the guesses it makes,
             the rows it pays for, the tokens each step gives
    oracle   prompt lookup's guesses where a policy knew which stand: each step checks exactly the guesses that
             will stand, and nothing where none will. Near what any policy over prompt lookup can give, not a
             strict bound: a policy that stops short can at times meet a longer match at the next step

Each ask's figure is its reply's tokens over the replayed time, against a step of one row a token (speculation
off); then the geometric mean of the copy asks and of the plain questions. The replay leaves out the time to
sample each row, the prompt, and the host's work between steps, which the served figures
(`bench/speculative.py --served`) include.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent)]

from common import machine  # noqa: E402
from speculative import GROUNDED, HELD_OUT_COPY, HELD_OUT_QUESTIONS, QUESTIONS  # noqa: E402

import torch  # noqa: E402

from model import generate, load_checkpoint  # noqa: E402
from model.generation import sampling_defaults  # noqa: E402
from model.options import DEFAULT_MODEL_NAME, DEFAULT_WEIGHTS_DIR  # noqa: E402
from model.sampling import SamplingParams  # noqa: E402
from model.speculation import PromptLookup, Speculation, StepTimes  # noqa: E402


def replies(asks: dict[str, str], penalty: str, tokens: int) -> dict[str, dict[str, list[int]]]:
    """Each ask's prompt ids and greedy reply ids."""
    ckpt = load_checkpoint(DEFAULT_WEIGHTS_DIR / DEFAULT_MODEL_NAME, widen="auto")  # as the engine loads it
    value = sampling_defaults(ckpt).repetition_penalty if penalty == "model" else float(penalty)
    out = {}
    for name, text in asks.items():
        prompt = ckpt.chat_format.encode_dialog([{"role": "user", "content": text}])
        gen = generate(ckpt, prompt, max_new_tokens=tokens, sampling=SamplingParams(repetition_penalty=value),
                       speculate="off")
        for _ in gen:
            pass
        out[name] = {"prompt": prompt, "reply": list(gen.tokens)}
        print(f"  {name}: {len(gen.tokens)} tokens", flush=True)
    return out


def standing(guesses: list[int], reply: list[int], at: int) -> int:
    """How many of the guesses for reply[at:] stand (the last token of the reply is never guessed past)."""
    n = 0
    while n < len(guesses) and at + n < len(reply) - 1 and guesses[n] == reply[at + n]:
        n += 1
    return n


def replay(prompt: list[int], reply: list[int], row_cost: float, oracle: bool) -> float:
    """The reply's speed with speculation over its speed without, in steps of one row."""
    times = StepTimes()
    for rows in range(1, 9):
        times.observe(rows, 1.0 + row_cost * (rows - 1))
    speculation = Speculation(PromptLookup(), times)
    at, seconds = 0, 0.0
    while at < len(reply):
        room = len(reply) - at - 1
        context = prompt + reply[:at]
        if oracle:
            guesses = speculation.guesser.propose(context, min(room, 7)) if room > 0 else []
            guesses = guesses[:standing(guesses, reply, at)]
        else:
            guesses = speculation.guesses(lambda: context, room) if room > 0 else []
            speculation.checked(len(guesses), standing(guesses, reply, at))
        seconds += times.cost(1 + len(guesses))
        at += 1 + standing(guesses, reply, at)
    return len(reply) / seconds


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--asks", choices=("tuning", "held-out"), default="tuning")
    p.add_argument("--penalty", default="model", help="'model' (the checkpoint's) or a number (1.0: off)")
    p.add_argument("--row-costs", default="0.42,0.15,0.05")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--replies", type=Path, help="read the replies from this file if it exists, else write them")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    sets = ({"copy asks": GROUNDED, "plain questions": QUESTIONS} if args.asks == "tuning" else
            {"copy asks": HELD_OUT_COPY, "plain questions": HELD_OUT_QUESTIONS})
    if args.replies and args.replies.exists():
        got = json.loads(args.replies.read_text())
    else:
        print(f"Greedy replies ({machine()['cpu']}), penalty {args.penalty}:")
        got = {kind: replies(asks, args.penalty, args.tokens) for kind, asks in sets.items()}
        if args.replies:
            args.replies.write_text(json.dumps(got))
    costs = [float(c) for c in args.row_costs.split(",")]
    print(f"\n{args.asks} asks, penalty {args.penalty}; speculation on / off, policy and oracle, by a row's cost:")
    print("| ask | tokens | " + " | ".join(f"policy {c:g} | oracle {c:g}" for c in costs) + " |")
    print("|---|---|" + "---|---|" * len(costs))
    for kind, got_kind in got.items():
        means = {c: ([], []) for c in costs}
        for name, d in got_kind.items():
            cells = []
            for c in costs:
                policy, best = replay(d["prompt"], d["reply"], c, False), replay(d["prompt"], d["reply"], c, True)
                means[c][0].append(policy)
                means[c][1].append(best)
                cells.append(f"{policy:.2f}x | {best:.2f}x")
            print(f"| {name} | {len(d['reply'])} | " + " | ".join(cells) + " |")
        print(f"| **{kind}, geometric mean** | | " + " | ".join(
            f"**{geometric_mean(means[c][0]):.2f}x** | **{geometric_mean(means[c][1]):.2f}x**" for c in costs) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
