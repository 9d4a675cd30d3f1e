"""GenerationService: the checkpoints of one process, serving many conversations.

One model on one CPU computes one reply at a time, so requests wait in a FIFO queue and a single
worker thread runs them in order, never on the event loop. `service.stream(conversation)` returns a
`Request`: an async iterator of events, with `cancel()`.

    Queued(position)    while it waits: how many requests are ahead (sent again when that changes)
    Loading(model)      the checkpoint is loading (the first use of a profile)
    Trimmed(left_out)   the oldest messages no longer fit the context and were left out
    Text(text)          a piece of the reply; pieces are joined to about one event per 50 ms
    Done(text, finish_reason, stats)   the last event of a reply, also of a cancelled one
    Failed(message, reason)            the last event of a request that could not run

A `Conversation` belongs to its caller: it keeps the messages and the KV cache of the last reply,
so a follow-up only prefills its new tokens. The caches of all conversations together stay within
a memory budget: when a reply would go over it, the caches of the conversations served longest ago
are dropped (they prefill in full on their next turn). The service knows nothing of Chainlit: the
UI, the tests and an HTTP API use it alike.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from model.checkpoint import Checkpoint, CheckpointError, find_checkpoint, load_checkpoint
from model.generate import Generation, GenerationStats, PromptTooLong, sampling_defaults
from model.kv_cache import KVCache

from .settings import DEFAULT_KV_CACHE_MB, DEFAULT_MAX_NEW_TOKENS, Settings

log = logging.getLogger(__name__)

STREAM_INTERVAL = 0.05  # seconds between two Text events of one request
MIN_REPLY_TOKENS = 64  # a prompt must leave room for at least this many (or max_new_tokens) tokens
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FINISH_REASONS = {"stop": "stop token", "length": "length limit", "cancelled": "stopped by user"}


# ---- events -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Queued:
    position: int  # requests ahead of this one, the running one included


@dataclass(frozen=True)
class Loading:
    model: str


@dataclass(frozen=True)
class Trimmed:
    left_out: int  # messages of the conversation, oldest first, no longer in the prompt


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Done:
    text: str
    finish_reason: str  # "stop", "length" or "cancelled"
    stats: GenerationStats

    @property
    def summary(self) -> str:
        """One line for people: tokens, time to first token, speed, why it ended."""
        s = self.stats
        parts = [f"{s.new_tokens} tokens"]
        if s.new_tokens:
            parts.append(f"first token {s.time_to_first_token:.2f} s")
        if s.tokens_per_second:
            parts.append(f"{s.tokens_per_second:.1f} tokens/s")
        parts.append(FINISH_REASONS.get(self.finish_reason, self.finish_reason))
        return " · ".join(parts)


@dataclass(frozen=True)
class Failed:
    message: str
    reason: str  # "prompt_too_long", "load" or "error"


Event = Queued | Loading | Trimmed | Text | Done | Failed


# ---- what a caller owns -------------------------------------------------------------------------

@dataclass(frozen=True)
class ReplySettings:
    """Sampling of one reply; None means the default (the service's, else the checkpoint's)."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None  # 0: off
    top_p: float | None = None
    seed: int | None = None  # None: random

    def over(self, base: ReplySettings) -> ReplySettings:
        """These settings, with base's values where these are None."""
        return ReplySettings(**{name: getattr(base, name) if getattr(self, name) is None else getattr(self, name)
                                for name in self.__dataclass_fields__})


@dataclass
class Message:
    role: str  # "user" or "assistant"
    content: str
    id: str | None = None  # the caller's id, to truncate the history at an edited message


