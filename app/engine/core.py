"""The engine: the one process that holds the models, the KV caches and the compute threads.

    python -m app.engine INPUT_ADDRESS OUTPUT_ADDRESS PARENT_PID < config.json

The web process (`app.backend.engine_client`) starts it, sends it `Generate`/`Cancel`/`Load`/... messages over a ZeroMQ
socket and reads back each request's events (`app.messages`). Its loop, one step at a time: take
new messages, admit waiting requests into the batch, prefill prompt chunks within a token budget,
decode one token for every running sequence in one forward pass, send what came out (a new reply's
first token as soon as it is sampled, further text pieces at most every 50 ms: app/engine/outbox.py).
Models load on a thread of their own (app/engine/models.py), so streams keep running while another
model loads; requests for it wait, and start (or fail) once it is there. A request's prompt is built on a
thread too (the chat template, a chat's files chunked and ranked, a JSON schema compiled: up to a second
for a long file), and the request joins the batch at the first step after. A model unused for its
keep-alive (LLAMA_KEEP_ALIVE) is unloaded at the end of a step, its memory given back
(`release_memory`); its next request loads it again. Finished replies' KV caches are
kept for requests that start the same way (app/engine/prefix_cache.py), and on disk for those after a
restart (app/engine/kv_disk.py).

`Engine` is the loop's state and step without the sockets, so tests can drive it directly.

A fault stays with its request: whatever one request's building (prompt, chat template, tools, JSON
schema), prefill, sampling, end or sending raises ends that request with a Failed event, and the
loop goes on with the others. A forward pass shared by a batch fails the requests of that batch. A JSON
constraint that fails midway is no fault: it ends its own reply (Done, finish_reason "constraint_failed").
"""

from __future__ import annotations

import contextlib
import concurrent.futures
import ctypes
import ctypes.util
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch

from model import kernels
from model.checkpoint import Checkpoint
from model.context import PromptTooLong
from model.kv_cache import PREFILL_CHUNK, KVCache
from model.linear import MAX_KERNEL_ROWS
from model.speculation import Draft, PromptLookup, Speculation, step_times
from model.static_decode import in_slot
from model.static_decode import new_cache as static_cache
from model.tools import forces_call, read_tool_choice, read_tools

from app.bounds import reply_seed
from app.messages import (
    Cancel,
    Context,
    EngineConfig,
    EngineStats,
    Failed,
    FindModels,
    FromEngine,
    Generate,
    KeepAlive,
    Load,
    Loading,
    ModelFailed,
    ModelReady,
    ModelsFound,
    ModelUnloaded,
    Queued,
    Started,
    Text,
    ToEngine,
)
from app.engine.ahead import Ahead, StepClock, queues_ahead
from app.engine.kv_disk import KVDisk
from app.engine.models import Loader, Models
from app.engine.outbox import Outbox
from app.engine.prefix_cache import PrefixCache
from app.engine.prompt import choose_prompt_files, fit_prompt, prompt_budget
from app.engine.scheduler import Scheduler
from app.engine.sequence import Sequence, State

log = logging.getLogger("app.engine")

IDLE_POLL_S = 0.1  # how long the loop waits for a message when there is nothing to compute
LOADING_POLL_S = 0.02  # ... and while a model loads or prompts are built (their requests start as soon as ready)
# Idle this long, the engine computes kept replies again (Engine.refine), a chunk at a time: a program that
# sends its next request at once does not wait for such a chunk; a person reading the reply gives it time.
REFINE_AFTER_S = 0.5
# How long a thread holding the interpreter keeps it from another that waits (Python's default: 5 ms). The loop
# gives it up in every torch op of a step and waits for it back; while the prompt thread ranks a long file in
# Python, at 5 ms a wait a stream decoded 7 tokens in 0.8 s, at 1 ms 36 (bench/prompt_build.py).
SWITCH_INTERVAL_S = 0.001


