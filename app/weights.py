"""The weights folder while the server runs: a model downloaded into it from Hugging Face (or imported from GGUF
files on this machine) as a job that outlives the request that asked for it, and a model folder taken out of it.
Ollama's /api/pull and /api/delete use it (app.api.ollama_models), and so does the chat's models panel
(app.web.models_panel): one `Weights` per server, so a pull started by either shows in both.

`Weights.pull(source)` starts the download, or joins the one under way for the same source and revision; any
number of callers watch it (`Pull.watch()`): the bytes of the files it fetches, how many are here so far, and its
end (the error, if any). A caller that goes away leaves it running. It runs `python -m model.fetch --report` in a
process of its own, so that `Pull.cancel()` can end it at once (huggingface_hub has no way to stop a download
under way), and so that the web process never imports huggingface_hub nor converts a GGUF. One cancelled or cut
(the server stopped) leaves weights/.NAME.download, from which the next pull of the same repo goes on
(model.convert.hub). Once a model is in place, the backend lists its models again (`find_models`), so requests can
name it. A model already in the folder is not fetched again.

`Weights.remove(name)` takes a model folder out: a loaded one unloaded first (as Ollama's server does), then renamed
at once to a hidden name (which the engine skips), the models listed again, then its files deleted. Never the
default model, one a request is using now (`InUse`), or one that is not a folder of the weights folder (`Refused`).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from model.convert.folder import ConversionError, folder_name, model_folder, partial_folder, source_of
from model.convert.url import URL, gguf_file_name
from model.options import PROJECT_ROOT

from app.backend.protocol import Backend, is_remote

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.5  # how often a watcher is told the bytes fetched so far
FIND_MODELS_TIMEOUT_S = 60.0
UNLOAD_WAIT_S = 10.0  # how long a remove waits for a loaded model to leave memory (a reply using it ends first)


class Refused(Exception):
    """A model that may not be removed, or a pull that cannot be asked for; the message says why."""


class InUse(Refused):
    """The model is loaded now: it may not be removed (unload it first)."""


class TooManyPulls(Refused):
    """As many pulls are under way as the server runs at once (LLAMA_MAX_PULLS): a 429, try again later."""


@dataclass
class Pull:
    """One download into the weights folder (or import of GGUF files); watched by whoever asked for it."""

    repo_id: str  # or the path of a GGUF file or folder on this machine
    revision: str | None
    folder: Path | None  # the model's folder once it is in place (its name is the model's); an import's: once known
    partial: Path | None  # where a download's files gather meanwhile (model.convert.folder.partial_folder)
    sizes: dict[str, int] | None = None  # the files fetched and their sizes, once the hub has told them
    error: str | None = None
    status: int = 500  # of an error: the HTTP status it means (model.convert's ConversionError.status)
    cancelled: bool = False
    started: float = field(default_factory=time.monotonic)
    process: subprocess.Popen | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)  # set on the server's loop

    @property
    def total(self) -> int | None:
        return sum(self.sizes.values()) if self.sizes is not None else None

    def completed(self) -> int:
        """Bytes of the files here so far: in the download folder while it is there, else in place (moved there at
        its end, before the pull is marked done: never back to 0)."""
        where = self.partial if self.partial is not None and self.partial.is_dir() else self.folder
        here = bytes_here(where) if where is not None and where.is_dir() else 0
        return min(here, self.total or here)

    def cancel(self) -> None:
        """End the download now; its files so far stay, for the next pull of it to go on from."""
        self.cancelled = True
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()

    async def watch(self) -> AsyncIterator[Pull]:
        """This pull, every WATCH_INTERVAL_S until it ends, and once more at its end."""
        while not self.finished.is_set():
            yield self
            try:
                await asyncio.wait_for(self.finished.wait(), WATCH_INTERVAL_S)
            except TimeoutError:
                pass
        yield self


def bytes_here(folder: Path) -> int:
    """The bytes of every file under a download's folder (huggingface_hub's unfinished files in .cache/ too: a pull
    goes on from them). The download moves and removes its files and folders meanwhile: what goes while it is read
    counts nothing (os.walk passes over a folder that is gone; a file that is gone is skipped)."""
    total = 0
    for parent, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.stat(os.path.join(parent, name)).st_size
            except OSError:
                continue
    return total


class Weights:
    """The weights folder of a backend that computes here (none for a remote server's: Refused)."""

    def __init__(self, backend: Backend, folder: Path | None, endpoint: str | None = None, max_pulls: int = 2):
        self.backend, self.folder, self.endpoint, self.max_pulls = backend, folder, endpoint, max_pulls
        self.pulls: dict[tuple[str, str | None], Pull] = {}  # those under way

    async def pull(self, repo_id: str, revision: str | None = None, local: bool = False) -> Pull:
        """The download of a Hugging Face repo's checkpoint (owner/name) into the weights folder, under way or
        started now; with `local` (the operator's own: the chat's model admins), `repo_id` may also be a GGUF
        file or a folder of them on this machine, or the http(s) address of a GGUF file."""
        if self.folder is None or any(is_remote(where) for where in self.backend.profiles.values()):
            raise Refused("models are not pulled here: this server fronts another one (LLAMA_BACKEND_URL)")
        key = (repo_id, revision)
        if key in self.pulls:
            return self.pulls[key]
        if local and (path := Path(repo_id).expanduser()).is_absolute() and path.exists():
            if not (path.is_dir() or path.suffix.lower() == ".gguf"):
                raise Refused(f"{repo_id} is neither a .gguf file nor a folder of them")
            pull = Pull(repo_id, None, None, None)
        elif local and URL.fullmatch(repo_id):
            try:  # the rules the download itself follows (model/convert/url.py), checked before it starts
                name = gguf_file_name(repo_id)
                pull = Pull(repo_id, None, None, partial_folder(model_folder(self.folder, name[:-len(".gguf")])))
            except ConversionError as e:
                raise Refused(str(e)) from None
        else:
            # huggingface_hub takes 0.6 s to import: at the first pull (on a thread: streams go on), not at start
            hub = await asyncio.to_thread(importlib.import_module, "model.convert.hub")
            if not hub.is_repo_id(repo_id):
                raise Refused(f"{repo_id[:200]!r} is not a Hugging Face model id: expected owner/name (ASCII letters, "
                              "digits, '-', '_' and '.', as the Hub allows), e.g. meta-llama/Llama-3.2-1B-Instruct (this server pulls from Hugging Face, not from "
                              "Ollama's library)" + (", the full path of a .gguf file or folder, or a .gguf's "
                                                     "http(s) address" if local else ""))
            if revision is not None and (not hub.REVISION.fullmatch(revision) or ".." in revision):
                raise Refused(f"{revision[:80]!r} is not a revision: expected a branch, tag or commit of {repo_id} "
                              "(letters, digits, '_', '.', '-' and '/', beginning with a letter or digit)")
            try:
                folder = model_folder(self.folder, folder_name(repo_id, revision))
            except ConversionError as e:
                raise Refused(str(e)) from None
            pull = Pull(repo_id, revision, folder, partial_folder(folder))
            if folder.is_dir():  # here already: not fetched again
                source = source_of(folder)
                if source is not None and source[0].lower() != repo_id.lower():
                    raise Refused(f"a model named {folder.name} is here already, pulled from {source[0]}: delete it "
                                  f"first to pull {repo_id}")
                pull.finished.set()
                return pull
        if len(self.pulls) >= self.max_pulls:  # (a model here already, above, is no pull)
            raise TooManyPulls(f"{len(self.pulls)} pulls are under way, as many as this server runs at once "
                               f"(LLAMA_MAX_PULLS={self.max_pulls}): pull {repo_id} again once one has ended")
        self.pulls[key] = pull
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._download, args=(pull, loop), name=f"pull {repo_id}", daemon=True).start()
        return pull

    def _download(self, pull: Pull, loop: asyncio.AbstractEventLoop) -> None:
        """`python -m model.fetch --report` for the pull, its JSON lines read as they come (on a thread)."""
        command = [sys.executable, "-m", "model.fetch", pull.repo_id, "--weights-dir", str(self.folder), "--report",
                   *([f"--revision={pull.revision}"] if pull.revision else [])]
        env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", **({"HF_ENDPOINT": self.endpoint} if self.endpoint
                                                                    else {})}
        try:
            with tempfile.TemporaryFile() as errors:
                pull.process = subprocess.Popen(command, cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE,
                                                stderr=errors, stdin=subprocess.DEVNULL, text=True)
                if pull.cancelled:  # (cancelled while it started)
                    pull.process.terminate()
                for line in pull.process.stdout:
                    try:
                        said = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(said, dict) and isinstance(said.get("files"), dict):
                        pull.sizes = said["files"]
                    elif isinstance(said, dict) and isinstance(said.get("folder"), str):
                        pull.folder = Path(said["folder"])
                    elif isinstance(said, dict) and isinstance(said.get("status"), int) and 400 <= said["status"] < 600:
                        pull.status = said["status"]
                status = pull.process.wait()
                errors.seek(0)
                told = [line.strip() for line in errors.read().decode(errors="replace").splitlines() if line.strip()]
            if pull.cancelled:
                pull.error = (f"cancelled: pulling {pull.repo_id} again goes on from the "
                              f"{pull.completed() / 1e6:.0f} MB already here" if pull.partial else "cancelled")
            elif status != 0:
                said = next((line for line in reversed(told) if line.startswith("error: ")), None)
                pull.error = said.removeprefix("error: ") if said else (
                    f"pulling {pull.repo_id} failed (status {status}): {told[-1] if told else 'no message'}")
            else:
                asyncio.run_coroutine_threadsafe(self.backend.find_models(), loop).result(FIND_MODELS_TIMEOUT_S)
                log.info("pulled %s into %s", pull.repo_id, pull.folder)
        except Exception as e:  # a bug, or the engine gone: the watchers are told
            log.exception("pulling %s failed", pull.repo_id)
            pull.error = f"pulling {pull.repo_id} failed: {e}"
        finally:
            if pull.process is not None and pull.process.stdout is not None:
                pull.process.stdout.close()
            loop.call_soon_threadsafe(self._finish, pull)

    def _finish(self, pull: Pull) -> None:
        self.pulls.pop((pull.repo_id, pull.revision), None)
        pull.finished.set()

    def under_way(self) -> list[Pull]:
        return list(self.pulls.values())

    def under_way_ids(self) -> list[int]:
        return [id(pull) for pull in self.pulls.values()]

    async def unloaded(self, name: str, wait_s: float) -> bool:
        """Whether the model is out of memory, waiting up to `wait_s` for it to go."""
        deadline = time.monotonic() + wait_s
        while self.backend.in_memory(name):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

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
        if self.backend.in_memory(name):  # unloaded first, as Ollama's server does, once no request uses it
            self.backend.keep_alive(name, 0)
            if not await self.unloaded(name, UNLOAD_WAIT_S):
                raise InUse(f"{name} is answering a request: it leaves memory once no request uses it; remove it "
                            "then")
        aside = path.parent / f".{path.name}.removed-{uuid.uuid4().hex[:8]}"
        path.rename(aside)  # at once: the engine lists hidden folders no more
        try:
            await asyncio.wait_for(self.backend.find_models(), FIND_MODELS_TIMEOUT_S)
        finally:
            await asyncio.to_thread(shutil.rmtree, aside, True)
        log.info("removed %s (%s)", name, path)
