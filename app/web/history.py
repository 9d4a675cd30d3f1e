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

from chainlit import server as chainlit_server
from chainlit.auth import get_current_user
from chainlit.context import ChainlitContextException
from chainlit.data import get_data_layer
from chainlit.data.sql_alchemy import SQLAlchemyDataLayer
from chainlit.message import Message
from chainlit.types import DeleteFeedbackRequest, ElementRequest, PageInfo, PaginatedResponse, UpdateFeedbackRequest
from chainlit.user_session import user_session
from chainlit.utils import utc_now
from fastapi import Depends, HTTPException, Request
from fastapi.routing import APIRoute

from app.backend.conversation import Conversation
from app.messages import Attachment
from app.web.attachments import metadata_of, shown_as_chips
from app.web.display import plain
from app.private_files import FILE_MODE, open_private, private_file, private_folder
from app.processes import alive
from app.web.file_store import FileStore
from app.web.ownership import NOBODY, Owners, actor, refused
from app.web.uploads import file_bytes, folder_bytes, is_upload
from app.settings import Settings, SettingsError

log = logging.getLogger(__name__)

SECRET_FILE = ".auth_secret"
SQLITE_COMPANIONS = ("-wal", "-shm", "-journal")  # files SQLite keeps beside a database
REPLY = "reply"  # metadata["kind"] of a step that holds one of the model's replies
CUT = "cut"  # ... of a reply cut off by a failure (the question is to be sent again): not remembered
STREAMING = "streaming"  # ... of a reply being written, with the writing web process's "pid": if that stops, cut
SAVE_EVERY_S = 2.0  # how often a streaming reply's text so far is written
CHAT_NAME_CHARS = 200  # a chat's name at most (the sidebar shows a line of it; a first message may be megabytes)
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
    # Chats deleted: never written again (a tab still open on one would otherwise make it anew, owned by nobody)
    "deleted_threads": {"id": "TEXT PRIMARY KEY", "deletedAt": "TEXT"},
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
        db.execute("""UPDATE elements SET "props" = '{}' WHERE "props" IS NULL""")  # see create_element
        db.execute('CREATE INDEX IF NOT EXISTS steps_thread ON steps ("threadId", "createdAt")')
        db.execute('CREATE INDEX IF NOT EXISTS threads_user ON threads ("userId")')


def session_value(key: str):
    """A value of the socket session's user_session (app.web.chat sets "answering": the id of the message whose
    reply runs, and "refused_ids": those refused meanwhile, never to be stored); None outside a socket session."""
    try:
        return user_session.get(key)
    except ChainlitContextException:
        return None