class Refused(Exception):
    """A request whose prompt cannot be built: the message for its caller, and the kind of failure."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


class Engine:
    """Requests, their sequences and caches, over the models (app/engine/models.py); `handle()` a
    message, `step()` the computation. What comes out goes to `emit`, one message at a time, in order.
    loader: how a model loads (tests give their own); clock: the seconds that keep-alive counts (tests
    give their own)."""

    def __init__(self, config: EngineConfig, emit: Callable[[FromEngine], None], loader: Loader | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.emit = emit
        self.clock = clock
        self.models = Models(config, loader)
        self.requests: dict[str, list[Sequence]] = {}  # request id -> its n sequences
        self.scheduler = Scheduler(config.max_batch, PREFILL_CHUNK)
        self.prefix_cache = PrefixCache(config.kv_cache_mb * 2**20)
        self.kv_disk = self._open_kv_disk(config)
        self._positions: dict[str, int] = {}
        self._stats = EngineStats()
        # request id -> its prompt being built on the prompt thread (one: builds finish in the order they came)
        self._prompts = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="prompts")
        self._building: dict[str, concurrent.futures.Future] = {}
        self._ahead: dict[str, Ahead] = {}  # model -> its decode step queued before its tokens were read
        self._read_at: dict[str, float] = {}  # model -> when its last step's tokens were read (on a GPU)

    @staticmethod
    def _open_kv_disk(config: EngineConfig) -> KVDisk | None:
        """The KV caches kept on disk (LLAMA_KV_DISK_DIR, LLAMA_KV_DISK_MB); None when off, or where the
        folder cannot be made (the engine runs without)."""
        if not config.kv_disk_mb:
            return None
        folder = Path(config.kv_disk_dir) if config.kv_disk_dir else Path(config.cache_dir) / "kv"
        try:
            return KVDisk(folder, config.kv_disk_mb * 2**20)
        except OSError as e:
            log.warning("KV caches are not kept on disk: %s", e)
            return None

    def close(self, timeout: float = 5.0) -> None:
        """Before the process ends: finish writing the KV caches handed over (a bounded while)."""
        self._prompts.shutdown(wait=False, cancel_futures=True)
        if self.kv_disk is not None and not self.kv_disk.flush(timeout):
            log.warning("KV caches not all written to disk within %.0f s", timeout)

    # -- messages

    def start(self) -> None:
        self.emit(Started({name: str(path) for name, path in self.models.profiles.items()}, self.models.default))
        self.load(self.models.default)

    def handle(self, message: ToEngine) -> None:
        if isinstance(message, Generate):
            with self._contained(message.id, "Starting the request"):
                self.submit(message)
        elif isinstance(message, Cancel):
            with self._contained(message.id, "Cancelling the request"):
                self.cancel(message.id)
        elif isinstance(message, Load):
            self.load(message.model)
        elif isinstance(message, KeepAlive):
            self.models.keep(message.model, message.seconds, self.clock())  # 0: unloaded at this step's end if idle
        elif isinstance(message, FindModels):
            self.models.find()
            self.emit(ModelsFound({name: str(path) for name, path in self.models.profiles.items()}))

    @property
    def sequences(self) -> list[Sequence]:
        return [sequence for sequences in self.requests.values() for sequence in sequences]

    def submit(self, request: Generate) -> None:
        if request.model not in self.models.profiles:
            self.emit(Failed(request.id, f"There is no model named {request.model!r}; there are: "
                                         f"{', '.join(self.models.profiles)}.", "bad_request"))
            return
        leader = Sequence(request, time.perf_counter())
        leader.followers = [Sequence(request, leader.arrived, i, leader) for i in range(1, request.n)]
        self.requests[request.id] = [leader, *leader.followers]
        for sequence in self.requests[request.id]:
            self.scheduler.add(sequence)
        if request.model in self.models.checkpoints:
            self._prepare(request.id)
        else:
            self.emit(Loading(request.id, request.model))
            self.load(request.model)

    def cancel(self, request_id: str) -> None:
        for sequence in list(self.requests.get(request_id, [])):
            sequence.cancel()  # a running one ends at its next step; a waiting one now
            if sequence not in self.scheduler.running:
                self._finish(sequence)

    def load(self, name: str) -> None:
        """Start loading a model (if it is not loaded or loading); ModelReady or ModelFailed follows."""
        models = self.models
        if name in models.checkpoints:
            models.used([name], self.clock())  # a chat chose it: it is about to be used
            self.emit(ModelReady(models.infos[name]))
        elif name not in models.profiles:
            self.emit(ModelFailed(name, f"There is no model named {name!r}; there are: {', '.join(models.profiles)}."))
        else:
            models.load(name)

    @property
    def busy(self) -> bool:
        """Whether step() has sequences to run (else the loop may wait for messages)."""
        return any(s.ready for s in self.sequences)

    @property
    def preparing(self) -> bool:
        """Whether prompts are being built (the next steps start their requests)."""
        return bool(self._building)

    def wait_for_prompts(self, timeout: float | None = None) -> None:
        """Wait until the prompts being built are (tests: so a step starts every request submitted before it)."""
        concurrent.futures.wait(list(self._building.values()), timeout)

    @property
    def idle_work(self) -> bool:
        """Whether refine() has a kept cache to compute again (the loop does it when nothing else runs)."""
        return any(scope[0] in self.models.checkpoints for scope, _ in self.prefix_cache.inexact())

    @torch.inference_mode()
    def refine(self) -> None:
        """One whole prefill chunk of the most recently kept cache that holds ids a decode step (a reply)
        or a partial chunk computed: computed again as a prefill computes it (model/kv_cache.py), so that
        the conversation's next request, whose prompt holds that reply, reuses it. Run only while no
        request is waiting to be computed: a request that comes meanwhile waits for one chunk at most."""
        for scope, cache in self.prefix_cache.inexact():
            checkpoint = self.models.checkpoints.get(scope[0])
            if checkpoint is None:
                continue
            start, ids = cache.inexact_chunk()
            try:
                checkpoint.model(torch.tensor([ids], device=checkpoint.device), start_pos=start, kv_cache=cache,
                                 last_only=True)
            except Exception:  # a bug or out of memory: that cache is not kept, nothing else changes
                log.exception("computing a kept cache again failed; dropping it")
                self.prefix_cache.drop(cache)
                return
            cache.exact = start + len(ids)
            if self.kv_disk is not None and cache.inexact_chunk() is None:  # all it holds is exact now
                self.kv_disk.save(checkpoint, scope[1], cache)
            return

    # -- one step

    def step(self) -> None:
        self._take_loaded()
        self._take_prompts()
        for sequence in self.scheduler.admit():
            with self._contained(sequence.id, "Reserving the reply's memory"):
                self._take_cache(sequence)
        step = self.scheduler.schedule()
        for sequence in step.prefill:
            if sequence.id in self.requests:  # (a request failed by an earlier piece of this step is gone)
                with self._contained(sequence.id, "Reading the prompt"):
                    self._prefill(sequence)
        by_model: dict[str, list[Sequence]] = {}
        queued, self._ahead = self._ahead, {}  # each model's step queued ahead: used by this step or not at all
        for sequence in step.decode:
            by_model.setdefault(sequence.model, []).append(sequence)
        for model, batch in by_model.items():
            batch = [sequence for sequence in batch if sequence.id in self.requests]
            if not batch:
                continue
            try:
                self._decode(model, batch, queued.get(model))
            except Exception as e:  # the forward pass the batch shares (a bug, out of memory)
                log.exception("decoding a batch of %d failed", len(batch))
                for request_id in dict.fromkeys(sequence.id for sequence in batch):
                    self._fail(request_id, f"Generation failed: {e}", "error")
        for sequence in self.sequences:
            if sequence.finished and sequence in self.requests.get(sequence.id, ()):  # (not failed meanwhile)
                with self._contained(sequence.id, "Ending the reply"):
                    self._finish(sequence)
        self._ahead = {model: ahead.without_finished() for model, ahead in self._ahead.items()}  # (their slots go)
        self._unload_idle()
        self._announce_positions()
        self._announce_stats()

    def _unload_idle(self) -> None:
        """Unload the models unused for their keep-alive. A model is in use while a request for it runs or
        waits (for a place, or for the model to load): a few set lookups a step."""
        in_use = {sequences[0].model for sequences in self.requests.values() if sequences}
        for name, idle in self.models.idle(in_use, self.clock()):
            self.unload(name, idle)

    def unload(self, name: str, idle: float = 0.0) -> None:
        """Give a loaded model's memory back: its kept KV caches go (its running requests must be gone), then
        the model; ModelUnloaded tells the web side."""
        self.prefix_cache.drop_model(name)
        self._ahead.pop(name, None)
        self._read_at.pop(name, None)
        self.models.unload(name)
        if structured := sys.modules.get("model.structured"):  # loaded once JSON was asked for
            structured.forget_compiled()  # what it compiled holds the tokenizer
        release_memory()
        log.info("unloaded %s after %.0f s idle", name, idle)
        self.emit(ModelUnloaded(name))

    @torch.inference_mode()
    def _prefill(self, sequence: Sequence) -> None:
        model = self.models.checkpoints[sequence.model].model
        ids, start = sequence.prefill_chunk()
        tokens = torch.tensor([ids], device=model.tok_embeddings.weight.device)
        logits = model(tokens, start_pos=start, kv_cache=sequence.cache, last_only=True)[0, -1]
        sequence.computed(ids)
        if sequence.state is State.DECODING:  # its whole prompt is in
            for follower in sequence.followers:  # the other replies to the same prompt start here too
                follower.follow()
                self._accept(follower, follower.sample(logits))
            self._accept(sequence, sequence.sample(logits))

    @torch.inference_mode()
    def _decode(self, model_name: str, batch: list[Sequence], ahead: Ahead | None = None) -> None:
        """One forward pass for the batch: each sequence's last token, and the tokens guessed to follow it
        (model/speculation.py) in the rows the decode kernel reads the weights once for that the batch
        leaves free: a full batch guesses nothing, so speculation never costs the other streams a
        weight read. The rows of `ahead`, the step queued last time (app/engine/ahead.py), ran already."""
        model = self.models.checkpoints[model_name].model
        times, read_at = step_times(model), self._read_at.pop(model_name, None)
        ran = ahead.rows(batch) if ahead is not None else {}  # sequence -> its logits (1, vocab) of that step
        rows, expected = len(batch), float(len(batch))  # the step's rows so far, and the tokens they should give
        inputs = []  # per sequence: [its last token, *guesses]
        for sequence in batch:
            guesses = []
            if sequence in ran:
                sequence.passed()
            elif rows < MAX_KERNEL_ROWS:
                with self._contained(sequence.id, "Guessing tokens ahead"):
                    guesses = sequence.guesses(MAX_KERNEL_ROWS - rows, rows, expected)
                    expected += sequence.speculation.expected(len(guesses)) if guesses else 0.0
            rows += len(guesses)
            inputs.append([sequence.tokens[-1], *guesses])
        logits, clock = dict(ran), None
        fresh = [(sequence, ids) for sequence, ids in zip(batch, inputs) if sequence not in ran]
        if fresh:
            at = [(sequence, i) for sequence, ids in fresh for i in range(len(ids))]
            tokens = torch.tensor([t for _, ids in fresh for t in ids], device=model.tok_embeddings.weight.device)
            with StepClock(tokens.device) as clock:
                out = model.decode(tokens, [sequence.cache for sequence, _ in at],
                                   positions=[sequence.cache.length + i for sequence, i in at])  # (rows, vocab)
            if read_at is not None:  # the device waited for the host since it gave the last step's tokens
                times.observe_host(time.perf_counter() - read_at)
            first = 0
            for sequence, ids in fresh:
                logits[sequence] = out[first:first + len(ids)]
                first += len(ids)
        drawn, queued = self._drawn(model_name, batch, inputs, logits)
        for sequence, ids in zip(batch, inputs):
            if sequence.id in self.requests:  # (another reply of its request may have failed it just now)
                with self._contained(sequence.id, "Sampling"):
                    self._send(sequence, sequence.decoded(logits[sequence], ids, drawn.get(sequence)))
        if clock is not None:  # (each step's tokens are read: its work is done)
            clock.observe(times, len(at))
        if ran:
            ahead.clock.observe(times, len(ahead.sequences))
        in_slots = all(sequence.cache is not None and sequence.cache.slot is not None for sequence in batch)
        if not queued and in_slots and logits and next(iter(logits.values())).is_cuda:  # (it could have been)
            self._read_at[model_name] = time.perf_counter()

    def _drawn(self, model_name: str, batch: list[Sequence], inputs: list[list[int]],
               logits: dict[Sequence, torch.Tensor]) -> tuple[dict[Sequence, int], bool]:
        """The tokens of the batch's one-row steps that need nothing from the host to be sampled (no guesses,
        constraint or logprobs), drawn on the logits' device and read back together: on a GPU one wait for
        the whole batch, where sampling each row and reading it waits once a row. Where the whole batch is
        such rows in static slots, its next step is queued on these tokens before they are read
        (app/engine/ahead.py); whether it was."""
        drawn = {}
        for sequence, ids in zip(batch, inputs):
            if len(ids) == 1 and sequence.id in self.requests and sequence.drawable:  # (a failure ends a request)
                with self._contained(sequence.id, "Sampling"):
                    drawn[sequence] = sequence.draw(logits[sequence][0])
        if not drawn:
            return {}, False
        tokens = torch.stack(list(drawn.values()))  # (rows,) on the logits' device
        gpu = tokens.is_cuda
        host = torch.empty(len(drawn), dtype=torch.long, pin_memory=gpu)
        host.copy_(tokens, non_blocking=gpu)
        read = torch.cuda.Event() if gpu else None
        if gpu:
            read.record()
        queued = queues_ahead(batch, len(drawn), MAX_KERNEL_ROWS - len(batch))
        if queued:
            model, caches = self.models.checkpoints[model_name].model, [sequence.cache for sequence in drawn]
            with StepClock(tokens.device) as clock:
                step = model.decode(tokens, caches, positions=[cache.length + 1 for cache in caches])
            self._ahead[model_name] = Ahead(list(drawn), step, clock)
        if gpu:
            read.synchronize()
        return dict(zip(drawn, host.tolist())), queued

    def _accept(self, sequence: Sequence, token: int) -> None:
        self._send(sequence, sequence.accept(token))

    def _send(self, sequence: Sequence, text: str) -> None:
        logprobs = sequence.take_logprobs()
        if text or logprobs:
            self.emit(Text(sequence.id, text, sequence.index, logprobs))

    @contextlib.contextmanager
    def _contained(self, request_id: str, what: str):
        """One request's piece of work: what it raises (a bug, out of memory, input nothing checked)
        fails that request alone."""
        try:
            yield
        except Exception as e:
            log.exception("request %s: %s failed", request_id, what.lower())
            self._fail(request_id, f"{what} failed: {type(e).__name__}: {e}", "error")

    # -- sequences coming and going

    def _prepare(self, request_id: str) -> None:
        """Start building the request's prompt on the prompt thread (its model is loaded); a later step starts
        the request with it (_take_prompts)."""
        request = self.requests[request_id][0].request
        checkpoint, info = self.models.checkpoints[request.model], self.models.infos[request.model]
        self._building[request_id] = self._prompts.submit(self._build, request, checkpoint, info,
                                                          len(self.requests[request_id]))

    def _build(self, request: Generate, checkpoint: Checkpoint, info,
               n: int) -> tuple[list[int], Context, list, str]:
        """On the prompt thread: the prompt's ids, its Context, a JSON constraint for each of the n sequences and
        the request's tool_choice as read_tool_choice reads it (read here once; "none" without tools).
        A chat's oldest messages are left out where they no longer fit (or it is Refused, if it asked not to be
        trimmed), and its replies report so (Done.context). Refused: a prompt that cannot be built."""
        settings = request.settings.over(info.defaults)
        if settings.logit_bias and (past := max(settings.logit_bias)) >= checkpoint.config.vocab_size:
            raise Refused(f"logit_bias: token id {past} is not in the vocabulary of {request.model} (token ids 0 to "
                          f"{checkpoint.config.vocab_size - 1:,})", "bad_request")
        try:
            choice = read_tool_choice(request.tool_choice, read_tools(request.tools)) if request.tools else "none"
            if request.prompt is not None:
                prompt, context = checkpoint.tokenizer.encode(request.prompt, bos=True), Context(info.context_limit)
                if len(prompt) >= info.context_limit:
                    raise PromptTooLong(f"The prompt has {len(prompt)} tokens; the model reads at most "
                                        f"{info.context_limit} tokens at once, its reply included.")
            else:
                tool_options = dict(tools=request.tools, tool_choice=request.tool_choice)
                if request.tools and not checkpoint.chat_format.supports_tools:
                    # Clients that offer their tools with every message (Open WebUI does) get a reply in text, as
                    # "auto" allows; only a call that tool_choice demands cannot be given.
                    if forces_call(choice):
                        raise Refused(f"tools: the model {request.model} has no tool calling (its chat template is "
                                      "given no tools; Llama 3 checkpoints are), so it cannot be made to call one: "
                                      "send the request without tool_choice (with \"auto\" it answers in text)",
                                      "bad_request")
                    tool_options = dict(tools=None, tool_choice=None)
                if not checkpoint.chat_format.supports_tools and any(
                        m.role == "tool" or m.tool_calls for m in request.messages):
                    raise Refused(f"messages: the model {request.model} has no tool calling (its chat template is "
                                  "given no tools; Llama 3 checkpoints are), so its prompt cannot hold a tool's result "
                                  "or an assistant's tool_calls: send the conversation without them, or choose a "
                                  "model with tool calling", "bad_request")
                messages, files = choose_prompt_files(checkpoint.chat_format, request.messages, info.context_limit,
                                                      settings.max_new_tokens, **tool_options)
                prompt, left_out = fit_prompt(checkpoint.chat_format, messages, request.left_out,
                                              info.context_limit, settings.max_new_tokens, request.trim, **tool_options)
                context = Context(info.context_limit, prompt_budget(info.context_limit, settings.max_new_tokens),
                                  left_out, files)
        except PromptTooLong as e:
            raise Refused(str(e), "prompt_too_long") from e
        except (ValueError, TypeError, RecursionError) as e:  # messages or tools the chat format cannot take
            raise Refused(f"The request cannot be answered: {e}", "bad_request") from e
        try:
            constraints = [self._constraint(request, checkpoint, choice) for _ in range(n)]
        except (ValueError, TypeError, RecursionError) as e:  # a schema past a limit or failing at once (SchemaError)
            raise Refused(str(e), "bad_schema") from e
        return prompt, context, constraints, choice

    def _take_prompts(self) -> None:
        """Start the requests whose prompts are built (in the order they came); fail those refused."""
        for request_id, future in list(self._building.items()):
            if not future.done():
                break
            del self._building[request_id]
            if request_id not in self.requests:  # cancelled or failed while it was built
                continue
            with self._contained(request_id, "Starting the request"):
                try:
                    prompt, context, constraints, choice = future.result()
                except Refused as e:
                    self._fail(request_id, str(e), e.kind)
                else:
                    self._start(request_id, prompt, context, constraints, choice)

    def _start(self, request_id: str, prompt: list[int], context: Context, constraints: list, choice: str) -> None:
        sequences = self.requests[request_id]
        request = sequences[0].request
        checkpoint, info = self.models.checkpoints[request.model], self.models.infos[request.model]
        settings = request.settings.over(info.defaults)
        token_bytes = self.models.token_bytes(request.model) if request.logprobs is not None else None
        for sequence, constraint in zip(sequences, constraints):  # n replies: seeds seed, seed + 1, ...
            seed = None if settings.seed is None else reply_seed(settings.seed, sequence.index)
            sequence.context = context
            sequence.start(checkpoint, prompt, msgspec.structs.replace(settings, seed=seed), info.context_limit,
                           constraint=constraint, tool_choice=choice, token_bytes=token_bytes,
                           speculation=self._speculation(request.model, min(len(prompt) + settings.max_new_tokens,
                                                                             info.context_limit)))

    def _speculation(self, model: str, max_len: int) -> Speculation | None:
        """How a reply of `model` guesses tokens ahead: the draft model where one drafts for it, else from
        its prompt and reply; None with LLAMA_SPECULATE=off."""
        if self.config.speculate == "off":
            return None
        draft = self.models.drafts.get(model)
        guesser = Draft(draft, max_len) if draft is not None else PromptLookup()
        return Speculation(guesser, step_times(self.models.checkpoints[model].model))

    def _constraint(self, request: Generate, checkpoint: Checkpoint, choice: str):
        """The JSON constraint a reply of this request follows, or None: the tool call its tool_choice (`choice`)
        asks for ("required" or a function by name: model/tool_choice.py), else its response_format's JSON."""
        if not forces_call(choice) and request.json_schema is None and not request.json_object:
            return None
        from model.structured import JsonConstraint  # llguidance, loaded only where JSON is asked for
        options = dict(vocab_size=checkpoint.config.vocab_size, stop_ids=checkpoint.stop_ids)
        if not forces_call(choice):
            return JsonConstraint(checkpoint.tokenizer, request.json_schema, **options)
        from model.tool_choice import call_schema
        return JsonConstraint(checkpoint.tokenizer, call_schema(request.tools, choice, request.parallel_tool_calls),
                              param="tools", **options)

    def _take_cache(self, sequence: Sequence) -> None:
        if sequence.state is not State.READY:  # a follower with its copy of the leader's prompt, or one that ended
            return
        checkpoint = self.models.checkpoints[sequence.model]

        def new_cache(max_len: int) -> KVCache:  # a static slot where the model decodes in CUDA graphs
            return static_cache(checkpoint.model, max_len, device=checkpoint.device, dtype=checkpoint.dtype)

        self.prefix_cache.trim(self._bytes_in_use())
        scope, prompt = sequence.scope, sequence.prompt
        from_disk = None if self.kv_disk is None else self.kv_disk.take(
            checkpoint, sequence.request.user, prompt, sequence.max_len, new_cache,
            more_than=self.prefix_cache.reusable(scope, prompt))
        cache, reused = from_disk or self.prefix_cache.take(scope, prompt, sequence.max_len, new_cache)
        sequence.take_cache(in_slot(checkpoint.model, cache), reused)  # a kept cache goes into a free slot

    def _finish(self, sequence: Sequence) -> None:
        """Send the sequence's Done and keep its cache for requests that start the same way."""
        done, batch = sequence.done(), len(self.scheduler.running)
        if sequence.unsent:  # held back to the end (a possible tool call, and not one; a cancel's last piece)
            self.emit(Text(sequence.id, sequence.unsent, sequence.index))
        self.emit(done)
        if done.error:
            log.warning("request %s, reply %d: %s", sequence.id, sequence.index, done.error)
        if sequence.cache is not None:
            cache = sequence.cache
            if cache.slot is not None and cache.length >= cache.chunk:  # a static slot is for running sequences:
                cache = cache.copy_prefix(cache.length, cache.length)  # its positions are kept in a copy
            self.prefix_cache.put(sequence.scope, cache, self._bytes_in_use(without=sequence))
            if self.kv_disk is not None and (checkpoint := self.models.checkpoints.get(sequence.model)) is not None:
                self.kv_disk.save(checkpoint, sequence.request.user, cache)
        self._forget(sequence)
        s = done.stats
        log.info("reply: prompt %d tokens (%d from the cache), %d new tokens, first token %.2f s, %.1f tokens/s, "
                 "%.1f tokens a step (%d of %d guesses stood), %s, batch %d", s.prompt_tokens, s.reused_tokens,
                 s.new_tokens, s.time_to_first_token, s.tokens_per_second, s.tokens_per_step,
                 s.decoded_tokens - s.decode_steps, s.guesses, done.finish_reason, batch)

    def _forget(self, sequence: Sequence) -> None:
        sequences = self.requests.get(sequence.id, [])
        if sequence in sequences:
            sequences.remove(sequence)
        if not sequences:
            self.requests.pop(sequence.id, None)
            self._positions.pop(sequence.id, None)
        self.scheduler.remove(sequence)

    def _fail(self, request_id: str, message: str, reason: str) -> None:
        """End a whole request (all its sequences) with one Failed; its caches are not kept."""
        self.emit(Failed(request_id, message, reason))
        self.abandon(request_id)

    def fail_all(self, message: str) -> None:
        """End every request (the loop itself failed, outside any one request's work)."""
        for request_id in list(self.requests):
            self._fail(request_id, message, "error")

    def abandon(self, request_id: str) -> None:
        """Forget a request (its end is told already, or cannot be): its sequences and their caches go."""
        for sequence in list(self.requests.get(request_id, [])):
            sequence.cache = None
            self._forget(sequence)

    def _bytes_in_use(self, without: Sequence | None = None) -> int:
        return sum(s.cache.used_bytes for s in self.scheduler.running if s.cache is not None and s is not without)

    def _take_loaded(self) -> None:
        """Tell each model that finished loading, and start (or fail) the requests that waited for it."""
        for name, result, _ in self.models.take_loaded():
            waiting = [request_id for request_id, (leader, *_) in self.requests.items()
                       if leader.model == name and leader.state is State.NEW]
            if isinstance(result, Exception):
                message = f"The model {name} could not be loaded: {result}"
                self.emit(ModelFailed(name, message))
                for request_id in waiting:
                    self._fail(request_id, message, "load")
                continue
            self.models.used([name], self.clock())  # its keep-alive counts from here
            self.emit(ModelReady(self.models.infos[name]))
            for request_id in waiting:
                with self._contained(request_id, "Starting the request"):
                    self._prepare(request_id)

    def _announce_positions(self) -> None:
        positions = {sequence.id: position for sequence, position in self.scheduler.positions().items()
                     if sequence.index == 0 and sequence.id not in self._building}  # (not waiting: being built)
        for request_id, position in positions.items():
            if self._positions.get(request_id) != position:
                self.emit(Queued(request_id, position))
        self._positions = positions


    def _announce_stats(self) -> None:
        running = len(self.scheduler.running)
        stats = EngineStats(running, len(self.scheduler) - running,
                            self._bytes_in_use() + self.prefix_cache.nbytes, len(self.prefix_cache))
        if stats != self._stats:
            self.emit(stats)
            self._stats = stats


