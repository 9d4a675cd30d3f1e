"""The web process's handle on the engine process: start it, send it requests, stream back events.

    client = EngineClient(EngineConfig(checkpoint="weights/SmolLM2-135M-Instruct"))
    await client.start()                 # the engine is up and has listed its models
    await client.load()                  # the default model is loaded
    async for event in client.stream(conversation):
        ...

The engine (`python -m app.engine`) is a child process; requests go to it over a ZeroMQ PUSH
socket and its events come back over a PULL socket, both MessagePack-encoded `app.messages`
structs, through Unix domain sockets in a private folder (mode 0700). One thread reads the events
and hands each to its reply's event loop; nothing an event holds stops that thread.

A request is checked before it takes a place in the queue: encoded, and decoded back as the
`Generate` the engine reads (its ranges and sizes, `app.bounds`); one that fails is an
InvalidRequest naming the field, and takes no place. Every place taken is given back when the
request ends, whichever way: its last Done, a Failed, a cancel, the engine's death.

If the engine dies (killed, out of memory, a crash in a kernel), every reply it was computing ends
with a Failed event saying so, and a new engine starts (after a pause when crashes come in quick
succession) and loads the default model again; the web process keeps serving throughout. Requests
that come meanwhile wait for the new engine (they are told so with a Restarting event) and are
sent when it has started; one that waits longer than RESTART_WAIT_S ends with a Failed "restarting".
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq

from app.backend.conversation import Conversation
from app.bounds import json_problem
from app.messages import (
    Cancel,
    Done,
    EngineConfig,
    EngineStats,
    Event,
    Failed,
    FindModels,
    FromEngine,
    Generate,
    KeepAlive,
    Load,
    ModelFailed,
    ModelInfo,
    ModelReady,
    ModelsFound,
    ModelUnloaded,
    ReplySettings,
    Restarting,
    Started,
)
from app.backend import socket_folder
from app.backend.reply import STREAM_INTERVAL, Reply
from app.settings import keep_alive_for

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
POLL_MS = 200  # how often the reader looks at the engine process while no event comes
START_TIMEOUT_S = 120.0  # from starting the process to its first message (importing torch, finding models)
RESTART_DELAYS_S = (0.0, 1.0, 5.0, 30.0)  # after crashes in quick succession, wait longer before the next start
RESTART_WAIT_S = 60.0  # how long a request that comes while the engine restarts waits for it


class EngineError(Exception):
    """The engine could not start, or a model could not be loaded."""


class ServerBusy(Exception):
    """As many requests are running and waiting as the server takes (LLAMA_MAX_BATCH + LLAMA_MAX_WAITING)."""


class InvalidRequest(ValueError):
    """A request the engine cannot take (a number out of range, too many of something, a string that is
    not Unicode); the message names the field."""


class EngineClient:
    def __init__(self, config: EngineConfig, *, max_waiting: int = 32, stream_interval: float = STREAM_INTERVAL):
        self.config = config
        self.max_waiting = max_waiting
        self.stream_interval = stream_interval
        self.profiles: dict[str, str] = {}
        self.default: str | None = None
        self.restarts = 0
        self.stats = EngineStats()  # the engine's, as last reported
        self.observers: list[Callable[[Event], None]] = []  # called with each reply's last event (metrics)
        self._models: dict[str, ModelInfo] = {}  # every model this engine has loaded: its info (it stays true)
        self._loaded: set[str] = set()  # those loaded now (the engine unloads idle ones: ModelUnloaded)
        self._kept: dict[str, float] = {}  # loaded model -> its keep-alive as keep_alive() set it (until unloaded)
        self._last_used: dict[str, float] = {}  # loaded model -> when (time.time()) a request for it last ended
        self._finding: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []  # find_models() waiting
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}
        self._replies: dict[str, Reply] = {}  # every request holding places: sent, or held for a new engine
        self._held: dict[str, tuple[bytes, float]] = {}  # request id -> (its Generate, encoded; when it gives up)
        self._lock = threading.RLock()
        self._started = threading.Event()
        self._closed = False
        self._crashes: list[float] = []
        self._restarting_since: float | None = None  # the engine died; no new one has started since
        self._spawn_at: float | None = None  # when to start the next engine
        self._context = zmq.Context()
        self._encode = msgspec.msgpack.Encoder().encode
        self._check = msgspec.msgpack.Decoder(Generate).decode
        self._decode = msgspec.msgpack.Decoder(list[FromEngine]).decode
        self._decode_one = msgspec.msgpack.Decoder(FromEngine).decode
        socket_folder.remove_stale()  # those of web processes killed before they could remove theirs
        self._spawn()
        self._reader = threading.Thread(target=self._read, name="engine events", daemon=True)
        self._reader.start()

    # -- what the web side calls

    async def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Wait until the engine has started and listed its models (`profiles`, `default`)."""
        if not await asyncio.to_thread(self._started.wait, timeout):
            raise EngineError(f"the engine did not start within {timeout:.0f} s")
        if self._closed:
            raise EngineError("the engine client is closed")

    @property
    def ready(self) -> bool:
        """The engine is running and has loaded the default model (it may have unloaded it since, idle
        past LLAMA_KEEP_ALIVE: the next request loads it again)."""
        return self.default is not None and self.default in self._models

    def is_loaded(self, name: str | None = None) -> bool:
        """Whether the model is loaded now."""
        return (name or self.default) in self._loaded

    def in_memory(self, name: str | None = None) -> bool:
        return self.is_loaded(name)

    async def load(self, name: str | None = None) -> ModelInfo:
        """Load a model (if it is not loaded); raises EngineError with the reason when it cannot be."""
        await self.start()
        name = name or self.default
        loop = asyncio.get_running_loop()
        with self._lock:
            if name in self._loaded:
                return self._models[name]
            future = loop.create_future()
            self._waiters.setdefault(name, []).append((loop, future))
            self._send(Load(name))  # (while the engine restarts: once the new one has started)
        return await future

    def context_limit(self, name: str | None = None) -> int:
        """Of a model loaded once (also while unloaded since): its context in tokens."""
        return self._info(name).context_limit

    def reply_defaults(self, name: str | None = None) -> ReplySettings:
        return self._info(name).defaults

    def memory_bytes(self, name: str | None = None) -> int | None:
        return (self._info(name).memory_bytes or None) if self.is_loaded(name) else None

    def device_memory_bytes(self, name: str | None = None) -> int:
        info = self._info(name) if self.is_loaded(name) else None
        return info.memory_bytes if info is not None and info.device != "cpu" else 0

    def keep_alive(self, name: str | None, seconds: float | None) -> None:
        """How long a loaded (or loading) model stays loaded once unused, from now until it is unloaded (Ollama's
        keep_alive): seconds; 0: as soon as no request runs or waits for it; negative: until the engine stops;
        None: LLAMA_KEEP_ALIVE's again. Sent after the request it comes with, so that request keeps it meanwhile."""
        name = name or self.default
        with self._lock:
            if name not in self._loaded and not self._waiters.get(name) and not any(
                    reply.model == name for reply in self._replies.values()):
                return  # neither loaded nor on its way: nothing to keep
            if seconds is None:
                self._kept.pop(name, None)
            else:
                self._kept[name] = seconds
            self._last_used[name] = time.time()
            self._send(KeepAlive(name, seconds))

    def unloads_at(self, name: str | None = None) -> float | None:
        """Of a loaded model: when (time.time()) the engine unloads it unless a request uses it before; None: it
        stays until the engine stops. While a request for it runs, counted from now."""
        name = name or self.default
        with self._lock:
            seconds = self._kept.get(name, keep_alive_for(name, self.default, self.config.keep_alive))
            in_use = any(reply.model == name for reply in self._replies.values())
            since = time.time() if in_use else self._last_used.get(name, time.time())
        return None if seconds < 0 else since + seconds

    async def find_models(self) -> dict[str, str]:
        """List the models again after a model folder was added to or removed from the weights folder; the
        profiles then (`profiles` is updated too)."""
        await self.start()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._finding.append((loop, future))
            self._send(FindModels())  # (while the engine restarts: the new one's Started lists them)
        return await future

    def stream(self, conversation: Conversation, settings: ReplySettings | None = None, n: int = 1,
               **options) -> Reply:
        """Start a reply (n replies) to the conversation's last message; call from the event loop that
        iterates it. options: more fields of the Generate message (tools, tool_choice, json_schema,
        json_object, logprobs, ...). Raises ServerBusy when the queue is full, InvalidRequest for a request
        the engine cannot take."""
        if not conversation.messages:
            raise ValueError("the conversation has no message to reply to")
        reply = self._reply(conversation, settings, n)
        return self._submit(reply, Generate(reply.id, reply.model, reply.settings, conversation.chat_messages(),
                                            left_out=conversation.left_out, n=n, **options))

    def complete(self, prompt: str, model: str | None = None, settings: ReplySettings | None = None,
                 n: int = 1, **options) -> Reply:
        """Continue a raw text prompt (no chat format); otherwise as stream()."""
        reply = self._reply(Conversation(model=model), settings, n)
        return self._submit(reply, Generate(reply.id, reply.model, reply.settings, prompt=prompt, n=n, **options))

    def _reply(self, conversation: Conversation, settings: ReplySettings | None, n: int) -> Reply:
        model = conversation.model or self.default
        if model not in self.profiles:
            raise ValueError(f"no model named {model!r}; there are: {', '.join(self.profiles)}")
        return Reply(conversation, settings or ReplySettings(), model, self._cancel, self.stream_interval, n)

    def _submit(self, reply: Reply, request: Generate) -> Reply:
        data = self.checked(request)
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine client is closed")
            taken = sum(r.n for r in self._replies.values())  # a request for n replies takes n places
            if taken + reply.n > self.config.max_batch + self.max_waiting:
                raise ServerBusy(f"{taken} replies are running or waiting, and this server takes "
                                 f"{self.config.max_batch + self.max_waiting} (LLAMA_MAX_BATCH={self.config.max_batch} + "
                                 f"LLAMA_MAX_WAITING={self.max_waiting})")
            held = self._restarting_since is not None
            if held:
                self._held[reply.id] = (data, time.monotonic() + RESTART_WAIT_S)
            else:
                self._requests.send(data)
            self._replies[reply.id] = reply
        if held:
            reply.deliver(Restarting(reply.id))
        return reply

    def checked(self, request: Generate) -> bytes:
        """The request encoded, once it is known to be one the engine takes: decoded back as a Generate,
        its ranges and sizes hold (app.bounds). Raises InvalidRequest naming the field."""
        try:
            data = self._encode(request)
            self._check(data)
        except msgspec.ValidationError as e:
            raise InvalidRequest(str(e)) from None
        except (ValueError, OverflowError, TypeError, RecursionError) as e:  # not Unicode, past 64 bits, ...
            try:
                found = json_problem(msgspec.to_builtins(request), max_depth=sys.getrecursionlimit())
            except Exception:  # (as unusual as the request)
                found = None
            raise InvalidRequest(f"{e} - at `$.{found[0]}`" if found else str(e)) from None
        return data

    def cancel(self, request_id: str) -> bool:
        """Cancel a running or waiting reply by id; False if there is none."""
        reply = self._replies.get(request_id)
        if reply is not None:
            reply.cancel()
        return reply is not None

    @property
    def active(self) -> int:
        """Requests running or waiting (for a place, or for the engine to restart)."""
        return len(self._replies)

    @property
    def places_taken(self) -> int:
        """Places in the queue taken: a request for n replies takes n."""
        with self._lock:
            return sum(reply.n for reply in self._replies.values())

    @property
    def pid(self) -> int:
        return self._process.pid

    def close(self, timeout: float = 10.0) -> None:
        """Cancel everything and stop the engine process."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._started.set()  # nobody waits for a start that will not come
        self._reader.join(timeout)
        self._stop_engine(timeout)
        self._fail_all("The server is shutting down.", "engine")
        with self._lock:
            waiters, self._waiters = self._waiters, {}
            finding, self._finding = self._finding, []
        for loop, future in [w for ws in waiters.values() for w in ws] + finding:
            _resolve(loop, future, error=EngineError("the server is shutting down"))
        self._context.term()

    # -- the engine process

    def _spawn(self) -> None:
        """Start an engine process with fresh sockets (nothing queued for a dead one reaches it)."""
        self._folder = socket_folder.make()
        inbox, outbox = f"ipc://{self._folder}/requests", f"ipc://{self._folder}/events"
        self._events = self._context.socket(zmq.PULL)
        self._events.bind(outbox)
        self._requests = self._context.socket(zmq.PUSH)
        self._requests.setsockopt(zmq.LINGER, 0)
        self._requests.connect(inbox)  # queues until the engine has bound it
        self._process = subprocess.Popen([sys.executable, "-m", "app.engine", inbox, outbox, str(os.getpid())],
                                         stdin=subprocess.PIPE, cwd=ROOT,
                                         # A signal to the web process's process group (Ctrl-C in its
                                         # terminal, kill -- -PGID) is the web process's to act on: it stops
                                         # its engine in order; the engine leaving first looked like a crash.
                                         start_new_session=True)
        self._process.stdin.write(msgspec.json.encode(self.config))
        self._process.stdin.close()
        self._spawned_at = time.monotonic()
        log.info("engine process %d started", self._process.pid)

    def _stop_engine(self, timeout: float) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._events.close(linger=0)
        self._requests.close(linger=0)
        socket_folder.remove(self._folder)

    def _send(self, message) -> None:
        with self._lock:
            if self._restarting_since is None and not self._closed:  # else: nobody would read it
                self._requests.send(self._encode(message))

    def _cancel(self, reply: Reply) -> None:
        with self._lock:
            held = self._held.pop(reply.id, None) is not None
            if held:  # never sent: it ends here
                del self._replies[reply.id]
            elif reply.id in self._replies:
                self._send(Cancel(reply.id))
        if held:
            for index in range(reply.n):
                reply.deliver(Done(reply.id, "", "cancelled", index=index))

    def _read(self) -> None:
        """The reader thread: events to their replies; a dead engine is replaced. Nothing stops it but close()."""
        while not self._closed:
            try:
                self._read_once()
            except Exception:
                log.exception("the engine's events: a step of the reader failed; it goes on")
                time.sleep(POLL_MS / 1000)
            self._give_up_waiting()

    def _read_once(self) -> None:
        if self._spawn_at is not None:  # the engine died: the next one starts after a pause
            wait = self._spawn_at - time.monotonic()
            if wait > 0:
                time.sleep(min(wait, POLL_MS / 1000))
            else:
                with self._lock:
                    self._spawn_at = time.monotonic() + RESTART_DELAYS_S[-1]  # again then, if this start fails
                    self._spawn()  # it loads the default model by itself
                    self._spawn_at = None
                    self.restarts += 1
        elif self._events.poll(POLL_MS):
            for message in self._messages(self._events.recv()):
                try:
                    self._dispatch(message)
                except Exception as e:
                    log.exception("an event of the engine could not be delivered")
                    self._end(getattr(message, "id", None), f"The reply could not be delivered: {e}", "error")
        elif self._process.poll() is not None and not self._closed:
            self._engine_stopped()

    def _messages(self, data: bytes) -> list[FromEngine]:
        """The engine's messages in data; one that cannot be read is left out (its request, if it names
        one, ends with a Failed), the others are read."""
        try:
            return self._decode(data)
        except msgspec.DecodeError:
            pass
        messages = []
        for item in msgspec.msgpack.decode(data, type=list[msgspec.Raw]):
            try:
                messages.append(self._decode_one(item))
            except msgspec.DecodeError as e:
                log.error("a message from the engine could not be read: %s", e)
                found = msgspec.msgpack.decode(item)
                request_id = found.get("id") if isinstance(found, dict) else None
                if isinstance(request_id, str):
                    self._end(request_id, f"An event of this reply could not be read: {e}", "error")
        return messages

    def _dispatch(self, message: FromEngine) -> None:
        if isinstance(message, EngineStats):
            self.stats = message
        elif isinstance(message, Started):
            with self._lock:
                self.default = message.default
                self._listed(message.profiles)
                if self._restarting_since is not None:  # what waited for this engine goes to it now
                    self._restarting_since = None
                    for data, _ in self._held.values():
                        self._requests.send(data)
                    self._held.clear()
                    for name in self._waiters:
                        self._send(Load(name))
            self._started.set()
        elif isinstance(message, ModelsFound):
            with self._lock:
                self._listed(message.profiles)
        elif isinstance(message, ModelUnloaded):
            with self._lock:
                self._loaded.discard(message.model)
                self._kept.pop(message.model, None)
                self._last_used.pop(message.model, None)
        elif isinstance(message, ModelReady | ModelFailed):
            name = message.info.name if isinstance(message, ModelReady) else message.model
            with self._lock:
                if isinstance(message, ModelReady):
                    self._models[name] = message.info
                    self._loaded.add(name)
                    self._last_used[name] = time.time()
                waiters = self._waiters.pop(name, [])
            for loop, future in waiters:
                if isinstance(message, ModelReady):
                    _resolve(loop, future, result=message.info)
                else:
                    _resolve(loop, future, error=EngineError(message.message))
        else:
            with self._lock:
                reply = self._replies.get(message.id)
                if reply is not None:
                    if reply.ends_with(message):  # gone before the caller can see the end (and count us)
                        del self._replies[message.id]
                        self._last_used[reply.model] = time.time()
                    reply.deliver(message)
            if reply is not None and isinstance(message, Done | Failed):
                self._observe(message)

    def _listed(self, profiles: dict[str, str]) -> None:
        """The engine listed its models (it started, or FindModels): find_models() waits no more."""
        self.profiles = profiles
        finding, self._finding = self._finding, []
        for loop, future in finding:
            _resolve(loop, future, result=profiles)

    def _end(self, request_id: str | None, message: str, reason: str) -> None:
        """End a request here, with a Failed (its place is given back)."""
        with self._lock:
            reply = self._replies.pop(request_id, None) if request_id is not None else None
            self._held.pop(request_id, None)
        if reply is not None:
            failed = Failed(reply.id, message, reason)
            reply.deliver(failed)
            self._observe(failed)
            self._send(Cancel(reply.id))  # in case the engine still computes it

    def _engine_stopped(self) -> None:
        """The engine process is gone: fail what it was computing; a new one starts after a pause."""
        code = self._process.returncode
        started = self._started.is_set()
        log.error("the engine process stopped unexpectedly (exit code %s); starting a new one", code)
        message = (f"The model process stopped unexpectedly (exit code {code}); a new one is starting. "
                   "Please send your message again in a moment.")
        now = time.monotonic()
        with self._lock:
            self._models.clear()
            self._loaded.clear()
            self._kept.clear()
            self._last_used.clear()
            waiters = {}  # the loads this engine was asked for fail; while restarting, none was sent to it
            if self._restarting_since is None:
                waiters, self._waiters = self._waiters, {}  # (a fresh dict: a load asked from now on waits)
            sent = [reply for request_id, reply in self._replies.items() if request_id not in self._held]
            for reply in sent:
                del self._replies[reply.id]
            self._restarting_since = self._restarting_since or now
            self._close_sockets()
            if started:
                self._crashes = [t for t in self._crashes if now - t < 300] + [now]
                self._spawn_at = now + RESTART_DELAYS_S[min(len(self._crashes) - 1, len(RESTART_DELAYS_S) - 1)]
        self.stats = EngineStats()
        for reply in sent:
            failed = Failed(reply.id, message, "engine")
            reply.deliver(failed)
            self._observe(failed)
        for loop, future in (w for ws in waiters.values() for w in ws):
            _resolve(loop, future, error=EngineError(message))
        if not started:  # it never came up: the same start would fail again
            log.error("the engine process exited before it started; not restarting it")
            self._closed = True
            self._fail_all(message, "engine")
            self._started.set()

    def _give_up_waiting(self) -> None:
        """Requests (and model loads) that waited for a new engine longer than RESTART_WAIT_S end."""
        if self._restarting_since is None:
            return
        now = time.monotonic()
        with self._lock:
            expired = [request_id for request_id, (_, deadline) in self._held.items() if deadline <= now]
            replies = [self._replies.pop(request_id) for request_id in expired]
            for request_id in expired:
                del self._held[request_id]
            waiters = {}
            if self._restarting_since is not None and now - self._restarting_since > RESTART_WAIT_S:
                waiters, self._waiters = self._waiters, {}
        message = (f"The model is restarting after a failure and was not back within {RESTART_WAIT_S:.0f} s. "
                   "Please try again in a moment.")
        for reply in replies:
            failed = Failed(reply.id, message, "restarting")
            reply.deliver(failed)
            self._observe(failed)
        for loop, future in (w for ws in waiters.values() for w in ws):
            _resolve(loop, future, error=EngineError(message))

    def _fail_all(self, message: str, reason: str) -> None:
        with self._lock:
            replies, self._replies = list(self._replies.values()), {}
            self._held.clear()
        for reply in replies:
            failed = Failed(reply.id, message, reason)
            reply.deliver(failed)
            self._observe(failed)
        self.stats = EngineStats()

    def _observe(self, event: Event) -> None:
        for observe in self.observers:
            observe(event)

    def _info(self, name: str | None) -> ModelInfo:
        name = name or self.default
        try:
            return self._models[name]
        except KeyError:
            raise EngineError(f"the model {name} is not loaded") from None


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, *, result=None, error=None) -> None:
    def settle():
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)
    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # that loop is closed: nobody waits any more
        pass


__all__ = ["EngineClient", "EngineError", "InvalidRequest", "ServerBusy"]
