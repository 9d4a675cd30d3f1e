"""Questions about a long PDF: do the chunks the engine puts in the prompt hold the page with the answer?

Writes a PDF of made-up records (`--pages`, default 48), each page a few paragraphs about one harbor
district, with one distinct fact among them; similar words (lighthouse, ferry, bell, ...) recur on every
page, so a question's words alone do not point to its page. Then reads it as an upload is read
(app.files.read) and, for each of 12 questions whose answer is on a known page, runs the engine's own
selection (app.engine.prompt.choose_prompt_files) with the default model's tokenizer, context and reply
room (weights/SmolLM2-135M-Instruct, LLAMA_MAX_CONTEXT's default, the default max_new_tokens): how many
questions' chosen chunks hold the answer's page and the fact itself, where the fact's chunk ranked, how
many chunks of how many went in, in how many tokens, and how long reading and choosing took. No model
runs: this measures the retrieval, not the answers.

    python bench/file_questions.py [--pages 48] [--checkpoint weights/SmolLM2-135M-Instruct] [--elsewhere]
                                   [--max-context 8192] [--max-new-tokens 1024]
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "tests"):  # the scripts run as `python bench/x.py` from anywhere
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from support.pdfs import make_pdf  # noqa: E402

from app.engine.prompt import choose_prompt_files  # noqa: E402
from app.files.chunks import chunks, rank  # noqa: E402
from app.files.read import read_file  # noqa: E402
from app.messages import Attachment, ChatMessage  # noqa: E402
from model.chat_format import load_chat_format  # noqa: E402
from model.config import DEFAULT_MAX_CONTEXT  # noqa: E402
from model.options import DEFAULT_MAX_NEW_TOKENS, DEFAULT_MODEL_NAME, DEFAULT_WEIGHTS_DIR  # noqa: E402
from model.tokenizer import load_tokenizer  # noqa: E402

DISTRICTS = ["Kestrel Point", "Gannet Rock", "Saltmarsh", "Brightwater", "Old Quay", "Heron Bay", "Mill Reach",
             "Cobble Hill", "Tern Island", "Foxglove Lane", "Anchor Yard", "Lantern Row"]
# (page, fact, question): each fact on a page of its district (page p is about DISTRICTS[(p - 1) % 12]), so the
# district's name points to four pages; its other words share their kind with every page's filler
FACTS = [
    (13, "The lighthouse on Kestrel Point was painted sea green in 1911 by Amos Wrenfield.",
     "Who painted the lighthouse on Kestrel Point, and in what color?"),
    (9, "The ferry to Tern Island carries at most 38 passengers and leaves from pier nine.",
     "How many passengers can the Tern Island ferry carry?"),
    (17, "The harbor bell at Old Quay was cast from melted cannon in 1784.",
     "What was the Old Quay harbor bell cast from?"),
    (31, "Mill Reach holds its eel festival every second Sunday of October.",
     "When is the eel festival in Mill Reach?"),
    (42, "The tide gauge at Heron Bay recorded its highest water, 6.2 meters, on 14 March 1953.",
     "What was the highest water the Heron Bay tide gauge recorded?"),
    (3, "The Saltmarsh library lends barometers instead of books on Tuesdays.",
     "What does the Saltmarsh library lend on Tuesdays?"),
    (20, "Cobble Hill's clock tower runs four minutes fast on purpose, for the fishermen.",
     "Why does the Cobble Hill clock tower run fast?"),
    (28, "The Brightwater rowing club was founded by Ines Marrow, a retired pilot.",
     "Who founded the Brightwater rowing club?"),
    (35, "Anchor Yard's crane can lift 120 tonnes and is named Big Hester.",
     "What is the Anchor Yard crane called?"),
    (46, "Foxglove Lane has the only bakery allowed to sell bread after midnight.",
     "Which bakery may sell bread after midnight?"),
    (24, "The Lantern Row lamps are lit by hand by the Okafor family since 1902.",
     "Who lights the lamps on Lantern Row?"),
    (38, "Gannet Rock's foghorn sounds in the pattern long, short, short every thirty seconds.",
     "What pattern does the Gannet Rock foghorn sound?"),
]
FILLER = ["The {district} harbor office keeps its ledgers of {thing} in the {place}.",
          "Every spring the {district} council inspects the {thing} near the {place}.",
          "Visitors to {district} often ask about the {thing}, which stands by the {place}.",
          "A report from {district} notes repairs to the {thing} and to the {place}.",
          "The ferry timetable of {district} lists the {thing} among the sights of the {place}.",
          "Old photographs of {district} show the {thing} beside the {place} in winter."]
THINGS = ["lighthouse", "ferry landing", "harbor bell", "tide gauge", "clock tower", "rowing boats", "crane",
          "bakery", "lamps", "foghorn", "fish market", "pier", "library", "festival stalls"]
PLACES = ["north quay", "market square", "old customs house", "breakwater", "town hall", "chapel yard"]


def facts(n_pages: int, elsewhere: bool) -> list[tuple[int, str, str]]:
    """FACTS within n_pages; elsewhere: each two pages on, on a page about another district."""
    return [(page + 2 * elsewhere, fact, question) for page, fact, question in FACTS if page + 2 * elsewhere <= n_pages]


def pages(n_pages: int, elsewhere: bool = False, seed: int = 0) -> list[list[str]]:
    """n_pages of records: ~18 filler sentences each (PDF lines of about 90 characters), one fact on its page."""
    rng = random.Random(seed)
    facts_on = {page: fact for page, fact, _ in facts(n_pages, elsewhere)}
    out = []
    for number in range(1, n_pages + 1):
        district = DISTRICTS[(number - 1) % len(DISTRICTS)]
        sentences = [rng.choice(FILLER).format(district=district, thing=rng.choice(THINGS), place=rng.choice(PLACES))
                     for _ in range(18)]
        if number in facts_on:
            sentences.insert(rng.randrange(len(sentences) + 1), facts_on[number])
        lines = [f"Records of the harbor districts, page {number}", ""]
        for i in range(0, len(sentences), 3):  # paragraphs of three sentences
            lines += [*sentences[i:i + 3], ""]
        out.append(lines)
    return out


def cpu_name() -> str:
    try:
        fields = dict(line.split(":", 1) for line in subprocess.run(["lscpu"], capture_output=True, text=True,
                                                                    check=True).stdout.splitlines() if ":" in line)
        return f"{fields['Model name'].strip()}, family {fields['CPU family'].strip()} model {fields['Model'].strip()}"
    except (OSError, subprocess.CalledProcessError, KeyError, ValueError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=48)
    parser.add_argument("--checkpoint", default=str(DEFAULT_WEIGHTS_DIR / DEFAULT_MODEL_NAME))
    parser.add_argument("--max-context", type=int, default=DEFAULT_MAX_CONTEXT)
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    parser.add_argument("--elsewhere", action="store_true",
                        help="each fact on a page about another district: the name in the question points away")
    args = parser.parse_args()

    tokenizer = load_tokenizer(args.checkpoint)
    chat_format = load_chat_format(tokenizer, args.checkpoint)
    pdf = make_pdf(pages(args.pages, args.elsewhere))
    started = time.perf_counter()
    attachment = read_file("harbor-records.pdf", pdf)
    read_s = time.perf_counter() - started
    whole = len(tokenizer.encode(attachment.text))
    print(f"CPU: {cpu_name()}")
    print(f"PDF: {args.pages} pages, {len(pdf) / 1e3:.0f} kB, read in {read_s:.2f} s; its text: "
          f"{len(attachment.text):,} characters, {whole:,} tokens")
    print(f"context {args.max_context}, reply room {args.max_new_tokens}\n")
    found_page = found_fact = 0
    times, counts, ranks = [], [], []
    parts = chunks(attachment)
    for page, fact, question in facts(args.pages, args.elsewhere):
        messages = [ChatMessage("user", question, files=[Attachment(attachment.name, attachment.text,
                                                                    attachment.size, attachment.pages)])]
        started = time.perf_counter()
        _, (use,) = choose_prompt_files(chat_format, messages, args.max_context, args.max_new_tokens)
        times.append(time.perf_counter() - started)
        pages_in = set()
        for source in use.sources:
            first, _, last = source.where.removeprefix("pages ").removeprefix("page ").partition("-")
            pages_in |= set(range(int(first), int(last or first) + 1))
        has_page, has_fact = page in pages_in, any(fact in s.text for s in use.sources)
        found_page += has_page
        found_fact += has_fact
        counts.append((len(use.chosen), use.chunks, use.tokens))
        order = rank(parts, question)
        ranks.append(1 + next(r for r, k in enumerate(order) if fact in parts[k].text))
        print(f"{'yes' if has_page else 'NO ':3} page {page:2}  {len(use.chosen)}/{use.chunks} chunks, "
              f"{use.tokens} tokens, the fact's chunk ranked {ranks[-1]}, {times[-1] * 1e3:.0f} ms  {question}")
    n = len(times)
    print(f"\nanswer page among the chosen chunks: {found_page}/{n} (the fact whole in a chunk: {found_fact}/{n}); "
          f"{sum(c[0] for c in counts) / n:.1f} of {counts[0][1]} chunks, {sum(c[2] for c in counts) / n:.0f} "
          f"tokens a question on average; the fact's chunk ranked first for {ranks.count(1)}/{n}, at worst "
          f"{max(ranks)}; choosing took {sum(times) / n * 1e3:.0f} ms a question "
          f"(the longest {max(times) * 1e3:.0f} ms)")


if __name__ == "__main__":
    main()
