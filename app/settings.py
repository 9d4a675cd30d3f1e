"""The app's configuration, read once from environment variables.

The model's options (`model.options`: checkpoint, device, dtype, sampling defaults, the decode
kernel, ...) and the web server's own (sign-in, history, limits, allowed hosts, ...), read by one
reader. Every variable is optional. An empty value counts as unset. A value that cannot be used
stops the app at start-up with a message naming the variable, what was expected and what was found:

    LLAMA_TOP_P=abc: expected a number between 0 and 1

Sampling values left unset come from each checkpoint's generation_config.json
(`model.generation.sampling_defaults`).
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from model.options import DEFAULT_CACHE_DIR, PROJECT_ROOT, Environment, ModelOptions, SettingsError, read_model_options

from app.bounds import MAX_PENDING_BYTES

DEFAULT_KV_CACHE_MB = 1024  # KV caches kept between turns, all conversations together
DEFAULT_KV_DISK_MB = 4096  # KV caches kept on disk for after a restart (app/engine/kv_disk.py); 0: none
DEFAULT_MAX_BATCH = 8  # replies computed together
DEFAULT_KEEP_ALIVE_S = 300.0  # a model idle this long is unloaded (the default model stays, unless LLAMA_KEEP_ALIVE is set)
DEFAULT_MAX_WAITING = 32  # replies waiting for a place in the batch; past it the server says it is busy
DEFAULT_MAX_BODY_MB = 4  # an API request's body; past it, 413
DEFAULT_MAX_PULLS = 2  # downloads or imports under way at once: each a process, its memory and the disk's and network's time
DEFAULT_HISTORY_DB = PROJECT_ROOT / "data" / "history.db"
DEFAULT_MAX_USER_FILES_MB = 500  # files a user's stored chats hold (app.web.attachments); past it, a message is refused
DEFAULT_PRESETS = PROJECT_ROOT / "presets"  # system-prompt presets (app.web.presets)
AUTH_MODES = ("none", "password")
DEFAULT_HEADER_TIMEOUT_S = 10.0  # a request's headers must arrive within this (app.web.http_server)
DEFAULT_BODY_TIMEOUT_S = 30.0  # and its body within this after them
DEFAULT_WRITE_TIMEOUT_S = 30.0  # a client that takes nothing of its answer (or websocket) this long is cut off


@dataclass(frozen=True)
class Settings(ModelOptions):
    """The model's options (checkpoint, device, sampling defaults, ...: model.options) and the app's."""

    presets: Path = DEFAULT_PRESETS  # a folder of named system prompts, NAME.md each
    kv_cache_mb: int = DEFAULT_KV_CACHE_MB  # KV caches kept between turns, all conversations together
    keep_alive: float | None = None  # seconds a model stays loaded when unused (negative: always); None: unset
    kv_disk_dir: Path = DEFAULT_CACHE_DIR / "kv"  # <cache_dir>/kv unless LLAMA_KV_DISK_DIR says otherwise
    kv_disk_mb: int = DEFAULT_KV_DISK_MB
    max_batch: int = DEFAULT_MAX_BATCH
    max_waiting: int = DEFAULT_MAX_WAITING
    max_body_mb: int = DEFAULT_MAX_BODY_MB
    max_pulls: int = DEFAULT_MAX_PULLS  # models pulled at once; more are refused (429) until one ends
    max_pending_mb: int = MAX_PENDING_BYTES // 2**20  # a user's uploads not sent yet, over all their tabs
    history: bool = True
    history_db: Path = DEFAULT_HISTORY_DB
    max_user_files_mb: int = DEFAULT_MAX_USER_FILES_MB
    auth: str = "none"  # "none": one local user, no login form; "password": a login form
    password: str | None = None
    users_file: Path | None = None
    api_key: str | None = None  # one key for the API and /metrics, its holders one user (app.api.keys)
    api_keys_file: Path | None = None  # a key per user (app.api.keys); sign-in needs this or api_key
    backend_url: str | None = None  # an OpenAI-compatible server that generates instead of this process
    backend_key: str | None = None
    backend_model: str | None = None
    allowed_hosts: tuple[str, ...] = ()  # host names besides loopback that requests may name (app.api.guard)
    allowed_origins: tuple[str, ...] = ()  # web pages besides the app's own that may send requests (app.api.guard)
    trusted_proxies: tuple[str, ...] = ()  # addresses or networks whose X-Forwarded-For is believed
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S
    write_timeout: float = DEFAULT_WRITE_TIMEOUT_S
    model_admins: tuple[str, ...] | None = None  # who may pull and remove models in the chat; None: everyone
    checkpoint_set: bool = False  # LLAMA_CHECKPOINT chose the default model (over the one chosen in the chat)

    @property
    def data_dir(self) -> Path:
        """The folder of what the app keeps across restarts: the history, the default model chosen in the chat."""
        return self.history_db.parent

    def may_manage_models(self, user: str | None) -> bool:
        """LLAMA_MODEL_ADMINS: the users (sign-in names, key users' names: app.api.keys) who may pull, remove,
        unload and import models, in the chat and through the API; unset, everyone where there is no sign-in,
        and nobody where there is."""
        if self.model_admins is not None:
            return user in self.model_admins
        return self.auth != "password"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = _AppEnvironment(environ)
        auth, password, users_file = (env.choice("LLAMA_AUTH", AUTH_MODES), env.text("LLAMA_PASSWORD"),
                                      env.path("LLAMA_USERS"))
        options = read_model_options(env)
        history_db = env.path("LLAMA_HISTORY_DB", DEFAULT_HISTORY_DB)
        if env.text("LLAMA_CHECKPOINT") is None and (chosen := chosen_default(history_db.parent,
                                                                              options["weights_dir"])):
            options["checkpoint"] = chosen  # made the default in the chat's models panel
        settings = cls(
            **options,
            presets=env.path("LLAMA_PRESETS", DEFAULT_PRESETS),
            kv_cache_mb=env.integer("LLAMA_KV_CACHE_MB", low=0, default=DEFAULT_KV_CACHE_MB),
            keep_alive=env.duration("LLAMA_KEEP_ALIVE"),
            kv_disk_dir=env.path("LLAMA_KV_DISK_DIR", options["cache_dir"] / "kv"),
            kv_disk_mb=env.integer("LLAMA_KV_DISK_MB", low=0, default=DEFAULT_KV_DISK_MB),
            max_batch=env.integer("LLAMA_MAX_BATCH", low=1, default=DEFAULT_MAX_BATCH),
            max_waiting=env.integer("LLAMA_MAX_WAITING", low=0, default=DEFAULT_MAX_WAITING),
            max_body_mb=env.integer("LLAMA_MAX_BODY_MB", low=1, default=DEFAULT_MAX_BODY_MB),
            max_pulls=env.integer("LLAMA_MAX_PULLS", low=1, default=DEFAULT_MAX_PULLS),
            max_pending_mb=env.integer("LLAMA_MAX_PENDING_MB", low=1, default=MAX_PENDING_BYTES // 2**20),
            history=env.switch("LLAMA_HISTORY", default=True),
            history_db=history_db,
            max_user_files_mb=env.integer("LLAMA_MAX_USER_FILES_MB", low=1, default=DEFAULT_MAX_USER_FILES_MB),
            auth=auth or ("password" if password or users_file else "none"),  # a password or users file: sign-in
            password=password,
            users_file=users_file,
            api_key=_strip(env.text("LLAMA_API_KEY")),
            api_keys_file=env.path("LLAMA_API_KEYS"),
            backend_url=env.url("LLAMA_BACKEND_URL"),
            backend_key=_strip(env.text("LLAMA_BACKEND_KEY")),
            backend_model=_strip(env.text("LLAMA_BACKEND_MODEL")),
            allowed_hosts=env.items("LLAMA_ALLOWED_HOSTS"),
            allowed_origins=env.items("LLAMA_ALLOWED_ORIGINS"),
            trusted_proxies=env.networks("LLAMA_TRUSTED_PROXIES"),
            header_timeout=env.number("LLAMA_HEADER_TIMEOUT", 0.0, 3600.0, low_open=True,
                                      default=DEFAULT_HEADER_TIMEOUT_S),
            body_timeout=env.number("LLAMA_BODY_TIMEOUT", 0.0, 3600.0, low_open=True, default=DEFAULT_BODY_TIMEOUT_S),
            write_timeout=env.number("LLAMA_WRITE_TIMEOUT", 0.0, 3600.0, low_open=True,
                                     default=DEFAULT_WRITE_TIMEOUT_S),
            model_admins=env.items("LLAMA_MODEL_ADMINS") if env.text("LLAMA_MODEL_ADMINS") is not None else None,
            checkpoint_set=env.text("LLAMA_CHECKPOINT") is not None,
        )
        _check_sign_in(settings, auth)
        return settings


DEFAULT_MODEL_FILE = "default-model"  # in the data folder: the name of the model made the default in the chat


def chosen_default(data_dir: Path, weights_dir: Path) -> Path | None:
    """The model folder made the default in the chat's models panel, if it is still in the weights folder."""
    try:
        name = (data_dir / DEFAULT_MODEL_FILE).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    folder = weights_dir / name
    return folder if name and not name.startswith(".") and "/" not in name and folder.is_dir() else None


def save_default(data_dir: Path, name: str) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / DEFAULT_MODEL_FILE).write_text(name + "\n", encoding="utf-8")


