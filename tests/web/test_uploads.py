"""Uploads in the chat: pending until a message takes them, bounded per session, swept when no message does
(app.web.uploads); a refused message's files never stored (app.web.history's data layer); the files a user's
chats hold bounded (LLAMA_MAX_USER_FILES_MB); the bytes on disk in /metrics.

The handlers run in a mocked Chainlit context (tests/support/handlers.py) over a remote backend that is never
asked (nothing here reaches a model); Chainlit's own part, sending a message's elements as it hands the
message over (which stores them through the data layer), is called as Chainlit calls it."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import chainlit.config
import chainlit.data
import chainlit.server
from chainlit.session import BaseSession
import httpx
import pytest
from support.app import imported_app
from support.handlers import Chat

from app.api.metrics import Metrics
from app.web import uploads
from app.web.file_store import FileStore

pytestmark = pytest.mark.timeout(60)

NOTES = b"# Launch\n\nThe launch is on Tuesday at noon, in room 7.\n"
NOT_A_PDF = b"PK\x03\x04 a zip"


@pytest.fixture
def main(tmp_path, monkeypatch):
    """The chat with history on (in tmp_path), a user's stored files bounded at 1 MB, uploads in tmp_path/.files."""
    monkeypatch.setattr(uploads, "FOLDER", tmp_path / ".files")
    monkeypatch.setattr(chainlit.data, "_data_layer", None)  # the layer of this app, not one of an earlier test
    monkeypatch.setattr(chainlit.data, "_data_layer_initialized", False)
    with imported_app(backend_url="http://127.0.0.1:9/v1", backend_model="remote", history="on",
                      history_db=tmp_path / "history.db", max_user_files_mb=1) as main:
        main.reply = _no_reply  # files are stored before the reply; no model is asked here
        yield main


async def _no_reply(conversation, *args, **kwargs):
    pass


def chat_of(main, user_id: str | None = None) -> Chat:
    chat = Chat(main)
    chat._uploads = uploads.FOLDER / chat.session.id  # where Chainlit keeps the session's uploads
    chat._uploads.mkdir(parents=True)
    chat.session.has_first_interaction = True
    chat.session.user = SimpleNamespace(id=user_id or "u-local", identifier=user_id or "local")  # (whose chat)
    return chat


async def send(chat: Chat, text: str, files: dict[str, bytes]):
    """Send as Chainlit does: its emitter sends the message's elements (storing them through the data layer)
    while on_message runs."""
    import chainlit as cl
    chat.enter()
    elements = []
    for name, data in files.items():
        file_id = str(uuid.uuid4())
        path = chat.uploads() / f"{file_id}.txt"
        path.write_bytes(data)
        chat.session.files[file_id] = {"id": file_id, "path": path, "name": name, "type": "text/plain",
                                       "size": len(data)}
        uploads.PENDING[file_id] = uploads.Upload(chat.session.id, path, len(data), 0.0)
        elements.append(cl.File(id=file_id, name=name, path=str(path), chainlit_key=file_id, mime="text/plain"))
    message = cl.Message(content=text, type="user_message", elements=elements)
    sending = asyncio.gather(*(element.send(for_id=message.id) for element in elements))
    await chat.main.on_message(message)
    await sending
    await asyncio.sleep(0.2)  # the data layer's writes, which Chainlit starts as tasks
    return message


def rows(db: Path, query: str) -> list:
    with sqlite3.connect(db) as connection:
        return connection.execute(query).fetchall()


def stored(tmp_path: Path) -> list[str]:
    folder = tmp_path / "history-files"
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def test_a_refused_message_leaves_none_of_its_files_stored_and_an_accepted_one_keeps_them(main, tmp_path):
    chat = chat_of(main)

    async def scenario():
        refused = await send(chat, "Summarize these", {"notes.md": NOTES, "report.pdf": NOT_A_PDF})
        taken = await send(chat, "Summarize this", {"notes.md": NOTES})
        return refused, taken

    refused, taken = asyncio.run(asyncio.wait_for(scenario(), 30))
    [error] = chat.errors()
    assert "**report.pdf**: the file is not a PDF" in error
    [element] = taken.elements
    assert rows(tmp_path / "history.db", 'SELECT "id", "forId" FROM elements') == [(element.id, taken.id)]
    assert stored(tmp_path) == [f"{element.id}/file", f"{element.id}/text"]
    assert [p.name for p in chat.uploads().iterdir()] == [Path(element.path).name]  # the refused ones: deleted
    assert element.id in chat.session.files and not uploads.PENDING
    assert not {e.id for e in refused.elements} & set(chat.session.files)  # (the rest: the chips the page shows)


