"""The chat's models panel (the Models command, or /models): every model of the weights folder, and those of other
apps' stores on this machine (model/stores.py: Ollama's, LM Studio's, the Hugging Face cache; used where they lie,
the ones that cannot be used listed with why), with its size,
format, parameters, context and whether it is loaded; use one for this chat, make one the default, remove one,
and pull one from Hugging Face (or import GGUF files of this machine) with a live progress bar and a cancel.

The page side is public/elements/ModelsPanel.jsx, a Chainlit custom element: it draws `props` and sends what the
user clicks as the action "models" ({"do": "use" | "default" | "unload" | "remove" | "pull" | "cancel", ...}), which
`act` answers. The panel is one message of the chat; its props are sent again when something changes, and every
WATCH_INTERVAL_S while a pull is under way. The pulls are app.weights' jobs, the same as Ollama's /api/pull: one
started by a tool shows here too, and a pull goes on when its panel (or tab) goes away.

Who may pull, remove, unload or make a default: Settings.may_manage_models (LLAMA_MODEL_ADMINS); anyone may look and
use a model for their chat.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import chainlit as cl

from model.convert.folder import folder_name, source_of
from model.convert.url import URL
from model.stores import find_store_models
from model.options import Environment
from model.summary import summarize

from app.backend.protocol import Backend, is_remote
from app.settings import Settings, save_default
from app.weights import Pull, Refused, Weights, bytes_here

log = logging.getLogger(__name__)
WATCH_INTERVAL_S = 0.5
ESTIMATE_AFTER_S, ESTIMATE_AFTER_BYTES = 3.0, 1_000_000  # a pull's speed and time left are shown from then on
MAX_ENDED = 3  # pulls' ends the panel shows at once
HUB_PAGE = re.compile(r"(https?://)?(www\.)?(huggingface\.co|hf\.co)/", re.IGNORECASE)  # before owner/name
FOLLOWING: set[asyncio.Task] = set()  # the tasks that keep panels' progress bars moving (held: tasks are weak)
# Suggested until pulled: (what Pull fetches, its download size in bytes, whether the Hub asks for an account and a
# token). First Llama 3.2 Instruct in Q4_K_M from bartowski's GGUF repos (open to anyone), then Meta's own (gated:
# an account that accepted Meta's license, and HF_TOKEN on the server).
SUGGESTED = [("bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M", 808_000_000, False),
             ("bartowski/Llama-3.2-3B-Instruct-GGUF:Q4_K_M", 2_020_000_000, False),
             ("meta-llama/Llama-3.2-1B-Instruct", 2_471_645_608, True),
             ("meta-llama/Llama-3.2-3B-Instruct", 6_425_499_648, True)]
GATED_NOTE = "needs a Hugging Face account that accepted Meta's license, and HF_TOKEN on the server"
OPEN_NOTE = "no account needed"
DEFAULT_NOTE = ("You are chatting with **{name}**, a small model that comes with the app: quick, and good for "
                "trying it, but weak at facts and reasoning. Llama 3.2 1B or 3B answer far better: pull one here "
                "(the first two need no account).")


def size_text(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


@dataclass
class ModelsPanel:
    backend: Backend
    weights: Weights
    settings: Settings

    def rows(self, current: str | None) -> list[dict]:
        """Each model as the panel shows it (reads checkpoint headers: call on a thread)."""
        rows = []
        for name, where in list(self.backend.profiles.items()):
            details, size = "", None
            if is_remote(where):
                details = f"served by {where}"
            else:
                try:
                    summary = summarize(where)
                    details, size = summary.describe(), summary.bytes
                except Exception as e:  # a folder being written, or not a checkpoint: shown as such
                    details = f"not readable: {e}"
            held = self.backend.memory_bytes(name)
            in_place = not is_remote(where) and Path(where).is_file() and Path(where).parent != self.weights.folder
            if in_place:  # another app's store's GGUF (model/stores.py), read where it lies
                details += f" · used where it lies: {where}"
            rows.append({"name": name, "details": details, "size": size, "loaded": bool(self.backend.in_memory(name)),
                         "in_place": in_place,
                         "memory": f"{size_text(held)} in memory" if held else None,
                         "default": name == self.backend.default, "current": name == current,
                         "context": self.backend.context_limit(name) if self.backend.is_loaded(name) else None})
        return rows

    def interrupted(self) -> list[dict]:
        """Downloads cut short (cancelled, or the server stopped) that pulling again goes on from (reads the
        weights folder: call on a thread)."""
        if self.weights.folder is None or not self.weights.folder.is_dir():
            return []
        under_way = {(pull.repo_id, pull.revision) for pull in self.weights.under_way()}
        found = []
        for partial in sorted(self.weights.folder.glob(".*.download")):
            source = source_of(partial)
            if source is None or source in under_way:
                continue
            found.append({"source": source[0] + (f":{source[1]}" if source[1] else ""),
                          "here": size_text(bytes_here(partial))})  # (what a pull goes on from, as it says)
        return found

    def unusable(self) -> list[dict]:
        """The models of other apps' stores on this machine that cannot be used here, each with why (reads the
        stores: call on a thread)."""
        return [{"name": m.name, "store": m.store, "why": m.unusable}
                for m in find_store_models(Environment().environ) if m.unusable]

    def pulls(self) -> list[dict]:
        return [pull_state(pull) for pull in self.weights.under_way()]

    def suggestions(self) -> list[dict]:
        """What to pull, each with its size, whether it fits the disk, the memory it needs against this machine's,
        and whether the Hub asks for an account: those not here yet (their folder: folder_name)."""
        if self.weights.folder is None:
            return []
        free = shutil.disk_usage(self.weights.folder if self.weights.folder.exists() else
                                 self.weights.folder.parent).free
        memory = memory_bytes()
        found = []
        pulling = {(pull.repo_id, pull.revision) for pull in self.weights.under_way()}
        for source, size, gated in SUGGESTED:
            repo, _, tag = source.partition(":")
            if folder_name(repo, tag or None) in self.backend.profiles or (repo, tag or None) in pulling:
                continue  # here, or on its way (its progress bar shows)
            found.append({"repo": source, "size": size_text(size), "fits_disk": size < free,
                          "memory": f"needs about {size_text(size * 1.25)} of memory"
                                    + (f" of this machine's {size_text(memory)}" if memory else ""),
                          "account": GATED_NOTE if gated else OPEN_NOTE})
        return found

    async def props(self, current: str | None, user: str | None, said: str = "") -> dict:
        rows, interrupted, unusable = await asyncio.to_thread(
            lambda: (self.rows(current), self.interrupted(), self.unusable()))
        only_default = len(rows) == 1 and rows[0]["default"]
        admin, pulls = self.settings.may_manage_models(user), self.pulls()
        if not admin:  # an admin's file or folder on this machine, or an address, is theirs: its name alone
            for pull in pulls + interrupted:
                pull["source"] = public_source(pull["source"])
        return {"models": rows, "pulls": pulls, "interrupted": interrupted, "suggestions": self.suggestions(),
                "unusable": unusable,
                "admin": admin,
                "note": DEFAULT_NOTE.format(name=self.backend.default) if only_default else "",
                "said": said, "ended": []}

    async def act(self, payload: dict, conversation, user: str | None, busy: bool) -> str:
        """What the user clicked; returns a line saying what was done, or why not."""
        do = payload.get("do")
        name = payload.get("name") if isinstance(payload.get("name"), str) else ""
        if do == "use":
            if name not in self.backend.profiles:
                return f"There is no model {name!r} (any more)."
            if busy:
                return "Please wait until this reply is done (or stop it) to change the model."
            conversation.model = name
            return f"This chat now uses {name}: it loads with your next message."
        if do in ("default", "remove", "pull", "cancel", "unload") and not self.settings.may_manage_models(user):
            return "Only the users named in LLAMA_MODEL_ADMINS may pull, remove, unload or choose the default model."
        if do == "unload":
            if name not in self.backend.profiles or not self.backend.in_memory(name):
                return f"{name} is not loaded."
            self.backend.keep_alive(name, 0)
            if await self.weights.unloaded(name, 2.0):
                return f"Unloaded {name}: it loads again when a chat uses it."
            return f"{name} leaves memory once the replies using it end."
        if do == "default":
            if name not in self.backend.profiles or is_remote(self.backend.profiles[name]):
                return f"There is no model {name!r} in the weights folder."
            if Path(self.backend.profiles[name]).is_file():
                return (f"{name} is another app's model, read where it lies: import it into the weights folder "
                        "(Pull, with its file's path) to make it the default.")
            if self.settings.checkpoint_set:
                return f"LLAMA_CHECKPOINT is set, so it chooses the default: {name} would not become it."
            await asyncio.to_thread(save_default, self.settings.data_dir, name)
            return f"{name} is the default model from the next start of the server."
        if do == "remove":
            if name == conversation.model and busy:
                return f"{name} is answering in this chat: stop the reply first."
            if name not in self.backend.profiles:
                return f"There is no model {name!r} (any more)."
            try:
                await self.weights.remove(name)
            except Refused as e:
                return f"Not removed: {e}."
            return f"Removed {name}."
        if do == "pull":
            source = str(payload.get("source") or "").strip()
            page = HUB_PAGE.match(source) if not source.lower().endswith(".gguf") else None
            if page is None and (source.startswith(("/", "~")) or URL.fullmatch(source)):
                repo, revision = source, ""  # a GGUF file or folder here, or a GGUF's address
            else:  # a Hugging Face id, owner/name[:revision], maybe written as its page's address
                repo, _, revision = source[page.end() if page else 0:].partition(":")
            if not repo:
                return "Type a Hugging Face model id (owner/name), or the path of a .gguf file or folder."
            try:
                await self.weights.pull(repo, revision or None, local=True)
            except Refused as e:
                return f"Not pulled: {e}."
            return f"Pulling {source}…"
        if do == "cancel":
            for pull in self.weights.under_way():
                if pull.repo_id == payload.get("source"):
                    pull.cancel()
                    return f"Cancelled pulling {pull.repo_id}."
            return "That pull is not under way any more."
        return "The panel sent something this server does not know."


def pull_state(pull: Pull) -> dict:
    """A pull as the progress bar shows it: bytes done of total, speed, time left, the file being fetched."""
    done, total = pull.completed(), pull.total
    took = max(time.monotonic() - pull.started, 1e-3)
    speed = done / took
    settled = took >= ESTIMATE_AFTER_S and done >= ESTIMATE_AFTER_BYTES  # a speed worth an estimate
    fetching = None
    if pull.sizes and pull.partial is not None:
        have = {p.name: p.stat().st_size for p in pull.partial.glob("*") if p.is_file()}
        fetching = next((name for name, size in pull.sizes.items() if have.get(name.split("/")[-1]) != size), None)
    if total and done >= total:
        left = "finishing: the files are checked and moved into place"
    elif total and settled and speed > 0:
        left = f"{time_text((total - done) / speed)} left"
    else:
        left = None
    return {"source": pull.repo_id, "done": done, "total": total, "done_text": size_text(done),
            "total_text": size_text(total) if total else None,
            "speed": f"{size_text(speed)}/s" if settled else None, "left": left, "file": fetching,
            "error": page_words(pull.error) if pull.error else None}


# The fetch's messages are written for its terminal (python -m model.fetch); in the page, the panel's Pull does it.
TERMINAL_WORDS = (("run the same command again", "pull it again"), ("and run again", "and pull it again"))


def page_words(message: str) -> str:
    for terminal, page in TERMINAL_WORDS:
        message = message.replace(terminal, page)
    return message


def time_text(seconds: float) -> str:
    """12 s, 4 min, 1 h 20 min."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds // 3600:.0f} h {seconds % 3600 / 60:.0f} min"


