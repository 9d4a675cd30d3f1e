"""Uploads that wait for their message: bounded per session, deleted within minutes when no message takes
them; and what the app keeps on disk, measured for /metrics.

Chainlit writes each upload (POST /project/file: the page sends a file as soon as it is attached) into the
session's folder, .files/<session id>/<file id><extension>, and deletes that folder only when the session
ends, an hour after its tab closed: ten uploads of 20 MB, never sent, took 200 MB in 2.2 s, for that hour.
Here a middleware on that route (`Tracked`) makes an upload pending from its answer until a message takes it
(`take`, as on_message begins, before its files are read). A session holds at most MAX_PENDING_FILES
pending, MAX_PENDING_BYTES together, and a user USER_PENDING_BYTES over all their sessions (tabs: LLAMA_MAX_PENDING_MB):
past any the route answers 429 and keeps nothing. Every
SWEEP_SECONDS, `sweep` deletes the uploads pending for longer than KEEP_SECONDS, and the folders of
sessions that are gone (left by a stopped server); a chat replaced by a new one loses its pending uploads
at once (`end_session`), a refused message its files (`discard`). A file a message took stays with its
session, as Chainlit keeps it (an edited message reads it again).

The same loop measures the history database, its files and the uploads (`STORED`, bytes by part), so a
scrape of /metrics reads a number, never walks a folder.

Each server has a folder of its own, .files/<host>-<process id> (`claim_folder`): Chainlit deletes the whole
of .files when its server stops, and this sweep deleted the folders of sessions it did not know, so a second
server started from the same project folder (on another port, or a test's) lost its sessions' files: their
uploads, and the models panel, which Chainlit writes there too. A server's folder goes when it stops; those of servers
no longer running, and an older layout's session folders, are deleted when the next one starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs

import chainlit.config
import chainlit.server
from chainlit.session import WebsocketSession, ws_sessions_id
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.bounds import MAX_PENDING_BYTES, MAX_PENDING_FILES
from app.private_files import private_folder

log = logging.getLogger(__name__)

ROUTE = "/project/file"  # Chainlit's upload route
# This server's uploads, a folder per session. Named by host and process: a project folder shared by containers
# (each with its own process ids) is cleaned only of its own host's servers that stopped.
HOST = socket.gethostname()


def server_folder(pid: int, files: Path = chainlit.config.FILES_DIRECTORY) -> Path:
    """The folder of this host's server of process id `pid` in Chainlit's files folder."""
    return files / f"{HOST}-{pid}"


FOLDER = server_folder(os.getpid())
SESSION_FOLDER = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")  # (an older layout's)
KEEP_SECONDS = 300.0  # an upload no message took is deleted this long after it came (within a sweep more)
SWEEP_SECONDS = 30.0


@dataclass
class Upload:
    session_id: str
    path: Path
    size: int
    at: float  # time.monotonic() when it came
    user: str = ""  # the session's signed-in user ("": without sign-in, everyone is one user)


PENDING: dict[str, Upload] = {}  # uploads no message took yet, by Chainlit's file id (the element's id)
USER_PENDING_BYTES = MAX_PENDING_BYTES  # one user's pending uploads over all their sessions (LLAMA_MAX_PENDING_MB)
STORED: dict[str, int] = {}  # bytes on disk by part: history (the database), history_files, uploads


class Tracked:
    """ASGI middleware on Chainlit's upload route: an upload that a session has no room for is answered 429 (before
    its body is read, or once it is in and its bytes are too many: then it is deleted); one taken is pending.
    (The route's answer, a small JSON object naming the file, is held until then.)"""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, root = scope.get("path", ""), scope.get("root_path", "")
        path = path[len(root):] if root and path.startswith(root) else path  # (served under a prefix)
        if scope["type"] != "http" or scope["method"] != "POST" or path.rstrip("/") != ROUTE:
            await self.app(scope, receive, send)
            return
        session_id = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("session_id", [""])[0]
        if problem := crowded(session_id, coming=1):
            await JSONResponse({"detail": problem}, status_code=429)(scope, receive, send)
            return
        answer: list[Message] = []

        async def held(message: Message) -> None:
            answer.append(message)

        try:
            await self.app(scope, receive, held)
        except ValueError as e:  # Chainlit's session takes a file's empty content for none given
            if answer or "content must be provided" not in str(e):
                raise
            await JSONResponse({"detail": "The file is empty: it has nothing to read."}, status_code=400)(
                scope, receive, send)
            return
        if answer and answer[0].get("status") == 200 and (problem := self.pending(session_id, answer)):
            await JSONResponse({"detail": problem}, status_code=429)(scope, receive, send)
            return
        for message in answer:
            await send(message)

    @staticmethod
    def pending(session_id: str, answer: list[Message]) -> str | None:
        """Count the upload the route answered for as pending; why it cannot stay (it is deleted), or None."""
        session = WebsocketSession.get_by_id(session_id)
        try:
            file = session.files[json.loads(b"".join(m.get("body", b"") for m in answer[1:]))["id"]]
        except (AttributeError, KeyError, TypeError, ValueError):  # not an answer naming a file of the session
            return None
        PENDING[file["id"]] = Upload(session_id, Path(file["path"]), file["size"], time.monotonic(), user_of(session_id))
        if problem := crowded(session_id):  # this one took the session past its bytes
            delete(file["id"], session)
            return problem
        return None


def claim_folder() -> Path:
    """Make FOLDER the one where Chainlit keeps this server's session files (and deletes when it stops), and
    delete what servers no longer running left beside it."""
    private_folder(FOLDER.parent)
    private_folder(FOLDER)
    chainlit.config.FILES_DIRECTORY = FOLDER  # (read by each session for its folder)
    chainlit.server.FILES_DIRECTORY = FOLDER  # (deleted when the server stops)
    for folder in FOLDER.parent.iterdir():
        host, _, pid = folder.name.rpartition("-")
        with contextlib.suppress(OSError):  # (gone meanwhile: another server starting cleaned it)
            left = (host == HOST and pid.isdigit() and len(pid) <= 7 and not running(int(pid))) or (
                SESSION_FOLDER.fullmatch(folder.name) and time.time() - folder.stat().st_mtime > KEEP_SECONDS)
            if left and folder.is_dir() and folder != FOLDER:
                shutil.rmtree(folder, ignore_errors=True)
    return FOLDER


def running(pid: int) -> bool:
    """Whether a process of that id is there (another account's too)."""
    try:
        os.kill(pid, 0)  # no signal: only whether it is there
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def user_of(session_id: str) -> str:
    """The signed-in user of a session; "" without sign-in (or for a session not known)."""
    session = WebsocketSession.get_by_id(session_id)
    user = getattr(session, "user", None)
    return str(getattr(user, "identifier", "") or "")


def crowded(session_id: str, coming: int = 0) -> str | None:
    """Why a session cannot keep one more upload (coming=1: before it is read; 0: once it is in), or None: a
    session keeps MAX_PENDING_FILES and MAX_PENDING_BYTES, and its user USER_PENDING_BYTES over all their sessions
    (tabs), so that more tabs hold no more."""
    waiting = [upload for upload in PENDING.values() if upload.session_id == session_id]
    size = sum(upload.size for upload in waiting)
    later = f"(files not sent are deleted after {KEEP_SECONDS / 60:.0f} minutes)"
    if len(waiting) + coming > MAX_PENDING_FILES or size > MAX_PENDING_BYTES:
        return (f"This chat has {len(waiting)} files ({size / 2**20:.1f} MB) uploaded and not sent yet; it keeps at "
                f"most {MAX_PENDING_FILES} files, {MAX_PENDING_BYTES // 2**20} MB together. Send them with a message "
                f"or remove some first {later}.")
    user = user_of(session_id)
    theirs = [upload for upload in PENDING.values() if upload.user == user]
    held = sum(upload.size for upload in theirs)
    if held > USER_PENDING_BYTES:
        return (f"You have {len(theirs)} files ({held / 2**20:.1f} MB) uploaded and not sent yet in your open chats; "
                f"at most {USER_PENDING_BYTES / 2**20:.0f} MB wait together (LLAMA_MAX_PENDING_MB). Send them with a "
                f"message or remove some first {later}.")
    return None


def is_upload(element) -> bool:
    """Whether an element is a file uploaded in the chat (Chainlit's session folder holds its bytes)."""
    return bool(element.path) and Path(element.path).resolve().is_relative_to(FOLDER.resolve())


def take(elements: list) -> None:
    """A message takes its uploads: never swept from now on."""
    for element in elements:
        PENDING.pop(element.id, None)


def discard(elements: list, session) -> None:
    """Delete a refused message's uploads (the page sends a file again when it is attached again)."""
    for element in elements:
        PENDING.pop(element.id, None)
        if is_upload(element):
            with contextlib.suppress(OSError):
                os.unlink(element.path)
            session.files.pop(element.id, None)


def delete(file_id: str, session: WebsocketSession | None) -> None:
    upload = PENDING.pop(file_id)
    with contextlib.suppress(OSError):
        os.unlink(upload.path)
    if session is not None:
        session.files.pop(file_id, None)


def end_session(session_id: str) -> None:
    """A session that ends for good: its pending uploads go now."""
    session = ws_sessions_id.get(session_id)
    for file_id in [k for k, upload in PENDING.items() if upload.session_id == session_id]:
        delete(file_id, session)


def sweep(now: float | None = None) -> int:
    """Delete the uploads pending for longer than KEEP_SECONDS, and the folders of sessions that are gone and
    were last written to longer ago; returns how many uploads went. (No await: a message cannot take a file
    midway.)"""
    now = time.monotonic() if now is None else now
    stale = [file_id for file_id, upload in PENDING.items() if now - upload.at > KEEP_SECONDS]
    for file_id in stale:
        delete(file_id, ws_sessions_id.get(PENDING[file_id].session_id))
    with contextlib.suppress(FileNotFoundError):
        for folder in FOLDER.iterdir():
            if (folder.is_dir() and folder.name not in ws_sessions_id
                    and time.time() - folder.stat().st_mtime > KEEP_SECONDS):
                shutil.rmtree(folder, ignore_errors=True)
    return len(stale)


def folder_bytes(folder: Path) -> int:
    return sum(file_bytes(Path(top) / name) for top, _, names in os.walk(folder) for name in names)


def file_bytes(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # gone meanwhile, or never there
        return 0


async def sweeping(measure_history: Callable[[], dict[str, int]] = dict) -> None:
    """The loop: sweep, measure (the uploads, and what measure_history gives), wait SWEEP_SECONDS; for the
    process's life."""
    while True:
        try:
            if swept := sweep():
                log.info("deleted %d uploads not sent within %.0f s", swept, KEEP_SECONDS)
            STORED.update(await asyncio.to_thread(lambda: {"uploads": folder_bytes(FOLDER)} | measure_history()))
        except Exception:  # never the end of the loop
            log.exception("sweeping uploads")
        await asyncio.sleep(SWEEP_SECONDS)