def release_memory() -> None:
    """Give back what an unloaded model held, as soon as nothing refers to it any more: reference cycles
    are collected (the loop froze the heap, models included: `serve` freezes it again at its next step;
    a full collection takes about 0.1 s, once per unload), freed blocks go back to the system (glibc keeps
    them for reuse: of the default model widened to fp32, 900 MB loaded, 70 MB stayed after its first
    unload, 200 MB after its third), and a GPU's cached blocks go back to the device."""
    gc.unfreeze()
    gc.collect()
    if _malloc_trim is not None:
        _malloc_trim(0)
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _libc_malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (macOS, musl)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None


_malloc_trim = _libc_malloc_trim()


# ---- the process ------------------------------------------------------------------------------

def serve(config: EngineConfig, input_address: str, output_address: str, parent: int) -> None:
    """The engine's loop over its sockets, until the web process (pid `parent`, which may have gone
    already while this one started) goes away, or sends SIGTERM."""
    import zmq

    if os.getppid() != parent:
        log.info("the web process %d is gone; stopping", parent)
        return
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.bind(input_address)
    sender = context.socket(zmq.PUSH)
    sender.setsockopt(zmq.LINGER, 0)  # what the web process did not read goes with it
    sender.connect(output_address)
    decode = msgspec.msgpack.Decoder(ToEngine).decode
    encode = msgspec.msgpack.Encoder().encode
    outbox = Outbox()

    def flush(idle: bool = False) -> None:
        if outbox.due(idle):
            data, failed = outbox.take_encoded(encode)
            for request_id in failed:  # told by a Failed in data: nothing more of it is computed
                engine.abandon(request_id)
            while not sender.poll(1000 * IDLE_POLL_S, zmq.POLLOUT):  # the web process is not reading
                if os.getppid() != parent:
                    raise SystemExit(0)
            sender.send(data)

    def emit(event: FromEngine) -> None:
        outbox.add(event)
        flush()  # mid-step: a new reply's first token goes before the step decodes the others

    engine = Engine(config, emit)
    frozen = -1  # Models.changes when the heap was last frozen

    try:
        engine.start()
        flush(idle=True)
        idle_since = time.monotonic()
        while os.getppid() == parent:
            if engine.busy:
                idle_since = time.monotonic()
            idle_work = (not (engine.busy or engine.preparing) and engine.idle_work
                         and time.monotonic() - idle_since >= REFINE_AFTER_S)
            if inbox.poll(0 if engine.busy or idle_work else
                          1000 * (LOADING_POLL_S if engine.models.loading or engine.preparing else IDLE_POLL_S)):
                while inbox.poll(0):
                    data = inbox.recv()
                    try:
                        message = decode(data)
                    except msgspec.DecodeError as e:  # the web side checks what it sends: not expected
                        log.error("a message that is no request (%d bytes) was left out: %s", len(data), e)
                        continue
                    engine.handle(message)
            elif idle_work:
                engine.refine()
            try:
                engine.step()
            except Exception:  # a fault of the loop itself, outside any one request's work
                log.exception("an engine step failed")
                engine.fail_all("The engine failed; please send your message again.")
            if engine.models.changes != frozen:
                # The imports and the loaded models live until a model is unloaded (release_memory unfreezes
                # the heap): frozen, no garbage collection walks them again (a full one took 124-141 ms
                # with the default model loaded, a pause of every stream). (Not gc.get_freeze_count() each
                # step: it counts the frozen objects one by one, and slowed decoding fivefold.)
                gc.freeze()
                frozen = engine.models.changes
            flush(idle=not engine.busy)
        log.info("the web process %d is gone; stopping", parent)
    finally:
        engine.close()
        inbox.close(linger=0)
        sender.close(linger=0)
        context.term()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or not args[2].isdigit():
        print("usage: python -m app.engine INPUT_ADDRESS OUTPUT_ADDRESS PARENT_PID < config.json", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the web process's to handle; it stops us
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s - %(levelname)s - %(name)s - %(message)s")
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=EngineConfig)
    if config.threads:
        torch.set_num_threads(config.threads)
    kernels.configure(enabled=config.kernels, march=config.kernel_march, deterministic=config.deterministic,
                      cache_dir=config.cache_dir)
    serve(config, args[0], args[1], int(args[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