@dataclass(eq=False)
class Conversation:
    """One chat: its messages, its system prompt, and the KV cache of its last reply."""

    model: str | None = None  # profile name; None: the service's default
    system_prompt: str | None = None
    messages: list[Message] = field(default_factory=list)
    left_out: int = 0  # leading messages dropped from the prompt because they no longer fit
    kv_cache: KVCache | None = None
    cache_model: str | None = None  # the model whose keys/values kv_cache holds
    reply_ids: dict[str, list[int]] = field(default_factory=dict)  # reply text -> the ids generated for it

    def add(self, role: str, content: str, id: str | None = None) -> Message:
        message = Message(role, content, id)
        self.messages.append(message)
        return message

    def index(self, message_id: str) -> int | None:
        return next((i for i, m in enumerate(self.messages) if m.id is not None and m.id == message_id), None)

    def truncate(self, message_id: str) -> bool:
        """Forget the message with this id and every later one (the user edited it); False if unknown."""
        i = self.index(message_id)
        if i is None:
            return False
        del self.messages[i:]
        self.left_out = min(self.left_out, len(self.messages))
        return True

    def dialog(self, start: int = 0) -> list[dict]:
        """System prompt and messages[start:] as the chat format's dicts."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [{"role": m.role, "content": m.content, **self._ids(m)} for m in self.messages[start:]]

    def _ids(self, message: Message) -> dict:
        """A reply of the model's keeps the ids it was generated as (the chat format may use them)."""
        ids = self.reply_ids.get(message.content) if message.role == "assistant" else None
        return {"ids": ids} if ids is not None else {}


