"""Exporting a chat (app/web/export.py): Markdown and OpenAI-shaped JSON, from a conversation or the history database."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
from datetime import datetime

from app.web import export
from app.backend.conversation import Conversation
from app.messages import Attachment
from app.web.history import REPLY, create_schema

THREAD = "3f2a9c1e-0000-4000-8000-000000000001"


def conversation() -> Conversation:
    chat = Conversation(model="tiny", system_prompt="You are terse.")
    chat.add("user", "What is 2 + 2?")
    chat.add("assistant", "4, as in\n\n```python\nprint(2 + 2)\n```")
    chat.add("user", "And $5 + $10?")
    chat.add("assistant", "$15.")
    return chat


def test_openai_messages_start_with_the_system_prompt():
    assert export.openai_messages(conversation()) == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4, as in\n\n```python\nprint(2 + 2)\n```"},
        {"role": "user", "content": "And $5 + $10?"},
        {"role": "assistant", "content": "$15."}]
    assert export.openai_messages(Conversation()) == []


def test_markdown_has_a_heading_per_message():
    text = export.markdown(conversation(), "Sums", exported=datetime(2026, 1, 2, 3, 4))
    assert text == ("# Sums\n\n*Model tiny · exported 2026-01-02 03:04 UTC*\n\n## System prompt\n\nYou are terse.\n\n"
                    "## User\n\nWhat is 2 + 2?\n\n## Assistant\n\n4, as in\n\n```python\nprint(2 + 2)\n```\n\n"
                    "## User\n\nAnd $5 + $10?\n\n## Assistant\n\n$15.\n")


def test_markdown_names_a_message_s_files():
    chat = Conversation()
    chat.add("user", "Compare them.", files=[Attachment(name="notes.md", text="a"),
                                             Attachment(name="report.pdf", text="b\fc", pages=2)])
    chat.add("assistant", "They differ.")
    text = export.markdown(chat, "Files", exported=datetime(2026, 1, 2, 3, 4))
    assert "## User\n\nCompare them.\n\n*Files: notes.md · report.pdf (2 pages)*\n\n## Assistant" in text
    assert export.openai_messages(chat)[0] == {"role": "user", "content": "Compare them."}


def test_file_names_come_from_the_first_message():
    names = list(export.files(conversation()))
    assert names == ["what-is-2-2.md", "what-is-2-2.json"]
    assert export.file_stem("¿Qué tal? / ../etc") == "qué-tal-etc" and export.file_stem("???") == "chat"
    long = Conversation()
    long.add("user", "word " * 40)
    assert len(export.title_of(long)) == export.TITLE_CHARS and export.title_of(long).endswith("…")


def stored_chat(db):
    """A chat as Chainlit's data layer stores it: a thread, its steps (the stats line and a run step too)."""
    create_schema(db)
    steps = [("u1", "user_message", "What is 2 + 2?", None, 0), ("r", "run", "", None, 0),
             ("a1", "assistant_message", "4.", json.dumps({"kind": REPLY}), 0),
             ("s1", "assistant_message", "*2 tokens*", "{}", 0),
             ("u2", "user_message", "Thanks", None, 0)]  # never answered
    with sqlite3.connect(db) as con:
        con.execute('INSERT INTO threads (id, "createdAt", name, "userIdentifier", metadata) VALUES (?, ?, ?, ?, ?)',
                    (THREAD, "2026-01-02T03:04:05Z", "What is 2 + 2?", "local",
                     json.dumps({"chat_profile": "tiny", "chat_settings": {"system_prompt": "Be brief."}})))
        for i, (id, kind, output, metadata, error) in enumerate(steps):
            con.execute('INSERT INTO steps (id, name, type, "threadId", streaming, output, metadata, "isError", '
                        '"createdAt") VALUES (?, ?, ?, ?, 0, ?, ?, ?, ?)',
                        (id, "x", kind, THREAD, output, metadata, error, f"2026-01-02T03:04:{10 + i}Z"))


def test_the_command_lists_chats_and_writes_one(tmp_path, capsys):
    db = tmp_path / "history.db"
    stored_chat(db)
    assert export.main(["--db", str(db)]) == 0
    assert capsys.readouterr().out == f"{THREAD}  2026-01-02 03:04  local  What is 2 + 2?\n"

    assert export.main([THREAD[:8], "--db", str(db), "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "what-is-2-2.json").read_text()) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4."}, {"role": "user", "content": "Thanks"}]
    text = (tmp_path / "out" / "what-is-2-2.md").read_text()
    assert text.startswith("# What is 2 + 2?\n\n*Model tiny · exported ") and "2 tokens" not in text


def test_the_written_chat_is_readable_by_its_owner_only_whatever_the_umask(tmp_path):
    db = tmp_path / "history.db"
    stored_chat(db)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "what-is-2-2.md").write_text("an older export, left readable by all")
    before = os.umask(0)
    try:
        assert export.main([THREAD, "--db", str(db), "--out", str(tmp_path / "out")]) == 0
    finally:
        os.umask(before)
    for name in ("what-is-2-2.md", "what-is-2-2.json"):
        path = tmp_path / "out" / name
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and "older export" not in path.read_text()


def test_the_command_says_what_it_did_not_find(tmp_path, capsys):
    db = tmp_path / "history.db"
    assert export.main(["--db", str(db)]) == 1
    assert "no history database there" in capsys.readouterr().err
    stored_chat(db)
    assert export.main(["nope", "--db", str(db)]) == 1
    assert "expected one chat whose id starts with 'nope', found none" in capsys.readouterr().err
    stored, chat = export.read_chat(db, "")  # the only chat: every id starts with ""
    assert stored.id == THREAD and chat.model == "tiny" and len(chat.messages) == 3
