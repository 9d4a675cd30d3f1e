"""Ollama's routes about the models (the replies' routes are app.api.ollama's):

    GET    /api/tags    every model, as /v1/models lists them: size on disk, a digest, modified_at, details
                        (format, family, parameter_size, quantization_level: model.summary reads them from the
                        checkpoint's headers, without loading it)
    POST   /api/show    one model: details, model_info (the architecture's numbers, context_length as the
                        server runs it), capabilities ("completion", "tools" for Llama 3 chat formats), its chat
                        template, and the sampling values a request leaves out (parameters, once it has loaded)
    GET    /api/ps      the models loaded now: size (its weights on disk), expires_at (when it is unloaded if no
                        request uses it before: its keep-alive), context_length, size_vram (its bytes on a GPU; 0 on
                        the CPU)
    POST   /api/pull    a Hugging Face checkpoint (owner/name, hf.co/owner/name, :revision or :Q4_K_M) into the weights folder;
                        a model here already, named as /api/tags names it, is a success at once
                        (app.weights: a download that goes on if the client goes away, and resumes); the progress
                        streamed as Ollama's: {"status", "digest", "total", "completed"}, then {"status": "success"}
    DELETE /api/delete  a model folder out of the weights folder (not the default model; a loaded one is unloaded first)

Pull and delete are for the users LLAMA_MODEL_ADMINS names (app.api.keys: a key's user; 403 for the others),
except a pull of a model here already, which is a success for anyone.

The digest is not of the weights' bytes (hashing gigabytes at each listing would take minutes): it is a SHA-256
of the checkpoint's file names, sizes and times, so it changes when the files do. A remote server's models
(LLAMA_BACKEND_URL) are listed with what is known of them: their names.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

import msgspec
from fastapi import Request as HttpRequest
from fastapi.responses import Response, StreamingResponse

from model.checkpoint_files import CheckpointError, find_checkpoint, tokenizer_file
from model.config import ConfigError, LlamaConfig
from model.convert.folder import folder_name, source_of
from model.summary import count, summarize

from app.backend.protocol import Backend, EngineError, is_remote
from app.weights import InUse, Refused, TooManyPulls, Weights
from app.api.keys import check_may_manage
from app.api.openai import ApiError
from app.api.body import json_body
from app.api.ollama_shapes import (NDJSON, Details, Error, ModelBody, ModelEntry, ModelList, Progress, ShowReply, now_text,
                                   read_ollama)

QUANTIZATION = {"bf16": "BF16", "fp16": "F16", "fp32": "F32", "fp64": "F64", "int8": "INT8", "int4": "INT4"}
FOREVER_S = 2**63 / 1e9  # a model kept until the engine stops expires as Ollama's do: at Go's longest duration
LLAMA3_TEMPLATE = (  # the Llama 3 chat format (model/chat_format.py), as Ollama's Go templates write it
    "{{ if .System }}<|start_header_id|>system<|end_header_id|>\n\n{{ .System }}<|eot_id|>{{ end }}"
    "{{ range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>{{ end }}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n")
PARAMETERS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
              "repetition_penalty": "repeat_penalty", "frequency_penalty": "frequency_penalty",
              "presence_penalty": "presence_penalty", "max_new_tokens": "num_predict"}


def local_name(named: str, profiles: dict) -> str | None:
    """Our model by the name a client gives: ours, Ollama's `name:latest` for it, or the Hugging Face name it was
    pulled by (hf.co/owner/name:Q4_K_M, folder_name's folder); None if it is not here."""
    base, _, tag = named.rpartition(":")
    if named not in profiles and tag == "latest" and base in profiles:
        return base
    if named not in profiles and "/" in named:  # (a folder of that name pulled from another repo is not this one)
        repo_id, revision = hub_name(named)
        where = profiles.get(pulled := folder_name(repo_id, revision))
        source = source_of(Path(where)) if where is not None and not is_remote(where) else None
        if source is not None and source[0].lower() == repo_id.lower():
            return pulled
    return named if named in profiles else None


def model_named(named: str | None, profiles: dict) -> str:
    """local_name, or a 400 for no name and a 404 for one not here."""
    if not named:
        raise ApiError(400, "'model' is required: one of the models of GET /api/tags.", param="model")
    name = local_name(named, profiles)
    if name is None:
        raise ApiError(404, f"model '{named}' not found", param="model", code="model_not_found")
    return name



def entry(backend: Backend, name: str, started: float) -> ModelEntry:
    """A model as /api/tags lists it (reads the checkpoint's headers: call on a thread)."""
    where = backend.profiles[name]
    if is_remote(where):
        return ModelEntry(name=name, model=name, modified_at=now_text(started), size=0,
                          digest=hashlib.sha256(f"{where} {name}".encode()).hexdigest(), details=Details())
    files = sorted(p for p in ([Path(where)] if Path(where).is_file() else Path(where).rglob("*")) if p.is_file())
    stats = [(str(p.relative_to(where) if p != Path(where) else p.name), p.stat()) for p in files]
    digest = hashlib.sha256(repr([(f, s.st_size, s.st_mtime_ns) for f, s in stats]).encode()).hexdigest()
    try:
        summary = summarize(where)
        details = Details(format=summary.format, family="llama", families=["llama"],
                          parameter_size=count(summary.parameters) if summary.parameters else "",
                          quantization_level=QUANTIZATION.get(summary.dtype, (summary.dtype or "").upper()))
        size = summary.bytes
    except (CheckpointError, OSError):  # (removed, or broken, since the engine listed it)
        details, size = Details(), sum(s.st_size for _, s in stats)
    modified = max((s.st_mtime for _, s in stats), default=started)
    return ModelEntry(name=name, model=name, modified_at=now_text(modified), size=size, digest=digest,
                      details=details)


def config(where: str) -> LlamaConfig | None:
    try:
        files = find_checkpoint(where)
        return LlamaConfig.from_meta_params(files.config) if files.format == "meta" else \
            LlamaConfig.from_hf_config(files.config)
    except (CheckpointError, ConfigError, KeyError, TypeError, ValueError):
        return None


def context_length(backend: Backend, name: str, max_context: int | None) -> int | None:
    """The context the model runs with: the engine's word once it has loaded it; before, its config's length
    within LLAMA_MAX_CONTEXT."""
    try:
        return backend.context_limit(name)
    except EngineError:
        found = config(backend.profiles[name])
        return min(found.max_seq_len, max_context or found.max_seq_len) if found else None


def show(backend: Backend, name: str, max_context: int | None, started: float) -> ShowReply:
    """A model as /api/show tells it (reads its config and tokenizer files: call on a thread)."""
    listed, where = entry(backend, name, started), backend.profiles[name]
    found = None if is_remote(where) else config(where)
    info: dict[str, object] = {"general.architecture": "llama", "llama.context_length": context_length(
        backend, name, max_context)}
    if found is not None:
        try:
            info["general.parameter_count"] = summarize(where).parameters
        except (CheckpointError, OSError):  # (a config beside weights that cannot be read: listed without)
            pass
        info |= {"llama.embedding_length": found.dim,
                 "llama.block_count": found.n_layers, "llama.feed_forward_length": found.ffn_dim,
                 "llama.attention.head_count": found.n_heads, "llama.attention.head_count_kv": found.n_kv_heads,
                 "llama.attention.layer_norm_rms_epsilon": found.norm_eps, "llama.rope.freq_base": found.rope_theta,
                 "llama.rope.dimension_count": found.head_dim, "llama.vocab_size": found.vocab_size}
    template, llama3 = chat_template(where)
    try:
        defaults = msgspec.structs.asdict(backend.reply_defaults(name))
    except EngineError:  # never loaded: its own defaults are read as it loads
        defaults = {}
    parameters = "\n".join(f"{PARAMETERS[k]:<30} {v}" for k, v in defaults.items() if k in PARAMETERS and v is not None)
    modelfile = f"# The model as this server runs it\nFROM {where}\n" + "".join(
        f"PARAMETER {line}\n" for line in parameters.splitlines())
    return ShowReply(modelfile=modelfile, parameters=parameters, template=template, details=listed.details,
                     model_info=info, capabilities=["completion", "tools"] if llama3 else ["completion"],
                     modified_at=listed.modified_at)


def chat_template(where: str) -> tuple[str, bool]:
    """The model's chat template, and whether it is Llama 3's (which takes tools): a checkpoint with Meta's
    tokenizer (or none) gets Llama 3's chat format; one with tokenizer.json its own Jinja template
    (model/chat_format.py's load_chat_format)."""
    if is_remote(where):
        return "", False
    folder = Path(where) if Path(where).is_dir() else Path(where).parent
    found = tokenizer_file(folder)
    if found is None or found.suffix == ".model":
        return LLAMA3_TEMPLATE, True
    try:
        template = msgspec.json.decode((folder / "tokenizer_config.json").read_bytes()).get("chat_template")
    except (OSError, msgspec.DecodeError, AttributeError):
        template = None
    if not isinstance(template, str) and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8", errors="replace")
    return template if isinstance(template, str) else "", False


def running(backend: Backend, name: str, max_context: int | None, started: float) -> ModelEntry:
    """A loaded model as /api/ps lists it."""
    listed = entry(backend, name, started)
    forever = time.time() + FOREVER_S  # (also the latest date: LLAMA_KEEP_ALIVE may say more)
    unloads = backend.unloads_at(name)
    return msgspec.structs.replace(listed, expires_at=now_text(forever if unloads is None else min(unloads, forever)),
                                   context_length=context_length(backend, name, max_context),
                                   size_vram=backend.device_memory_bytes(name))


def model_asked(body: object, profiles: dict | None) -> tuple[str, ModelBody]:
    """The model a body names (`model`, or `name` as older clients write it): one of `profiles` (404 if not), or
    with profiles None the name as given."""
    asked = read_ollama(body, ModelBody)
    named = asked.model or asked.name
    return (model_named(named, profiles) if profiles is not None else named or ""), asked


def add_routes(route, backend: Backend, max_body_mb: int, weights: Weights, max_context: int | None) -> None:
    """The model routes, added with app.api.ollama's `route` (Ollama's error shape, the API's key check); pulls
    and removals are `weights`' jobs (the chat's models panel shares them)."""
    started = time.time()

    def json(shape) -> Response:
        return Response(msgspec.json.encode(shape), media_type="application/json")

    @route("/api/tags", ["GET"])
    async def tags() -> Response:
        return json(ModelList(await asyncio.to_thread(
            lambda: [entry(backend, name, started) for name in list(backend.profiles)])))

    @route("/api/show", ["POST"])
    async def show_model(http_request: HttpRequest) -> Response:
        name, _ = model_asked(await json_body(http_request, max_body_mb, any_type=True), backend.profiles)
        return json(await asyncio.to_thread(show, backend, name, max_context, started))

    @route("/api/ps", ["GET"])
    async def ps() -> Response:
        loaded = [name for name in list(backend.profiles) if backend.in_memory(name)]
        return json(ModelList(await asyncio.to_thread(
            lambda: [running(backend, name, max_context, started) for name in loaded])))

    @route("/api/delete", ["DELETE"])
    async def delete(http_request: HttpRequest) -> Response:
        check_may_manage(http_request, "delete models")
        name, _ = model_asked(await json_body(http_request, max_body_mb, any_type=True), backend.profiles)
        try:
            await weights.remove(name)
        except InUse as e:
            raise ApiError(409, str(e)) from None
        except Refused as e:
            raise ApiError(400, str(e)) from None
        return json(Progress("success"))

    @route("/api/pull", ["POST"])
    async def pull(http_request: HttpRequest) -> Response:
        named, asked = model_asked(await json_body(http_request, max_body_mb, any_type=True), None)
        if named and local_name(named, backend.profiles) is not None:  # (anyone may ask that of a model here)
            # a model here already, by its own name (clients that "ensure" a model pull it first): as Ollama's
            if asked.stream is False:
                return json(Progress("success"))
            return StreamingResponse(iter([msgspec.json.encode(Progress(s)) + b"\n" for s in ("pulling manifest", "success")]),
                                     media_type=NDJSON, headers={"Cache-Control": "no-cache"})
        check_may_manage(http_request, "pull models")
        repo_id, revision = hub_name(named)
        try:
            job = await weights.pull(repo_id, revision)
        except TooManyPulls as e:
            raise ApiError(429, str(e), param="model") from None
        except Refused as e:
            raise ApiError(400, str(e), param="model") from None
        digest = f"{repo_id}@{revision or 'main'}"
        if asked.stream is False:
            await job.finished.wait()
            if job.error:  # the status its error means: a repo not found 404, gated 401/403, no network 502
                raise ApiError(job.status, job.error, type="server_error" if job.status >= 500 else "invalid_request_error")
            return json(Progress("success"))

        async def lines():
            yield msgspec.json.encode(Progress("pulling manifest")) + b"\n"
            async for now in job.watch():
                if now.total is not None:
                    yield msgspec.json.encode(Progress(f"pulling {repo_id}", digest, now.total, now.completed())) + b"\n"
            last = Error(job.error) if job.error else Progress("success")
            yield msgspec.json.encode(last) + b"\n"

        return StreamingResponse(lines(), media_type=NDJSON, headers={"Cache-Control": "no-cache"})


def hub_name(named: str) -> tuple[str, str | None]:
    """Ollama's way of naming a Hugging Face model ("hf.co/owner/name:revision") as (repo id, revision); a
    revision "latest" is the repo's main branch."""
    if not named:
        raise ApiError(400, "'model' is required: a Hugging Face model id (owner/name).", param="model")
    for prefix in ("https://", "hf.co/", "huggingface.co/"):
        named = named.removeprefix(prefix)
    repo_id, _, revision = named.partition(":")
    return repo_id, None if revision in ("", "latest") else revision
