"""The weights folder while the server runs: a model downloaded into it from Hugging Face as a job that outlives
the request that asked for it, and a model folder taken out of it. Ollama's /api/pull and /api/delete use it
(app.api.ollama_models); so can a models panel of the web page.

`Weights.pull(repo_id)` starts the download (model.convert.hub.download, on a thread of its own), or joins the
one under way for the same repo and revision; any number of callers watch it (`Pull.watch()`): the bytes of the
files it fetches, how many are here so far, and its end (the error, if any). A caller that goes away leaves it
running. One interrupted (the server stopped) leaves weights/.NAME.download, from which the next pull of the
same repo goes on (model.convert.hub). Once a model is in place, the backend lists its models again
(`find_models`), so requests can name it. A model already in the folder is not fetched again.

`Weights.remove(name)` takes a model folder out: renamed at once to a hidden name (which the engine skips), the
models listed again, then its files deleted. Never the default model, one loaded now, or one that is not a
folder of the weights folder (`Refused`).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import shutil
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from model.convert.folder import ConversionError

from app.backend.protocol import Backend, is_remote

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.5  # how often a watcher is told the bytes fetched so far
FIND_MODELS_TIMEOUT_S = 60.0


class Refused(Exception):
    """A model that may not be removed, or a pull that cannot be asked for; the message says why."""


class InUse(Refused):
    """The model is loaded now: it may not be removed (unload it first)."""


@dataclass
class Pull:
    """One download into the weights folder; watched by whoever asked for it."""

    repo_id: str
    revision: str | None
    folder: Path  # the model's folder once it is in place (its name is the model's)
    partial: Path  # where its files gather meanwhile (model.convert.hub.partial_folder)
    sizes: dict[str, int] | None = None  # the files fetched and their sizes, once the hub has told them
    error: str | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)  # set on the server's loop

    @property
    def total(self) -> int | None:
        return sum(self.sizes.values()) if self.sizes is not None else None

    def completed(self) -> int:
        """Bytes of the files here so far (in the download folder, or in place once it is done)."""
        where = self.folder if self.finished.is_set() and self.error is None else self.partial
        here = sum(p.stat().st_size for p in where.rglob("*") if p.is_file()) if where.is_dir() else 0
        return min(here, self.total or here)

    async def watch(self) -> AsyncIterator[Pull]:
        """This pull, every WATCH_INTERVAL_S until it ends, and once more at its end."""
        while not self.finished.is_set():
            yield self
            try:
                await asyncio.wait_for(self.finished.wait(), WATCH_INTERVAL_S)
            except TimeoutError:
                pass
        yield self


class Weights:
    """The weights folder of a backend that computes here (none for a remote server's: Refused)."""

    def __init__(self, backend: Backend, folder: Path | None, endpoint: str | None = None):
        self.backend, self.folder, self.endpoint = backend, folder, endpoint
        self.pulls: dict[tuple[str, str | None], Pull] = {}  # those under way

    async def pull(self, repo_id: str, revision: str | None = None) -> Pull:
        """The download of a Hugging Face repo's checkpoint (owner/name) into the weights folder, under way or
        started now."""
        if self.folder is None or any(is_remote(where) for where in self.backend.profiles.values()):
            raise Refused("models are not pulled here: this server fronts another one (LLAMA_BACKEND_URL)")
        # huggingface_hub takes 0.6 s to import: at the first pull (on a thread: the streams go on), not at start
        hub = await asyncio.to_thread(importlib.import_module, "model.convert.hub")
        if not hub.REPO_ID.fullmatch(repo_id):
            raise Refused(f"{repo_id!r} is not a Hugging Face model id: expected owner/name, e.g. "
                          "meta-llama/Llama-3.2-1B-Instruct (this server pulls from Hugging Face, not from "
                          "Ollama's library)")
        if repo_id.split("/")[1].startswith("."):  # ".." or a hidden name: the folder would not be the model's
            raise Refused(f"{repo_id!r} is not a model's name: a name may not begin with '.'")
        key = (repo_id, revision)
        if key in self.pulls:
            return self.pulls[key]
        folder = self.folder / repo_id.split("/")[1]
        pull = Pull(repo_id, revision, folder, hub.partial_folder(folder))
        if pull.folder.is_dir():  # here already: not fetched again
            pull.finished.set()
            return pull
        self.pulls[key] = pull
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._download, args=(pull, loop, hub.download), name=f"pull {repo_id}",
                         daemon=True).start()
        return pull

    def _download(self, pull: Pull, loop: asyncio.AbstractEventLoop, download) -> None:
        try:
            download(pull.repo_id, self.folder, revision=pull.revision, endpoint=self.endpoint,
                     on_files=lambda sizes: setattr(pull, "sizes", sizes))
            asyncio.run_coroutine_threadsafe(self.backend.find_models(), loop).result(FIND_MODELS_TIMEOUT_S)
            log.info("pulled %s into %s", pull.repo_id, pull.folder)
        except ConversionError as e:
            pull.error = str(e)
        except Exception as e:  # a bug, or the engine gone: the watchers are told
            log.exception("pulling %s failed", pull.repo_id)
            pull.error = f"pulling {pull.repo_id} failed: {e}"
        finally:
            loop.call_soon_threadsafe(self._finish, pull)

    def _finish(self, pull: Pull) -> None:
        self.pulls.pop((pull.repo_id, pull.revision), None)
        pull.finished.set()

    async def remove(self, name: str) -> None:
        """Take a model's folder out of the weights folder; Refused (InUse) says why not."""
        where = self.backend.profiles[name]
        if self.folder is None or is_remote(where):
            raise Refused(f"{name} is another server's model (LLAMA_BACKEND_URL): it is not removed from here")
        path = Path(where)
        if name == self.backend.default:
            raise Refused(f"{name} is the server's default model (LLAMA_CHECKPOINT): it is not removed")
        if not path.is_dir() or path.parent.resolve() != self.folder.resolve():
            raise Refused(f"{name} ({path}) is not a folder of the weights folder {self.folder}: it is not removed")
        if self.backend.in_memory(name):
            raise InUse(f"{name} is loaded: unload it first (keep_alive 0), then remove it")
        aside = path.parent / f".{path.name}.removed-{uuid.uuid4().hex[:8]}"
        path.rename(aside)  # at once: the engine lists hidden folders no more
        try:
            await asyncio.wait_for(self.backend.find_models(), FIND_MODELS_TIMEOUT_S)
        finally:
            await asyncio.to_thread(shutil.rmtree, aside, True)
        log.info("removed %s (%s)", name, path)
