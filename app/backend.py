"""Which backend computes the replies: the local engine process, or a remote OpenAI-compatible server.

Both offer the same calls, which is all the chat UI (`app.main`) and the API (`app.api`) use:

    profiles, default           the models offered (name -> where), and the one used when none is named
    await start()               ready to take requests (the models are listed)
    ready                       the default model is loaded
    is_loaded(name), await load(name) -> ModelInfo
    context_limit(name), reply_defaults(name)     of a loaded model
    stream(conversation, settings) -> Reply       async-iterate it for events; reply.cancel()
    cancel(request_id), active, close()
"""

from __future__ import annotations

from .client import EngineClient, EngineError, InvalidRequest, ServerBusy
from .messages import EngineConfig, ReplySettings
from .remote import RemoteClient
from .settings import Settings

Backend = EngineClient | RemoteClient


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
        device=settings.device, dtype=settings.dtype, quantize=settings.quantize,
        max_context=settings.max_context,
        defaults=ReplySettings(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                               top_k=settings.top_k, top_p=settings.top_p, min_p=settings.min_p,
                               repetition_penalty=settings.repetition_penalty),
        max_batch=settings.max_batch, kv_cache_mb=settings.kv_cache_mb, threads=settings.threads,
        kernels=settings.kernels, kernel_march=settings.kernel_march, deterministic=settings.deterministic,
        cache_dir=str(settings.cache_dir),
        smollm2_wheel=str(settings.smollm2_wheel) if settings.smollm2_wheel else None)


__all__ = ["Backend", "EngineError", "InvalidRequest", "ServerBusy", "engine_config", "open_backend"]
