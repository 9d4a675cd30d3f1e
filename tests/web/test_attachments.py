"""Files in the chat, on the web side: what the page may upload, a message's files read or refused, the
line under a reply, and a stored chat's files: kept private, served to their owner only, and given back to
the model when the chat is resumed."""

from __future__ import annotations

import asyncio
import inspect
import json
import sqlite3
import stat
from types import SimpleNamespace

import chainlit as cl
import pytest
from chainlit.auth import get_current_user
from fastapi import FastAPI, UploadFile
from fastapi.testclient import TestClient
from starlette.datastructures import Headers
from support.handlers import Chat
from support.pdfs import make_pdf

from app.bounds import MAX_FILE_BYTES, MAX_FILE_CHARS, MAX_FILES
from app.messages import WHOLE, Attachment, FileUse, Source
from app.settings import Settings
from app.web import attachments, history
from app.web.file_store import FileStore
from app.web.ownership import acting_as

README = "# Notes\n\nThe launch is on Tuesday.\n"


def in_chat(make, chat: Chat | None = None):
    """Run make() in a Chainlit context (elements and messages are made in one), whose session and emitter
    are mocks (tests/support/handlers.py)."""
    async def scenario():
        (chat or Chat(SimpleNamespace())).enter()
        made = make()
        return await made if inspect.isawaitable(made) else made
    return asyncio.run(scenario())


def upload(name: str, mime: str, size: int = 10) -> UploadFile:
    return UploadFile(file=None, filename=name, size=size, headers=Headers({"content-type": mime}))


# ---- what the page uploads ----------------------------------------------------------------------

def test_uploads_are_taken_by_extension_whatever_type_the_browser_names(monkeypatch):
    from chainlit.config import config
    from chainlit.server import validate_file_upload

    feature = attachments.upload_feature()
    monkeypatch.setattr(config.features, "spontaneous_file_upload", feature)
    assert feature.enabled and feature.max_files == MAX_FILES == 10 and feature.max_size_mb == 20
    for name, mime in [("notes.md", "text/markdown"), ("report.pdf", "application/pdf"), ("data.csv", "text/csv"),
                       ("main.rs", "application/octet-stream"),  # a type the browser does not know
                       ("app.ts", "video/mp2t"),  # TypeScript, by a browser that thinks it is a video
                       ("Notes.MD", "application/octet-stream")]:
        validate_file_upload(upload(name, mime))
    validate_file_upload(upload("notes.weird", "text/plain"))  # app.files.read refuses it, saying why, in the chat
    for name, mime in [("setup.exe", "application/octet-stream"), ("photo.jpg", "image/jpeg")]:
        with pytest.raises(ValueError, match="File type not allowed"):
            validate_file_upload(upload(name, mime))
    with pytest.raises(ValueError, match="File size too large"):
        validate_file_upload(upload("big.txt", "text/plain", size=MAX_FILE_BYTES + 1))
    validate_file_upload(upload("big.txt", "text/plain", size=MAX_FILE_BYTES))


# ---- a message's files --------------------------------------------------------------------------

def test_a_message_s_files_are_read_from_their_uploads(tmp_path):
    (tmp_path / "up-1").write_text(README)
    (tmp_path / "up-2").write_bytes(make_pdf([["Page one says hello."], ["Page two says goodbye."]]))
    notes, talk, data = in_chat(lambda: attachments.read([
        cl.File(name="notes.md", path=str(tmp_path / "up-1")), cl.Pdf(name="talk.pdf", path=str(tmp_path / "up-2")),
        cl.File(name="data.json", content=b'{"a": 1}')]))
    assert notes == Attachment(name="notes.md", text=README, size=len(README))
    assert talk.name == "talk.pdf" and talk.pages == 2 and talk.text.split("\f") == ["Page one says hello.",
                                                                                     "Page two says goodbye."]
    assert data.text == '{"a": 1}' and data.chosen is None  # the engine chooses, the first time


