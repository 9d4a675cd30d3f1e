"""Files in the chat as a user meets them: `chainlit run app/main.py` driven by headless Chromium.

A Markdown file and a PDF are attached with the clip button's file input, asked about, and shown with the
question as chips (name, kind, pages, size), the PDF beside the chat when its chip is clicked; the line under
the reply tells each file's tokens and links the parts of them the model read; one opens beside the chat.
A file too big is refused by the page, a renamed binary by the app, each with a message naming it. The
chat, opened again from the history, shows its files as chips (the PDF opens from the history's store) and
sends them to the model again. A file dragged onto the chat and dropped is attached as one chosen with the
clip button, and read. The default model (SmolLM2-135M-Instruct) answers greedily, in a context of
2,048 tokens, so the PDF (12 pages) goes in as the parts nearest the question. Screenshots go to
test-output/e2e-files/. Needs Debian's Chromium, as tests/test_e2e_browser.py.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest
from support.browser import ANSWERS, CHROMIUM, CHROMIUM_ARGS, STATS, need_browser, send_message
from support.pdfs import make_pdf
from support.servers import DEFAULT_MODEL, ROOT, ChainlitServer, server_env
from support.special_checkpoints import default_model

from app.bounds import MAX_FILE_BYTES
from app.web.attachments import file_size

SHOTS = ROOT / "test-output" / "e2e-files"
ERRORS = '.step[data-step-type="assistant_message"] .message-content'
USER_MESSAGES = '.step[data-step-type="user_message"]'
UPLOAD = "#upload-button-input"  # the clip button's file input
DROP_INPUT = '[id="#upload-drop-input"]'  # the chat's drop zone's input

NOTES = "# Team notes\n\nThe team lunch is on Friday at noon, in the blue room.\n"
TOPICS = ["budget", "hiring", "offices", "security", "travel", "training", "suppliers", "weather", "parking",
          "canteen", "printing", "holidays"]
LAUNCH = "The Falcon launch is planned for Tuesday, 9 March, from pad 39A, at dawn."

pytestmark = pytest.mark.timeout(300)


def report_pdf() -> bytes:
    """12 pages of a report, each about one topic; page 7 tells when the Falcon launch is."""
    pages = []
    for number, topic in enumerate(TOPICS, 1):
        lines = [f"Page {number}: {topic}."]
        lines += [f"Line {i} of the {topic} section repeats what the {topic} team wrote this quarter."
                  for i in range(40)]
        if number == 7:
            lines[1:1] = [LAUNCH] * 3
        pages.append(lines)
    return make_pdf(pages)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    need_browser()
    default_model()
    folder = tmp_path_factory.mktemp("chainlit")
    env = server_env(checkpoint=DEFAULT_MODEL, temperature=0, repetition_penalty=1, dtype="fp32", threads=1,
                     max_context=2048, max_new_tokens=48, history_db=folder / "history.db")
    server = ChainlitServer(env, log=folder / "chainlit.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("files")
    paths = {"notes.md": NOTES.encode(), "report.pdf": report_pdf(),
             "scan.pdf": b"PK\x03\x04" + bytes(range(256)) * 8}  # a zip named .pdf
    for name, data in paths.items():
        (folder / name).write_bytes(data)
    big = folder / "big.txt"
    with open(big, "wb") as f:
        f.truncate(MAX_FILE_BYTES + 2**20)  # 21 MB
    return {path.name: path for path in folder.iterdir()}


@pytest.fixture(scope="module")
def page(server):
    from playwright.sync_api import sync_playwright

    shutil.rmtree(SHOTS, ignore_errors=True)
    SHOTS.mkdir(parents=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 800}, accept_downloads=True)
            page.set_default_timeout(60_000)
            page.goto(server.url)
            page.wait_for_selector("#chat-settings-open-modal")  # the chat has started: uploads have a session
            yield page
        finally:
            browser.close()


def shot(page, name: str) -> None:
    page.screenshot(path=SHOTS / f"{name}.png")


def attach(page, *paths: Path) -> None:
    """Choose files with the clip button's input; wait until each is uploaded (the send button is enabled)."""
    page.set_input_files(UPLOAD, [str(p) for p in paths])
    page.wait_for_function(f"() => document.querySelectorAll('#attachments .truncate').length === {len(paths)}")
    page.wait_for_selector("#chat-submit:enabled")