def _check_sign_in(settings: Settings, auth: str | None) -> None:
    """LLAMA_PASSWORD or LLAMA_USERS turns sign-in on, and sign-in needs LLAMA_API_KEY or LLAMA_API_KEYS (else the
    API and /metrics would stay open to anyone who reaches the port)."""
    given = " and ".join(name for name, value in [("LLAMA_PASSWORD", settings.password),
                                                  ("LLAMA_USERS", settings.users_file)] if value)
    if auth == "none" and given:
        raise SettingsError(f"LLAMA_AUTH=none with {given} set: unset LLAMA_AUTH (or set it to password) to have "
                            f"sign-in, or unset {given} to have one local user and no sign-in")
    if auth == "password" and not given:
        raise SettingsError("LLAMA_AUTH=password: expected LLAMA_PASSWORD or LLAMA_USERS to be set too")
    if given and not settings.api_key and not settings.api_keys_file:
        raise SettingsError(f"sign-in is on ({given} set): the API and /metrics then need a key too, else anyone "
                            "who reaches the port could use them; set LLAMA_API_KEYS to a file of keys per user "
                            "(python -m app.api.keys add NAME --file FILE), or LLAMA_API_KEY to one long random "
                            "string (e.g. from: python -c 'import secrets; print(secrets.token_urlsafe(32))')")


