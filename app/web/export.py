"""A chat as files: Markdown to read, and JSON in the OpenAI messages shape to feed back to a model.

    python -m app.web.export                    list the stored chats (in LLAMA_HISTORY_DB)
    python -m app.web.export ID [--out DIR]     write chat ID (or a unique start of it) as DIR/<name>.md and .json

In the chat itself, the Export button under the last answer (or the Export command) sends the same
two files. The JSON is `[{"role": "system" | "user" | "assistant", "content": "..."}]`, the system
prompt first when the chat has one. Files sent with a message are named in the Markdown, under it; their
text is in neither.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sqlite3
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from app.backend.conversation import Conversation
from app.web.attachments import stored_files
from app.web.file_store import FileStore
from app.web.history import conversation_from_steps
from app.private_files import open_private
from app.settings import Settings, SettingsError

TITLE_CHARS = 60  # a chat's title in the file name, at most


def openai_messages(conversation: Conversation) -> list[dict]:
    """The system prompt and every message, as OpenAI's chat API takes them."""
    system = [{"role": "system", "content": conversation.system_prompt}] if conversation.system_prompt else []
    return system + [{"role": m.role, "content": m.content} for m in conversation.messages]


def markdown(conversation: Conversation, title: str, exported: datetime | None = None) -> str:
    """The chat for people: a heading per message, the system prompt and the model on top."""
    exported = exported or datetime.now(timezone.utc)
    model = conversation.model or "default"
    lines = [f"# {title}", "", f"*Model {model} · exported {exported:%Y-%m-%d %H:%M} UTC*", ""]
    if conversation.system_prompt:
        lines += ["## System prompt", "", conversation.system_prompt, ""]
    for message in conversation.messages:
        lines += [f"## {message.role.capitalize()}", "", message.content or "*(no answer)*", ""]
        if message.files:
            lines += ["*Files: " + " · ".join(file.name + (f" ({file.pages} pages)" if file.pages else "")
                                              for file in message.files) + "*", ""]
    return "\n".join(lines)


def file_stem(title: str) -> str:
    """A file name for the chat: its title's words joined by dashes ("chat" when it has none)."""
    words = re.findall(r"\w+", title.lower())
    return "-".join(words)[:TITLE_CHARS].strip("-") or "chat"


def title_of(conversation: Conversation) -> str:
    """As Chainlit names a chat: its first message."""
    first = next((m.content for m in conversation.messages if m.role == "user"), "")
    first = " ".join(first.split())
    return first if len(first) <= TITLE_CHARS else first[:TITLE_CHARS - 1] + "…"


def files(conversation: Conversation, title: str | None = None) -> dict[str, bytes]:
    """File name -> content: the chat as NAME.md and NAME.json."""
    title = title or title_of(conversation) or "Chat"
    stem = file_stem(title)
    as_json = json.dumps(openai_messages(conversation), ensure_ascii=False, indent=2) + "\n"
    return {f"{stem}.md": markdown(conversation, title).encode(), f"{stem}.json": as_json.encode()}


# ---- the history database -----------------------------------------------------------------------

@dataclass
class StoredChat:
    id: str
    name: str
    created: str
    user: str


def list_chats(db: Path) -> list[StoredChat]:
    """Every stored chat, newest first."""
    with _open(db) as con:
        rows = con.execute('SELECT id, name, "createdAt", "userIdentifier" FROM threads '
                           'ORDER BY "createdAt" DESC').fetchall()
    return [StoredChat(id, name or "", created or "", user or "") for id, name, created, user in rows]


def read_chat(db: Path, chat_id: str) -> tuple[StoredChat, Conversation]:
    """The chat whose id is (or starts with) chat_id, as its messages and system prompt were."""
    with _open(db) as con:
        rows = con.execute('SELECT id, name, "createdAt", "userIdentifier", metadata FROM threads '
                           "WHERE substr(id, 1, ?) = ?", (len(chat_id), chat_id)).fetchall()
        if len(rows) != 1:
            found = "none" if not rows else f"{len(rows)}: {', '.join(r[0] for r in rows[:5])}"
            raise LookupError(f"{db}: expected one chat whose id starts with {chat_id!r}, found {found}")
        id, name, created, user, metadata = rows[0]
        con.row_factory = sqlite3.Row
        steps = [dict(row) for row in con.execute(
            'SELECT id, type, output, metadata, "isError" FROM steps WHERE "threadId" = ? ORDER BY "createdAt", rowid',
            (id,))]
        elements = [dict(row) for row in con.execute('SELECT id, "forId" FROM elements WHERE "threadId" = ?', (id,))]
    session = _json(metadata)
    panel = session.get("chat_settings") or {}
    store = FileStore.beside(db)
    conversation = conversation_from_steps(steps, model=session.get("chat_profile"),
                                           system_prompt=(panel.get("system_prompt") or "").strip() or None,
                                           files=lambda step: stored_files(step, store, elements))
    while conversation.messages and conversation.messages[-1].role == "assistant" \
            and not conversation.messages[-1].content:  # asked, never answered
        conversation.messages.pop()
    return StoredChat(id, name or "", created or "", user or ""), conversation


def _open(db: Path) -> sqlite3.Connection:
    if not db.is_file():
        raise FileNotFoundError(f"{db}: no history database there (set LLAMA_HISTORY_DB, or pass --db)")
    return sqlite3.connect(f"file:{db}?mode=ro", uri=True)


def _json(text) -> dict:
    try:
        value = json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.web.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("chat", nargs="?", help="the chat's id, or a unique start of it; none: list the chats")
    parser.add_argument("--db", type=Path, help="the history database (default: LLAMA_HISTORY_DB, data/history.db)")
    parser.add_argument("--out", type=Path, default=Path("."), help="the folder to write to (default: here)")
    args = parser.parse_args(argv)
    try:
        db = args.db or Settings.from_env().history_db
        if args.chat is None:
            for chat in list_chats(db):
                print(f"{chat.id}  {chat.created[:16].replace('T', ' ')}  {chat.user}  {chat.name}")
            return 0
        chat, conversation = read_chat(db, args.chat)
        args.out.mkdir(parents=True, exist_ok=True)
        for name, content in files(conversation, chat.name or None).items():
            with os.fdopen(open_private(args.out / name, os.O_TRUNC), "wb") as f:  # a chat: for its owner's eyes
                f.write(content)
            print(args.out / name)
    except (SettingsError, LookupError, OSError, sqlite3.Error) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