def ask(page, text: str) -> tuple[str, str]:
    """Send text (with the files attached); wait for the reply and the line under it."""
    stats = page.locator(STATS).count()
    send_message(page, text)
    deadline = time.monotonic() + 180
    while page.locator(STATS).count() <= stats:
        assert time.monotonic() < deadline, f"no reply to {text!r} within 180 s"
        time.sleep(0.1)
    page.wait_for_selector("#stop-button", state="detached")
    return page.locator(ANSWERS).last.inner_text(), page.locator(STATS).last.inner_text()


def used_tokens(stats: str) -> int:
    return int(re.search(r"([\d,]+) / 2,048 tokens", stats).group(1).replace(",", ""))


def file_tokens(stats: str, name: str) -> int:
    return int(re.search(rf"{re.escape(name)}: ([\d,]+) tokens", stats).group(1).replace(",", ""))


def test_files_are_attached_asked_about_and_their_sources_opened(page, server, files):
    attach(page, files["notes.md"], files["report.pdf"])
    shot(page, "01-attached")
    answer, stats = ask(page, "When is the Falcon launch?")
    assert answer.strip()
    # the files are shown with the message as chips, small, the PDF not drawn until asked for
    question = page.locator(USER_MESSAGES).last
    chips = question.locator(".file-chip")
    assert [re.sub(r"\s+", " ", text) for text in chips.all_inner_texts()] == [
        f"notes.md MD · {len(NOTES)} bytes", f"report.pdf PDF · 12 pages · {file_size(files['report.pdf'].stat().st_size)}"]
    assert question.locator("canvas, .react-pdf__Document").count() == 0
    assert all(chip.bounding_box()["height"] < 60 for chip in chips.all())
    assert question.bounding_box()["height"] < 150  # the chips and the question
    # the line under the reply: each file's tokens, and the parts read of the PDF, those nearest the question
    notes, report = file_tokens(stats, "notes.md"), file_tokens(stats, "report.pdf")
    assert 10 < notes < 60 and 300 < report < 2048, stats
    assert re.search(r"report\.pdf: [\d,]+ tokens, \d+ of its \d+ parts, those nearest the question", stats), stats
    assert used_tokens(stats) > notes + report
    sources = page.locator(STATS).last.locator("a", has_text="report.pdf, page")
    assert sources.count() >= 1
    shot(page, "02-answered")
    # the part about the launch is among them; opened, it shows beside the chat, alone
    names = sources.all_text_contents()  # (as written: the page shows links in capitals)
    assert "report.pdf, page 7" in names, names
    chips.filter(has_text="report.pdf").click()  # the PDF, beside the chat
    page.wait_for_function("() => document.querySelector('#side-view-title')?.innerText === 'report.pdf'")
    page.locator("#side-view-content canvas").first.wait_for()
    page.wait_for_timeout(500)  # (drawn)
    pane, drawn = (page.locator(selector).first.bounding_box() for selector in ("#side-view-content",
                                                                                "#side-view-content canvas"))
    assert 0 < drawn["width"] <= pane["width"], (drawn, pane)  # the whole page's width is in sight
    shot(page, "02-pdf-beside")
    sources.filter(has_text="report.pdf, page 7").first.click()
    page.wait_for_function("() => document.querySelector('#side-view-title')?.innerText === 'report.pdf, page 7'"
                           " && !document.querySelector('#side-view-content').innerText.includes('Page 1:')")
    side = page.inner_text("#side-view-content")
    assert side.startswith("report.pdf, page 7") and LAUNCH in side, side[:300]
    shot(page, "03-source")
    assert "Traceback" not in server.log()


