"""Chat history: the SQLite database behind the sidebar, the sign-in that history needs, and the
conversation a resumed chat continues from.

Chainlit keeps threads (chats) and steps (messages) through a data layer; ours is its
SQLAlchemyDataLayer over SQLite, with the tables created here on first start, with the columns
Chainlit 2.12 really writes (its documented schema lacks some). Chainlit only lists and resumes
the chats of a signed-in user, so history also means sign-in: by default one local user with no
login form (header authentication that accepts every request), or a password login for a shared
machine (app.web.users checks the passwords). Chainlit's JSON web tokens need a secret: CHAINLIT_AUTH_SECRET, else one generated once
and kept in `.auth_secret` beside the database. The files of the chats (attached, and the sources shown
under replies) are kept beside it too, by app.web.file_store. The database's folder and files, the secret
and the chats' files included, are readable by the app's account only (app.private_files).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import sqlite3
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from chainlit.data import get_data_layer
from chainlit.data.sql_alchemy import SQLAlchemyDataLayer
from chainlit.message import Message
from chainlit.utils import utc_now

from app.backend.conversation import Conversation
from app.messages import Attachment
from app.web.attachments import metadata_of
from app.web.display import plain
from app.private_files import FILE_MODE, open_private, private_file, private_folder
from app.processes import alive
from app.web.file_store import FileStore
from app.settings import Settings, SettingsError

log = logging.getLogger(__name__)

SECRET_FILE = ".auth_secret"
SQLITE_COMPANIONS = ("-wal", "-shm", "-journal")  # files SQLite keeps beside a database
REPLY = "reply"  # metadata["kind"] of a step that holds one of the model's replies
CUT = "cut"  # ... of a reply cut off by a failure (the question is to be sent again): not remembered
STREAMING = "streaming"  # ... of a reply being written, with the writing web process's "pid": if that stops, cut
SAVE_EVERY_S = 2.0  # how often a streaming reply's text so far is written
CUT_SHORT_NOTE = "*(cut short: the server stopped; send the message again to have it answered)*"

# Every column Chainlit 2.12's SQLAlchemyDataLayer reads or writes (StepDict, Message.to_dict,
# ElementDict, Feedback), in SQLite's types. JSON and list values are stored as text.
TABLES: dict[str, dict[str, str]] = {
    "users": {"id": "TEXT PRIMARY KEY", "identifier": "TEXT NOT NULL UNIQUE", "metadata": "TEXT NOT NULL",
              "createdAt": "TEXT"},
    "threads": {"id": "TEXT PRIMARY KEY", "createdAt": "TEXT", "name": "TEXT",
                "userId": "TEXT REFERENCES users(id) ON DELETE CASCADE", "userIdentifier": "TEXT",
                "tags": "TEXT", "metadata": "TEXT"},
    "steps": {"id": "TEXT PRIMARY KEY", "name": "TEXT NOT NULL", "type": "TEXT NOT NULL",
              "threadId": "TEXT NOT NULL REFERENCES threads(id) ON DELETE CASCADE", "parentId": "TEXT",
              "streaming": "BOOLEAN NOT NULL", "waitForAnswer": "BOOLEAN", "isError": "BOOLEAN",
              "metadata": "TEXT", "tags": "TEXT", "input": "TEXT", "output": "TEXT", "createdAt": "TEXT",
              "command": "TEXT", "modes": "TEXT", "start": "TEXT", "end": "TEXT", "generation": "TEXT",
              "showInput": "TEXT", "language": "TEXT", "indent": "INTEGER", "defaultOpen": "BOOLEAN",
              "autoCollapse": "BOOLEAN", "icon": "TEXT"},
    "elements": {"id": "TEXT PRIMARY KEY", "threadId": "TEXT REFERENCES threads(id) ON DELETE CASCADE",
                 "type": "TEXT", "url": "TEXT", "chainlitKey": "TEXT", "name": "TEXT NOT NULL", "display": "TEXT",
                 "objectKey": "TEXT", "size": "TEXT", "page": "INTEGER", "language": "TEXT", "forId": "TEXT",
                 "mime": "TEXT", "props": "TEXT", "autoPlay": "BOOLEAN", "playerConfig": "TEXT"},
    "feedbacks": {"id": "TEXT PRIMARY KEY", "forId": "TEXT NOT NULL",
                  "threadId": "TEXT NOT NULL REFERENCES threads(id) ON DELETE CASCADE", "value": "INTEGER NOT NULL",
                  "comment": "TEXT"},
}


def create_schema(path: Path) -> None:
    """Create the database and its tables if missing; add columns that a database from an older
    Chainlit lacks (a column added later is NULL in old rows, which Chainlit reads as unset). The folder
    and the files are made private first: SQLite gives the files it adds the database's mode."""
    private_file(private_folder(path.parent) / path.name)
    for companion in SQLITE_COMPANIONS:
        with contextlib.suppress(FileNotFoundError):
            os.chmod(path.with_name(path.name + companion), FILE_MODE)
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA journal_mode=WAL")  # readers never wait for a writer (kept in the file)
        for table, columns in TABLES.items():
            body = ", ".join(f'"{name}" {kind}' for name, kind in columns.items())
            db.execute(f"CREATE TABLE IF NOT EXISTS {table} ({body})")
            present = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
            for name, kind in columns.items():
                if name not in present:
                    kind = kind.split()[0]  # SQLite adds columns without constraints
                    db.execute(f'ALTER TABLE {table} ADD COLUMN "{name}" {kind}')
        db.execute('CREATE INDEX IF NOT EXISTS steps_thread ON steps ("threadId", "createdAt")')
        db.execute('CREATE INDEX IF NOT EXISTS threads_user ON threads ("userId")')


