"""A PDF's text, read by pypdf in a child process (`python -m app.files.pdf`) with a time and a memory limit.

pypdf is pure Python and does what the file asks: a PDF of a few kilobytes whose pages all point at one
content stream of a million text operators keeps it busy for hours, and its history has had loops and
memory blow-ups on crafted files. In a thread of the web process such a file would hold a core, a share
of the interpreter every stream is served from, and a worker thread, until the process ended: nothing
can stop a thread. A child is killed at the limit, and the file refused saying so. Starting one costs
about 0.15 s; a 500-page PDF of plain text reads in about 1.2 s (Zen 5). The child runs at Linux's idle
priority (SCHED_IDLE; elsewhere nice 19): on 2 cores, an 8-token reply took 2.2 s instead of 0.11 s
while a PDF was read at normal priority, 0.23 s at idle priority, and 4 streams running left a 100-page
PDF still read within a second.

The child reads the PDF's bytes on stdin and writes one JSON object on stdout: {"text": ...}, the pages
joined with "\\f", or {"problem": ...}, why the file is refused.
"""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import msgspec

from app.bounds import FILES_READ_SECONDS, MAX_FILE_CHARS, MAX_PDF_PAGES
from app.files.text import PAGE_BREAK, FileRefused, clean_text

PDF_MEMORY = 2 * 2**30  # the child's address space, in bytes
ROOT = Path(__file__).resolve().parents[2]


class Result(msgspec.Struct, omit_defaults=True):
    text: str | None = None
    problem: str | None = None


def pdf_text(name: str, data: bytes, *, seconds: float = FILES_READ_SECONDS, memory: int = PDF_MEMORY) -> str:
    """The PDF's text, its pages joined with "\\f"; FileRefused saying why it cannot be read."""
    # This project first on the child's path, whatever the server's working directory (-m puts it first)
    # and environment (PYTHONSAFEPATH leaves it out) are.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        child = subprocess.run([sys.executable, "-m", "app.files.pdf", str(seconds), str(memory)], input=data,
                               capture_output=True, timeout=seconds, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired:  # (killed, and waited for)
        raise FileRefused(name, f"reading the PDF took longer than {seconds:.0f} s, the time left for its "
                                "message's files; send its text instead.") from None
    try:
        result = msgspec.json.decode(child.stdout, type=Result)
    except msgspec.DecodeError:  # it died: out of memory or CPU time, or a crash in the reader
        logging.getLogger(__name__).warning("reading %s: the reader stopped (exit %s): %s", name, child.returncode,
                                            child.stderr.decode(errors="replace")[-2000:])
        raise FileRefused(name, f"the PDF could not be read: the reader stopped (it may need more than "
                                f"{_size(memory)} of memory or {seconds:.0f} s). Send its text instead.") from None
    if result.problem is not None:
        raise FileRefused(name, result.problem)
    return result.text or ""


def read_pages(name: str, data: bytes, chars: int = MAX_FILE_CHARS) -> str:
    """Each page's text (pypdf's layout-free extraction), the pages joined with "\\f", at most `chars` characters
    in all; FileRefused saying what is wrong. Runs in the child."""
    import pypdf
    from pypdf.errors import LimitReachedError, PyPdfError

    logging.getLogger("pypdf").setLevel(logging.ERROR)  # a damaged PDF is refused or read; its warnings are noise
    try:
        reader = pypdf.PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):  # many PDFs are "encrypted" with an empty password
            raise FileRefused(name, "the PDF is protected by a password; send a copy without one.")
        if len(reader.pages) > MAX_PDF_PAGES:
            raise FileRefused(name, f"the PDF has {len(reader.pages)} pages; at most {MAX_PDF_PAGES} are taken.")
        pages, length = [], 0
        for number, page in enumerate(reader.pages, 1):
            pages.append(clean_text(page.extract_text() or "").replace(PAGE_BREAK, "\n").strip())
            length += len(pages[-1]) + 1
            if length > chars:  # said now, not after the remaining pages are read
                raise FileRefused(name, f"its text is more than {chars:,} characters long by page {number}; "
                                      f"at most {chars:,} are taken.")
    except FileRefused:
        raise
    except LimitReachedError as e:  # pypdf's own bounds (tokens in a stream, bytes decompressed, ...)
        raise FileRefused(name, f"the PDF could not be read: it holds more than the reader takes "
                                f"({str(e).rstrip('.')}).") from None
    except (PyPdfError, ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError, OSError,
            NotImplementedError) as e:  # pypdf lets through what a damaged file makes its parser meet
        if "decrypt" in str(e).lower() or "crypt" in type(e).__name__.lower():
            raise FileRefused(name, "the PDF is encrypted in a way that cannot be read here; send a copy "
                                  "without a password.") from None
        raise FileRefused(name, f"the PDF could not be read ({type(e).__name__}): is it damaged?") from None
    if not any(pages):
        raise FileRefused(name, "the PDF has no text to read: its pages may be scanned images (text from "
                              "images is not read). Send a PDF with text in it, or the text itself.")
    return PAGE_BREAK.join(pages)


def _size(memory: int) -> str:
    return f"{memory / 2**30:g} GB" if memory >= 2**30 else f"{memory // 2**20} MB"


def main(seconds: str, memory: str) -> None:
    try:  # behind the engine's threads: replies being written go first on a machine of few cores
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # (Linux: only a core nothing else wants)
    except (AttributeError, OSError):
        try:
            os.nice(19)
        except (AttributeError, OSError):
            pass
    try:
        import resource  # (not on Windows: there the parent's time limit alone holds)
        resource.setrlimit(resource.RLIMIT_AS, (int(memory), int(memory)))
        cpu = int(float(seconds)) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    except (ImportError, ValueError, OSError):
        pass
    try:
        result = Result(text=read_pages("", sys.stdin.buffer.read()))
    except FileRefused as e:
        result = Result(problem=e.problem)
    except MemoryError:
        result = Result(problem=f"the PDF needs more than {_size(int(memory))} of memory to read; send its text "
                                "instead.")
    sys.stdout.buffer.write(msgspec.json.encode(result))


if __name__ == "__main__":
    main(*sys.argv[1:3])