def test_files_past_the_users_limit_are_refused_saying_how_much_is_used(main, tmp_path):
    db, store = tmp_path / "history.db", FileStore(tmp_path / "history-files")
    with sqlite3.connect(db) as connection:  # an older chat of the user's, holding 0.9 MB of files
        connection.execute("INSERT INTO users VALUES ('u1', 'alice', '{}', NULL)")
        connection.execute("INSERT INTO threads (id, userId) VALUES ('t0', 'u1')")
        connection.execute("INSERT INTO elements (id, threadId, name) VALUES ('old', 't0', 'big.txt')")
    store.write_text("old", "x" * (900 * 1024))
    chat = chat_of(main, user_id="u1")

    async def scenario():
        await send(chat, "And this?", {"more.txt": b"y" * 100_000})  # 2 x 0.1 MB more: past 1 MB
        await send(chat, "And this?", {"small.txt": b"z" * 10_000})  # fits

    asyncio.run(asyncio.wait_for(scenario(), 30))
    [error] = chat.errors()
    assert error == ("Your message was not sent to the model: its files (0.2 MB, with their text) would take the "
                     "files kept with your chats past your limit: they hold 0.9 MB of at most 1 MB. Delete chats "
                     "you no longer need (in the sidebar) to make room, then send it again.")
    names = [name for (name,) in rows(db, 'SELECT "name" FROM elements ORDER BY "name"')]
    assert names == ["big.txt", "small.txt"]
    assert [p.read_bytes()[:1] for p in chat.uploads().iterdir()] == [b"z"]


# ---- pending uploads, swept ---------------------------------------------------------------------

class Session:
    def __init__(self, session_id: str):
        self.id, self.files = session_id, {}


def chainlit_upload(folder: Path, sessions: dict):
    """Chainlit's upload route as far as the middleware sees it: the file into the session's folder, its entry
    in session.files, {"id": ...} answered."""

    async def route(scope, receive, send):
        session = sessions[scope["query_string"].decode().split("=")[1]]
        body = b""
        while (message := await receive())["type"] == "http.request":
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if not body:  # (Chainlit 2.12's BaseSession.persist_file: empty content is none given)
            await BaseSession.persist_file(session, "a.txt", "text/plain", content=body)
        file_id = str(uuid.uuid4())
        path = folder / session.id / f"{file_id}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
        session.files[file_id] = {"id": file_id, "path": path, "name": "a.txt", "type": "text/plain",
                                  "size": len(body)}
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps({"id": file_id}).encode()})

    return route


@pytest.fixture
def served(tmp_path, monkeypatch):
    """An upload route behind the middleware, one session, uploads in tmp_path; KEEP_SECONDS 0.5."""
    sessions = {"s1": Session("s1")}
    monkeypatch.setattr(uploads, "FOLDER", tmp_path)
    monkeypatch.setattr(uploads, "ws_sessions_id", sessions)
    monkeypatch.setattr(uploads.WebsocketSession, "get_by_id", staticmethod(sessions.get))
    monkeypatch.setattr(uploads, "PENDING", {})
    monkeypatch.setattr(uploads, "STORED", {})
    monkeypatch.setattr(uploads, "KEEP_SECONDS", 0.5)
    monkeypatch.setattr(uploads, "SWEEP_SECONDS", 0.05)
    app = uploads.Tracked(chainlit_upload(tmp_path, sessions))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")

    async def upload(data: bytes) -> httpx.Response:
        return await client.post("/project/file?session_id=s1", content=data)

    return sessions["s1"], upload


def test_an_upload_no_message_takes_is_swept_within_the_period_one_taken_is_kept(served, tmp_path):
    session, upload = served

    async def scenario():
        taken, left = [(await upload(data)).json()["id"] for data in (b"taken", b"left")]
        uploads.take([SimpleNamespace(id=taken)])
        sweeping = asyncio.create_task(uploads.sweeping())
        await asyncio.sleep(0.2)
        before = sorted(p.name for p in (tmp_path / "s1").iterdir()), dict(uploads.STORED)
        await asyncio.sleep(0.6)
        sweeping.cancel()
        return taken, left, before

    taken, left, (before, stored_before) = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert before == sorted([f"{taken}.txt", f"{left}.txt"]) and stored_before == {"uploads": 9}
    assert [p.name for p in (tmp_path / "s1").iterdir()] == [f"{taken}.txt"]
    assert set(session.files) == {taken} and uploads.PENDING == {} and uploads.STORED == {"uploads": 5}


def test_a_session_keeps_a_bounded_number_of_uploads_waiting(served, tmp_path, monkeypatch):
    session, upload = served
    monkeypatch.setattr(uploads, "MAX_PENDING_BYTES", 1000)

    async def scenario():
        answers = [await upload(b"x" * 10) for _ in range(uploads.MAX_PENDING_FILES + 1)]
        uploads.PENDING.clear()
        return answers, await upload(b"x" * 1001)

    answers, too_big = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert [a.status_code for a in answers] == [200] * uploads.MAX_PENDING_FILES + [429]
    assert answers[-1].json()["detail"].startswith(f"This chat has {uploads.MAX_PENDING_FILES} files (0.0 MB) "
                                                   "uploaded and not sent yet; it keeps at most")
    assert too_big.status_code == 429 and "Send them with a message or remove some first" in too_big.json()["detail"]
    assert len(list((tmp_path / "s1").iterdir())) == uploads.MAX_PENDING_FILES  # the 1001 bytes: deleted
    assert len(session.files) == uploads.MAX_PENDING_FILES


