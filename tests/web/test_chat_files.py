"""Files sent with chat messages, through the Chainlit handlers of app/main.py (mocked Chainlit context,
tests/support/handlers.py) and the real engine process on a tiny random checkpoint: what the engine is
sent, what the page shows under the reply, what is refused, and a resumed chat's files."""

from __future__ import annotations

import asyncio
import json

import pytest
from support.app import imported_app
from support.checkpoints import write_tiny_checkpoint
from support.handlers import Chat
from support.pdfs import make_pdf

from app.messages import WHOLE, Attachment
from app.web import attachments, history
from app.web.file_store import FileStore

pytestmark = pytest.mark.timeout(120)

NOTES = "# Launch\n\nThe launch is on Tuesday at noon, in room 7.\n"
# a long file: 60 paragraphs about different fruit; one of them, about kiwis, answers the question
FRUIT = ["apple", "banana", "cherry", "grape", "lemon", "mango", "orange", "peach", "pear", "plum"]
PARAGRAPHS = [f"Paragraph {i}. The {FRUIT[i % 10]} harvest of year {1900 + i} was stored in barn {i}. "
              + f"Farmers sold the {FRUIT[i % 10]} crop at the market every week of that season. " * 3
              for i in range(60)]
PARAGRAPHS[41] = "Paragraph 41. The kiwi orchard by the river had a record harvest of kiwis that year. " * 3
LONG = "\n\n".join(PARAGRAPHS) + "\n"


@pytest.fixture(scope="module")
def main(tmp_path_factory):
    weights = tmp_path_factory.mktemp("weights")
    write_tiny_checkpoint(weights / "tiny")
    with imported_app(checkpoint=weights / "tiny", weights_dir=weights, max_context=2048, max_new_tokens=16,
                      temperature=0, threads=1, history="off") as main:
        yield main


@pytest.fixture
def sent(main, monkeypatch):
    """The messages of every request the chat hands to the backend, as the engine gets them."""
    requests = []
    stream = main.BACKEND.stream

    def spy(conversation, settings, **options):
        requests.append(conversation.chat_messages())
        return stream(conversation, settings, **options)

    monkeypatch.setattr(main.BACKEND, "stream", spy)
    return requests


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 90))


def stats(chat: Chat) -> list[str]:
    """The lines under the replies, as sent (Markdown)."""
    return [s["output"] for s in chat.sent() if s["name"] == "stats"]


def source_elements(chat: Chat) -> list[dict]:
    return [c.args[0] for c in chat.emitter.send_element.await_args_list if c.args[0]["type"] == "text"]


def test_a_file_goes_with_its_message_whole_and_the_line_under_the_reply_says_so(main, sent):
    chat = Chat(main)

    async def scenario():
        await chat.start()
        await chat.send("When is the launch?", files={"notes.md": NOTES.encode()})
        await chat.send("Where?")

    run(scenario())
    first, follow_up = sent
    assert first[-1].content == "When is the launch?"
    assert first[-1].files == [Attachment(name="notes.md", text=NOTES, size=len(NOTES))]  # the engine chooses
    # it chose the whole file; the conversation keeps that, and the next turn sends it so
    question = chat.conversation().messages[0]
    assert question.files == [Attachment(name="notes.md", text=NOTES, size=len(NOTES), chosen=WHOLE)]
    assert follow_up[-3].files == question.files and follow_up[-1].files is None
    lines = stats(chat)
    line, files = lines[0].split("\n\n")
    assert "tokens/s" in line
    tokens = int(files.split("notes.md: ")[1].split(" tokens")[0])
    assert 20 < tokens < 40, files  # the file's block in the prompt: its text (~17 tokens) and the tags naming it
    assert files == f"*notes.md: {tokens} tokens, the whole file*"
    assert "notes.md" not in lines[1]  # only the reply to the message with the file tells of it
    assert not source_elements(chat)