class SQLiteDataLayer(SQLAlchemyDataLayer):
    """Chainlit's SQLAlchemy data layer on a SQLite file, elements' bytes in a FileStore.

    SQLite cannot bind lists or dicts (a step's tags or modes, a thread's tags): they are stored as
    JSON text. Failed statements, which Chainlit only logs, are logged as errors naming the statement.
    """

    def __init__(self, path: Path, store: FileStore | None = None):
        super().__init__(conninfo=f"sqlite+aiosqlite:///{path}", storage_provider=store)
        self.path = path

    async def delete_step(self, step_id: str):
        """Chainlit deletes a step's elements from the database only: their files go too (a regenerated
        answer's sources, the messages after an edited one)."""
        if self.storage_provider is not None:
            elements = await self.execute_sql('SELECT "objectKey" FROM elements WHERE "forId" = :id', {"id": step_id})
            for element in elements if isinstance(elements, list) else []:
                if element["objectKey"]:
                    await self.storage_provider.delete_file(object_key=element["objectKey"])
        await super().delete_step(step_id)

    async def execute_sql(self, query: str, parameters: dict):
        parameters = {k: json.dumps(v) if isinstance(v, list | dict) else v for k, v in parameters.items()}
        result = await super().execute_sql(query, parameters)
        if result is None:  # Chainlit logged the exception as a warning
            log.error("history database %s: a statement failed: %s", self.path, " ".join(query.split())[:200])
        return result


def prepare(settings: Settings) -> None:
    """Create the history database (at start, so that a path that cannot be used stops the app), and mark the
    replies that a killed server left half written as cut short."""
    try:
        create_schema(settings.history_db)
        if cut := mark_cut_short(settings.history_db):
            log.info("history: %d repl%s left streaming by a server that stopped, marked as cut short",
                     cut, "y" if cut == 1 else "ies")
    except (OSError, sqlite3.Error) as e:
        raise SettingsError(f"LLAMA_HISTORY_DB={settings.history_db}: cannot create the database there, readable by "
                            f"this account only: {e}") from None


def data_layer(settings: Settings, store: FileStore | None = None) -> SQLiteDataLayer:
    """The history database's data layer; its elements' bytes go to store (by default, the one beside it)."""
    create_schema(settings.history_db)  # again: the file may have been deleted since the start
    store = store or FileStore.beside(settings.history_db)
    layer = SQLiteDataLayer(settings.history_db, store)
    log.info("chat history in %s, its files in %s", settings.history_db, store.folder)
    return layer


# ---- a reply written as it streams --------------------------------------------------------------

class StreamedReply:
    """A reply written to the history while it streams: Chainlit writes a message once, at send(), when it is
    whole, so a web process killed midway left an empty answer. The text so far is written at its first piece
    and then at most every SAVE_EVERY_S (one write at a time), marked STREAMING with this process's pid; the
    message's send() writes it whole over that, with its own kind. A process that stopped leaves it STREAMING:
    the next start marks it cut short (mark_cut_short)."""

    def __init__(self, message: Message, every: float = SAVE_EVERY_S):
        self.message, self.every = message, every
        self.layer = get_data_layer()  # None with history off
        self.saved_at = -every
        self.writing: asyncio.Task | None = None

    def grew(self) -> None:
        """The message's text grew: write it, unless a write is under way or the last began under `every` ago."""
        if self.layer is None or (self.writing and not self.writing.done()) \
                or time.monotonic() - self.saved_at < self.every:
            return
        self.saved_at = time.monotonic()
        self.message.created_at = self.message.created_at or utc_now()  # its place in the chat: where it began
        step = self.message.to_dict() | {"streaming": True, "metadata": {"kind": STREAMING, "pid": os.getpid()}}
        self.writing = asyncio.create_task(self._write(step))

    async def _write(self, step: dict) -> None:
        try:
            await self.layer.create_step(step)
        except Exception:  # the reply goes on; its send() writes it again
            log.exception("history: the text so far of reply %s could not be written", step["id"])

    async def settled(self) -> None:
        """Once the write under way (if any) is done: call before the message's send(), which must come last."""
        if self.writing is not None:
            await asyncio.shield(self.writing)


