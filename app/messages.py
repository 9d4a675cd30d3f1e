"""The messages between the web process and the engine process, and the events a reply streams.

Both backends (the local engine, `app.backend.engine_client`, and a remote OpenAI-compatible server,
`app.backend.remote`) give the web side the same events, so the chat UI and the API never ask which one
runs. Everything here is a `msgspec.Struct`: encoded as MessagePack over the engine's sockets, and
plain typed objects everywhere else. Web -> engine:

    Generate(id, model, messages | prompt, settings, trim)   start a reply
    Cancel(id)                                          stop it at its next token
    Load(model)                                         load a model before a request needs it
    KeepAlive(model, seconds)                           how long it stays loaded once unused (Ollama's keep_alive)
    FindModels()                                        the weights folder changed: list the models again

Engine -> web, each event naming its request:

    Queued(position)    while it waits: how many requests are ahead of it (sent again on change)
    Loading(model)      the model is loading (its first use)
    Text(text)          a piece of the reply; the web side joins pieces to about one per 50 ms
    Done(text, finish_reason, stats, token_ids, context)   the last event of a reply, also of a cancelled
                        one; context: how the conversation fit the model's context (what was left out)
    Failed(message, reason)                        the last event of a request that could not run
    Restarting()        (from the web side itself) the engine process is restarting; the request waits for it

A request for n replies (the API's `n`) gets Text and Done events for each, told apart by `index`.

and about the engine: Started(profiles, default), ModelReady(info), ModelFailed(model, message),
ModelUnloaded(model) (idle past its keep-alive; its next request loads it again), ModelsFound(profiles),
EngineStats(running, waiting, kv_cache_bytes, kept_caches).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from model.stats import Stats  # a reply's figures: generate() reports the same type
from model.options import ModelOptions

from app.bounds import (
    MAX_FILE_CHARS,
    MAX_FILES,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_STOP_STRINGS,
    MAX_TOOLS,
    Bias,
    Count,
    FileText,
    MinP,
    Name,
    Penalty,
    RepetitionPenalty,
    Replies,
    Seed,
    StopString,
    Temperature,
    TokenId,
    Tokens,
    TopK,
    TopLogprobs,
    TopP,
)
from app.settings import DEFAULT_KV_CACHE_MB, DEFAULT_KV_DISK_MB, DEFAULT_MAX_BATCH

FINISH_REASONS = {"stop": "stop token", "length": "length limit (Max new tokens, in the settings)",
                  "cancelled": "stopped by user", "constraint_failed": "the JSON schema could not be followed"}


class ReplySettings(msgspec.Struct, frozen=True, omit_defaults=True):
    """Sampling and limits of one reply; None means the default (the server's, else the model's).
    The ranges (app.bounds) are what the engine takes; msgspec checks them where these are decoded."""

    max_new_tokens: Tokens | None = None
    temperature: Temperature | None = None
    top_k: TopK | None = None  # 0: off
    top_p: TopP | None = None
    min_p: MinP | None = None  # llama.cpp's: keep tokens at least this share of the top token's probability
    repetition_penalty: RepetitionPenalty | None = None  # llama.cpp's, over the last 64 tokens; 1 is off
    frequency_penalty: Penalty | None = None  # OpenAI's, over the reply; 0 is off
    presence_penalty: Penalty | None = None
    seed: Seed | None = None  # None: random; reply i of n takes bounds.reply_seed(seed, i)
    logit_bias: Annotated[dict[TokenId, Bias], Meta(max_length=MAX_LOGIT_BIAS)] | None = None  # OpenAI's: added
    # to those tokens' logits before sampling (model/sampling.py)
    stop: Annotated[tuple[StopString, ...], Meta(max_length=MAX_STOP_STRINGS)] = ()  # end the reply (not in it)
    ignore_eos: bool = False  # go on past the model's stop tokens, to the token limit (for benchmarks)

    def over(self, base: ReplySettings) -> ReplySettings:
        """These settings, with base's values where these are None."""
        return msgspec.structs.replace(base, **{name: value for name in self.__struct_fields__
                                                if (value := getattr(self, name)) is not None})


