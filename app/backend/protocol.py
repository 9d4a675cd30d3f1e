"""The backend: what computes the replies for the chat UI (`app.main`) and the API (`app.api`).

Two implement it: `EngineClient` (app.backend.engine_client), the engine process on this machine, and `RemoteClient`
(app.backend.remote), any OpenAI-compatible server named by LLAMA_BACKEND_URL. `Backend` is the contract both keep,
and all that the web side may use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from app.backend.engine_client import EngineClient, EngineError, InvalidRequest, ServerBusy
from app.backend.conversation import Conversation
from app.messages import EngineConfig, EngineStats, Event, ModelInfo, ReplySettings
from app.backend.remote import RemoteClient
from app.backend.reply import Reply
from app.settings import Settings


class Backend(Protocol):
    profiles: dict[str, str]  # the models offered: name -> a checkpoint folder, or a remote server's address
    default: str | None  # the one used when a request names none (known once started)
    restarts: int  # how often the engine process was started again after it stopped
    observers: list[Callable[[Event], None]]  # called with each reply's last event (the API's metrics)
    ready: bool  # the default model has loaded (it may be unloaded since, and loads again): /health says 200
    stats: EngineStats  # the engine's figures, as last reported (the API's metrics)
    places_taken: int  # replies running or waiting, of the most the queue takes

    async def start(self) -> None:
        """Ready to take requests: the models are listed."""

    def is_loaded(self, name: str | None = None) -> bool:
        """Whether a request for the model is answered without loading it first."""

    def in_memory(self, name: str | None = None) -> bool | None:
        """Whether the model is loaded now (the engine unloads a model idle past LLAMA_KEEP_ALIVE); None:
        not known here (a remote server's)."""

    async def load(self, name: str | None = None) -> ModelInfo:
        """Load a model if it is not loaded; raises EngineError with the reason when it cannot be."""

    def context_limit(self, name: str | None = None) -> int:
        """Of a loaded model: its context in tokens."""

    def reply_defaults(self, name: str | None = None) -> ReplySettings:
        """Of a loaded model: the sampling values a request leaves out (its generation_config)."""

    def memory_bytes(self, name: str | None = None) -> int | None:
        """Of a model loaded now: the bytes its weights hold; None: not loaded, or not known (a remote server's)."""

    def device_memory_bytes(self, name: str | None = None) -> int:
        """Of a model loaded now: the bytes its weights hold on a GPU (Ollama's size_vram); 0 on the CPU, not
        loaded, or not known."""

    def keep_alive(self, name: str | None, seconds: float | None) -> None:
        """How long a loaded (or loading) model stays loaded once unused, until it is unloaded (Ollama's
        keep_alive): seconds; 0: unloaded as soon as no request uses it; negative: until the engine stops; None:
        LLAMA_KEEP_ALIVE's again."""

    def unloads_at(self, name: str | None = None) -> float | None:
        """Of a loaded model: when (time.time()) it is unloaded unless a request uses it before; None: it stays
        (or, for a remote server's, not known)."""

    async def find_models(self) -> dict[str, str]:
        """List the models again (a model folder was added to or removed from the weights folder): the profiles."""

    def stream(self, conversation: Conversation, settings: ReplySettings | None = None, n: int = 1,
               **options) -> Reply:
        """Start n replies to the conversation's last message; async-iterate the Reply for its events,
        reply.cancel() stops it. Raises ServerBusy (queue full) or InvalidRequest."""

    def complete(self, prompt: str, model: str | None = None, settings: ReplySettings | None = None,
                 n: int = 1, **options) -> Reply:
        """Continue a raw text prompt (no chat format); otherwise as stream()."""

    def cancel(self, request_id: str) -> bool: ...

    def close(self, timeout: float = 10.0) -> None: ...


def is_remote(where: str) -> bool:
    """Whether a profile's place is a remote server's address rather than a checkpoint folder."""
    return "://" in where


def open_backend(settings: Settings) -> Backend:
    """The engine process serving LLAMA_CHECKPOINT (and LLAMA_WEIGHTS_DIR's models) as the settings
    say; with LLAMA_BACKEND_URL, that server instead."""
    if settings.backend_url:
        return RemoteClient.from_settings(settings)
    return EngineClient(engine_config(settings), max_waiting=settings.max_waiting)


def engine_config(settings: Settings) -> EngineConfig:
    return EngineConfig(
        checkpoint=str(settings.checkpoint), weights_dir=str(settings.weights_dir),
        prepare_default=settings.is_default_checkpoint,
        tokenizer=str(settings.tokenizer) if settings.tokenizer else None,
        device=settings.device, dtype=settings.dtype, quantize=settings.quantize, kv_type=settings.kv_type,
        max_context=settings.max_context,
        defaults=ReplySettings(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                               top_k=settings.top_k, top_p=settings.top_p, min_p=settings.min_p,
                               repetition_penalty=settings.repetition_penalty),
        max_batch=settings.max_batch, kv_cache_mb=settings.kv_cache_mb, keep_alive=settings.keep_alive,
        threads=settings.threads, kv_disk_dir=str(settings.kv_disk_dir), kv_disk_mb=settings.kv_disk_mb,
        speculate=settings.speculate, draft=str(settings.draft) if settings.draft else None,
        kernels=settings.kernels, kernel_march=settings.kernel_march, deterministic=settings.deterministic,
        cache_dir=str(settings.cache_dir),
        smollm2_wheel=str(settings.smollm2_wheel) if settings.smollm2_wheel else None)


__all__ = ["Backend", "EngineError", "InvalidRequest", "ServerBusy", "engine_config", "is_remote", "open_backend"]
