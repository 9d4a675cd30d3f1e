"""Chat history: the SQLite schema against what Chainlit 2.12 writes, the conversation a resumed chat
is rebuilt to, sign-in, and the real thing: a chat stored by one `chainlit run`, listed and resumed
with its memory by the next.

The end-to-end tests run a tiny random checkpoint greedily. The default model (SmolLM2-135M) does
not reliably answer "What is my name?" even with the name in its prompt, so memory is checked
exactly instead: the reply after the restart must be the engine's greedy reply to the whole stored
conversation, which differs from its reply to the last question alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import sqlite3
import stat
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest
import socketio
import torch
from chainlit.user import User
from support.chat_tab import ChatTab, sign_in
from support.servers import ApiServer, ChainlitServer, server_env

from app.web import history
from app.settings import Settings, SettingsError
from app.web.users import HASHER

pytestmark = pytest.mark.timeout(240)

FIRST = "My name is Ada. Remember it."
SECOND = "What is my name?"
MAX_NEW_TOKENS = 24
# A data layer that fails logs a warning or an error and goes on: any such line fails the test, but
# for Chainlit's note that chainlit.md has no translation for the browser's language.
BAD_LOG_LINE = re.compile(r" - (WARNING|ERROR|CRITICAL) - |Traceback|sqlite3\.|OperationalError|IntegrityError")
HARMLESS_LOG_LINE = re.compile(r"Translated markdown file for [\w-]+ not found")


# ---- the schema ---------------------------------------------------------------------------------

def test_schema_has_a_column_for_every_field_chainlit_writes(tmp_path):
    from chainlit.element import ElementDict
    from chainlit.step import StepDict
    from chainlit.types import Feedback

    db = tmp_path / "history.db"
    history.create_schema(db)
    with sqlite3.connect(db) as connection:
        columns = {table: {row[1] for row in connection.execute(f"PRAGMA table_info({table})")}
                   for table in history.TABLES}
    # create_step writes every key of a step's dict but "feedback" (a join); elements and feedbacks likewise
    assert set(StepDict.__annotations__) - {"feedback"} <= columns["steps"]
    assert set(ElementDict.__annotations__) - {"path"} <= columns["elements"]
    assert {f.name for f in dataclasses.fields(Feedback)} <= columns["feedbacks"]
    assert {"autoCollapse", "defaultOpen", "modes", "command"} <= columns["steps"]


def test_an_older_database_gets_the_missing_columns(tmp_path):
    db = tmp_path / "history.db"
    with sqlite3.connect(db) as connection:  # the schema of Chainlit's documentation, without autoCollapse
        connection.execute('CREATE TABLE steps ("id" TEXT PRIMARY KEY, "name" TEXT NOT NULL, "type" TEXT NOT NULL, '
                           '"threadId" TEXT NOT NULL, "streaming" BOOLEAN NOT NULL, "output" TEXT)')
        connection.execute("INSERT INTO steps VALUES ('s', 'User', 'user_message', 't', 0, 'kept')")
    history.create_schema(db)
    with sqlite3.connect(db) as connection:
        columns = {row[1] for row in connection.execute("PRAGMA table_info(steps)")}
        assert connection.execute("SELECT output FROM steps").fetchall() == [("kept",)]
    assert set(history.TABLES["steps"]) == columns


def test_the_data_layer_stores_and_lists_chats_without_sql_errors(tmp_path, caplog):
    """Every write Chainlit makes for a chat, with the values it really sends (lists, dicts, booleans)."""
    import chainlit as cl
    from chainlit.context import init_http_context
    from chainlit.types import Feedback, Pagination, ThreadFilter

    settings = Settings.from_env({"LLAMA_HISTORY_DB": str(tmp_path / "history.db")})
    history.prepare(settings)

    async def scenario():
        layer = history.data_layer(settings)
        try:
            user = await layer.create_user(cl.User(identifier="local", metadata={"provider": "local"}))
            context = init_http_context(user=user)
            thread_id = context.session.thread_id
            await layer.update_thread(thread_id, name="A chat " * 100_000, user_id=user.id, tags=["tiny"],
                                      metadata={"chat_settings": {"temperature": 0.5}})  # (named after a pasted
            long_name = (await layer.get_thread(thread_id))["name"]  # ... first message of megabytes)
            await layer.update_thread(thread_id, name="A chat")
            question = cl.Message(content="Hello", author="User", type="user_message")
            step = cl.Step(name="on_message", type="run", default_open=True, auto_collapse=True, icon="bot")
            answer = cl.Message(content="Hi there", metadata={"kind": history.REPLY}, tags=["a", "b"])
            for step_dict in (question.to_dict(), step.to_dict(), answer.to_dict()):
                await layer.create_step(step_dict)
            answer.content = "Hi there, edited"
            await layer.update_step(answer.to_dict())
            await layer.upsert_feedback(Feedback(forId=answer.id, value=1, threadId=thread_id, comment="good"))
            # a chat used only for the Models command (chosen in the Tools menu, or typed): nothing of it stored,
            # not listed; and the command in a chat is no message of it
            tools = init_http_context(user=user).session.thread_id
            await layer.update_thread(tools, name="", user_id=user.id)
            typed = init_http_context(user=user).session.thread_id  # "/models" typed as its first message
            await layer.update_thread(typed, name="/models", user_id=user.id)
            writing = init_http_context(user=user).session.thread_id  # a first message not written yet: listed
            await layer.update_thread(writing, name="Hello there", user_id=user.id)
            for command in (cl.Message(content="", type="user_message", command="Models"),
                            cl.Message(content=" /models ", type="user_message")):
                for thread in (tools, typed, thread_id):
                    await layer.create_step(command.to_dict() | {"threadId": thread, "id": str(uuid.uuid4())})
            listed = await layer.list_threads(Pagination(first=10), ThreadFilter(userId=user.id))
            tools_chat = await layer.get_thread(tools)
            thread = await layer.get_thread(thread_id)
            author = await layer.get_thread_author(thread_id)
            await layer.delete_thread(thread_id)
            return listed, thread, author, await layer.get_thread(thread_id), long_name, tools_chat
        finally:
            await layer.close()

    with caplog.at_level(logging.INFO):
        listed, thread, author, deleted, long_name, tools_chat = asyncio.run(scenario())
    assert tools_chat is not None and tools_chat["steps"] == []  # (still its owner's to open, if asked)
    assert len(long_name) == history.CHAT_NAME_CHARS and long_name.startswith("A chat A chat") and long_name[-1] == "…"
    assert sorted(t["name"] for t in listed.data) == ["A chat", "Hello there"] and author == "local"
    steps = {s["type"]: s for s in thread["steps"]}
    assert {type: s["output"] for type, s in steps.items()} == {
        "user_message": "Hello", "run": "", "assistant_message": "Hi there, edited"}
    assert history.is_reply(steps["assistant_message"]) and not history.is_reply(steps["user_message"])
    assert steps["assistant_message"]["feedback"]["value"] == 1
    assert deleted is None
    problems = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not problems, problems


# ---- the conversation of a resumed chat ---------------------------------------------------------

def step(type: str, output: str, reply: bool = False, error: bool = False, name: str = "Llama Chat") -> dict:
    return {"id": f"id-{output}", "type": type, "name": name, "output": output, "isError": error,
            "metadata": json.dumps({"kind": history.REPLY}) if reply else "{}"}


def test_a_resumed_conversation_has_the_messages_and_replies_only():
    steps = [
        step("run", "", name="on_chat_start"),
        step("user_message", "My name is Ada.", name="User"),
        step("run", "", name="on_message"),
        step("assistant_message", "Nice to meet you, Ada.", reply=True),
        step("assistant_message", "*12 tokens · stop token*", name="stats"),
        step("assistant_message", "*Older messages of this chat no longer fit…*"),
        step("user_message", "word " * 5000, name="User"),
        step("assistant_message", "Your message is too long for this model", error=True),
        step("user_message", "   ", name="User"),
        step("assistant_message", "Please type a message."),
        step("user_message", "Tell me a story.", name="User"),
        step("assistant_message", "Task manually stopped."),  # stopped before the first token
        step("user_message", "What is my name?", name="User"),
        step("assistant_message", "Ada.", reply=True),
    ]
    conversation = history.conversation_from_steps(steps, model="tiny", system_prompt="Be brief.")
    assert conversation.model == "tiny" and conversation.system_prompt == "Be brief."
    assert [(m.role, m.content) for m in conversation.messages] == [
        ("user", "My name is Ada."), ("assistant", "Nice to meet you, Ada."),
        ("user", "Tell me a story."), ("assistant", ""),
        ("user", "What is my name?"), ("assistant", "Ada.")]
    assert conversation.messages[0].id == "id-My name is Ada."  # an edit of it truncates from there
    assert all(m.ids is None for m in conversation.messages)  # stored as text: a resumed chat re-encodes it


def test_a_chat_that_ends_with_an_unanswered_message_resumes_ready_for_the_next():
    conversation = history.conversation_from_steps(
        [step("user_message", "Hi", name="User")], model=None, system_prompt=None)
    assert [(m.role, m.content) for m in conversation.messages] == [("user", "Hi"), ("assistant", "")]


def test_a_reply_cut_short_leaves_its_question_out_as_a_failed_one_does():
    """Cut by a failure (CUT), or left streaming by a server that was killed (STREAMING, marked CUT at the next
    start): no error follows it, and the question is to be sent again all the same."""
    def cut(output: str, kind: str, **more) -> dict:
        return {"id": f"id-{output}", "type": "assistant_message", "name": "Llama Chat", "output": output,
                "metadata": json.dumps({"kind": kind, **more})}

    steps = [step("user_message", "My name is Ada.", name="User"), step("assistant_message", "Hello Ada.", reply=True),
             step("user_message", "Tell me a story.", name="User"), cut("Once upon", history.CUT),
             step("user_message", "Tell me another.", name="User"), cut("Long ago", history.STREAMING, pid=1),
             step("user_message", "And one more.", name="User"),
             cut(history.cut_short("There was"), history.CUT)]
    conversation = history.conversation_from_steps(steps, model=None, system_prompt=None)
    assert [(m.role, m.content) for m in conversation.messages] == [("user", "My name is Ada."),
                                                                    ("assistant", "Hello Ada.")]


def streaming_steps(db: Path, rows: list[tuple[str, str, dict]]) -> None:
    with sqlite3.connect(db) as connection:
        for id, output, metadata in rows:
            connection.execute('INSERT INTO steps (id, name, type, "threadId", streaming, output, metadata) '
                               "VALUES (?, 'Llama Chat', 'assistant_message', 't', 1, ?, ?)",
                               (id, output, json.dumps(metadata)))


def test_at_start_replies_left_streaming_by_a_server_that_stopped_are_marked_cut_short(tmp_path):
    import subprocess
    import sys

    stopped = subprocess.Popen([sys.executable, "-c", "pass"])
    stopped.wait()
    db = tmp_path / "history.db"
    history.create_schema(db)
    streaming = {"kind": history.STREAMING}
    streaming_steps(db, [
        ("killed", "The answer so far", streaming | {"pid": stopped.pid}),
        ("in-code", "Look:\n```python\nprint(", streaming | {"pid": stopped.pid}),
        ("no-pid", "Written by whom?", streaming),
        ("running", "Another server, still writing", streaming | {"pid": os.getpid()}),
        ("whole", "A whole reply mentioning streaming", {"kind": history.REPLY})])
    history.prepare(Settings.from_env({"LLAMA_HISTORY_DB": str(db)}))
    with sqlite3.connect(db) as connection:
        found = {id: (output, json.loads(metadata), streaming) for id, output, metadata, streaming
                 in connection.execute("SELECT id, output, metadata, streaming FROM steps")}
    note = "\n\n*(cut short: the server stopped; send the message again to have it answered)*"
    cut = {"kind": history.CUT}
    assert found == {"killed": ("The answer so far" + note, cut, 0),
                     "in-code": ("Look:\n```python\nprint(\n```" + note, cut, 0),  # the code block closed first
                     "no-pid": ("Written by whom?" + note, cut, 0),
                     "running": ("Another server, still writing", streaming | {"pid": os.getpid()}, 1),
                     "whole": ("A whole reply mentioning streaming", {"kind": history.REPLY}, 1)}
    assert history.mark_cut_short(db) == 0  # once


def test_a_streaming_reply_is_written_at_its_first_piece_then_at_most_every_interval(monkeypatch):
    import chainlit as cl
    from chainlit.context import ChainlitContext, context_var
    from support.handlers import Session, mock_emitter

    written: list[dict] = []

    class Layer:
        async def create_step(self, step_dict):
            await asyncio.sleep(0.01)
            written.append(step_dict)

    monkeypatch.setattr(history, "get_data_layer", lambda: Layer())

    async def scenario():
        context_var.set(ChainlitContext(Session(), mock_emitter()))
        answer = cl.Message(content="", metadata={"kind": history.REPLY})
        saved = history.StreamedReply(answer, every=0.3)
        for i in range(40):  # 1.2 s of pieces
            await answer.stream_token(f"w{i} ")
            saved.grew()
            await asyncio.sleep(0.03)
        await saved.settled()
        return answer

    answer = asyncio.run(scenario())
    assert 3 <= len(written) <= 5, [w["output"] for w in written]  # not one write per piece
    assert written[0]["output"] == "w0 "
    assert all(w["metadata"] == {"kind": history.STREAMING, "pid": os.getpid()} and w["streaming"] for w in written)
    assert all(w["id"] == answer.id and w["createdAt"] == answer.created_at for w in written)
    assert answer.metadata == {"kind": history.REPLY}  # what its send() writes over them


# ---- sign-in ------------------------------------------------------------------------------------

def test_the_auth_secret_is_made_once_and_kept_private(tmp_path, monkeypatch):
    monkeypatch.delenv("CHAINLIT_AUTH_SECRET", raising=False)
    secret = history.auth_secret(tmp_path / "data")
    path = tmp_path / "data" / history.SECRET_FILE
    assert len(secret) >= 32 and path.read_text().strip() == secret
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert history.auth_secret(tmp_path / "data") == secret  # the next start signs the same tokens
    monkeypatch.setenv("CHAINLIT_AUTH_SECRET", "from-the-environment")
    assert history.auth_secret(tmp_path / "other") == "from-the-environment"
    assert not (tmp_path / "other").exists()


@pytest.fixture
def permissive_umask():
    """A umask that takes nothing away (files created 0666, folders 0777), as some systems set."""
    before = os.umask(0)
    try:
        yield
    finally:
        os.umask(before)


def modes(folder: Path) -> dict[str, int]:
    return {path.name: stat.S_IMODE(path.stat().st_mode) for path in [folder, *folder.iterdir()]}


def test_the_database_its_sqlite_files_and_the_secret_are_private_whatever_the_umask(tmp_path, monkeypatch,
                                                                                      permissive_umask):
    monkeypatch.delenv("CHAINLIT_AUTH_SECRET", raising=False)
    settings = Settings.from_env({"LLAMA_HISTORY_DB": str(tmp_path / "data" / "history.db")})
    history.prepare(settings)
    history.auth_secret(settings.history_db.parent)

    async def write():
        layer = history.data_layer(settings)
        user = await layer.create_user(User(identifier="ada"))
        await layer.update_thread("t1", name="Secrets", user_id=user.id)
        await layer.engine.dispose()

    with sqlite3.connect(settings.history_db) as db:  # held open: SQLite's -wal and -shm exist meanwhile
        db.execute("SELECT 1 FROM threads").fetchall()
        asyncio.run(write())
        found = modes(settings.history_db.parent)
    assert {"history.db", "history.db-wal", "history.db-shm", ".auth_secret"} <= set(found), found
    assert found == {"data": 0o700} | {name: 0o600 for name in found if name != "data"}


def test_an_older_history_made_readable_by_others_is_made_private(tmp_path, monkeypatch, permissive_umask):
    monkeypatch.delenv("CHAINLIT_AUTH_SECRET", raising=False)
    folder = tmp_path / "data"
    folder.mkdir(mode=0o755)
    (folder / history.SECRET_FILE).write_text("x" * 48)  # as an older start, or a copy, left them: 0666
    db = folder / "history.db"
    with sqlite3.connect(db) as older:  # open meanwhile: its -wal and -shm exist, with the database's 0644
        older.execute("PRAGMA journal_mode=WAL").fetchall()
        older.execute("CREATE TABLE notes (text)")
        assert modes(folder)["history.db-wal"] == 0o644
        history.prepare(Settings.from_env({"LLAMA_HISTORY_DB": str(db)}))
        assert history.auth_secret(folder) == "x" * 48
        assert modes(folder) == {"data": 0o700, "history.db": 0o600, "history.db-wal": 0o600,
                                 "history.db-shm": 0o600, history.SECRET_FILE: 0o600}


def test_history_and_auth_settings():
    settings = Settings.from_env({})
    assert settings.history and settings.history_db.parts[-2:] == ("data", "history.db")
    assert settings.auth == "none" and settings.password is None
    assert not Settings.from_env({"LLAMA_HISTORY": "off"}).history
    assert Settings.from_env({"LLAMA_AUTH": "password", "LLAMA_PASSWORD": "x", "LLAMA_API_KEY": "k"}).password == "x"
    with pytest.raises(SettingsError, match="LLAMA_HISTORY=maybe: expected on or off"):
        Settings.from_env({"LLAMA_HISTORY": "maybe"})
    with pytest.raises(SettingsError, match="LLAMA_AUTH=password: expected LLAMA_PASSWORD or LLAMA_USERS"):
        Settings.from_env({"LLAMA_AUTH": "password"})
    with pytest.raises(SettingsError, match="LLAMA_AUTH=oauth: expected one of none, password"):
        Settings.from_env({"LLAMA_AUTH": "oauth"})


def test_a_database_path_that_cannot_be_used_is_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    settings = Settings.from_env({"LLAMA_HISTORY_DB": str(blocker / "history.db")})
    with pytest.raises(SettingsError, match="LLAMA_HISTORY_DB=.*cannot create the database"):
        history.prepare(settings)


# ---- end to end: stored, listed after a restart, resumed with memory ----------------------------

def assert_clean_log(server: ChainlitServer, allowed: re.Pattern | None = None) -> None:
    bad = [line for line in server.log_path.read_text(errors="replace").splitlines()
           if BAD_LOG_LINE.search(line) and not HARMLESS_LOG_LINE.search(line)
           and not (allowed and allowed.search(line))]
    assert not bad, "the server logged problems:\n" + "\n".join(bad)


def stored_steps(db: Path, thread_id: str) -> list[tuple[str, str, dict]]:
    with sqlite3.connect(db) as connection:
        rows = connection.execute('SELECT type, output, metadata FROM steps WHERE "threadId" = ? '
                                  'ORDER BY "createdAt"', (thread_id,)).fetchall()
    return [(type, output, json.loads(metadata or "{}")) for type, output, metadata in rows]


def stored_replies(db: Path, thread_id: str) -> list[str]:
    return [output for type, output, metadata in stored_steps(db, thread_id) if metadata.get("kind") == history.REPLY]


@pytest.fixture(scope="module")
def first_chat(tiny, tmp_path_factory):
    """One chat with one question, by a server that is then stopped: (environment, thread id, cookies)."""
    folder = tmp_path_factory.mktemp("history")
    env = server_env(checkpoint=tiny, weights_dir=tiny.parent, temperature=0, dtype="fp32", threads=1,
                     max_new_tokens=MAX_NEW_TOKENS, history_db=folder / "history.db")
    env.pop("CHAINLIT_AUTH_SECRET", None)  # the app makes its own and keeps it beside the database
    server = ChainlitServer(env, log=folder / "first.log")
    try:
        server.wait_ready()
        cookies = sign_in(server.url)
        tab = ChatTab(server.url, cookies)
        tab.wait_for("chat_settings")
        tab.send(FIRST)
        thread_id = tab.thread_id
        tab.close()
        time.sleep(0.5)  # the session's settings are stored when the socket closes
    finally:
        server.stop()
    assert_clean_log(server)
    return env, thread_id, cookies, folder


@pytest.fixture(scope="module")
def restarted(first_chat):
    env, _, _, folder = first_chat
    server = ChainlitServer(env, log=folder / "second.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
    assert_clean_log(server)


def test_the_chat_is_stored_with_its_reply(first_chat):
    env, thread_id, _, folder = first_chat
    db = Path(env["LLAMA_HISTORY_DB"])
    steps = stored_steps(db, thread_id)
    assert [output for type, output, _ in steps if type == "user_message"] == [FIRST]
    [reply] = stored_replies(db, thread_id)
    assert reply
    assert any(type == "assistant_message" and f" · {MAX_NEW_TOKENS} tokens · " in output
               for type, output, _ in steps)  # the stats line is stored too, but is no reply
    secret = folder / history.SECRET_FILE
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600


def test_after_a_restart_the_chat_is_listed_for_the_same_sign_in(first_chat, restarted):
    _, thread_id, cookies, _ = first_chat
    # the sign-in of the first run still holds (the secret was kept): what the sidebar asks
    response = httpx.post(f"{restarted.url}/project/threads", cookies=cookies, timeout=30,
                          json={"pagination": {"first": 20, "cursor": None}, "filter": {}})
    assert response.status_code == 200, response.text
    assert [(t["id"], t["name"]) for t in response.json()["data"]] == [(thread_id, FIRST)]
    assert_clean_log(restarted)


def test_a_resumed_chat_continues_with_the_models_memory_of_it(first_chat, restarted, tiny):
    from model.checkpoint import load_checkpoint
    from model.generation import Generation

    env, thread_id, cookies, _ = first_chat
    db = Path(env["LLAMA_HISTORY_DB"])
    tab = ChatTab(restarted.url, sign_in(restarted.url), thread_id=thread_id)
    try:
        _, resumed = tab.wait_for("resume_thread")
        assert resumed["id"] == thread_id
        tab.send(SECOND)
    finally:
        tab.close()
    deadline = time.monotonic() + 10
    while len(stored_replies(db, thread_id)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)  # the reply is written to the database as it is sent, not awaited
    first_reply, reply = stored_replies(db, thread_id)
    assert f"resumed chat {thread_id} with 2 messages" in restarted.log()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        checkpoint = load_checkpoint(tiny, dtype=torch.float32)

        def greedy(dialog: list[dict]) -> str:
            ids = checkpoint.chat_format.encode_dialog(dialog)
            return "".join(Generation(checkpoint, ids, max_new_tokens=MAX_NEW_TOKENS, temperature=0.0))

        remembering = greedy([{"role": "user", "content": FIRST}, {"role": "assistant", "content": first_reply},
                              {"role": "user", "content": SECOND}])
        forgetting = greedy([{"role": "user", "content": SECOND}])
    finally:
        torch.set_num_threads(threads)
    assert remembering != forgetting  # else this test could not tell
    assert reply == remembering
    assert_clean_log(restarted)


def test_the_sidebar_lists_the_chat_and_opens_it(first_chat, restarted):
    from support.browser import CHROMIUM, CHROMIUM_ARGS, need_browser

    need_browser()
    from playwright.sync_api import sync_playwright

    _, thread_id, _, _ = first_chat
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 800})
            page.set_default_timeout(60_000)
            page.goto(restarted.url)  # no login form: signed in as the local user
            link = page.locator('#thread-history a[href^="/thread/"]')
            link.first.wait_for()
            assert link.count() == 1 and link.first.get_attribute("href") == f"/thread/{thread_id}"
            assert FIRST in link.first.inner_text()
            link.first.click()
            page.wait_for_url(f"**/thread/{thread_id}")
            page.locator('.step[data-step-type="user_message"]', has_text=FIRST).wait_for()
            page.wait_for_selector("#chat-input")
        finally:
            browser.close()
    assert_clean_log(restarted)


def test_a_chat_deleted_while_its_tab_is_open_is_not_written_again(first_chat, restarted):
    """(After the sidebar's test: these add chats.) Deleted from another tab (the sidebar's DELETE), a chat still open in one took every later message and
    file into a chat owned by nobody (nobody could see or delete it, nor were its files counted). Now the tab is
    told, and nothing more is stored."""
    _, _, cookies, folder = first_chat
    db = folder / "history.db"
    tab = ChatTab(restarted.url, cookies)
    try:
        tab.wait_for("chat_settings")
        tab.send("A chat to delete.")
        thread_id = tab.thread_id
        gone = httpx.request("DELETE", f"{restarted.url}/project/thread", cookies=cookies, timeout=30,
                             json={"threadId": thread_id})
        assert gone.status_code == 200, gone.text
        start = tab.send("Anyone there?")
        assert any("This chat was deleted" in text for text in tab.outputs(start))
    finally:
        tab.close()
    with sqlite3.connect(db) as connection:
        assert connection.execute('SELECT COUNT(*) FROM threads WHERE "id" = ?', (thread_id,)).fetchone() == (0,)
        assert connection.execute('SELECT COUNT(*) FROM steps WHERE "threadId" = ?', (thread_id,)).fetchone() == (0,)
    assert_clean_log(restarted)


def test_a_message_sent_while_one_is_answered_is_refused_and_not_kept(first_chat, restarted):
    """The page disables Send while a reply runs; a client that does not wait had every message answered at
    once (mixed into each other's prompts, the history out of order, Stop ending one). Now one at a time."""
    _, _, cookies, folder = first_chat
    tab = ChatTab(restarted.url, cookies)
    try:
        tab.wait_for("chat_settings")
        start = tab.send("First question.", wait=False)
        tab.send("Second question.", wait=False)
        tab.wait_for("task_end", after=start, timeout=90)
        time.sleep(1.0)  # (both handled)
        refused = [text for text in tab.outputs(start) if text.startswith("Please wait until this reply is done")]
        thread_id = tab.thread_id or tab.wait_for("first_interaction", after=start)[1]["thread_id"]
    finally:
        tab.close()
    assert len(refused) == 1
    users = [output for type, output, _ in stored_steps(folder / "history.db", thread_id) if type == "user_message"]
    assert users == ["First question."]  # the refused one is not in the history


def test_a_message_over_a_megabyte_is_refused_saying_so(first_chat, restarted):
    """engineio closed the socket at a frame over 1 MB: the message was shown as sent and never answered. The
    frame limit is LLAMA_MAX_BODY_MB now, and a message too long for the model is refused by name."""
    _, _, cookies, _ = first_chat
    tab = ChatTab(restarted.url, cookies)
    try:
        tab.wait_for("chat_settings")
        start = tab.send("word " * 300_000, timeout=120)  # 1.5 MB
        assert any("Your message is too long for this model" in text for text in tab.outputs(start))
        assert tab.sio.connected
    finally:
        tab.close()


# ---- a server killed mid-reply ------------------------------------------------------------------

def socket_folders(folder: Path) -> dict[int, list[str]]:
    """The engines' socket folders in a temporary directory, by the pid of the web process they belong to."""
    found: dict[int, list[str]] = {}
    for path in folder.glob("llama-engine-*"):
        found.setdefault(int(path.name.split("-")[2]), []).append(path.name)
    return found


def test_a_server_killed_mid_reply_keeps_the_text_so_far_marked_cut_short_and_its_socket_folder_goes(tiny, tmp_path):
    """kill -9 of the web process while a reply streams: the next start on the same database shows the text
    written so far, marked cut short, and a resumed chat leaves it (and its question) out; the socket folder the
    killed process left is removed at that start, while the folder of another server that runs is kept."""
    temp = Path(tempfile.mkdtemp(prefix="kill-"))  # the servers' TMPDIR, short: socket paths have a length limit
    db = tmp_path / "history.db"
    common = dict(checkpoint=tiny, weights_dir=tiny.parent, temperature=0, dtype="fp32", threads=1,
                  kernels="off")  # (what is tested here does not need the decode kernel's build)
    env = server_env(**common, max_context=32768, max_new_tokens=30000, history_db=db) | {"TMPDIR": str(temp)}
    env.pop("CHAINLIT_AUTH_SECRET", None)
    other = ApiServer(server_env(**common, max_new_tokens=4) | {"TMPDIR": str(temp)}, log=tmp_path / "other.log")
    killed = ChainlitServer(env, log=tmp_path / "killed.log")
    restarted = None
    try:
        other.wait_ready()
        killed.wait_ready()
        tab = ChatTab(killed.url, sign_in(killed.url))
        tab.wait_for("chat_settings")
        sent = len(tab.events)
        tab.sio.emit("client_message", {"message": {
            "id": str(uuid.uuid4()), "threadId": "", "type": "user_message", "name": "User", "output": FIRST,
            "createdAt": datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")}, "fileReferences": None})
        begun, _ = tab.wait_for("task_start", after=sent)
        started, _ = tab.wait_for("stream_start", after=begun)
        time.sleep(history.SAVE_EVERY_S + 1.5)  # past the first write and the next
        shown = []  # the answer as the page showed it after each event: tokens added, or a whole new text
        for event, data in tab.events[started:]:
            if event == "stream_start":
                shown.append(data["output"])
            elif event == "stream_token":
                shown.append(data["token"] if data["isSequence"] else shown[-1] + data["token"])
        assert "task_end" not in [event for event, _ in tab.events[begun:]], "the reply ended before the kill"
        os.kill(killed.process.pid, signal.SIGKILL)  # the web process alone (its engine sees it go, and stops)
        killed.process.wait(timeout=10)
        tab.sio.disconnect()
        thread_id = tab.thread_id
        assert sorted(socket_folders(temp)) == sorted([killed.process.pid, other.process.pid])  # left behind

        [(kind, partial, metadata)] = [s for s in stored_steps(db, thread_id) if s[0] == "assistant_message"]
        assert metadata == {"kind": history.STREAMING, "pid": killed.process.pid}
        assert partial in shown[1:], partial[:80]  # as shown then: written again after the first piece

        restarted = ChainlitServer(env, log=tmp_path / "restarted.log")
        restarted.wait_ready()
        answered = httpx.post(f"{other.url}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert answered.status_code == 200, answered.text  # the other server's engine still talks to it
        folders = socket_folders(temp)
        assert sorted(folders) == sorted([other.process.pid, restarted.process.pid])  # the killed one's went
        assert f"web process {other.process.pid}," not in restarted.log()  # (not removed and made again)

        steps = stored_steps(db, thread_id)
        assert [(kind, output) for kind, output, _ in steps if kind == "user_message"] == [("user_message", FIRST)]
        [(_, output, metadata)] = [s for s in steps if s[0] == "assistant_message"]
        assert metadata == {"kind": history.CUT} and output == history.cut_short(partial)
        resumed = ChatTab(restarted.url, sign_in(restarted.url), thread_id=thread_id)
        try:
            _, thread = resumed.wait_for("resume_thread")
            [answer] = [s for s in thread["steps"] if s["type"] == "assistant_message"]
            assert answer["output"].endswith(history.CUT_SHORT_NOTE) and not answer["streaming"]
        finally:
            resumed.close()
        deadline = time.monotonic() + 10
        while f"resumed chat {thread_id}" not in restarted.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert f"resumed chat {thread_id} with 0 messages" in restarted.log()  # the question is to be sent again
    finally:
        for server in (killed, restarted, other):
            if server is not None:
                server.stop()
        shutil.rmtree(temp, ignore_errors=True)
    assert_clean_log(restarted)


# ---- a shared machine: each signed-in person has their own history ------------------------------

def test_with_password_logins_each_person_sees_only_their_own_chats(tiny, tmp_path):
    users = tmp_path / "users"
    users.write_text(f"ada:{HASHER.hash('lovelace')}\ngrace:{HASHER.hash('hopper')}\n")
    env = server_env(checkpoint=tiny, weights_dir=tiny.parent, temperature=0, dtype="fp32", threads=1,
                     max_new_tokens=8, history_db=tmp_path / "history.db", auth="password", users=users,
                     api_key="a-key")
    env.pop("CHAINLIT_AUTH_SECRET", None)
    server = ChainlitServer(env, log=tmp_path / "chainlit.log")

    def login(name: str, password: str) -> httpx.Response:
        return httpx.post(f"{server.url}/login", data={"username": name, "password": password}, timeout=30)

    def threads(cookies) -> list[str]:
        response = httpx.post(f"{server.url}/project/threads", cookies=cookies, timeout=30,
                              json={"pagination": {"first": 20, "cursor": None}, "filter": {}})
        assert response.status_code == 200, response.text
        return [t["name"] for t in response.json()["data"]]

    try:
        server.wait_ready()
        config = httpx.get(f"{server.url}/auth/config").json()
        assert config["passwordAuth"] and not config["headerAuth"]
        assert httpx.post(f"{server.url}/auth/header").status_code == 400  # no way in without a password
        assert login("ada", "hopper").status_code == 401
        assert "sign-in as 'ada' from 127.0.0.1 failed" in server.log()  # slowed per name and address
        ada, grace = dict(login("ada", "lovelace").cookies), dict(login("grace", "hopper").cookies)
        tab = ChatTab(server.url, ada)
        try:
            tab.wait_for("chat_settings")
            tab.send("Ada's question")
        finally:
            tab.close()
        assert threads(ada) == ["Ada's question"]
        assert threads(grace) == []
        with pytest.raises(socketio.exceptions.ConnectionError):  # grace cannot open ada's chat
            ChatTab(server.url, grace, thread_id=tab.thread_id)
    finally:
        server.stop()
    assert_clean_log(server, allowed=re.compile(r"Authorization for the thread failed"))