WHOLE = [-1]  # Attachment.chosen, FileUse.chosen: the file's whole text, not chunks of it
ChunkIndex = Annotated[int, Meta(ge=-1, le=MAX_FILE_CHARS)]


class Attachment(msgspec.Struct, frozen=True, omit_defaults=True):
    """A file sent with a user message, read into text at the edge (app.files.read). The engine decides,
    the first time, how much of it goes into the prompt (app.files.prompt); the web side keeps that
    decision (chosen) and sends it back, so the message renders to the same tokens every turn."""

    name: Name  # the file's name as uploaded (shown, and named in the prompt)
    text: FileText  # its text (a PDF's pages joined with "\f")
    size: Count = 0  # bytes of the uploaded file
    pages: Count = 0  # a PDF's page count; 0: not a paged document
    chosen: Annotated[list[ChunkIndex], Meta(max_length=MAX_FILE_CHARS)] | None = None
    # chunk indices (app.files.chunks) in the prompt when first sent; None: the engine decides (Context.files);
    # WHOLE: the whole text


class ChatMessage(msgspec.Struct, frozen=True, omit_defaults=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    ids: list[TokenId] | None = None  # a reply of the model's: the token ids it was generated as
    tool_calls: Annotated[list[dict], Meta(max_length=MAX_TOOLS)] | None = None  # an assistant's calls, as OpenAI's
    tool_call_id: Name | None = None  # a tool result: the call it answers
    files: Annotated[list[Attachment], Meta(max_length=MAX_FILES)] | None = None  # a user message's files


# ---- web -> engine ------------------------------------------------------------------------------

class EngineConfig(msgspec.Struct, omit_defaults=True):
    """What the engine process serves and how; sent once, as JSON on its standard input."""

    checkpoint: str  # the default model's checkpoint
    weights_dir: str | None = None  # every checkpoint folder in it is offered too
    prepare_default: bool = False  # convert the embedded default model when the checkpoint is missing
    tokenizer: str | None = None  # the default model's tokenizer, instead of its own
    device: str = ModelOptions.device
    dtype: str = ModelOptions.dtype
    quantize: str = ModelOptions.quantize
    kv_type: str = ModelOptions.kv_type  # "bf16" or "q8" (model/kv_cache.py)
    max_context: int | None = None  # LLAMA_MAX_CONTEXT; None: each model's own within the memory budget
    defaults: ReplySettings = ReplySettings()  # the server's defaults (LLAMA_TEMPERATURE, ...)
    max_batch: int = DEFAULT_MAX_BATCH  # sequences decoded together; more wait
    kv_cache_mb: int = DEFAULT_KV_CACHE_MB  # kept and running KV caches together
    # Seconds a model stays loaded after its last request ended (negative: until the engine stops); None
    # (LLAMA_KEEP_ALIVE unset): DEFAULT_KEEP_ALIVE_S, and the default model stays
    keep_alive: float | None = None
    kv_disk_dir: str | None = None  # where kept KV caches are written for after a restart; None: <cache_dir>/kv
    kv_disk_mb: int = DEFAULT_KV_DISK_MB  # those files together; 0: none are written or read
    threads: int | None = None
    speculate: str = ModelOptions.speculate  # "auto": decode steps check guessed tokens; "off"
    draft: str | None = None  # the checkpoint that drafts the guesses of the default model (else prompt lookup)
    # The engine process's options of the model package (model.kernels.configure, prepare_default)
    kernels: bool = ModelOptions.kernels
    kernel_march: str = ModelOptions.kernel_march
    deterministic: bool = ModelOptions.deterministic
    cache_dir: str = str(ModelOptions.cache_dir)
    smollm2_wheel: str | None = None


class Generate(msgspec.Struct, tag=True, omit_defaults=True):
    """A request, as checked at the edge: the web side encodes it and decodes it back as this type
    (every range and size holds, every string is encodable) before it takes a place in the queue."""

    id: Name
    model: Name
    settings: ReplySettings = ReplySettings()
    messages: Annotated[list[ChatMessage], Meta(max_length=MAX_MESSAGES)] = []  # a chat: any system prompt first
    left_out: Count = 0  # leading non-system messages already left out of this chat's prompt before
    trim: bool = True  # leave out the oldest messages that do not fit; False: fail ("prompt_too_long") instead
    prompt: str | None = None  # a raw completion prompt instead of messages
    n: Replies = 1  # replies to compute from the one prompt (prefilled once; seeds seed, seed + 1, ...)
    tools: Annotated[list[dict], Meta(max_length=MAX_TOOLS)] | None = None  # OpenAI tool definitions (Llama 3)
    tool_choice: str | dict | None = None  # "none", "auto", "required" or {"type": "function", ...}
    parallel_tool_calls: bool = True  # False: at most one call per reply
    json_schema: dict | None = None  # the reply is a document of this JSON schema (constrained decoding)
    json_object: bool = False  # the reply is a JSON object (OpenAI's json_object mode)
    logprobs: TopLogprobs | None = None  # report each token's log-probability and this many alternatives; None: off
    user: str = ""  # whose request: the engine reuses a kept KV cache only for requests of the same user


class Cancel(msgspec.Struct, tag=True):
    id: str


class Load(msgspec.Struct, tag=True):
    model: str


class KeepAlive(msgspec.Struct, tag=True):
    """How long a loaded (or loading) model stays loaded once no request uses it, from now until it is unloaded:
    seconds; 0: unload it as soon as none runs or waits for it; negative: until the engine stops; None: its
    keep-alive of LLAMA_KEEP_ALIVE again. For a model neither loaded nor loading: nothing."""

    model: str
    seconds: float | None = None


class FindModels(msgspec.Struct, tag=True):
    """A model folder was added to or removed from the weights folder: list the models again (ModelsFound)."""


# ---- engine -> web: a request's events ----------------------------------------------------------

class Queued(msgspec.Struct, tag=True):
    id: str
    position: int  # requests ahead of this one


class Loading(msgspec.Struct, tag=True):
    id: str
    model: str


class TokenLogprob(msgspec.Struct, array_like=True):
    token: str  # the token's text (U+FFFD where its bytes are part of a character)
    bytes: list[int]  # its UTF-8 bytes
    logprob: float  # in the model's own distribution (before penalties, filters and temperature)
    top: list[TokenLogprob] = []  # the most likely tokens at its position


class Text(msgspec.Struct, tag=True):
    id: str
    text: str
    index: int = 0  # which of the request's n replies
    logprobs: list[TokenLogprob] = []  # the tokens this text (or a later one) comes from, when asked for


def join_texts(pieces: list[Text]) -> Text:
    """Consecutive pieces of one reply as one Text."""
    first = pieces[0]
    return Text(first.id, "".join(p.text for p in pieces), first.index, [lp for p in pieces for lp in p.logprobs])


class Source(msgspec.Struct, frozen=True):
    """A chunk of a file that went into the prompt."""

    file: str  # the file's name
    where: str  # where the chunk is in the file: "pages 3-4", "lines 120-168", "part 2 of 9"
    text: str  # the chunk's text, as the model read it


class FileUse(msgspec.Struct, frozen=True, omit_defaults=True):
    """How much of one file went into the prompt."""

    name: str
    tokens: int  # tokens of this file in the prompt
    chosen: list[int]  # WHOLE; else chunk indices in file order (an Attachment's chosen on later turns)
    chunks: int = 0  # how many chunks the file has (0 when whole)
    sources: list[Source] = []  # the chunks used, when not whole


class Context(msgspec.Struct, frozen=True, omit_defaults=True):
    """How a reply's conversation fit the model's context, as the engine built the prompt: the web side
    shows it, and sends left_out back with the chat's next request, which then starts there too (and
    reuses the cache)."""

    limit: int = 0  # the model's context in tokens, prompt + reply; 0: not known (the request never started)
    room: int = 0  # tokens the prompt may take, the reply's share kept: past it, older messages go; 0: none ever go
    left_out: int = 0  # leading non-system messages not in the prompt: they no longer fit
    files: list[FileUse] = []  # the files of the request's last user message, as they went into the prompt


class Done(msgspec.Struct, tag=True):
    id: str
    text: str
    finish_reason: str  # "stop", "length", "cancelled" or "constraint_failed" (error says why)
    stats: Stats = msgspec.field(default_factory=Stats)
    token_ids: list[int] = []  # the reply as generated (a follow-up's prompt reuses them)
    index: int = 0  # which of the request's n replies (each ends with its own Done)
    tool_calls: list[dict] = []  # the calls the reply makes (a request with tools), as OpenAI writes them
    context: Context = Context()
    error: str = ""  # why the reply ended early: its JSON schema's constraint failed midway (model/structured.py)

    @property
    def context_used(self) -> int:
        """Tokens of the conversation as the model saw it: the prompt and this reply."""
        return self.stats.prompt_tokens + self.stats.new_tokens

    @property
    def summary(self) -> str:
        """One line for people: tokens, time to first token, speed, why it ended (how many tokens each step of
        speculative decoding gave is the engine log's, not words for the page)."""
        s = self.stats
        parts = [f"{s.new_tokens} tokens"]
        if s.new_tokens:
            parts.append(f"first token {s.time_to_first_token:.2f} s")
        if s.tokens_per_second:
            parts.append(f"{s.tokens_per_second:.1f} tokens/s")
        parts.append(FINISH_REASONS.get(self.finish_reason, self.finish_reason))
        return " · ".join(parts)


class Failed(msgspec.Struct, tag=True):
    id: str
    message: str
    reason: str  # "prompt_too_long", "load", "busy", "bad_request", "bad_schema", "engine", "restarting", "unread" or
    # "error"


class Restarting(msgspec.Struct, tag=True):
    """The engine process stopped; this request waits for the new one (app.backend.engine_client), a while at most."""

    id: str


Event = Queued | Loading | Text | Done | Failed | Restarting


# ---- engine -> web: about the engine ------------------------------------------------------------

class ModelInfo(msgspec.Struct):
    name: str
    context_limit: int  # prompt + reply, in tokens
    defaults: ReplySettings  # every field set: what a reply gets when the caller sets nothing
    load_seconds: float = 0.0  # how long loading it took (preparing it on first start included); 0: not known
    memory_bytes: int = 0  # what its weights (and buffers) hold in memory, mapped from the file or not; 0: not known
    device: str = "cpu"  # the kind of device its weights are on: "cpu", "cuda", "mps"


class Started(msgspec.Struct, tag=True):
    profiles: dict[str, str]  # model name -> where its checkpoint is
    default: str


class ModelReady(msgspec.Struct, tag=True):
    info: ModelInfo


class ModelFailed(msgspec.Struct, tag=True):
    model: str
    message: str


class ModelUnloaded(msgspec.Struct, tag=True):
    """The model was idle past its keep-alive and gave its memory back; a request for it loads it again."""

    model: str


class ModelsFound(msgspec.Struct, tag=True):
    """The models offered, listed again (FindModels): name -> where its checkpoint is."""

    profiles: dict[str, str]


class EngineStats(msgspec.Struct, tag=True):
    """Sent when it changes: what the engine holds now."""

    running: int = 0  # sequences in the batch
    waiting: int = 0  # sequences waiting for a place (or for their model)
    kv_cache_bytes: int = 0  # written positions of running and kept caches
    kept_caches: int = 0  # finished replies' caches kept for reuse


ToEngine = Generate | Cancel | Load | KeepAlive | FindModels
FromEngine = (Queued | Loading | Text | Done | Failed | Started | ModelReady | ModelFailed | ModelUnloaded
              | ModelsFound | EngineStats)