def fit_prompt(chat_format, conversation: Conversation, limit: int, max_new_tokens: int) -> tuple[list[int], int]:
    """The conversation's prompt ids, leaving out its oldest messages when they no longer fit.

    The prompt leaves room for the reply: max_new_tokens, but at most half the context. When it
    does not fit, whole exchanges are left out, oldest first, until the rest fits in three quarters
    of its room, so that the next replies keep the same prefix and reuse the cache. The system
    prompt and the last message always stay. Returns (ids, how many messages are left out).
    Raises PromptTooLong when those alone leave no room for a reply.
    """
    budget = limit - min(max_new_tokens, limit // 2)
    last = len(conversation.messages) - 1
    starts = [i for i, m in enumerate(conversation.messages)
              if conversation.left_out <= i < last and m.role == "user"] + [last]
    encoded: dict[int, list[int]] = {}

    def encode(start: int) -> list[int]:
        if start not in encoded:
            encoded[start] = chat_format.encode_dialog(conversation.dialog(start))
        return encoded[start]

    if len(encode(starts[0])) <= budget:
        return encode(starts[0]), starts[0]

    def first_fitting(room: int) -> int:
        """The prompt shrinks as the start moves on: binary search for the first start that fits."""
        low, high = 0, len(starts)
        while low < high:
            middle = (low + high) // 2
            if len(encode(starts[middle])) <= room:
                high = middle
            else:
                low = middle + 1
        return low

    first = first_fitting(budget - budget // 4)
    if first >= len(starts) - 1:  # only the last message fits with room to spare: drop no more than needed
        first = first_fitting(budget)
    if first < len(starts):
        return encode(starts[first]), starts[first]
    ids = encode(last)
    if len(ids) + min(max_new_tokens, MIN_REPLY_TOKENS) > limit:
        raise PromptTooLong(
            f"Your message is too long for this model: it comes to {len(ids)} tokens, and the model "
            f"reads at most {limit} tokens at once, its reply included. Please send a shorter message.")
    return ids, last


# ---- requests -----------------------------------------------------------------------------------

class Request:
    """One reply being computed: iterate it (async) for events; `cancel()` stops it at the next token."""

    def __init__(self, service: GenerationService, conversation: Conversation, settings: ReplySettings,
                 model: str, stream_interval: float):
        self.id = uuid.uuid4().hex
        self.service = service
        self.conversation = conversation
        self.settings = settings
        self.model = model
        self.messages = list(conversation.messages)  # what was asked, whatever the caller adds later
        self.system_prompt = conversation.system_prompt
        self.stop = threading.Event()
        self.position = 0
        self.stream_interval = stream_interval
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._ahead: Event | None = None  # read while joining text pieces, returned next
        self._last_text = 0.0
        self._finished = False

    @property
    def cancelled(self) -> bool:
        return self.stop.is_set()

    def cancel(self) -> None:
        """Stop this request: the worker checks before every token. Safe from any thread, and twice."""
        self.stop.set()
        self.service._withdraw(self)

    def emit(self, event: Event) -> None:
        """Hand an event to the caller's event loop (from any thread)."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            self.stop.set()

    def __aiter__(self):
        return self

    async def __anext__(self) -> Event:
        if self._finished:
            raise StopAsyncIteration
        if self._ahead is not None:
            event, self._ahead = self._ahead, None
        else:
            event = await self._events.get()
        if isinstance(event, Text):
            wait = self._last_text + self.stream_interval - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            pieces = [event.text]
            while not self._events.empty():
                following = self._events.get_nowait()
                if not isinstance(following, Text):
                    self._ahead = following
                    break
                pieces.append(following.text)
            self._last_text = time.monotonic()
            event = Text("".join(pieces))
        self._finished = isinstance(event, Done | Failed)
        return event

    async def events(self) -> list[Event]:
        """Every remaining event, up to and including the last one."""
        return [event async for event in self]


# ---- the service --------------------------------------------------------------------------------

class CacheBudget:
    """The conversations whose KV caches are kept between turns, least recently served first.

    `keep(conversation)` after each reply marks it most recent, then drops the caches of the least
    recent others until all kept caches fit in `max_bytes` (the newest is always kept). Entries are
    weak references: a conversation its caller forgot leaves on its own, with its cache.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._order: OrderedDict[int, weakref.ref] = OrderedDict()  # id(conversation) -> conversation
        self._lock = threading.RLock()  # a weakref callback can run on any thread, even inside keep()

    def keep(self, conversation: Conversation) -> None:
        key = id(conversation)
        with self._lock:
            self._order.pop(key, None)
            self._order[key] = weakref.ref(conversation, lambda _, key=key: self._forget(key))
            for other in self._kept()[:-1]:
                if self.nbytes <= self.max_bytes:
                    break
                other.kv_cache = None
                self._order.pop(id(other), None)

    @property
    def nbytes(self) -> int:
        """Bytes of the KV caches that kept conversations hold now."""
        return sum(c.kv_cache.nbytes for c in self._kept() if c.kv_cache is not None)

    def _kept(self) -> list[Conversation]:
        with self._lock:
            return [c for c in (ref() for ref in self._order.values()) if c is not None]

    def _forget(self, key: int) -> None:
        with self._lock:
            self._order.pop(key, None)


class GenerationService:
    """Loads checkpoints lazily (each once, then kept) and runs requests one at a time, in order."""

    def __init__(self, profiles: dict[str, Path], *, default: str | None = None,
                 loader: Callable[[str, Path], Checkpoint] | None = None, max_context: int = 8192,
                 defaults: ReplySettings = ReplySettings(), stream_interval: float = STREAM_INTERVAL,
                 kv_cache_budget_mb: float = DEFAULT_KV_CACHE_MB):
        if not profiles:
            raise ValueError("no checkpoints to serve")
        self.profiles = dict(profiles)
        self.default = default or next(iter(profiles))
        if self.default not in self.profiles:
            raise ValueError(f"default profile {self.default!r} is not one of {', '.join(self.profiles)}")
        self.loader = loader or (lambda name, path: load_checkpoint(path))
        self.max_context = max_context
        self.defaults = defaults
        self.stream_interval = stream_interval
        self.cache_budget = CacheBudget(int(kv_cache_budget_mb * 2**20))
        self._checkpoints: dict[str, Checkpoint] = {}
        self._load_locks = {name: threading.Lock() for name in self.profiles}
        self._lock = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._running: Request | None = None
        self._closed = False
        self._worker = threading.Thread(target=self._work, name="generation", daemon=True)
        self._worker.start()

    @classmethod
    def from_settings(cls, settings: Settings, **options) -> GenerationService:
        """Profiles from LLAMA_CHECKPOINT and LLAMA_WEIGHTS_DIR, loading as the settings say; with
        LLAMA_BACKEND_URL, an app.remote.RemoteService that has that server generate instead."""
        if settings.backend_url:
            from .remote import RemoteService
            return RemoteService.from_settings(settings, **options)
        if settings.threads:
            torch.set_num_threads(settings.threads)
        profiles = find_profiles(settings.checkpoint, settings.weights_dir)
        default = next(iter(profiles))
        device = resolve_device(settings.device)
        dtype = DTYPES.get(settings.dtype)

        def loader(name: str, path: Path) -> Checkpoint:
            if name == default and settings.is_default_checkpoint and not path.exists():
                from model.prepare_default import ConversionError, prepare_default
                try:
                    prepare_default(settings.weights_dir)
                except ConversionError as e:
                    raise CheckpointError(str(e)) from None
            return load_checkpoint(path, device=device, dtype=dtype,
                                   tokenizer=settings.tokenizer if name == default else None,
                                   quantize=None if settings.quantize == "off" else settings.quantize)

        defaults = ReplySettings(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                                 top_k=settings.top_k, top_p=settings.top_p)
        return cls(profiles, default=default, loader=loader, max_context=settings.max_context,
                   defaults=defaults, kv_cache_budget_mb=settings.kv_cache_mb, **options)

    # -- checkpoints

    def is_loaded(self, name: str | None = None) -> bool:
        return (name or self.default) in self._checkpoints

    def checkpoint(self, name: str | None = None) -> Checkpoint:
        """The profile's checkpoint, loaded on first use (blocking: call it off the event loop)."""
        name = name or self.default
        if name not in self.profiles:
            raise CheckpointError(f"no model named {name!r}; there are: {', '.join(self.profiles)}")
        with self._load_locks[name]:
            if name not in self._checkpoints:
                started = time.perf_counter()
                self._checkpoints[name] = self.loader(name, self.profiles[name])
                log.info("loaded %s in %.1f s", name, time.perf_counter() - started)
            return self._checkpoints[name]

    async def load(self, name: str | None = None) -> Checkpoint:
        """checkpoint() in a thread, for the event loop."""
        return await asyncio.to_thread(self.checkpoint, name)

    def context_limit(self, name: str | None = None) -> int:
        """Tokens of prompt and reply together: max_context, at most the model's own (loads it)."""
        return min(self.max_context, self.checkpoint(name).config.max_seq_len)

    def reply_defaults(self, name: str | None = None) -> ReplySettings:
        """The settings a reply gets when the caller sets none: the service's over the checkpoint's."""
        sampling = sampling_defaults(self.checkpoint(name))
        checkpoint = ReplySettings(max_new_tokens=DEFAULT_MAX_NEW_TOKENS, temperature=sampling["temperature"],
                                   top_k=sampling["top_k"] or 0, top_p=sampling["top_p"])
        return self.defaults.over(checkpoint)

    # -- requests

    def stream(self, conversation: Conversation, settings: ReplySettings | None = None) -> Request:
        """Queue a reply to the conversation's last message; call from the event loop that iterates it."""
        if not conversation.messages:
            raise ValueError("the conversation has no message to reply to")
        model = conversation.model or self.default
        if model not in self.profiles:
            raise ValueError(f"no model named {model!r}; there are: {', '.join(self.profiles)}")
        request = Request(self, conversation, settings or ReplySettings(), model, self.stream_interval)
        with self._lock:
            if self._closed:
                raise RuntimeError("the generation service is closed")
            self._waiting.append(request)
            self._announce_positions()
            self._lock.notify_all()
        return request

    def cancel(self, request_id: str) -> bool:
        """Cancel a waiting or running request by id; False if there is none."""
        with self._lock:
            found = [r for r in (self._running, *self._waiting) if r is not None and r.id == request_id]
        for request in found:
            request.cancel()
        return bool(found)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def active(self) -> int:
        """Requests waiting or running; 0 when the model is free."""
        with self._lock:
            return len(self._waiting) + (self._running is not None)

    def close(self, timeout: float = 10.0) -> None:
        """Cancel everything and stop the worker thread."""
        with self._lock:
            self._closed = True
            pending = [r for r in (self._running, *self._waiting) if r is not None]
            self._lock.notify_all()
        for request in pending:
            request.cancel()
        self._worker.join(timeout)

    def _withdraw(self, request: Request) -> None:
        """A cancelled request that has not started leaves the queue at once."""
        with self._lock:
            if request not in self._waiting:
                return
            self._waiting.remove(request)
            self._announce_positions()
        request.emit(Done("", "cancelled", GenerationStats()))

    def _announce_positions(self) -> None:
        ahead = 1 if self._running is not None and not self._running.cancelled else 0  # a cancelled one ends now
        for i, request in enumerate(self._waiting):
            if request.position != ahead + i and ahead + i > 0:
                request.emit(Queued(ahead + i))
            request.position = ahead + i

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._waiting and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                request = self._running = self._waiting.popleft()
                request.position = 0
                self._announce_positions()
            try:
                last = self._serve(request)
            except Exception as e:  # a bug or a device error: report it and go on serving
                log.exception("generation failed")
                request.conversation.kv_cache = None
                last = Failed(f"Generation failed: {e}", "error")
            finally:
                with self._lock:
                    self._running = None
                    self._announce_positions()
            request.emit(last)  # after the worker is free, so a next request starts at once
            del request, last  # while idle, hold no conversation (and no KV cache) alive

    def _serve(self, request: Request) -> Done | Failed:
        """Run one request on the worker thread, emitting its events; returns the last one."""
        if request.cancelled:
            return Done("", "cancelled", GenerationStats())
        if not self.is_loaded(request.model):
            request.emit(Loading(request.model))
        try:
            checkpoint = self.checkpoint(request.model)
        except Exception as e:  # CheckpointError, and whatever a broken file raises
            log.exception("loading %s failed", request.model)
            return Failed(f"The model {request.model} could not be loaded: {e}", "load")
        settings = request.settings.over(self.reply_defaults(request.model))
        limit = min(self.max_context, checkpoint.config.max_seq_len)
        conversation = request.conversation
        asked = replace(conversation, messages=request.messages, system_prompt=request.system_prompt)
        try:
            prompt, left_out = fit_prompt(checkpoint.chat_format, asked, limit, settings.max_new_tokens)
        except PromptTooLong as e:
            return Failed(str(e), "prompt_too_long")
        if left_out > conversation.left_out:
            request.emit(Trimmed(left_out))
        conversation.left_out = left_out
        cache = conversation.kv_cache if conversation.cache_model == request.model else None
        generation = Generation(
            checkpoint, prompt, max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
            top_k=settings.top_k or None, top_p=settings.top_p, seed=settings.seed,
            should_stop=request.stop.is_set, max_context=self.max_context, kv_cache=cache)
        conversation.kv_cache = None  # until the reply is complete, the cache is being written
        for piece in generation:
            request.emit(Text(piece))
        conversation.kv_cache, conversation.cache_model = generation.kv_cache, request.model
        conversation.reply_ids[generation.text] = list(generation.tokens)
        self.cache_budget.keep(conversation)
        stats = generation.stats
        log.info("reply: prompt %d tokens (%d from the cache), %d new tokens, first token %.2f s, %.1f tokens/s, %s",
                 stats.prompt_tokens, stats.reused_tokens, stats.new_tokens, stats.time_to_first_token,
                 stats.tokens_per_second, generation.finish_reason)
        return Done(generation.text, generation.finish_reason, generation.stats)


def find_profiles(checkpoint: Path, weights_dir: Path) -> dict[str, Path]:
    """Profile name -> checkpoint: the given checkpoint first, then every checkpoint folder in weights_dir."""
    profiles = {checkpoint.name if checkpoint.is_dir() or not checkpoint.suffix else checkpoint.stem: checkpoint}
    if not weights_dir.is_dir():
        return profiles
    known = {checkpoint.resolve()}
    for folder in sorted(weights_dir.iterdir()):
        if not folder.is_dir() or folder.name.startswith(".") or folder.resolve() in known:
            continue
        try:
            find_checkpoint(folder)
        except CheckpointError:
            continue
        name, n = folder.name, 2
        while name in profiles:
            name, n = f"{folder.name} ({n})", n + 1
        profiles[name] = folder
        known.add(folder.resolve())
    return profiles


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


__all__ = ["Conversation", "Done", "Event", "Failed", "GenerationService", "Loading", "Message",
           "Queued", "ReplySettings", "Request", "Text", "Trimmed", "find_profiles", "fit_prompt",
           "resolve_device"]
