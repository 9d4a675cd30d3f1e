"""What a file's text is made of once read, and how a file is refused: shared by the reading (read.py), the
PDF reader's child process (pdf.py) and the chunks (chunks.py)."""

from __future__ import annotations

import re
import unicodedata

PAGE_BREAK = "\f"  # between a PDF's pages
# Control characters that are no text: all but \t \n \f (\r is turned into \n first).
_CONTROL = re.compile("[\x00-\x08\x0b\x0e-\x1f\x7f-\x9f]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class FileRefused(ValueError):
    """A file that cannot be attached; the message names it and says what is wrong."""

    def __init__(self, name: str, problem: str):
        super().__init__(f"{name}: {problem}")
        self.name = name
        self.problem = problem


def clean_text(text: str) -> str:
    """Text that can be carried anywhere: line ends as \\n, lone surrogates as U+FFFD, no control characters
    but \\t \\n \\f, NFC (the same letters always the same code points, so search finds them)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROL.sub("", _SURROGATE.sub("\ufffd", text))
    return unicodedata.normalize("NFC", text)