def users_file(environ: Mapping[str, str] | None = None) -> Path | None:
    """LLAMA_USERS alone: `python -m app.web.users` needs no other setting."""
    return Environment(environ).path("LLAMA_USERS")


def _strip(value: str | None) -> str | None:
    return value.strip() if value is not None else None


_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h)")  # one number and its unit: 1.5h, 30s


def parse_duration(text: str) -> float:
    """Seconds, as Ollama's keep_alive takes them: a number of seconds, or a duration such as 30s, 5m, 1h or
    1h30m (units ms, s, m, h); negative stands for "forever". ValueError for anything else."""
    text = text.strip().lower()
    try:
        seconds = float(text)
    except ValueError:
        sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.removeprefix("+"))
        parts = _DURATION_PART.findall(body)
        seconds = (sign * sum(float(number) * _DURATION_UNITS[unit] for number, unit in parts)
                   if parts and "".join(number + unit for number, unit in parts) == body else math.nan)
    if not math.isfinite(seconds):
        raise ValueError(f"{text!r} is not a number of seconds or a duration such as 30s, 5m or 1h")
    return seconds


def keep_alive_for(name: str, default: str | None, configured: float | None) -> float:
    """Seconds a model stays loaded after its last use (negative: until the engine stops): LLAMA_KEEP_ALIVE
    (`configured`) when set, for every model; unset, DEFAULT_KEEP_ALIVE_S, and the default model (the one most
    requests want) stays."""
    if configured is not None:
        return configured
    return -1.0 if name == default else DEFAULT_KEEP_ALIVE_S


class _AppEnvironment(Environment):
    """The reader of model.options, and the kinds of value only the web server reads: lists, networks, URLs,
    durations."""

    def items(self, name: str) -> tuple[str, ...]:
        """A comma-separated list (app.api.guard checks the entries, naming the variable)."""
        return tuple(item.strip() for item in (self.text(name) or "").split(",") if item.strip())

    def networks(self, name: str) -> tuple[str, ...]:
        """Comma-separated addresses or networks (CIDR), each written as ipaddress writes it."""
        networks = []
        for item in self.items(name):
            try:
                networks.append(str(ipaddress.ip_network(item, strict=False)))
            except ValueError:
                raise SettingsError(f"{name}: {item!r} is not an address or network: expected entries such as "
                                    "127.0.0.1, 10.0.0.0/8 or ::1, comma-separated") from None
        return tuple(networks)

    def duration(self, name: str) -> float | None:
        """Seconds, as Ollama's keep_alive takes them (`parse_duration`)."""
        value = self.text(name)
        if value is None:
            return None
        try:
            return parse_duration(value)
        except ValueError:
            raise SettingsError(f"{name}={value}: expected a number of seconds or a duration such as 30s, 5m or 1h "
                                "(negative: forever)") from None

    def url(self, name: str) -> str | None:
        value = self.text(name)
        if value is None:
            return None
        url = value.strip().rstrip("/")
        scheme, _, rest = url.partition("://")
        if scheme.lower() not in ("http", "https") or not rest:
            raise SettingsError(f"{name}={value}: expected an http:// or https:// address")
        return url