class SQLiteDataLayer(SQLAlchemyDataLayer):
    """Chainlit's SQLAlchemy data layer on a SQLite file, elements' bytes in a FileStore, and every row
    found by its id and its owner (app.web.ownership): a chat, message, file or feedback of another user
    is not there, whatever id a client sends, and no client id moves another chat's row.

    SQLite cannot bind lists or dicts (a step's tags or modes, a thread's tags): they are stored as
    JSON text. Failed statements, which Chainlit only logs, are logged as errors naming the statement.
    """

    def __init__(self, path: Path, store: FileStore | None = None):
        super().__init__(conninfo=f"sqlite+aiosqlite:///{path}", storage_provider=store)
        self.path = path
        self.owners = Owners(self.execute_sql)

    async def execute_sql(self, query: str, parameters: dict):
        parameters = {k: json.dumps(v) if isinstance(v, list | dict) else v for k, v in parameters.items()}
        result = await super().execute_sql(query, parameters)
        if result is None:  # Chainlit logged the exception as a warning
            log.error("history database %s: a statement failed: %s", self.path, " ".join(query.split())[:200])
        return result

    # ---- chats ----

    async def get_thread_author(self, thread_id: str) -> str:
        """The chat's owner when it is the user's; "" otherwise, which Chainlit's routes answer with 404
        (an unknown id included: Chainlit's own raises, a 500)."""
        if await self.owners.readable(thread_id):
            return actor()
        log.info("chat %s: not found for user %r", str(thread_id)[:40], actor())
        return ""

    async def get_thread(self, thread_id: str):
        """The chat, to its owner. To anyone else, a chat owned by nobody they are (so Chainlit refuses a
        socket that asks to resume it) when it exists, and None when it does not."""
        if await self.owners.readable(thread_id):  # its messages' files shown as chips, as in the live chat
            thread = await super().get_thread(thread_id)
            return shown_as_chips(thread) if thread else thread
        if await self.owners.thread_owner(thread_id) is not None:
            return {"id": thread_id, "userIdentifier": NOBODY, "name": None, "createdAt": None, "metadata": {},
                    "tags": [], "steps": [], "elements": []}
        return None

    async def update_thread(self, thread_id: str, name=None, user_id=None, metadata=None, tags=None):
        if not await self.owners.writable(thread_id):
            return refused("chat", "that is not the user's", thread_id)
        if user_id is not None and await self._get_user_identifer_by_id(user_id) != actor():
            return refused("chat", "for another user", thread_id)
        if isinstance(name, str) and len(name) > CHAT_NAME_CHARS:  # (named after its first message, whole)
            name = name[:CHAT_NAME_CHARS - 1].rstrip() + "…"
        await super().update_thread(thread_id, name=name, user_id=user_id, metadata=metadata, tags=tags)

    async def delete_thread(self, thread_id: str):
        if await self.owners.readable(thread_id):
            await self.execute_sql('INSERT OR IGNORE INTO deleted_threads ("id", "deletedAt") VALUES (:id, :at)',
                                   {"id": thread_id, "at": utc_now()})
            await super().delete_thread(thread_id)

    async def get_all_user_threads(self, user_id=None, thread_id=None):
        """(Chainlit's list and its thread lookup.) The list leaves out a chat used only for the Models or Export
        commands, no chat to go back to: no message of the user's stored, and named after a command (Chainlit names
        a chat after its first message: "" for a command chosen in the Tools menu). A new chat whose first message is
        still being written is listed by its name."""
        threads = await super().get_all_user_threads(user_id=user_id, thread_id=thread_id)
        if thread_id is not None or not threads:
            return threads
        return [t for t in threads if any(step.get("type") == "user_message" for step in t.get("steps") or [])
                or ((t.get("name") or "").strip() and command_of(None, t.get("name") or "") is None)]

    async def list_threads(self, pagination, filters):
        """The user's own chats, whatever user the filter names."""
        user = await self.get_user(actor()) if actor() != NOBODY else None
        if user is None or filters.userId != user.id:
            return PaginatedResponse(pageInfo=PageInfo(hasNextPage=False, startCursor=None, endCursor=None), data=[])
        return await super().list_threads(pagination, filters)

    # ---- messages ----

    async def create_step(self, step_dict):
        """(update_step comes here too.) A message goes only into the user's chat, and never over a
        message of another chat that has its id."""
        thread_id, step_id = step_dict.get("threadId"), step_dict.get("id")
        if step_dict.get("type") == "user_message" and command_of(step_dict.get("command"),
                                                                  step_dict.get("output") or "") is not None:
            return  # a command (Models, Export) is no message of the chat: reopened, it would be an empty bubble
        refused_ids = session_value("refused_ids") or set()
        if step_dict.get("type") == "user_message" and (session_value("answering") not in (None, step_id)
                                                        or step_id in refused_ids):
            log.info("not stored: a message sent while the chat's reply to another runs (chat %s)", str(thread_id)[:40])
            return
        if await self.owners.may_write_row("message", await self.owners.step_thread(step_id), thread_id):
            await super().create_step(step_dict)
            if step_id in (session_value("refused_ids") or set()):  # refused while it was being written (Chainlit
                # writes it on a task of its own)
                await super().delete_step(step_id)

    async def get_step(self, step_id: str):
        if await self.owners.readable(await self.owners.step_thread(step_id)):
            return await super().get_step(step_id)
        return None

    async def delete_step(self, step_id: str):
        """The user's own message only; its elements' files go too (Chainlit deletes their rows only: a
        regenerated answer's sources, the messages after an edited one)."""
        thread_id = await self.owners.step_thread(step_id)
        if thread_id is None:
            return
        if not await self.owners.writable(thread_id):
            return refused("deletion of a message", "of a chat that is not the user's", thread_id)
        if self.storage_provider is not None:
            elements = await self.execute_sql('SELECT "objectKey" FROM elements WHERE "forId" = :id '
                                              'AND "threadId" = :thread', {"id": step_id, "thread": thread_id})
            for element in elements if isinstance(elements, list) else []:
                if element["objectKey"]:
                    await self.storage_provider.delete_file(object_key=element["objectKey"])
        await super().delete_step(step_id)

    # ---- files ----

    async def create_element(self, element):
        """Chainlit stores a message's uploads as the message arrives, before on_message has read them: here
        they wait for `keep_uploads`, so that a file the message is refused for is never stored."""
        if not is_upload(element):
            await self._create_element(element)

    async def keep_uploads(self, message) -> None:
        """Store the uploads of a message whose files were taken (each element's row, its bytes in the store)."""
        for element in message.elements:
            if is_upload(element):
                element.for_id = element.for_id or message.id  # (Chainlit sets it as it sends the element)
                await self._create_element(element)

    async def _create_element(self, element):
        """A file goes only into the user's chat, for a message of that chat, never over another chat's file."""
        thread_id = element.thread_id
        if not await self.owners.may_write_row("file", await self.owners.element_thread(element.id), thread_id):
            return
        if element.for_id and await self.owners.step_thread(element.for_id) not in (None, thread_id):
            return refused("file", "for a message of another chat", thread_id)
        if getattr(element, "props", None) is None:  # Chainlit's get_element cannot read a file's NULL props
            element.props = {}
        await super().create_element(element)

    async def get_element(self, thread_id: str, element_id: str):
        if await self.owners.readable(thread_id):
            return await super().get_element(thread_id, element_id)
        return None

    async def delete_element(self, element_id: str, thread_id: str | None = None):
        owner_thread = await self.owners.element_thread(element_id)
        if owner_thread is None:
            return
        if thread_id not in (None, owner_thread) or not await self.owners.writable(owner_thread):
            return refused("deletion of a file", "of a chat that is not the user's", owner_thread)
        await super().delete_element(element_id, owner_thread)

    async def may_write_element(self, element: dict) -> bool:
        """Whether a client's element (a custom element the page updates or removes) names no file or chat
        of another user: its id is new or in the user's chat, and so is the chat it names."""
        if not isinstance(element, dict) or not isinstance(element.get("id"), str):
            return False
        named = element.get("threadId") or None
        thread_id = await self.owners.element_thread(element["id"])
        if thread_id is not None:
            return named in (None, thread_id) and await self.owners.writable(thread_id)
        return await self.owners.thread_owner(named) in (None, actor())

    # ---- feedback ----

    async def upsert_feedback(self, feedback) -> str:
        """A feedback on a message of the user's chat only; NotFound otherwise."""
        if not await self.may_feedback(feedback):
            refused("feedback", "on a message that is not the user's", feedback.threadId)
            raise NotFound("no such message")
        feedback.threadId = await self.owners.step_thread(feedback.forId)
        return await super().upsert_feedback(feedback)

    async def delete_feedback(self, feedback_id: str) -> bool:
        if not await self.may_delete_feedback(feedback_id):
            raise NotFound("no such feedback")
        return await super().delete_feedback(feedback_id)

    async def may_delete_feedback(self, feedback_id: str) -> bool:
        thread_id = await self.owners.feedback_thread(feedback_id)
        return thread_id is not None and await self.owners.writable(thread_id)

    async def may_feedback(self, feedback) -> bool:
        """Whether a feedback is on a message of the user's chat (and, if it names one, over a feedback of
        that chat): asked by upsert_feedback, and by the route before Chainlit's, to answer 404."""
        thread_id = await self.owners.step_thread(feedback.forId)
        return (thread_id is not None and feedback.threadId in (None, thread_id)
                and await self.owners.writable(thread_id)
                and await self.owners.feedback_thread(feedback.id) in (None, thread_id))