def mark_cut_short(path: Path) -> int:
    """Mark the replies left STREAMING by web processes that no longer run as cut short: a last line says so,
    and their kind becomes CUT (not remembered: their question is to be sent again). Those of a running server
    that shares the database stay as they are. Returns how many were marked."""
    marked = 0
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        rows = db.execute('SELECT id, output, metadata FROM steps WHERE metadata LIKE ?', (f"%{STREAMING}%",))
        for id, output, metadata in rows.fetchall():
            metadata = metadata_of(metadata)
            pid = metadata.get("pid")
            if metadata.get("kind") != STREAMING or (type(pid) is int and alive(pid)):
                continue
            db.execute('UPDATE steps SET output = ?, metadata = ?, streaming = 0 WHERE id = ?',
                       (cut_short(output or ""), json.dumps({"kind": CUT}), id))
            marked += 1
    return marked


def cut_short(text: str) -> str:
    """A reply's text with the line that says it was cut short (after closing a code block left open)."""
    if text.count("```") % 2:
        text += "\n```"
    return f"{text}\n\n{CUT_SHORT_NOTE}" if text.strip() else CUT_SHORT_NOTE


# ---- sign-in ------------------------------------------------------------------------------------

def auth_secret(folder: Path) -> str:
    """CHAINLIT_AUTH_SECRET, else the secret in folder/.auth_secret, created (mode 0600) the first time."""
    if os.environ.get("CHAINLIT_AUTH_SECRET"):
        return os.environ["CHAINLIT_AUTH_SECRET"]
    path = private_folder(folder) / SECRET_FILE
    try:
        fd = open_private(path, os.O_EXCL)
    except FileExistsError:
        os.chmod(path, FILE_MODE)
        secret = path.read_text().strip()
        if not secret:
            raise SettingsError(f"{path} is empty: delete it to have a new secret made, or set CHAINLIT_AUTH_SECRET")
        return secret
    secret = secrets.token_urlsafe(48)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return secret


# ---- resuming a chat ----------------------------------------------------------------------------

def conversation_from_steps(steps: Iterable[dict], *, model: str | None, system_prompt: str | None,
                            files: Callable[[dict], list[Attachment] | None] = lambda step: None) -> Conversation:
    """The Conversation a chat had, rebuilt from its stored steps (in order); files(step): a user
    message's files (app.web.attachments.stored_files).

    Only the user's messages and the model's replies (steps marked as replies) count; notes, errors,
    statistics lines and replies cut off (by a failure, or by the server stopping: CUT, STREAMING) do not. As
    in a live chat, a message that failed (a cut reply or an error followed it, and no whole reply) is left
    out: it is to be sent again; a reply stopped before its first token is an empty reply. A reply is
    taken as the model wrote it, without the escapes the page needed (app.web.display).
    """
    conversation = Conversation(model=model, system_prompt=system_prompt)
    asked = None  # the user's message that waits for its reply
    for step in steps:
        if step.get("type") == "user_message":
            if asked is not None:
                conversation.add("assistant", "")
            asked = None
            sent = files(step)
            if (step.get("output") or "").strip() or sent:
                asked = conversation.add("user", step.get("output") or "", id=step.get("id"), files=sent)
        elif step.get("type") == "assistant_message":
            if is_reply(step) and asked is not None:
                conversation.add("assistant", plain(step.get("output") or ""), id=step.get("id"))
                asked = None
            elif (step.get("isError") or kind_of(step) in (CUT, STREAMING)) and asked is not None:
                conversation.messages.remove(asked)
                asked = None
    if asked is not None:  # the last message was never answered: it waits for the next one
        conversation.add("assistant", "")
    return conversation


def kind_of(step: dict) -> str | None:
    return metadata_of(step.get("metadata")).get("kind")


def is_reply(step: dict) -> bool:
    return kind_of(step) == REPLY
