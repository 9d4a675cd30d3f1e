"""Replies as the page shows them, with LaTeX on: `$...$` is math, so a dollar that is money is escaped.

Chainlit's `latex` feature (remark-math) reads any `$...$` as inline math, so "$5 and $10" would show
"5 and " as a formula. `shown()` puts a backslash before each dollar that starts an amount ("$5",
"$1,200.50", "$3M") outside code, which Markdown shows as a plain "$"; code spans and fenced code
blocks are left exactly as written, and real math such as `$x^2$` or `$2^n$` stays math. `plain()`
undoes it (a stored reply, resumed, is given back to the model as it wrote it).
"""

from __future__ import annotations

import re
import time

# How often a streaming answer's page is sent its new text. Each piece makes the page lay out the answer's
# Markdown again, whole: a page that cannot do that as fast as tokens come falls behind, its socket's pings
# wait behind the pieces, and the server closes it (what it sent meanwhile is lost to that page).
STREAM_EVERY_S = 0.1

# "$" + an amount, then something that ends it (space, punctuation, a range or per-unit, the end)
MONEY = r"\$(?=\d[\d,]*(?:\.\d+)?(?:[kKMB]|bn)?(?:[\s.,;:!?)\]/-]|$))"
ESCAPE = re.compile(r"(?<![\\$])" + MONEY)
UNESCAPE = re.compile(r"\\" + MONEY)
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)[^`].*?\1|(`+)[^`]*$", re.DOTALL)  # a span, or one still open (while streaming)


def shown(text: str) -> str:
    return _outside_code(text, lambda prose: ESCAPE.sub(r"\\$", prose))


def plain(text: str) -> str:
    return _outside_code(text, lambda prose: UNESCAPE.sub("$", prose))


def _outside_code(text: str, change) -> str:
    """text with `change` applied to every piece that is not code (fenced blocks, code spans)."""
    out, fence, prose = [], None, []
    for line in text.splitlines(keepends=True):
        opening = FENCE.match(line)
        if fence is None and opening:
            out.append(_spans(change, "".join(prose)))
            prose, fence = [], opening.group(1)
            out.append(line)
        elif fence is not None:
            out.append(line)
            if line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
                fence = None
        else:
            prose.append(line)
    out.append(_spans(change, "".join(prose)))
    return "".join(out)


def _spans(change, prose: str) -> str:
    pieces, start = [], 0
    for span in CODE_SPAN.finditer(prose):
        pieces += [change(prose[start:span.start()]), span.group(0)]
        start = span.end()
    return "".join(pieces + [change(prose[start:])])


class ShownStream:
    """Streams a reply as shown(): feed() the pieces as they come, send what it returns.

    Returns (text, whole): the piece to append, or (whole=True) the text to show instead of all so far,
    when escaping changed something already sent (a code span closed around a dollar). A dollar at the
    end, whose amount may go on, is held back until the next piece says."""

    def __init__(self):
        self.raw, self.sent = "", ""

    def feed(self, piece: str) -> tuple[str, bool]:
        self.raw += piece
        text = shown(self.raw)
        undecided = re.search(r"\$[\d,.]*$", self.raw)
        if undecided:
            text = shown(self.raw[:undecided.start()])
        if text.startswith(self.sent):
            piece, self.sent = text[len(self.sent):], text
            return piece, False
        self.sent = text
        return text, True

    def end(self) -> str:
        """The whole reply as shown."""
        self.sent = shown(self.raw)
        return self.sent


class Paced:
    """The pieces of a streaming answer (ShownStream's), sent at most every STREAM_EVERY_S: add() each, send
    take() when due(); what is held at the end goes with the answer's last, whole, update."""

    def __init__(self, every: float = STREAM_EVERY_S):
        self.every, self.sent_at = every, -every
        self.text, self.whole = "", False

    def add(self, piece: str, whole: bool) -> None:
        self.text, self.whole = (piece, True) if whole else (self.text + piece, self.whole)

    def due(self) -> bool:
        return (bool(self.text) or self.whole) and time.monotonic() - self.sent_at >= self.every

    def take(self) -> tuple[str, bool]:
        """(text, whole): the text to append, or (whole) to show instead of all so far."""
        taken, self.text, self.whole, self.sent_at = (self.text, self.whole), "", False, time.monotonic()
        return taken
