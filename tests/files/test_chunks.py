"""Cutting a file into chunks and ranking them against a question (app/files/chunks.py)."""

from __future__ import annotations

import random
import re

from support.pdfs import make_pdf

from app.files.chunks import CHUNK_CHARS, Chunk, chunks, rank
from app.files.read import read_file
from app.messages import Attachment


def prose(seed: int, n_lines: int) -> str:
    rng = random.Random(seed)
    words = ["river", "stone", "lantern", "orchard", "copper", "meadow", "harbor", "willow", "ember", "signal"]
    return "\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 25))) for _ in range(n_lines)) + "\n"


def test_a_short_file_is_one_chunk():
    assert chunks(Attachment("a.txt", "  Just this.\nAnd this.\n\n")) == [Chunk("Just this.\nAnd this.", "lines 1-2")]


def test_chunks_cover_the_text_in_order_and_are_sized_between_the_bounds():
    text = prose(0, 600)
    found = chunks(Attachment("a.txt", text))
    assert len(found) > 5
    assert "".join(c.text for c in found).replace("\n", "") == text.replace("\n", "")  # nothing lost, in order
    assert all(CHUNK_CHARS - 25 <= len(c.text) <= 2 * CHUNK_CHARS for c in found[:-1])  # (a line may be trimmed)


def test_chunks_end_at_line_ends_and_say_their_lines():
    text = prose(1, 300)
    found = chunks(Attachment("a.txt", text))
    lines = text.split("\n")
    for chunk in found:
        first, last = map(int, re.fullmatch(r"lines (\d+)-(\d+)", chunk.where).groups())
        assert chunk.text == "\n".join(lines[first - 1:last])
    assert found[0].where.startswith("lines 1-") and found[-1].where.endswith(f"-{len(lines) - 1}")


def test_a_blank_line_is_preferred_to_a_line_end():
    line = "word " * 39 + "word\n"  # 200 characters
    text = (line * 3 + "\n") * 12  # paragraphs of three lines
    found = chunks(Attachment("a.md", text))
    assert len(found) > 3
    assert all(paragraph.count("\n") == 2 for chunk in found for paragraph in chunk.text.split("\n\n"))


def test_a_pdfs_chunks_end_at_page_ends_and_say_their_pages():
    pages = [[f"Page {p} line {i}: " + "filler words " * 5 for i in range(10)] for p in range(1, 13)]  # ~800 a page
    attachment = read_file("r.pdf", make_pdf(pages))
    found = chunks(attachment)
    assert [c.where for c in found] == [f"pages {p}-{p + 1}" for p in range(1, 12, 2)]
    assert found[1].text.startswith("Page 3 line 0:") and found[1].text.endswith("Page 4 line 9: " + "filler words " * 4
                                                                                  + "filler words")
    assert "\f" not in found[1].text and "\n\nPage 4 line 0" in found[1].text


def test_one_page_that_is_long_gives_chunks_on_that_page():
    attachment = read_file("r.pdf", make_pdf([["short"], [f"line {i} " + "x" * 80 for i in range(60)], ["end"]]))
    found = chunks(attachment)
    assert found[0].where == "pages 1-2" and found[-1].where == "pages 2-3"
    assert {c.where for c in found[1:-1]} == {"page 2"}


def test_text_without_line_ends_is_cut_in_parts():
    text = "Sentence number one is here. " * 300
    found = chunks(Attachment("a.txt", text))
    assert [c.where for c in found] == [f"part {i} of {len(found)}" for i in range(1, len(found) + 1)]
    assert all(c.text.endswith("here.") for c in found)  # at sentence ends
    assert chunks(Attachment("a.json", "x" * 5000))[0].text == "x" * (2 * CHUNK_CHARS)  # no break at all: cut anyway


def test_chunks_are_the_same_every_time():
    attachment = Attachment("a.txt", prose(2, 400))
    assert chunks(attachment) == chunks(Attachment("a.txt", prose(2, 400)))


def test_rank_puts_the_chunk_with_the_questions_words_first():
    text = prose(3, 400)
    lines = text.split("\n")
    lines[250] = "The vault code is 4471, kept by Marguerite."
    found = chunks(Attachment("a.txt", "\n".join(lines)))
    holder = next(i for i, c in enumerate(found) if "Marguerite" in c.text)
    order = rank(found, "Who keeps the vault code?")
    assert order[0] == holder and sorted(order) == list(range(len(found)))


def test_rank_keeps_file_order_where_nothing_matches():
    found = chunks(Attachment("a.txt", prose(4, 300)))
    assert rank(found, "zebra quantum") == list(range(len(found)))
    assert rank(found, "") == list(range(len(found)))
    assert rank(found, "the of and") == list(range(len(found)))  # stopwords only
    assert rank([], "anything") == []


def test_rank_counts_single_letters_and_digits():
    found = [Chunk("room 5 holds the desk", "part 1 of 3"), Chunk("room 7 holds the key", "part 2 of 3"),
             Chunk("the garden", "part 3 of 3")]
    assert rank(found, "room 7")[0] == 1
    assert rank(found, "vitamin K") == [0, 1, 2]
    assert rank([Chunk("x", "part 1 of 2"), Chunk("vitamin K", "part 2 of 2")], "k")[0] == 1