def test_a_file_too_big_and_a_renamed_binary_are_refused_with_a_message(page, server, files):
    page.set_input_files(UPLOAD, [str(files["big.txt"])])
    toast = page.locator("[data-sonner-toast]", has_text="larger than 20 MB")
    toast.wait_for()
    assert page.locator("#attachments .truncate").count() == 0  # not attached
    shot(page, "04-too-big")

    attach(page, files["scan.pdf"])
    errors = page.locator(ERRORS).count()
    send_message(page, "What does this scan say?")
    error = page.locator(ERRORS).nth(errors)
    error.wait_for()
    text = error.inner_text()
    assert "Your message was not sent to the model" in text and "scan.pdf" in text and "not a PDF" in text, text
    page.wait_for_selector("#stop-button", state="detached")
    shot(page, "05-refused")
    assert "Traceback" not in server.log()


def test_a_resumed_chat_shows_its_files_and_sends_them_again(page, server, files):
    first_stats = page.locator(STATS).first.inner_text()
    before = file_tokens(first_stats, "notes.md") + file_tokens(first_stats, "report.pdf")
    page.click("#new-chat-button")
    page.click("#confirm")
    page.wait_for_function("() => !document.querySelector('.step[data-step-type=\"user_message\"]')")
    page.locator('#thread-history a[href^="/thread/"]').first.click()
    question = page.locator(USER_MESSAGES).filter(has_text="When is the Falcon launch?")
    question.wait_for()
    question.locator(".file-chip").nth(1).wait_for()  # (a custom element: drawn once its code has loaded)
    assert question.locator(".file-chip").count() == 2 and "12 pages" in question.inner_text()
    assert question.locator("canvas").count() == 0
    question.locator(".file-chip", has_text="report.pdf").click()
    page.locator("#side-view-content canvas").first.wait_for()  # the PDF, drawn from the history's store
    assert page.locator(STATS).first.locator("a", has_text="report.pdf, page 7").count() == 1
    shot(page, "06-resumed")
    with page.expect_download() as download:
        question.locator("a", has_text="notes.md").click()
    assert Path(download.value.path()).read_text() == NOTES  # served to this user from the history's store

    # the files go to the model again: the follow-up's prompt holds them
    _, stats = ask(page, "And the team lunch?")
    assert used_tokens(stats) > before, stats
    assert "notes.md" not in stats  # (a message without files: no line about them)
    shot(page, "07-follow-up")
    assert "Traceback" not in server.log()


def drop(page, path: Path, mime: str) -> None:
    """Drag a file from the desktop and drop it on the chat: the drop zone is the element around the whole chat
    that holds Chainlit's drop input (whose id is written with a "#")."""
    transfer = page.evaluate_handle(
        """([name, bytes, type]) => {
            const transfer = new DataTransfer();
            transfer.items.add(new File([new Uint8Array(bytes)], name, {type}));
            return transfer;
        }""", [path.name, list(path.read_bytes()), mime])
    zone = page.locator(DROP_INPUT).locator("..")
    for event in ("dragenter", "dragover", "drop"):
        zone.dispatch_event(event, {"dataTransfer": transfer})


def test_a_file_dropped_on_the_chat_is_attached_and_read(page, server, files):
    page.click("#new-chat-button")
    page.click("#confirm")
    page.wait_for_function("() => !document.querySelector('.step[data-step-type=\"user_message\"]')")
    drop(page, files["notes.md"], "text/markdown")
    page.wait_for_function("() => document.querySelectorAll('#attachments .truncate').length === 1")
    assert page.inner_text("#attachments").count("notes.md") == 1
    page.wait_for_selector("#chat-submit:enabled")
    shot(page, "07-dropped")
    _, stats = ask(page, "When is the team lunch?")
    assert 10 < file_tokens(stats, "notes.md") < 60, stats
    assert "notes.md" in page.locator(USER_MESSAGES).last.inner_text()
    assert "Traceback" not in server.log()