def test_a_long_file_goes_in_as_the_parts_nearest_the_question_each_a_source_to_open(main, sent):
    chat = Chat(main)

    async def scenario():
        await chat.start()
        await chat.send("Which orchard had a record harvest of kiwis?", files={"farm.txt": LONG.encode()})

    run(scenario())
    [use_line] = stats(chat)[0].split("\n\n")[1:]
    chosen = chat.conversation().messages[0].files[0].chosen
    assert chosen and chosen != WHOLE
    sources = source_elements(chat)
    assert len(sources) == len(chosen) and all(s["display"] == "side" for s in sources)
    # the chunk about kiwis is among them, and each source's name is written in the line, where the page links it
    texts = [chat.session.files[s["chainlitKey"]]["content"] for s in sources]  # what opening one shows
    assert any("kiwi orchard" in text for text in texts)
    assert all(s["name"] in use_line and s["name"].startswith("farm.txt, lines ") for s in sources)
    assert f", {len(chosen)} of its " in use_line and " parts, those nearest the question" in use_line
    stats_step = next(s for s in chat.sent() if s["name"] == "stats")
    assert all(s["forId"] == stats_step["id"] for s in sources)


def test_a_regenerated_answer_reads_the_same_parts_and_says_so_again(main, sent):
    chat = Chat(main)

    async def scenario():
        await chat.start()
        await main.update_settings({"temperature": 1.0, "seed": "5"})
        await chat.send("Which orchard had a record harvest of kiwis?", files={"farm.txt": LONG.encode()})
        [regenerate] = chat.actions("regenerate")
        await main.regenerate(regenerate)

    run(scenario())
    first, again = sent
    chosen = chat.conversation().messages[0].files[0].chosen
    assert first[-1].files[0].chosen is None and again[-1].files[0].chosen == chosen  # decided once
    old_line, new_line = stats(chat)
    assert old_line.split("\n\n")[1] == new_line.split("\n\n")[1]  # the same parts, the same tokens
    names = [s["name"] for s in source_elements(chat)]
    assert names[:len(chosen)] == names[len(chosen):] and len(names) == 2 * len(chosen)


def test_a_message_with_a_file_that_cannot_be_read_is_not_sent(main, sent):
    chat = Chat(main)

    async def scenario():
        await chat.start()
        await chat.send("Summarize these", files={"notes.md": NOTES.encode(), "report.pdf": b"PK\x03\x04 a zip"})

    run(scenario())
    assert sent == [] and chat.conversation().messages == []
    [error] = chat.errors()
    assert error.startswith("Your message was not sent to the model: this file cannot be read.")
    assert "**report.pdf**: the file is not a PDF" in error and "notes.md" not in error


def test_a_file_without_words_is_sent_and_a_pdf_keeps_its_pages(main, sent):
    chat = Chat(main)
    pdf = make_pdf([["The launch is on Tuesday."], ["It is in room 7."]])

    async def scenario():
        await chat.start()
        await chat.send("   ", files={"plan.pdf": pdf})
        await chat.send("   ")

    run(scenario())
    [request] = sent
    assert request[-1].files == [Attachment(name="plan.pdf", text="The launch is on Tuesday.\fIt is in room 7.",
                                            size=len(pdf), pages=2)]
    assert len(chat.replies()) == 2 and chat.replies()[1] == "Please type a message."


def test_editing_a_resumed_message_keeps_its_files_for_the_new_question(main, sent, monkeypatch, tmp_path):
    """A chat resumed from the history sends its files again as they went, and an edit of the message that
    carried them (whose upload is gone) sends them with the new question, chosen anew."""
    store = FileStore(tmp_path / "files")
    store.write_text("e1", LONG)
    monkeypatch.setattr(main, "FILE_STORE", store)
    records = [{"element": "e1", "name": "farm.txt", "size": len(LONG), "pages": 0, "chosen": [3, 5]}]
    thread = {"id": "t1", "steps": [
        {"id": "s1", "type": "user_message", "output": "Which barn had plums?", "metadata": json.dumps(
            {attachments.FILES: records})},
        {"id": "r1", "type": "assistant_message", "output": "Barn 4.", "metadata": {"kind": history.REPLY}}],
        "elements": [{"id": "e1", "forId": "s1"}]}  # (a record naming an element not of its message is not read)
    chat = Chat(main)

    async def scenario():
        chat.enter()
        await main.resume_chat(thread)
        await chat.send("And bananas?")
        await chat.send("Which orchard had kiwis?", id="s1")

    run(scenario())
    resumed, edited = sent
    farm = Attachment(name="farm.txt", text=LONG, size=len(LONG), chosen=[3, 5])
    assert [(m.role, m.content, m.files) for m in resumed] == [
        ("user", "Which barn had plums?", [farm]), ("assistant", "Barn 4.", None), ("user", "And bananas?", None)]
    assert [(m.content, m.files) for m in edited] == [("Which orchard had kiwis?", [Attachment(
        name="farm.txt", text=LONG, size=len(LONG))])]