def test_files_that_cannot_be_read_are_each_named_with_the_reason(tmp_path):
    (tmp_path / "up").write_bytes(b"\x7fELF\x02\x01\x01" + bytes(200))
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(attachments.Refused) as refused:
        in_chat(lambda: attachments.read([
            cl.File(name="fine.md", content=README), cl.File(name="report.pdf", path=str(tmp_path / "up")),
            cl.File(name="empty.txt", path=str(tmp_path / "empty")),
            cl.File(name="gone.txt", path=str(tmp_path / "missing"))]))
    assert [p.name for p in refused.value.problems] == ["report.pdf", "empty.txt", "gone.txt"]
    note = str(refused.value)
    assert note.startswith("Your message was not sent to the model: these files cannot be read.")
    assert "- **report.pdf**: the file is not a PDF" in note and "- **empty.txt**: the file is empty." in note
    assert "- **gone.txt**: the upload is gone (a file not sent within 5 minutes of its upload is deleted" in note
    assert "fine.md" not in note


def test_a_message_s_slow_pdfs_share_one_reading_time(tmp_path, monkeypatch):
    """Three PDFs that each take minutes to read cost the message the time its files have together (made
    2 s here), not 2 s each: the first is stopped at it, the others are not started."""
    import app.files.read
    from support.pdfs import heavy_pdf

    monkeypatch.setattr(app.files.read, "FILES_READ_SECONDS", 2.0)
    (tmp_path / "slow.pdf").write_bytes(heavy_pdf(300, 100_000))
    with pytest.raises(attachments.Refused) as refused:
        in_chat(lambda: attachments.read([cl.File(name=f"{i}.pdf", path=str(tmp_path / "slow.pdf"))
                                          for i in range(3)] + [cl.File(name="fine.md", content=README)]))
    first, *others = refused.value.problems
    assert first.name == "0.pdf" and "took longer than 2 s, the time left" in first.problem
    assert [p.name for p in others] == ["1.pdf", "2.pdf"]  # the Markdown file, read at once, is not refused
    assert all(p.problem.startswith("not read: the files before it took the 2 s") for p in others)


def test_more_files_than_a_message_carries_are_refused():
    with pytest.raises(attachments.Refused, match=f"at most {MAX_FILES} files can be sent with one message"):
        in_chat(lambda: attachments.read([cl.File(name=f"{i}.txt", content="x") for i in range(MAX_FILES + 1)]))