def public_source(source: str) -> str:
    """What a user who manages no models sees of a pull's source: a Hugging Face id as it is; a path on this
    machine or an http(s) address by its last part only (a folder's layout, a host, a token in a query are not
    theirs to see)."""
    if URL.fullmatch(source):
        return Path(urlsplit(source).path).name or "a file"
    if source.startswith(("/", "~")):
        return Path(source).name or "a file"
    return source


async def show(panel: ModelsPanel, element: cl.CustomElement | None, current: str | None, user: str | None,
               said: str = "") -> cl.CustomElement:
    """The panel sent as a message saying `said` (element None), or its props sent again with what it says now
    (`say`: the latest line, whatever was said while the models were read). Neither is stored in the chat's
    history: the panel is a tool of the moment, not part of the conversation."""
    if element is None:  # opened: the weights folder and the other apps' stores looked at again
        try:
            await panel.backend.find_models()
        except Exception as e:  # noqa: BLE001  (the engine restarting: the list of a moment ago is shown)
            log.warning("listing the models again failed: %s", e)
    props = await panel.props(current, user, said)
    if element is None:
        message = cl.Message(content="", author="models")
        message.persisted = True  # (Chainlit stores a message it sends unless it was stored already)
        await message.send()
        element = cl.CustomElement(name="ModelsPanel", props=props, display="inline")
        await element.send(for_id=message.id, persist=False)
    else:
        element.props = props | {key: element.props.get(key, props[key]) for key in ("said", "ended")}
        await element.send(for_id=element.for_id, persist=False)  # (CustomElement.update() would store it)
    return element


