"""Speculative decoding, off against on, side by side in one run.

    python bench/speculative.py [--rounds 2] [--tokens 256] [--penalty 1.0|model] [--threads N] [--skip-1b] [--out FILE]
                                [--chart] [--chart-from FILE]
    python bench/speculative.py --served [--rounds 3] [--tokens 256] [--threads N] [--asks held-out|tuning] [--penalty P]
                                [--out FILE]

`--served` measures where users meet it: two API servers (`python -m app.api`, engine process and
all) on the default model, one with LLAMA_SPECULATE=off and one with the default (auto), asked in
turn through /v1/chat/completions, temperature 0, `--tokens` at most, the server's other defaults
(the checkpoint's repetition penalty); each ask's wall time as the client sees it, the median of
`--rounds`, and the ratio off / auto (above 1: speculation is faster). The asks are the held-out set
below (12 that copy their input, half of them code edits, and 8 plain questions), which the
speculation policy was not tuned on; `--asks tuning` takes the engine mode's own sets instead.

1. The default model (real weights, as the app serves it), one stream, temperature 0, through the engine
   (app/engine/core.py, in this process, without sockets): asks whose answer repeats the prompt (fixing
   a text, commenting or renaming in code, reformatting, quoting) and plain questions, each asked with
   LLAMA_SPECULATE=off and =auto in turn, `--rounds` times; the best decode tokens/s of each is kept.
   Reported per ask: tokens a decode step gave, decode tokens/s, the ratio, whether the texts are equal.
   `--penalty`: the repetition penalty, 1.0 (none: the model's own choices) by default; `model` keeps
   the checkpoint's (SmolLM2's generation_config: 1.1, which also penalizes the prompt's tokens, so the
   model copies its input much less and there is less to guess).
2. The same model, 8 streams at once (the grounded asks and the questions together), off against
   auto: aggregate tokens/s over the wall time.
3. The 1B shape (random weights, bench/common.py), library `generate()`, one stream: a draft that is the
   model itself (every guess right: what checking k guesses in one step can give at most) and a random
   draft of the default model's shape with Llama 3's vocabulary (every
   guess wrong: what guessing costs when nothing stands, the draft's time counted as the engine counts
   it); plus the time of one step of 1, 4 and 8 rows. The self-draft's own time is left out: it shows
   what checking k guesses in one step gives when all stand, not a useful pairing.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

from common import machine, random_checkpoint  # noqa: E402

from model.options import DEFAULT_MODEL_NAME  # noqa: E402

PARAGRAPH = ("Teh quick brown fox jumpd over the lazzy dog. It was a sunny day and the fox was verry happy. "
             "The dog did not care, it just slept under the tree all day long, dreaming of bones.")
FUNCTION = '''def mean(values):
    if not values:
        return 0.0
    total = 0.0
    for value in values:
        total += value
    return total / len(values)
'''
CODE = '''def area(x, y):
    result = x * y
    print("area", result)
    return result


def perimeter(x, y):
    result = 2 * (x + y)
    print("perimeter", result)
    return result
'''
STORY = ("The river runs past the old mill. Children play in the park every afternoon. In spring the river "
         "floods the low fields. The baker opens at six. Fishermen wait by the river before dawn. The library "
         "closes early on Fridays.")
GROUNDED = {
    "fix spelling": f"Fix the spelling in this paragraph and give it back in full:\n\n{PARAGRAPH}",
    "comment code": f"Add a comment to each line of this function and give back the whole function:\n\n{FUNCTION}",
    "rename variable": f"Rename the variable `result` to `value` in this code and give back all of it:\n\n{CODE}",
    "reformat list": "Reformat this as a Markdown bulleted list, one item a line: apples, pears, plums, cherries, "
                     "grapes, lemons, oranges, melons, peaches, apricots, figs, dates.",
    "quote sentences": f"Quote, word for word, every sentence of this text that mentions the river:\n\n{STORY}",
    "repeat a text": f"Repeat this text exactly, then say how many sentences it has:\n\n{STORY}",
}
QUESTIONS = {
    "capital": "What is the capital of France? Answer in two sentences.",
    "photosynthesis": "Explain photosynthesis in one paragraph.",
    "sleep tips": "Give me three tips for sleeping better.",
    "haiku": "Write a haiku about autumn.",
    "prime numbers": "What is a prime number? Give examples.",
    "airplanes": "How do airplanes fly?",
}

# The held-out set: never used to choose the speculation policy's constants; its figures are the ones reported.
INVENTORY = "hammer 12\nscrewdriver 30\nwrench 7\npliers 15\ntape measure 9\nlevel 4\nsaw 6\nchisel 11"
HANDLER = '''def handle(request):
    user = request.user
    if user is None:
        return {"status": 401, "error": "sign in first"}
    items = load_items(user.id)
    total = sum(item.price for item in items)
    return {"status": 200, "items": items, "total": total}
'''
LOOP = '''for i in range(len(names)):
    name = names[i]
    if name.startswith("_"):
        continue
    print(i, name.upper())
'''
CLASS = '''class Counter:
    def __init__(self):
        self.count = 0

    def add(self, n):
        self.count = self.count + n

    def reset(self):
        self.count = 0
'''
LETTER = ("Dear Ms. Alvarez, thank you for your letter of March 3. We have checked the order you described and "
          "found that two of the six chairs were sent to the wrong address. New chairs will leave our store on "
          "Monday and should reach you by Thursday. We are sorry for the trouble.")
HELD_OUT_COPY = {
    "python to js": "Translate this Python into JavaScript, keeping every name and line:\n\n" + HANDLER,
    "add type hints": "Add type hints to every function of this class and give back the whole class:\n\n" + CLASS,
    "rename function arg": "Rename `names` to `labels` everywhere in this code and give back all of it:\n\n" + LOOP,
    "add docstrings": "Add a one-line docstring to each method of this class and give back the whole class:\n\n"
                      + CLASS,
    "401 to 403": "This handler should return 403 instead of 401. Give back the whole function with that change:"
                       "\n\n" + HANDLER,
    "enumerate loop": "Rewrite this loop with enumerate() and give back the whole loop:\n\n" + LOOP,
    "table of stock": "Turn this inventory into a Markdown table with the columns Tool and Count:\n\n" + INVENTORY,
    "sort inventory": "Sort this inventory alphabetically, one item a line, as written:\n\n" + INVENTORY,
    "letter formal": "Copy this letter, replacing \"chairs\" with \"tables\" everywhere:\n\n" + LETTER,
    "letter bullets": "Give every sentence of this letter as a bullet point, word for word:\n\n" + LETTER,
    "json of stock": "Write this inventory as a JSON object mapping each tool to its count:\n\n" + INVENTORY,
    "quote the letter": "Quote this letter exactly, then say who it is addressed to:\n\n" + LETTER,
}
HELD_OUT_QUESTIONS = {
    "moon": "Why does the Moon have phases?",
    "bread": "How do I bake a simple loaf of bread?",
    "python list": "What is the difference between a list and a tuple in Python?",
    "exercise": "Suggest a short morning exercise routine.",
    "volcano": "Explain how a volcano erupts.",
    "poem": "Write a four-line poem about the sea.",
    "interest": "What is compound interest? Give an example.",
    "rain": "Why is the sky grey when it rains?",
}


MODEL = DEFAULT_MODEL_NAME


def one_stream(harness_for, asks: dict[str, str], rounds: int, settings) -> list[dict]:
    from support.engine import last, request

    rows = []
    for name, ask in asks.items():
        best = {}
        for _ in range(rounds):
            for mode in ("off", "auto"):  # interleaved: the machine's drift meets both alike
                harness = harness_for(mode)
                asked = request(ask, settings, model=MODEL)
                done = last(harness.ask(asked)[asked.id])
                s = done.stats
                if mode not in best or s.tokens_per_second > best[mode]["tokens_per_second"]:
                    best[mode] = {"tokens_per_second": s.tokens_per_second, "tokens_per_step": s.tokens_per_step,
                                  "tokens": s.new_tokens, "text": done.text}
        off, auto = best["off"], best["auto"]
        rows.append({"ask": name, "tokens": auto["tokens"], "tokens_per_step": auto["tokens_per_step"],
                     "off_tokens_per_second": off["tokens_per_second"],
                     "auto_tokens_per_second": auto["tokens_per_second"],
                     "ratio": auto["tokens_per_second"] / off["tokens_per_second"],
                     "same_text": off["text"] == auto["text"]})
        print(f"  {name:16} {rows[-1]['tokens']:4d} tokens  {rows[-1]['tokens_per_step']:.2f} a step  "
              f"off {off['tokens_per_second']:6.1f}  auto {auto['tokens_per_second']:6.1f} tokens/s  "
              f"{rows[-1]['ratio']:.2f}x  same text: {rows[-1]['same_text']}", flush=True)
    return rows


def many_streams(harness_for, asks: list[str], rounds: int, settings) -> dict:
    from support.engine import request
    from app.messages import Done

    best: dict[str, float] = {}
    texts: dict[str, list[str]] = {}
    for _ in range(rounds):
        for mode in ("off", "auto"):
            harness = harness_for(mode)
            requests = [request(ask, settings, model=MODEL) for ask in asks]
            started = time.perf_counter()
            events = harness.run(*requests)
            seconds = time.perf_counter() - started
            done = {e.id: e for e in events if isinstance(e, Done)}
            new_tokens = sum(d.stats.new_tokens for d in done.values())
            best[mode] = max(best.get(mode, 0.0), new_tokens / seconds)
            texts[mode] = [done[r.id].text for r in requests]
    result = {"streams": len(asks), "off_tokens_per_second": best["off"], "auto_tokens_per_second": best["auto"],
              "ratio": best["auto"] / best["off"], "same_text": texts["off"] == texts["auto"]}
    print(f"  {len(asks)} streams: off {best['off']:.1f}  auto {best['auto']:.1f} tokens/s  "
          f"{result['ratio']:.3f}x  same text: {result['same_text']}", flush=True)
    return result


def served(asks: dict[str, dict[str, str]], rounds: int, tokens: int, threads: int | None,
           penalty: str | None = None) -> dict:
    """Two API servers, speculation off and auto, asked in turn: each ask's median wall time, off / auto."""
    import statistics
    import tempfile

    import httpx
    from support.servers import DEFAULT_MODEL, ApiServer, server_env
    from support.special_checkpoints import default_model

    default_model()
    folder = Path(tempfile.mkdtemp(prefix="speculative-served-"))
    extra = {"threads": threads} if threads else {}
    if penalty not in (None, "model"):  # else the server's default: the checkpoint's
        extra["repetition_penalty"] = penalty
    servers = {mode: ApiServer(server_env(checkpoint=DEFAULT_MODEL, weights_dir=DEFAULT_MODEL.parent, speculate=mode,
                                          kv_cache_mb=0, **extra), folder / f"{mode}.log")
               for mode in ("off", "auto")}
    results: dict[str, list[dict]] = {}
    try:
        for server in servers.values():
            server.wait_ready()
        with httpx.Client(timeout=600) as client:
            def ask(mode: str, text: str) -> tuple[float, str, int]:
                started = time.perf_counter()
                r = client.post(f"{servers[mode].url}/v1/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": text}], "temperature": 0,
                    "max_tokens": tokens})
                seconds = time.perf_counter() - started
                r.raise_for_status()
                body = r.json()
                return seconds, body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"]

            for kind, named in asks.items():
                print(f"Served, {kind}:", flush=True)
                rows = []
                for name, text in named.items():
                    times: dict[str, list[float]] = {"off": [], "auto": []}
                    texts = {}
                    ask("auto", text)  # once unmeasured: both servers' caches of code and memory warm alike
                    ask("off", text)
                    for r in range(rounds):
                        for mode in (("off", "auto") if r % 2 == 0 else ("auto", "off")):
                            seconds, texts[mode], n = ask(mode, text)
                            times[mode].append(seconds)
                    off, auto = statistics.median(times["off"]), statistics.median(times["auto"])
                    rows.append({"ask": name, "tokens": n, "off_s": off, "auto_s": auto, "ratio": off / auto,
                                 "same_text": texts["off"] == texts["auto"]})
                    print(f"  {name:20} {n:4d} tokens  off {off:6.2f} s  auto {auto:6.2f} s  {off / auto:.2f}x  "
                          f"same text: {rows[-1]['same_text']}", flush=True)
                results[kind] = rows
                print(f"  {kind}: geometric mean {geometric_mean([r['ratio'] for r in rows]):.2f}x, slowest "
                      f"{min(r['ratio'] for r in rows):.2f}x", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    return results


def one_billion(tokens: int) -> dict:
    """The 1B shape, library generate(): no guesses, a self-draft, a random draft; one step of 1, 4, 8 rows."""
    import torch
    from common import random_prompt
    from model import generate, load_checkpoint
    from model.kv_cache import KVCache

    target = load_checkpoint(random_checkpoint("llama3.2-1b"), dtype="bfloat16")
    draft = load_checkpoint(random_checkpoint("smollm2-135m", vocab_size=128256), dtype="bfloat16")
    prompt = random_prompt(target.config.vocab_size, 200)
    out = {}
    texts = {}
    from model.speculation import Draft

    free = Draft.cost_per_guess
    for name, speculate in (("off", "off"), ("self-draft", target), ("random draft", draft), ("prompt lookup", "auto")):
        # The self-draft's own time is left out (every guess right: what checking can give at most); the
        # random draft's is counted, as the engine counts any draft's.
        Draft.cost_per_guess = 0.0 if name == "self-draft" else free
        g = generate(target, prompt, max_new_tokens=tokens, speculate=speculate, stop_ids=set())
        texts[name] = "".join(g)
        Draft.cost_per_guess = free
        s = g.stats
        out[name] = {"tokens_per_second": s.tokens_per_second, "tokens_per_step": s.tokens_per_step,
                     "guesses": s.guesses}
        print(f"  1B {name:14} {s.tokens_per_second:6.2f} tokens/s  {s.tokens_per_step:.2f} a step", flush=True)
    out["same_text"] = len(set(texts.values())) == 1
    cache = KVCache(target.config, 1024, dtype=target.dtype)
    with torch.inference_mode():
        target.model(torch.tensor([prompt]), kv_cache=cache, last_only=True)
        cache.extend(prompt)
        steps = {}
        for rows in (1, 4, 8):
            positions = list(range(cache.length, cache.length + rows))
            times = []
            for _ in range(6):
                started = time.perf_counter()
                target.model.decode(torch.tensor(prompt[:rows]), [cache] * rows, positions=positions)
                times.append(time.perf_counter() - started)
            steps[rows] = sorted(times)[len(times) // 2]
    out["step_ms"] = {rows: 1000 * t for rows, t in steps.items()}
    print("  1B one step: " + ", ".join(f"{r} rows {1000 * t:.1f} ms" for r, t in steps.items()), flush=True)
    return out


def chart(results: dict) -> str:
    """docs/benchmarks-speculative.png: auto / off per ask, with the tokens each step gave (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no chart: matplotlib is not installed (pip install matplotlib)"
    rows = [(r, "grounded") for r in results["grounded"]] + [(r, "questions") for r in results["questions"]]
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=110)
    colors = {"grounded": "tab:blue", "questions": "tab:gray"}
    for y, (row, kind) in enumerate(reversed(rows)):
        ax.barh(y, row["ratio"], color=colors[kind])
        ax.text(row["ratio"] + 0.03, y, f"{row['ratio']:.2f}x, {row['tokens_per_step']:.2f} a step", va="center",
                fontsize=7)
    ax.set_yticks(range(len(rows)), [row["ask"] for row, _ in reversed(rows)], fontsize=8)
    for x, style in ((1.0, "-"), (2.0, ":")):
        ax.axvline(x, color="black", linestyle=style, linewidth=0.8)
    ax.set_xlabel("decode tokens/s, LLAMA_SPECULATE=auto / off")
    ax.set_xlim(0, max(row["ratio"] for row, _ in rows) + 1.0)
    ax.set_title(f"Speculative decoding, one stream ({results['machine']['cpu']}): grounded asks (blue) "
                 f"{results['grounded_geomean']:.2f}x, questions {results['questions_geomean']:.2f}x", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    path = Path(__file__).resolve().parents[1] / "docs" / "benchmarks-speculative.png"
    fig.tight_layout()
    fig.savefig(path)
    return f"chart: docs/{path.name}"


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--penalty", help="repetition penalty: a number, or 'model' for the checkpoint's (default: 1.0; "
                                     "--served: the server's default, the checkpoint's)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--skip-1b", action="store_true")
    p.add_argument("--only-1b", action="store_true")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--chart", action="store_true", help="draw docs/benchmarks-speculative.png (matplotlib)")
    p.add_argument("--chart-from", default=None, help="only draw the chart, from the JSON of an earlier --out")
    p.add_argument("--served", action="store_true", help="through the API: two servers, off and auto, in turn")
    p.add_argument("--asks", choices=("held-out", "tuning"), default="held-out", help="the served mode's asks")
    args = p.parse_args()
    if args.served:
        import signal
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill stops the two servers too (finally)
        asks = ({"copy asks": HELD_OUT_COPY, "plain questions": HELD_OUT_QUESTIONS} if args.asks == "held-out" else
                {"copy asks": GROUNDED, "plain questions": QUESTIONS})
        results = {"machine": machine(), "tokens": args.tokens, "rounds": args.rounds, "asks": args.asks,
                   "penalty": args.penalty or "the server's"}
        print(f"[bench] {results['machine']['cpu']}, served, {args.asks} asks", flush=True)
        results["served"] = served(asks, args.rounds, args.tokens, args.threads, args.penalty)
        for kind, rows in results["served"].items():
            results[f"{kind} geomean"] = geometric_mean([r["ratio"] for r in rows])
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2))
        return 0
    if args.chart_from:
        print(chart(json.loads(Path(args.chart_from).read_text())))
        return 0
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    from support.engine import EngineHarness
    from support.special_checkpoints import default_model

    folder = default_model()
    harnesses = {}

    def harness_for(mode: str) -> EngineHarness:
        """An engine with speculation `mode` that keeps no KV cache (each ask prefills its prompt)."""
        if mode not in harnesses:
            harnesses[mode] = EngineHarness(folder, speculate=mode, kv_cache_mb=0)
        return harnesses[mode]

    from app.messages import ReplySettings
    settings = ReplySettings(max_new_tokens=args.tokens, temperature=0.0,
                             repetition_penalty=None if args.penalty == "model" else float(args.penalty or 1.0))
    results = {"machine": machine(), "tokens": args.tokens, "rounds": args.rounds, "penalty": args.penalty}
    print(f"[bench] {results['machine']['cpu']}, {torch.get_num_threads()} threads", flush=True)
    if args.only_1b:
        results["1b"] = one_billion(min(args.tokens, 64))
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2))
        return 0
    print("One stream, grounded asks:", flush=True)
    results["grounded"] = one_stream(harness_for, GROUNDED, args.rounds, settings)
    print("One stream, plain questions:", flush=True)
    results["questions"] = one_stream(harness_for, QUESTIONS, args.rounds, settings)
    for kind in ("grounded", "questions"):
        results[f"{kind}_geomean"] = geometric_mean([r["ratio"] for r in results[kind]])
        print(f"  {kind}: geometric mean {results[f'{kind}_geomean']:.2f}x, slowest "
              f"{min(r['ratio'] for r in results[kind]):.2f}x", flush=True)
    print("Many streams:", flush=True)
    mixed = list(GROUNDED.values())[:4] + list(QUESTIONS.values())[:4]
    results["streams"] = [many_streams(harness_for, mixed[:n], args.rounds, settings) for n in (2, 4, 8)]
    if args.chart:
        print(chart(results))
    if not args.skip_1b:
        print("The 1B shape:", flush=True)
        results["1b"] = one_billion(min(args.tokens, 64))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