class NotFound(LookupError):
    """A row the user asked for that is not theirs (or not there): a 404."""


def owned_routes(data_layer=get_data_layer) -> list[APIRoute]:
    """Chainlit's routes that take the id of a message, file or feedback and answer 200 (or 500) whatever
    the data layer did with it, put behind a route of ours that asks the data layer first and answers 404
    for a row that is not the user's; the rest is Chainlit's route. (The routes that take a chat's id ask
    get_thread_author, which answers for them.)"""

    async def may(check) -> None:
        layer = data_layer()
        if layer is None or not await check(layer):
            raise HTTPException(status_code=404, detail="Not found")

    async def put_feedback(request: Request, update: UpdateFeedbackRequest, user=Depends(get_current_user)):
        await may(lambda layer: layer.may_feedback(update.feedback))
        return await chainlit_server.update_feedback(request, update, user)

    async def delete_feedback(request: Request, payload: DeleteFeedbackRequest, user=Depends(get_current_user)):
        await may(lambda layer: layer.may_delete_feedback(payload.feedbackId))
        return await chainlit_server.delete_feedback(request, payload, user)

    async def get_element(request: Request, thread_id: str, element_id: str, user=Depends(get_current_user)):
        await may(lambda layer: layer.get_element(thread_id, element_id))
        return await chainlit_server.get_thread_element(request, thread_id, element_id, user)

    async def put_element(payload: ElementRequest, user=Depends(get_current_user)):
        await may(lambda layer: layer.may_write_element(payload.element))
        return await chainlit_server.update_thread_element(payload, user)

    async def delete_element(payload: ElementRequest, user=Depends(get_current_user)):
        await may(lambda layer: layer.may_write_element(payload.element))
        return await chainlit_server.delete_thread_element(payload, user)

    return [APIRoute("/feedback", put_feedback, methods=["PUT"]),
            APIRoute("/feedback", delete_feedback, methods=["DELETE"]),
            APIRoute("/project/thread/{thread_id}/element/{element_id}", get_element, methods=["GET"]),
            APIRoute("/project/element", put_element, methods=["PUT"]),
            APIRoute("/project/element", delete_element, methods=["DELETE"])]


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


def stored_bytes(db: Path) -> dict[str, int]:
    """Bytes on disk of the history: the database (with SQLite's files beside it), and its files."""
    return {"history": sum(file_bytes(db.with_name(db.name + suffix)) for suffix in ("", *SQLITE_COMPANIONS)),
            "history_files": folder_bytes(FileStore.beside(db).folder)}


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

TYPED_COMMANDS = {"/export": "Export", "/models": "Models"}  # the chat's commands, typed as a message


def command_of(command: str | None, text: str) -> str | None:
    """The app's command a user message is (chosen in the Tools menu, or typed: TYPED_COMMANDS), or None: it is a
    message to the model. A command is no turn of the conversation."""
    return command or TYPED_COMMANDS.get(text.strip().lower())


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
        if step.get("type") == "user_message" and command_of(step.get("command"), step.get("output") or ""):
            continue
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