def test_files_whose_text_together_is_too_long_for_one_message_are_refused():
    half = "word " * (MAX_FILE_CHARS // 10 + 1)  # each file alone is taken: two of them are not
    with pytest.raises(attachments.Refused, match="together their text is .* characters long") as refused:
        in_chat(lambda: attachments.read([cl.File(name="a.txt", content=half), cl.File(name="b.txt", content=half)]))
    assert refused.value.problems[0].name == "a.txt, b.txt"
    assert len(in_chat(lambda: attachments.read([cl.File(name="a.txt", content=half)]))) == 1


def test_the_engine_s_choice_is_kept_for_later_turns():
    files = [Attachment(name="a.md", text="a"), Attachment(name="b.pdf", text="b\fc", pages=2)]
    uses = [FileUse(name="a.md", tokens=3, chosen=WHOLE), FileUse(name="b.pdf", tokens=9, chosen=[1], chunks=2)]
    assert [f.chosen for f in attachments.with_chosen(files, uses)] == [WHOLE, [1]]
    assert attachments.with_chosen(files, uses[:1]) == files  # a report that is not of these files changes nothing


def test_the_line_under_a_reply_tells_each_file_s_tokens_and_links_its_sources():
    uses = [FileUse(name="notes.md", tokens=1234, chosen=WHOLE),
            FileUse(name="report.pdf", tokens=2345, chosen=[2, 6], chunks=9,
                    sources=[Source("report.pdf", "pages 3-4", "Revenue grew."),
                             Source("report.pdf", "page 7", "Costs.")]),
            FileUse(name="main.py", tokens=80, chosen=[0], chunks=3,
                    sources=[Source("main.py", "lines 1-40", "def f(): ...")]),
            FileUse(name="a.txt", tokens=9, chosen=[0], chunks=1, sources=[Source("a.txt", "lines 1-2", "Hi.")]),
            FileUse(name="empty.csv", tokens=0, chosen=[], chunks=4),
            FileUse(name="long.pdf", tokens=700, chosen=[0, 1, 5], chunks=26, sources=[
                Source("long.pdf", "page 1", "One."), Source("long.pdf", "page 1", "Two."),
                Source("long.pdf", "page 3", "Three.")])]
    text, sources = in_chat(lambda: attachments.note(uses))
    assert text.split("  \n") == [
        "*notes.md: 1,234 tokens, the whole file*",
        "*report.pdf: 2,345 tokens, 2 of its 9 parts, those nearest the question:* report.pdf, pages 3-4 · "
        "report.pdf, page 7",
        "*main.py: 80 tokens, 1 of its 3 parts, those nearest the question:* main.py, lines 1-40",
        "*a.txt: 9 tokens, all of it, in 1 part:* a.txt, lines 1-2",  # (with other files that did not fit whole)
        "*empty.csv: not read, no room was left in the model's context*",
        # two parts of one page: each name says which (the page opens a source by its name)
        "*long.pdf: 700 tokens, 3 of its 26 parts, those nearest the question:* long.pdf, page 1, part 1 of 26 · "
        "long.pdf, page 1, part 2 of 26 · long.pdf, page 3"]
    assert [s.name for s in sources] == ["report.pdf, pages 3-4", "report.pdf, page 7", "main.py, lines 1-40",
                                         "a.txt, lines 1-2", "long.pdf, page 1, part 1 of 26",
                                         "long.pdf, page 1, part 2 of 26", "long.pdf, page 3"]
    assert all(s.display == "side" for s in sources)
    # each headed by its name (the page may show them all at once); prose as Markdown, code in a code block
    assert sources[0].content == "**report.pdf, pages 3-4**\n\nRevenue grew."
    assert sources[2].content == "**main.py, lines 1-40**\n\n```py\ndef f(): ...\n```"
    assert all(s.name in text for s in sources)  # the page links a side element where its name is written
    assert in_chat(lambda: attachments.note([])) == ("", [])


# ---- stored with the chat -----------------------------------------------------------------------

def test_a_code_block_around_a_source_outlasts_the_fences_in_it():
    text = "Use:\n```\nx = 1\n```\nand ````` in prose."
    shown = attachments.shown_source("a.py, part 1 of 2", "a.py", text)
    assert shown == f"**a.py, part 1 of 2**\n\n``````py\n{text}\n``````"


def test_the_store_keeps_files_and_texts_private_and_deletes_them_with_their_element(tmp_path):
    store = FileStore.beside(tmp_path / "data" / "history.db")
    assert store.folder == tmp_path / "data" / "history-files"

    async def scenario():
        key = "user-1/3f2a-e1/report, final.pdf"
        uploaded = await store.upload_file(key, b"%PDF-1.4 ...", mime="application/pdf")
        store.write_text("3f2a-e1", "the text")
        return key, uploaded

    key, uploaded = asyncio.run(scenario())
    assert uploaded == {"object_key": key, "url": "/history-files/3f2a-e1/report%2C%20final.pdf"}
    assert (store.folder / "3f2a-e1" / "file").read_bytes() == b"%PDF-1.4 ..."
    assert store.read_text("3f2a-e1") == "the text" and store.read_text("other") is None
    for path in [store.folder, store.folder / "3f2a-e1", *(store.folder / "3f2a-e1").iterdir()]:
        assert stat.S_IMODE(path.stat().st_mode) == (0o700 if path.is_dir() else 0o600), path
    assert asyncio.run(store.get_read_url("user-1/3f2a-e1")) == "/history-files/3f2a-e1/file"  # (a nameless element)
    for bad in ["user-1/../../etc/passwd", "user-1/..", "3f2a-e1", "u/a.b/c"]:
        with pytest.raises(ValueError, match="not an element's id"):
            store.path(bad)
    asyncio.run(store.delete_file(key))
    assert not (store.folder / "3f2a-e1").exists()


@pytest.fixture
def stored_chat(tmp_path):
    """A history database with one chat of Ada's holding one uploaded file, its data layer and store."""
    settings = Settings.from_env({"LLAMA_HISTORY_DB": str(tmp_path / "history.db")})
    history.prepare(settings)
    store = FileStore.beside(settings.history_db)
    layer = history.data_layer(settings, store)

    async def write():
        ada = await layer.create_user(cl.User(identifier="ada"))
        eve = await layer.create_user(cl.User(identifier="eve"))
        await layer.update_thread("t1", name="Ada's chat", user_id=ada.id)
        await layer.create_step({"id": "s1", "threadId": "t1", "type": "user_message", "name": "ada",
                                 "output": "Read this.", "streaming": False})
        element = cl.File(name="notes.md", content=README.encode(), mime="text/markdown", thread_id="t1",
                          for_id="s1")
        await layer.create_element(element)
        return ada, eve, element

    with acting_as("ada"):
        ada, eve, element = in_chat(write, chat_of("t1"))
    return layer, store, ada, eve, element


def chat_of(thread_id: str) -> Chat:
    """A tab whose session writes into the chat thread_id (only there may a chat with no owner yet be made)."""
    chat = Chat(SimpleNamespace())
    chat.session.thread_id = thread_id
    return chat


def test_a_stored_file_is_served_to_the_owner_of_its_chat_only(stored_chat):
    layer, store, ada, eve, element = stored_chat
    app = FastAPI()
    route = store.route(data_layer=lambda: layer)
    app.add_api_route(route.path, route.endpoint, methods=["GET"])  # the app's: its dependency_overrides apply
    client = TestClient(app)  # (not `with`: Chainlit's lifespan is not this app's)
    url = asyncio.run(store.get_read_url(f"{ada.id}/{element.id}/notes.md"))
    assert url == f"/history-files/{element.id}/notes.md"

    app.dependency_overrides[get_current_user] = lambda: ada
    response = client.get(url)
    assert response.status_code == 200 and response.content == README.encode()
    assert response.headers["content-type"] == "application/octet-stream"  # downloaded, never a page of this site
    assert response.headers["content-disposition"].startswith("attachment")
    assert response.headers["x-content-type-options"] == "nosniff"
    assert client.get("/history-files/no-such-element/notes.md").status_code == 404

    app.dependency_overrides[get_current_user] = lambda: eve
    assert client.get(url).status_code == 404
    app.dependency_overrides[get_current_user] = lambda: None
    assert client.get(url).status_code == 404


def test_deleting_a_step_or_a_chat_deletes_its_elements_files(stored_chat):
    layer, store, ada, eve, element = stored_chat
    store.write_text(element.id, README)
    assert (store.folder / element.id / "file").is_file()
    with acting_as("eve"):  # not hers
        in_chat(lambda: layer.delete_step("s1"))
    assert (store.folder / element.id / "file").is_file()
    with acting_as("ada"):
        in_chat(lambda: layer.delete_step("s1"))  # (a regenerated answer's line, the messages after an edited one)
    assert not (store.folder / element.id).exists()

    async def another():
        again = cl.File(name="b.md", content=b"b", thread_id="t1", for_id="s2")
        await layer.create_element(again)
        store.write_text(again.id, "b")
        assert (store.folder / again.id / "text").is_file()
        await layer.delete_thread("t1")
        return again

    with acting_as("ada"):
        again = in_chat(another)
    assert not (store.folder / again.id).exists()


def user_step(id: str, output: str, files: list[dict] | None = None) -> dict:
    return {"id": id, "type": "user_message", "name": "User", "output": output, "isError": False,
            "metadata": json.dumps({attachments.FILES: files} if files else {})}


def reply_step(output: str) -> dict:
    return {"id": f"r-{output}", "type": "assistant_message", "name": "Llama Chat", "output": output,
            "isError": False, "metadata": json.dumps({"kind": history.REPLY})}


def test_a_resumed_chat_gives_its_files_back_as_they_went_to_the_model(tmp_path):
    store = FileStore(tmp_path / "files")
    store.write_text("e1", README)
    store.write_text("e2", "Page one.\fPage two.")
    store.write_text("e4", README)
    store.write_text("e6", "Another chat's secret.")
    steps = [
        user_step("s1", "Summarize these.", [
            {"element": "e1", "name": "notes.md", "size": len(README), "pages": 0, "chosen": WHOLE},
            {"element": "e2", "name": "talk.pdf", "size": 900, "pages": 2, "chosen": [1]}]),
        reply_step("A launch on Tuesday, and a talk."),
        user_step("s2", "", [{"element": "e3", "name": "gone.md", "size": 5, "pages": 0, "chosen": None},
                             {"element": "e4", "name": "again.md", "size": 3, "pages": 0, "chosen": None}]),
        reply_step("Sent without words."),
        user_step("s3", "", [{"element": "e3", "name": "gone.md", "size": 5, "pages": 0, "chosen": None}]),
        reply_step("A message whose only file is gone is left out, with its reply."),
        user_step("s4", "And then?", [{"element": "e5", "size": 3}, "not a record",  # (no name: no file)
                                      {"element": "e1", "name": "s1's file.md", "size": 3},  # not this message's
                                      {"element": "e6", "name": "stolen.md", "size": 3}]),  # not this chat's
    ]
    elements = [{"id": "e1", "forId": "s1"}, {"id": "e2", "forId": "s1"}, {"id": "e3", "forId": "s2"},
                {"id": "e4", "forId": "s2"}, {"id": "e5", "forId": "s4"}]  # the chat's element rows
    conversation = history.conversation_from_steps(
        steps, model="tiny", system_prompt=None, files=lambda step: attachments.stored_files(step, store, elements))
    assert [(m.role, m.content) for m in conversation.messages] == [
        ("user", "Summarize these."), ("assistant", "A launch on Tuesday, and a talk."),
        ("user", ""), ("assistant", "Sent without words."),
        ("user", "And then?"), ("assistant", "")]
    first, _, second, _, third, _ = conversation.messages
    assert first.files == [Attachment(name="notes.md", text=README, size=len(README), chosen=WHOLE),
                           Attachment(name="talk.pdf", text="Page one.\fPage two.", size=900, pages=2, chosen=[1])]
    assert second.files == [Attachment(name="again.md", text=README, size=3)]  # its text was gone: left out
    assert third.files is None
    # what the engine is sent: the files with the message, each with the chunks chosen the first time
    sent = conversation.chat_messages()
    assert sent[0].files == first.files and sent[1].files is None
    # without a store (history off), the same steps have no files
    assert all(m.files is None for m in history.conversation_from_steps(
        steps, model="tiny", system_prompt=None,
        files=lambda step: attachments.stored_files(step, None, elements)).messages)


def test_a_message_s_files_are_recorded_in_its_step_and_their_text_stored(tmp_path):
    store = FileStore(tmp_path / "files")
    chat = Chat(SimpleNamespace())
    message = in_chat(lambda: cl.Message(content="Read this", type="user_message",
                                         elements=[cl.File(name="notes.md", content=README, id="e1")]), chat)
    files = [Attachment(name="notes.md", text=README, size=len(README))]

    in_chat(lambda: attachments.keep(message, files, store), chat)
    assert store.read_text("e1") == README
    assert message.metadata == {attachments.FILES: [
        {"element": "e1", "name": "notes.md", "size": len(README), "pages": 0, "chosen": None}]}
    [update] = chat.emitter.update_step.await_args_list
    assert update.args[0]["metadata"] == message.metadata and update.args[0]["output"] == "Read this"

    store.write_text("e1", "changed on disk")  # once recorded, the text is not written again
    in_chat(lambda: attachments.keep(message, attachments.with_chosen(files, [FileUse("notes.md", 9, WHOLE)]), store),
            chat)
    assert message.metadata[attachments.FILES][0]["chosen"] == WHOLE and store.read_text("e1") == "changed on disk"
    assert chat.emitter.update_step.await_count == 2
    in_chat(lambda: attachments.keep(message, attachments.with_chosen(files, [FileUse("notes.md", 9, WHOLE)]), store),
            chat)
    assert chat.emitter.update_step.await_count == 2  # nothing new: not sent again


# ---- on the page --------------------------------------------------------------------------------

def test_a_live_message_s_files_are_chips_and_its_uploads_shown_on_demand(tmp_path):
    pdf = tmp_path / "upload-1"
    pdf.write_bytes(make_pdf([["Page one."], ["Page two."]]))
    chat = Chat(SimpleNamespace())
    message = in_chat(lambda: cl.Message(content="Read these", type="user_message", id="m1", elements=[
        cl.Pdf(name="report.pdf", path=str(pdf), id="e1", display="inline", chainlit_key="k1"),
        cl.File(name="notes.md", content=README, id="e2", display="inline", chainlit_key="k2")]), chat)

    in_chat(lambda: attachments.show(message), chat)  # as soon as it comes
    sent = [c.args[0] for c in chat.emitter.send_element.await_args_list]
    assert [(e["id"], e["display"], e["forId"]) for e in sent[:2]] == [("e1", "page", "m1"), ("e2", "page", "m1")]
    chips = sent[2]
    assert (chips["id"], chips["type"], chips["name"], chips["display"], chips["forId"]) == \
        ("m1-files", "custom", "FileChips", "inline", "m1")
    size = pdf.stat().st_size
    assert chips["props"]["files"] == [
        {"element": "e1", "name": "report.pdf", "details": f"PDF · {attachments.file_size(size)}"},
        {"element": "e2", "name": "notes.md", "details": "MD · " + attachments.file_size(len(README))}]

    files = [Attachment(name="report.pdf", text="Page one.\fPage two.", size=size, pages=2),
             Attachment(name="notes.md", text=README, size=len(README))]
    in_chat(lambda: attachments.show(message, files), chat)  # read: with their pages
    sent = [c.args[0] for c in chat.emitter.send_element.await_args_list]
    assert len(sent) == 4  # the uploads are not sent again, the chips are (the same element)
    assert sent[3]["id"] == "m1-files" and sent[3]["props"]["files"][0]["details"] == \
        f"PDF · 2 pages · {attachments.file_size(size)}"


def test_file_sizes_and_kinds_as_a_chip_says_them():
    assert [attachments.file_size(n) for n in (0, 1, 1023, 1024, 12_345, 2**20 - 1, 2**20, 20 * 2**20)] == [
        "0 bytes", "1 byte", "1023 bytes", "1 KB", "12 KB", "1024 KB", "1.0 MB", "20.0 MB"]
    assert attachments.chip("e", "Makefile", None, 0) == {"element": "e", "name": "Makefile", "details": "File"}
    assert attachments.chip("e", "a.tar.gz", 5, 1)["details"] == "GZ · 1 page · 5 bytes"


def test_a_stored_chat_shows_its_messages_files_as_chips(stored_chat):
    layer, store, ada, eve, element = stored_chat
    records = [{"element": element.id, "name": "notes.md", "size": len(README), "pages": 0, "chosen": WHOLE}]
    with sqlite3.connect(layer.path) as db:  # the user's message that sent it, and a reply with a source
        for id, type, metadata in [("s1", "user_message", {attachments.FILES: records}),
                                   ("s2", "assistant_message", {"kind": history.REPLY})]:
            db.execute('INSERT OR REPLACE INTO steps ("id", "name", "type", "threadId", "streaming", "output", '
                       '"metadata", "createdAt") VALUES (?, ?, ?, ?, 0, ?, ?, ?)',
                       (id, "User", type, "t1", "Read this", json.dumps(metadata), f"2026-01-01T00:00:0{id[1]}Z"))
    source = cl.Text(name="notes.md, lines 1-3", content="The launch", display="side", thread_id="t1", for_id="s2")
    with acting_as("ada"):
        in_chat(lambda: layer.create_element(source), chat_of("t1"))
        thread = in_chat(lambda: layer.get_thread("t1"))
    elements = {e["id"]: e for e in thread["elements"]}
    assert elements[element.id]["display"] == "page"  # the upload, shown when its chip is clicked
    assert elements[source.id]["display"] == "side"  # a reply's source: as it was
    chips = elements["s1-files"]
    assert (chips["type"], chips["name"], chips["display"], chips["forId"]) == ("custom", "FileChips", "inline", "s1")
    assert chips["props"]["files"] == [{"element": element.id, "name": "notes.md",
                                        "details": "MD · " + attachments.file_size(len(README))}]
    assert "s2-files" not in elements
