"""How often the default model ends an answer looping, at given sampling settings.

    python bench/loops.py run NAME [KEY=VALUE ...] [--max-new-tokens 512] [--seeds-from 0] [--threads 1]
    python bench/loops.py report [--loop-n 12 --loop-count 3] [--details]

`run` answers the 50 everyday QUESTIONS with the default model through `model.generate`, question i
seeded with i + `--seeds-from` (so a run repeats and every setting meets the same seeds; another
`--seeds-from` is a second sample of the same questions), and writes every answer's
tokens to `bench/results/loops-NAME.json`. KEY=VALUE are SamplingParams fields, e.g.
`temperature=0.2 top_p=0.9 repetition_penalty=1.1`. Settings that use only temperature, top_k,
top_p and seed go through Generation's shorthand keywords, so this script also runs against older
code of the engine (PYTHONPATH) for a before/after of the sampler itself.

`report` reads every results file and prints one row per setting. An answer *loops* when it ends
at the token limit inside a repeated phrase: its last `--loop-n` tokens occur at least
`--loop-count` times in it (so the loop was gone round at least twice before the limit cut it; a
period up to a third of the answer is caught, which a window penalty of 64 tokens cannot see). An
answer is *right* when it matches its check (a regular expression, case-insensitive) for the
questions that have one.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from model import generate, kernels, load_checkpoint  # noqa: E402
from model.options import DEFAULT_MODEL_NAME, DEFAULT_WEIGHTS_DIR, ModelOptions  # noqa: E402

RESULTS = ROOT / "bench" / "results"
CHECKPOINT = DEFAULT_WEIGHTS_DIR / DEFAULT_MODEL_NAME
SHORTHAND = {"temperature", "top_k", "top_p", "seed"}

# (question, regular expression a right answer matches, or None where any answer may do)
QUESTIONS: list[tuple[str, str | None]] = [
    ("Write a short poem about the sea.", None),
    ("What is a CPU cache?", None),
    ("What is the capital of France?", r"\bParis\b"),
    ("Give me a simple recipe for pancakes.", None),
    ("Quels sont les symboles de la France ?", None),
    ("What is 12 times 7?", r"\b84\b"),
    ("Who wrote Romeo and Juliet?", r"Shakespeare"),
    ("Explain photosynthesis in simple terms.", None),
    ("What is the largest planet in our solar system?", r"Jupiter"),
    ("How many legs does a spider have?", r"\b(8|eight)\b"),
    ("What is the boiling point of water in Fahrenheit?", r"\b212\b"),
    ("What language is spoken in Brazil?", r"Portuguese"),
    ("What is the capital of Japan?", r"Tokyo"),
    ("What is the chemical symbol for gold?", r"\bAu\b"),
    ("Translate 'good morning' into Spanish.", r"buenos d[ií]as"),
    ("Why is the sky blue?", None),
    ("Give me three tips for sleeping better.", None),
    ("How do I reverse a list in Python?", None),
    ("Write a haiku about autumn.", None),
    ("What is the difference between weather and climate?", None),
    ("Tell me a joke about cats.", None),
    ("How does a rainbow form?", None),
    ("What should I pack for a weekend hiking trip?", None),
    ("Explain what a black hole is to a child.", None),
    ("Write a short birthday message for my friend Anna.", None),
    ("What are the benefits of drinking water?", None),
    ("How do I make a cup of tea?", None),
    ("Summarize the story of Cinderella in two sentences.", None),
    ("What is machine learning?", None),
    ("Suggest a name for a pet turtle.", None),
    ("How can I save money on groceries?", None),
    ("What does DNA stand for?", r"deoxyribonucleic"),
    ("Write a four-line poem about the moon.", None),
    ("What is the internet?", None),
    ("Comment faire une omelette ?", None),
    ("¿Cuál es la capital de España?", r"Madrid"),
    ("Explain how a car engine works.", None),
    ("What are the primary colors?", None),
    ("Why do we have seasons?", None),
    ("Write a short story about a dragon who is afraid of fire.", None),
    ("How do vaccines work?", None),
    ("What is the tallest mountain in the world?", r"Everest"),
    ("Give me a workout plan for beginners.", None),
    ("What is the Pythagorean theorem?", None),
    ("Describe a sunset in three sentences.", None),
    ("How do I write a good email to my boss asking for a day off?", None),
    ("What is the difference between a virus and a bacterium?", None),
    ("List five fruits that are red.", None),
    ("Explain what an operating system does.", None),
    ("Why is exercise good for your health?", None),
]


# ---- run -------------------------------------------------------------------------------------------

def parse_setting(pairs: list[str]) -> dict:
    """`KEY=VALUE` words -> SamplingParams keywords, numbers parsed."""
    setting = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"expected KEY=VALUE, found {pair!r}")
        setting[key] = int(value) if re.fullmatch(r"-?\d+", value) else float(value)
    return setting


def sampling_options(setting: dict, seed: int) -> dict:
    """Generation keywords for one question: the shorthand where it is enough, else `sampling`."""
    if set(setting) <= SHORTHAND:
        return {**setting, "seed": seed}
    from model.sampling import SamplingParams
    return {"sampling": SamplingParams(**{**setting, "seed": seed})}


def run(name: str, setting: dict, max_new_tokens: int, checkpoint: Path, seeds_from: int = 0) -> Path:
    ckpt = load_checkpoint(checkpoint)
    answers, started = [], time.perf_counter()
    for i, (question, _) in enumerate(QUESTIONS):
        ids = ckpt.chat_format.encode_dialog([{"role": "user", "content": question}])
        gen = generate(ckpt, ids, max_new_tokens=max_new_tokens, **sampling_options(setting, seed=seeds_from + i))
        text = "".join(gen)
        answers.append({"question": question, "tokens": gen.tokens, "text": text,
                        "finish_reason": gen.finish_reason})
        print(f"[{name}] {i + 1}/{len(QUESTIONS)} {gen.finish_reason:6} {len(gen.tokens):4} tokens "
              f"{gen.stats.tokens_per_second:5.1f}/s  {question}", file=sys.stderr, flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"loops-{name}.json"
    out.write_text(json.dumps({"name": name, "setting": setting, "max_new_tokens": max_new_tokens,
                               "seeds_from": seeds_from, "seconds": round(time.perf_counter() - started), "answers": answers},
                              ensure_ascii=False, indent=1))
    return out


# ---- report ----------------------------------------------------------------------------------------

def occurrences(tokens: list[int], phrase: list[int]) -> int:
    """How often `phrase` occurs in `tokens` (overlaps counted)."""
    n = len(phrase)
    return sum(tokens[i:i + n] == phrase for i in range(len(tokens) - n + 1))


def loops(answer: dict, n: int, count: int) -> bool:
    tokens = answer["tokens"]
    return answer["finish_reason"] == "length" and occurrences(tokens, tokens[-n:]) >= count


def right(answer: dict, check: str | None) -> bool | None:
    return None if check is None else re.search(check, answer["text"], re.IGNORECASE) is not None


def setting_label(setting: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in setting.items()) or "greedy"


def report(n: int, count: int, details: bool) -> None:
    checks = dict(QUESTIONS)
    results = [json.loads(path.read_text()) for path in sorted(RESULTS.glob("loops-*.json"),
                                                                key=lambda p: p.stat().st_mtime)]
    print(f"loop: ends at the limit, and its last {n} tokens occur >= {count} times in it")
    print("| run | sampling | max tokens | seeds | loops | at limit | right | mean tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for result in results:
        answers = result["answers"]
        looped = [a for a in answers if loops(a, n, count)]
        marks = [right(a, checks.get(a["question"])) for a in answers]
        graded = [m for m in marks if m is not None]
        mean = sum(len(a["tokens"]) for a in answers) / len(answers)
        seeds = result.get("seeds_from", 0)
        print(f"| {result['name']} | {setting_label(result['setting'])} | {result['max_new_tokens']} | "
              f"{seeds}-{seeds + len(answers) - 1} | {len(looped)}/{len(answers)} | "
              f"{sum(a['finish_reason'] == 'length' for a in answers)} | {sum(graded)}/{len(graded)} | "
              f"{mean:.0f} |")
    if details:  # which checked question each run got right
        print("\n| question | " + " | ".join(r["name"] for r in results) + " |")
        print("|---" * (len(results) + 1) + "|")
        for question, check in QUESTIONS:
            if check is not None:
                marks = [right(next(a for a in r["answers"] if a["question"] == question), check) for r in results]
                print(f"| {question} | " + " | ".join("yes" if m else "no" for m in marks) + " |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python bench/loops.py", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="answer every question at one setting")
    run_parser.add_argument("name", help="the results file is bench/results/loops-NAME.json")
    run_parser.add_argument("setting", nargs="*", help="SamplingParams fields as KEY=VALUE")
    run_parser.add_argument("--max-new-tokens", type=int, default=512)
    run_parser.add_argument("--seeds-from", type=int, default=0, help="question i is seeded with i + this")
    run_parser.add_argument("--threads", type=int, help="torch threads (1 when another run shares the CPU)")
    run_parser.add_argument("--checkpoint", type=Path, default=CHECKPOINT)
    report_parser = commands.add_parser("report", help="one table row per results file")
    report_parser.add_argument("--loop-n", type=int, default=12, help="tokens of the final phrase")
    report_parser.add_argument("--loop-count", type=int, default=3, help="times it must occur")
    report_parser.add_argument("--details", action="store_true", help="each checked question, right or not")
    args = parser.parse_args(argv)
    if args.command == "run":
        kernels.configure(**ModelOptions.from_env().kernel_options)  # LLAMA_KERNELS etc., as the app takes them
        if args.threads:
            torch.set_num_threads(args.threads)
        print(run(args.name, parse_setting(args.setting), args.max_new_tokens, args.checkpoint, args.seeds_from))
    else:
        report(args.loop_n, args.loop_count, args.details)


if __name__ == "__main__":
    main()