def test_an_empty_file_is_a_400_saying_so(served, tmp_path):
    """Chainlit's upload route takes an empty file's content for none given and raised (a 500 with a trace)."""
    session, upload = served
    answer = asyncio.run(asyncio.wait_for(upload(b""), 10))
    assert answer.status_code == 400 and answer.json()["detail"] == "The file is empty: it has nothing to read."
    assert uploads.PENDING == {} and session.files == {}


def test_the_bytes_on_disk_are_in_the_metrics():
    stored = {"history": 4096, "history_files": 10, "uploads": 123}
    text = Metrics(stored=lambda: stored).exposition().decode()
    for part, size in stored.items():
        assert f'llama_stored_bytes{{part="{part}"}} {float(size)}' in text
    assert "llama_stored_bytes" not in Metrics().exposition().decode()  # (the API alone stores nothing)


def test_each_server_keeps_its_session_files_in_a_folder_of_its_own(tmp_path, monkeypatch):
    """Chainlit deletes its whole files folder when its server stops: each server claims .files/<host>-<its pid>,
    and what stopped servers of this host left is deleted, never a running one's, another host's (a container
    sharing the folder) nor a session's of the last minutes."""
    root = tmp_path / ".files"
    monkeypatch.setattr(uploads, "FOLDER", uploads.server_folder(os.getpid(), root))
    monkeypatch.setattr(chainlit.config, "FILES_DIRECTORY", chainlit.config.FILES_DIRECTORY)
    monkeypatch.setattr(chainlit.server, "FILES_DIRECTORY", chainlit.server.FILES_DIRECTORY)
    gone = subprocess.Popen(["true"])
    gone.wait()
    other, stopped = uploads.server_folder(os.getppid(), root), uploads.server_folder(gone.pid, root)
    elsewhere = root / f"another-host-{gone.pid}"
    old, recent = root / "0b7c6f6e-1a2b-4c3d-8e9f-001122334455", root / "1b7c6f6e-1a2b-4c3d-8e9f-001122334455"
    for folder in (other, stopped, elsewhere, old, recent, root / "notes"):
        (folder / "a").mkdir(parents=True)
    os.utime(old, (time.time() - 2 * uploads.KEEP_SECONDS,) * 2)
    assert uploads.claim_folder() == uploads.FOLDER == chainlit.config.FILES_DIRECTORY == chainlit.server.FILES_DIRECTORY
    assert sorted(p.name for p in root.iterdir()) == sorted([uploads.FOLDER.name, other.name, elsewhere.name,
                                                             recent.name, "notes"])
    assert uploads.FOLDER.stat().st_mode & 0o777 == 0o700 and root.stat().st_mode & 0o777 == 0o700
    uploads.claim_folder()  # again (a second app in the process): the same folder
    assert uploads.FOLDER.is_dir() and other.is_dir()


def test_a_users_uploads_waiting_are_bounded_over_all_their_tabs(tmp_path, monkeypatch):
    """Four tabs of one user do not hold four tabs' worth: LLAMA_MAX_PENDING_MB counts a user's uploads not sent
    over all their sessions, refused by name; another user's tab and a file sent (taken) are not counted."""
    user = lambda name: SimpleNamespace(identifier=name)  # noqa: E731
    sessions = {sid: Session(sid) for sid in ("ann1", "ann2", "ann3", "bob1")}
    for sid, session in sessions.items():
        session.user = user(sid[:3])
    monkeypatch.setattr(uploads, "FOLDER", tmp_path)
    monkeypatch.setattr(uploads, "ws_sessions_id", sessions)
    monkeypatch.setattr(uploads.WebsocketSession, "get_by_id", staticmethod(sessions.get))
    monkeypatch.setattr(uploads, "PENDING", {})
    monkeypatch.setattr(uploads, "STORED", {})
    monkeypatch.setattr(uploads, "USER_PENDING_BYTES", 250)  # each tab alone keeps up to MAX_PENDING_BYTES
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=uploads.Tracked(chainlit_upload(tmp_path, sessions))),
                               base_url="http://test")

    async def upload(sid: str, size: int) -> httpx.Response:
        return await client.post(f"/project/file?session_id={sid}", content=b"x" * size)

    async def scenario():
        first = [await upload(sid, 100) for sid in ("ann1", "ann2")]  # 200 bytes of ann's, in two tabs
        third = await upload("ann3", 100)  # 300 > 250: refused, deleted
        bob = await upload("bob1", 200)  # bob's own
        uploads.take([SimpleNamespace(id=first[0].json()["id"])])  # ann sends one: it no longer waits
        again = await upload("ann3", 100)
        return first, third, bob, again

    first, third, bob, again = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert [a.status_code for a in first] == [200, 200] and bob.status_code == 200 and again.status_code == 200
    assert third.status_code == 429 and third.json()["detail"].startswith(
        "You have 3 files (0.0 MB) uploaded and not sent yet in your open chats; at most 0 MB wait together "
        "(LLAMA_MAX_PENDING_MB)")
    assert not sessions["ann3"].files or len(sessions["ann3"].files) == 1  # the refused one is gone
    assert sum(u.size for u in uploads.PENDING.values() if u.user == "ann") == 200
