"""A needle in a haystack: a long document with one sentence that matters, and a question about it at the end.

The haystack is the GFDL 1.3 and Apache 2.0 licences as Debian ships them (base-files, an essential
package: on every Debian system), paragraph by paragraph, repeated as needed; the needle, a password in a
paragraph of its own, goes where `place` of the document lies before it.
"""

from __future__ import annotations

import re
from pathlib import Path

LICENCES = Path("/usr/share/common-licenses")
NEEDLE = "Note for the reader: the secret password is BLUE HARBOR."
ASK = "What is the secret password mentioned in the text above? Answer with the password only."
PLACES = (0.1, 0.5, 0.9)


def long_text() -> str:
    return "\n\n".join((LICENCES / name).read_text() for name in ("GFDL-1.3", "Apache-2.0"))


def needle_prompt(checkpoint, place: float, tokens: int = 6000) -> list[int]:
    """A chat prompt of about `tokens` tokens of document, NEEDLE within it at `place`, then ASK."""
    encode = checkpoint.tokenizer.encode
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", long_text()) if p.strip()]
    doc, sizes = [], []
    while sum(sizes) < tokens:
        doc.append(paragraphs[len(doc) % len(paragraphs)])
        sizes.append(len(encode(doc[-1])) + 1)
    before, cut = 0, len(doc)
    for i, size in enumerate(sizes):
        if before >= place * sum(sizes):
            cut = i
            break
        before += size
    text = "\n\n".join(doc[:cut] + [NEEDLE] + doc[cut:])
    return checkpoint.chat_format.encode_dialog([{"role": "user", "content": f"{text}\n\n{ASK}"}])


def found(reply: str) -> bool:
    return "blue harbor" in reply.lower()
