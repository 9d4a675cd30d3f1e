"""An uploaded file's bytes -> its text, as an Attachment to a user message; or FileRefused, saying why.

Runs at the edge (the chat page's uploads, the API's "file" content parts), before anything is sent to
the engine: what is refused here never reaches it. The kind comes from the name's extension, and the
bytes must be what the name says: a PDF starts with %PDF, a text file is UTF-8 (or UTF-16 with its byte
order mark) without NUL bytes, a .json file parses. The text is made safe to carry and show: no lone
surrogates, no control characters but newline, tab and form feed (a PDF's pages are joined with "\\f").
"""

from __future__ import annotations

import json
import posixpath
import time
from concurrent.futures import ThreadPoolExecutor

from app.bounds import FILES_READ_SECONDS, MAX_FILE_BYTES, MAX_FILE_CHARS, MAX_NAME_LENGTH, MAX_PDF_PAGES
from app.files.text import PAGE_BREAK, FileRefused, clean_text
from app.messages import Attachment

__all__ = ["ACCEPTED_EXTENSIONS", "ACCEPTED_MIME", "MAX_FILE_BYTES", "MAX_FILE_CHARS", "MAX_PDF_PAGES", "READERS",
           "FileRefused", "clean_name", "read_file", "check_together"]

TEXT_EXTENSIONS = (".txt", ".text", ".md", ".markdown", ".rst", ".log", ".tex", ".csv", ".tsv", ".json", ".jsonl",
                   ".yaml", ".yml", ".toml", ".ini", ".cfg", ".xml", ".html", ".htm", ".css", ".svg")
CODE_EXTENSIONS = (".py", ".pyi", ".ipynb", ".js", ".mjs", ".ts", ".tsx", ".jsx", ".java", ".kt", ".scala", ".c",
                   ".h", ".cc", ".cpp", ".hpp", ".cs", ".go", ".rs", ".rb", ".php", ".swift", ".m", ".r", ".jl",
                   ".lua", ".pl", ".sh", ".bash", ".zsh", ".ps1", ".bat", ".sql", ".hs", ".ml", ".ex", ".exs",
                   ".erl", ".clj", ".dart", ".vue", ".svelte", ".dockerfile", ".mk", ".cmake", ".gradle", ".proto")
PDF_EXTENSIONS = (".pdf",)
ACCEPTED_EXTENSIONS = list(TEXT_EXTENSIONS + CODE_EXTENSIONS + PDF_EXTENSIONS)
# What browsers name these files (a code file is often text/plain, or has no type at all: the extension decides).
ACCEPTED_MIME = ["text/plain", "text/markdown", "text/x-markdown", "text/csv", "text/tab-separated-values",
                 "application/json", "application/x-ndjson", "application/pdf", "text/html", "text/css",
                 "text/xml", "application/xml", "application/yaml", "application/x-yaml", "text/yaml",
                 "application/toml", "image/svg+xml", "text/x-python", "text/x-c", "text/x-java-source",
                 "text/javascript", "application/javascript", "application/x-sh", "application/sql",
                 "application/x-ipynb+json"]

_BOMS = ((b"\xef\xbb\xbf", "utf-8"), (b"\xff\xfe\x00\x00", "utf-32-le"), (b"\x00\x00\xfe\xff", "utf-32-be"),
         (b"\xff\xfe", "utf-16-le"), (b"\xfe\xff", "utf-16-be"))  # (the UTF-32 marks start like UTF-16's: first)

# The threads files are read on, two at a time (a PDF in its own child process, up to app.files.pdf's limits):
# a burst of slow files waits here, never in the threads (asyncio's default) every other request is parsed on.
READERS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="file-reader")


def read_file(name: str, data: bytes, deadline: float | None = None) -> Attachment:
    """The file's text as an Attachment (chosen None: the engine decides how much goes into the prompt).
    deadline (time.monotonic()): when the time given to its message's files ends (read_deadline); a PDF
    still being read then is refused."""
    name = clean_name(name)
    extension = _extension(name)
    if extension not in ACCEPTED_EXTENSIONS:
        kind = f"files of type {extension}" if extension else "files without an extension"
        raise FileRefused(name, f"{kind} are not taken. Text, Markdown, code, CSV, JSON and PDF files are "
                                f"(by their extension: {', '.join(ACCEPTED_EXTENSIONS[:8])}, ...).")
    if len(data) > MAX_FILE_BYTES:
        raise FileRefused(name, f"the file is {_mb(len(data))}; files may be at most {_mb(MAX_FILE_BYTES)}.")
    if not data:
        raise FileRefused(name, "the file is empty.")
    if extension in PDF_EXTENSIONS:
        text = _pdf_text(name, data, deadline)
        pages = text.count(PAGE_BREAK) + 1
    else:
        text, pages = _decoded(name, data), 0
        if extension == ".json":
            _check_json(name, text)
    if not text.strip():
        raise FileRefused(name, "the file holds no text.")
    if len(text) > MAX_FILE_CHARS:
        raise FileRefused(name, f"its text is {len(text):,} characters long; at most {MAX_FILE_CHARS:,} are taken.")
    return Attachment(name=name, text=text, size=len(data), pages=pages)


