"""The files of stored chats, beside the history database: what users attached to their messages, the
text read from each, and the sources shown under replies.

Chainlit's SQLAlchemy data layer keeps an element's bytes only through a storage client, and lists each
element with the address that client gives. This one writes into a folder of its own (the database's
name + "-files", e.g. data/history-files/), readable by the app's account only (app.private_files),
one folder per element:

    <folder>/<element id>/file    the bytes, as uploaded or sent
    <folder>/<element id>/text    an attachment's text, as read when it was sent (app.files.read)

It serves the bytes at /history-files/<element id>/<name>, to the user whose chat holds the element (as
the history database says) and to nobody else: 404 for everyone else. The text is never served: a resumed
chat reads it here, so its files go to the model as they went the first time, whatever reading them again
would give. Files are sent as downloads, never as pages of this site (an uploaded .html or .svg runs
nothing here); a PDF is shown by the page's own viewer.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from pathlib import Path
from urllib.parse import quote

from chainlit.auth import get_current_user
from chainlit.data import get_data_layer
from chainlit.data.storage_clients.base import BaseStorageClient
from fastapi import Depends, HTTPException
from fastapi.responses import FileResponse
from fastapi.routing import APIRoute

from app.private_files import open_private, private_folder
from app.web.uploads import file_bytes

ROUTE = "/history-files"
DATA, TEXT = "file", "text"
ELEMENT_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # Chainlit's are UUIDs
USER_ELEMENTS = ('SELECT e."id" AS id FROM elements e JOIN threads t ON t."id" = e."threadId" '
                 'WHERE t."userId" = :user_id')
OWNER = ('SELECT t."userId" AS owner FROM elements e JOIN threads t ON t."id" = e."threadId" '
         'WHERE e."id" = :element_id')


class FileStore(BaseStorageClient):
    def __init__(self, folder: Path):
        self.folder = folder

    @classmethod
    def beside(cls, db: Path) -> FileStore:
        """The store of the history database db: db's folder, db's name + "-files"."""
        return cls(db.with_name(db.stem + "-files"))

    def element_folder(self, element_id: str) -> Path:
        if not ELEMENT_ID.fullmatch(element_id):
            raise ValueError(f"not an element's id: {element_id[:80]!r}")
        return self.folder / element_id

    def path(self, object_key: str) -> Path:
        """Where an object's bytes are."""
        return self.element_folder(_parts(object_key)[0]) / DATA

    # ---- Chainlit's storage client ----

    async def upload_file(self, object_key: str, data: bytes | str, mime: str = "application/octet-stream",
                          overwrite: bool = True, content_disposition: str | None = None) -> dict:
        path = self.path(object_key)
        await asyncio.to_thread(self._write, path, data.encode() if isinstance(data, str) else data)
        return {"object_key": object_key, "url": await self.get_read_url(object_key)}

    async def delete_file(self, object_key: str) -> bool:
        await asyncio.to_thread(shutil.rmtree, self.path(object_key).parent, ignore_errors=True)
        return True

    async def get_read_url(self, object_key: str) -> str:
        element_id, name = _parts(object_key)
        return f"{ROUTE}/{element_id}/{quote(name, safe='')}"

    async def close(self) -> None:
        pass

    # ---- an attachment's text ----

    def write_text(self, element_id: str, text: str) -> None:
        self._write(self.element_folder(element_id) / TEXT, text.encode())

    def read_text(self, element_id: str) -> str | None:
        """The text stored for the element, or None when there is none (deleted, or never stored)."""
        try:
            return (self.element_folder(element_id) / TEXT).read_text(encoding="utf-8")
        except (FileNotFoundError, ValueError):
            return None

    def holds_text(self, element_id: str) -> bool:
        return bool(ELEMENT_ID.fullmatch(element_id)) and (self.folder / element_id / TEXT).is_file()

    async def user_bytes(self, layer, user_id: str) -> int:
        """The bytes the chats of a user hold here (as the history database, layer, says which elements are
        theirs): what LLAMA_MAX_USER_FILES_MB bounds."""
        rows = await layer.execute_sql(USER_ELEMENTS, {"user_id": user_id})
        ids = [row["id"] for row in rows if ELEMENT_ID.fullmatch(str(row["id"]))] if isinstance(rows, list) else []
        return await asyncio.to_thread(lambda: sum(file_bytes(self.folder / element_id / name)
                                                   for element_id in ids for name in (DATA, TEXT)))

    def _write(self, path: Path, data: bytes) -> None:
        private_folder(self.folder)
        private_folder(path.parent)
        with open(open_private(path, os.O_TRUNC), "wb") as f:
            f.write(data)

    # ---- serving ----

    def route(self, data_layer=get_data_layer) -> APIRoute:
        """GET /history-files/<element id>/<name>: the element's bytes, to the owner of its chat only (as
        data_layer(), the history database, says)."""

        async def stored_file(element_id: str, name: str, user=Depends(get_current_user)):
            layer = data_layer()
            if user is None or layer is None or not ELEMENT_ID.fullmatch(element_id):
                raise HTTPException(status_code=404, detail="Not found")
            rows = await layer.execute_sql(OWNER, {"element_id": element_id})
            path = self.element_folder(element_id) / DATA
            if not rows or rows[0]["owner"] != getattr(user, "id", None) or not path.is_file():
                raise HTTPException(status_code=404, detail="Not found")
            if name.lower().endswith(".pdf"):  # shown by the page's viewer, or the browser's in a tab of its own
                return FileResponse(path, media_type="application/pdf", filename=name,
                                    content_disposition_type="inline", headers={"X-Content-Type-Options": "nosniff"})
            return FileResponse(path, media_type="application/octet-stream", filename=name,
                                headers={"X-Content-Type-Options": "nosniff",
                                         "Content-Security-Policy": "sandbox; default-src 'none'"})

        return APIRoute(ROUTE + "/{element_id}/{name:path}", stored_file, methods=["GET"])


def _parts(object_key: str) -> tuple[str, str]:
    """The element id and name in an object's key: Chainlit names it "<user id>/<element id>/<name>" (without
    "/<name>" when the element has none)."""
    parts = object_key.split("/", 2)
    return (parts[1] if len(parts) > 1 else ""), (parts[2] if len(parts) > 2 else "file")
