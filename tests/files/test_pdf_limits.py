"""A PDF is read in a child process with a time and a memory limit (app/files/pdf.py): a file made to keep
the reader busy or to fill memory is refused saying why, the child is gone, and nothing else waits on it."""

from __future__ import annotations

import inspect
import os
import time
from pathlib import Path

import pytest
from support.pdfs import heavy_pdf, make_pdf

from app.bounds import MAX_FILE_CHARS, MAX_PDF_PAGES
from app.files.pdf import pdf_text, read_pages
from app.files.read import FileRefused, read_file


def refused(data: bytes, **limits) -> str:
    with pytest.raises(FileRefused) as caught:
        pdf_text("made.pdf", data, **limits)
    assert caught.value.name == "made.pdf"
    return caught.value.problem


def readers() -> list[int]:
    """The PDF readers this process runs now (children whose command lines name the module); not those of the
    servers that other test files, on other workers, may have reading PDFs at the same time."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"app.files.pdf" in (entry / "cmdline").read_bytes():
                status = (entry / "status").read_text()
                parent = int(status.split("\nPPid:", 1)[1].split()[0])
                if parent == os.getpid():
                    found.append(int(entry.name))
        except OSError:  # gone meanwhile
            pass
    return found


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the reader's process in /proc")
def test_a_pdf_that_would_keep_the_reader_busy_for_minutes_is_stopped_at_the_time_limit():
    # 80 KB: 500 pages that all show one stream of 100,000 text operators, about 2.5 s a page to read whole.
    data = heavy_pdf(MAX_PDF_PAGES, 100_000)
    assert len(data) < 100_000
    started = time.monotonic()
    problem = refused(data, seconds=2)
    assert "took longer than 2 s, the time left for its message's files" in problem
    assert "send its text" in problem
    assert time.monotonic() - started < 20  # stopped, not read to its end (about 20 minutes)
    assert readers() == []  # the child was killed and waited for


def test_a_pdf_that_needs_more_memory_than_the_limit_is_refused():
    data = heavy_pdf(1, 2_000_000)  # one stream of 2 million operators: about 330 MB to parse
    assert pdf_text("small.pdf", make_pdf([["fits"]]), memory=250 * 2**20) == "fits"
    assert refused(data, memory=250 * 2**20, seconds=600) == ("the PDF needs more than 250 MB of memory to read; "
                                                              "send its text instead.")


def test_a_stream_past_the_readers_own_bound_is_refused_saying_so():
    """Up to 30 s in a run (5 s alone, Zen 4): the reader runs at idle priority, and the other workers keep both
    cores busy; it is given time enough."""
    problem = refused(heavy_pdf(1, 2_000_000), seconds=600)  # with the memory it needs
    assert problem.startswith("the PDF could not be read: it holds more than the reader takes (")


def test_a_reader_that_dies_is_a_refusal_not_an_error():
    problem = refused(make_pdf([["text"]]), memory=8 * 2**20)  # too little for the interpreter to start
    assert problem.startswith("the PDF could not be read: the reader stopped (it may need more than 8 MB")


def test_text_past_the_character_limit_stops_the_reading_at_the_page_that_passes_it():
    """Read here, not in a child: the limit is the reader's own; a child at idle priority on a busy machine
    took the whole minute of the time limit to read the 4 million characters of the product's limit."""
    line, chars = "x" * 95, 20_000
    pages = chars // (100 * len(line)) + 20  # 100 lines a page; 20 pages more than the limit takes
    with pytest.raises(FileRefused) as caught:
        read_pages("made.pdf", make_pdf([[line] * 100] * pages), chars=chars)
    assert caught.value.problem == ("its text is more than 20,000 characters long by page 3; at most 20,000 "
                                    "are taken.")  # (9,501 characters a page)
    assert read_pages("made.pdf", make_pdf([[line] * 100] * 2), chars=chars).count("x") == 2 * 100 * 95
    assert inspect.signature(read_pages).parameters["chars"].default == MAX_FILE_CHARS  # the product's limit


def test_the_reader_is_this_projects_whatever_the_working_directory(tmp_path, monkeypatch):
    """The child runs this package's reader from any working directory, even one with an `app` of its own."""
    (tmp_path / "app" / "files").mkdir(parents=True)
    for init in ("app/__init__.py", "app/files/__init__.py"):
        (tmp_path / init).write_text("")
    (tmp_path / "app" / "files" / "pdf.py").write_text("print('not this one')")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.fspath(tmp_path))
    assert read_file("a.pdf", make_pdf([["one"], ["two"]])).text == "one\ftwo"
    monkeypatch.setenv("PYTHONSAFEPATH", "1")  # (the working directory is not put on the path)
    assert read_file("a.pdf", make_pdf([["three"]])).text == "three"


def test_a_pdf_gets_what_is_left_of_its_messages_time_and_none_once_it_is_spent():
    started = time.monotonic()
    with pytest.raises(FileRefused, match="took longer than 2 s"):
        read_file("slow.pdf", heavy_pdf(MAX_PDF_PAGES, 100_000), deadline=time.monotonic() + 2)
    with pytest.raises(FileRefused, match="not read: the files before it took the 60 s"):
        read_file("late.pdf", make_pdf([["fine"]]), deadline=time.monotonic() - 0.1)
    assert time.monotonic() - started < 15
    assert read_file("a.txt", b"text is read whatever the time", deadline=time.monotonic() - 1).text  # (quick)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or not Path("/proc").is_dir(), reason="Linux's idle scheduling")
def test_the_reader_runs_only_on_cores_that_nothing_else_wants():
    """A PDF being read must not slow the replies being written (on 2 cores, an ordinary 8-token reply took
    2.2 s instead of 0.11 s while a PDF was read at the reader's default priority)."""
    import threading

    reading = threading.Thread(target=lambda: pytest.raises(FileRefused, pdf_text, "slow.pdf",
                                                            heavy_pdf(MAX_PDF_PAGES, 100_000), seconds=3))
    reading.start()
    idle, deadline = False, time.monotonic() + 10
    while not idle and reading.is_alive() and time.monotonic() < deadline:
        for pid in readers():  # (it sets its policy as it starts)
            try:
                idle = idle or os.sched_getscheduler(pid) == os.SCHED_IDLE
            except OSError:  # gone meanwhile
                pass
        time.sleep(0.02)
    reading.join()
    assert idle