def say(element: cl.CustomElement, line: str, ended: bool = False) -> None:
    """What the panel says from its next `show`: the line of a click; or, ended, how a pull ended, under the
    lines of other pulls that ended since the last click (each pull's end stays in view, MAX_ENDED at most)."""
    lines = [*element.props.get("ended", []), line][-MAX_ENDED:] if ended else []
    element.props = element.props | {"said": "\n".join(lines) if ended else line, "ended": lines}  # (a new dict)


async def follow(panel: ModelsPanel, element: cl.CustomElement, pull: Pull, current, user: str | None) -> None:
    """Send the panel's props again every WATCH_INTERVAL_S while `pull` is under way, then say how it ended.
    `current`: the chat's model now (a callable)."""
    while not pull.finished.is_set():
        await show(panel, element, current(), user)
        try:
            await asyncio.wait_for(pull.finished.wait(), WATCH_INTERVAL_S)
        except TimeoutError:
            pass
    name = pull.folder.name if pull.folder else pull.repo_id
    say(element, f"Not pulled: {page_words(pull.error)}" if pull.error and not pull.cancelled else pull.error
        or f"{name} is here: choose Use to chat with it.", ended=True)
    await show(panel, element, current(), user)


def follow_in_background(panel: ModelsPanel, element: cl.CustomElement, pull: Pull, current, user: str | None) -> None:
    task = asyncio.create_task(follow(panel, element, pull, current, user))
    FOLLOWING.add(task)
    task.add_done_callback(FOLLOWING.discard)
