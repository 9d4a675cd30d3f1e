"""A file's text cut into chunks, and the chunks ranked against a question with BM25.

A file too long for the prompt goes in as the chunks that best match the question (Robertson and
Zaragoza's BM25, as the `bm25s` library computes it). Chunks are cut at the strongest break near their
end: a page's end (a PDF's "\\f"), else a blank line, a line's end, a sentence's end, a space, and only
else inside a word; each holds CHUNK_CHARS to 2 * CHUNK_CHARS characters, about 250-500 tokens. The cut
is a function of the text alone, so the web side and the engine, today and on a later turn, find the
same chunks at the same indices (an Attachment's `chosen` names them).
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

from app.files.text import PAGE_BREAK
from app.messages import Attachment

CHUNK_CHARS = 900  # a chunk's least length (but a file's last); it may grow to twice this to end at a break
# The breaks, strongest first: a chunk ends at the last one of the strongest kind found in its window.
BREAKS = [re.compile(pattern) for pattern in (r"\f", r"\n[ \t]*\n", r"\n", r"[.!?;:][)\]\"'”’]*[ \t]", r"[ \t]")]
WORD = r"(?u)\b\w+\b"  # BM25's terms: words, numbers and single letters too ("room 7", "vitamin K")


@dataclass(frozen=True)
class Chunk:
    text: str  # the text as it goes into the prompt (page breaks made blank lines)
    where: str  # "page 3", "pages 3-4", "lines 120-168" or "part 2 of 9"


def chunks(attachment: Attachment) -> list[Chunk]:
    """The attachment's text in chunks, in file order. A PDF's chunks say their pages; a text's say their
    lines when every cut fell at a line's end, else "part i of n"."""
    text = attachment.text
    cuts = _cuts(text)
    spans = [(a, b) for a, b in zip([0] + cuts, cuts, strict=False) if text[a:b].strip()]
    # (first, last) character of each chunk that is not whitespace
    inside = [(a + len(text[a:b]) - len(text[a:b].lstrip()), b - 1 - len(text[a:b]) + len(text[a:b].rstrip()))
              for a, b in spans]
    if attachment.pages:
        starts = [0] + [m.end() for m in re.finditer(PAGE_BREAK, text)]  # where each page starts
        where = [_range("page", bisect.bisect_right(starts, a), bisect.bisect_right(starts, b)) for a, b in inside]
    elif all(text[cut - 1] == "\n" for cut in cuts[:-1]):
        newlines = [m.start() for m in re.finditer("\n", text)]
        where = [_range("line", bisect.bisect_left(newlines, a) + 1, bisect.bisect_left(newlines, b) + 1)
                 for a, b in inside]
    else:
        where = [f"part {i} of {len(spans)}" for i in range(1, len(spans) + 1)]
    return [Chunk(text[a:b].strip().replace(PAGE_BREAK, "\n\n"), w) for (a, b), w in zip(spans, where, strict=True)]


def rank(chunks: list[Chunk], question: str) -> list[int]:
    """Every chunk's index, the best match for the question first (BM25 with English stopwords left out);
    ties, and chunks that share no word with the question, in file order."""
    import bm25s  # here: imported by the first file too long for its prompt, never by reading one

    if not chunks:
        return []
    options = dict(token_pattern=WORD, stopwords="english", return_ids=False, show_progress=False)
    corpus = bm25s.tokenize([c.text for c in chunks], **options)
    terms = bm25s.tokenize(question, **options)[0]
    if not terms or not any(corpus):
        return list(range(len(chunks)))
    index = bm25s.BM25()
    index.index(corpus, show_progress=False)
    scores = index.get_scores(terms).tolist()
    return sorted(range(len(chunks)), key=lambda i: -scores[i])  # (sorted is stable: ties stay in file order)


def _cuts(text: str) -> list[int]:
    """Where each chunk ends, the text's end last."""
    cuts, start = [], 0
    while start < len(text):
        start = _cut(text, start)
        cuts.append(start)
    return cuts


def _cut(text: str, start: int) -> int:
    """Where the chunk that starts at start ends: the text's end when that is near, else just past the last
    break of the strongest kind between CHUNK_CHARS and 2 * CHUNK_CHARS characters on."""
    if len(text) - start <= 2 * CHUNK_CHARS:
        return len(text)
    low, high = start + CHUNK_CHARS, start + 2 * CHUNK_CHARS
    for pattern in BREAKS:
        last = None
        for last in pattern.finditer(text, low, high):  # noqa: B007 (the last match is the one wanted)
            pass
        if last is not None:
            return last.end()
    return high


def _range(unit: str, first: int, last: int) -> str:
    return f"{unit} {first}" if first == last else f"{unit}s {first}-{last}"