def read_deadline() -> float:
    """When the files of a message (or an API request) starting to be read now must be read by: a few slow
    PDFs cannot hold a file reader much longer than one."""
    return time.monotonic() + FILES_READ_SECONDS


def check_together(files: list[Attachment]) -> None:
    """One message's files together hold at most MAX_FILE_CHARS characters of text: the engine ranks a message's
    chunks before the request starts (about 0.1 s a million characters), and a chat sends its files on every turn."""
    total = sum(len(f.text) for f in files)
    if total > MAX_FILE_CHARS:
        raise FileRefused(", ".join(f.name for f in files),
                          f"together their text is {total:,} characters long; one message's files may hold at most "
                          f"{MAX_FILE_CHARS:,}. Send fewer of them, or shorter ones.")


def clean_name(name: str) -> str:
    """The name to show and to put in the prompt: its last path part (a browser or a program may send a
    whole path), valid Unicode, no control characters, no Markdown link, at most MAX_NAME_LENGTH characters (the
    extension kept)."""
    name = clean_text(name).replace(PAGE_BREAK, "").replace("\n", " ").replace("\t", " ")
    name = posixpath.basename(name.replace("\\", "/")).strip() or "file"
    name = name.replace("](", "] (")  # never a Markdown link or image where the page shows it: "[x](site).md"
    if len(name) > MAX_NAME_LENGTH:
        stem, dot, extension = name.rpartition(".")
        keep = "." + extension if dot and len(extension) < 16 else ""
        name = name[:MAX_NAME_LENGTH - len(keep) - 1] + "…" + keep
    return name


def _decoded(name: str, data: bytes) -> str:
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            break
    else:
        bom, encoding = b"", "utf-8"
        if b"\x00" in data:
            raise FileRefused(name, "the file holds binary data (NUL bytes), not text: is it what its name says?")
    try:
        text = data[len(bom):].decode(encoding)  # strict: invalid bytes, and UTF-16's lone surrogates, raise
    except UnicodeDecodeError as e:
        raise FileRefused(name, f"the file is not {encoding.upper()} text (byte {e.start + len(bom)} is "
                                f"{data[e.start + len(bom)]:#04x}): is it what its name says? Save it as "
                                f"UTF-8 to send it.") from None
    return clean_text(text)


def _check_json(name: str, text: str) -> None:
    try:
        json.loads(text)
    except (ValueError, RecursionError) as e:
        where = f" (line {e.lineno}, column {e.colno})" if isinstance(e, json.JSONDecodeError) else ""
        raise FileRefused(name, f"the file is not valid JSON{where}.") from None


def _pdf_text(name: str, data: bytes, deadline: float | None) -> str:
    """Each page's text, the pages joined with \\f: read in a child process with a time and a memory limit
    (app.files.pdf says why), within what is left of the message's time."""
    from app.files.pdf import pdf_text  # here: only files that are PDFs need it

    if not data.lstrip()[:1024].startswith(b"%PDF-"):
        raise FileRefused(name, "the file is not a PDF (it does not start with %PDF-): is it what its name says?")
    seconds = FILES_READ_SECONDS if deadline is None else min(FILES_READ_SECONDS, deadline - time.monotonic())
    if seconds <= 0:
        raise FileRefused(name, f"not read: the files before it took the {FILES_READ_SECONDS:.0f} s that one "
                                "message's files may take together. Send it in a message of its own.")
    return pdf_text(name, data, seconds=seconds)


def _extension(name: str) -> str:
    if name.lower() in ("dockerfile", "makefile"):
        return "." + name.lower().replace("makefile", "mk")
    stem, dot, extension = name.rpartition(".")
    return "." + extension.lower() if dot and stem else ""


def _mb(size: int) -> str:
    return f"{size / 2**20:.1f} MB"
