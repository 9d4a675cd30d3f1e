"""The app's configuration, read once from environment variables.

Every variable is optional. An empty value counts as unset. A value that cannot be used stops the
app at start-up with a message naming the variable, what was expected and what was found:

    LLAMA_TOP_P=abc: expected a number between 0 and 1

Sampling values left unset come from each checkpoint's generation_config.json
(`model.generation.sampling_defaults`).
"""

from __future__ import annotations

import ipaddress
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from model.config import DEFAULT_MAX_CONTEXT

PROJECT_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_WEIGHTS_DIR = PROJECT_ROOT / "weights"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # converted by model.prepare_default on first start
DEFAULT_MAX_NEW_TOKENS = 1024
DEFAULT_KV_CACHE_MB = 1024  # KV caches kept between turns, all conversations together
DEFAULT_MAX_BATCH = 8  # replies computed together
DEFAULT_MAX_WAITING = 32  # replies waiting for a place in the batch; past it the server says it is busy
DEFAULT_MAX_BODY_MB = 4  # an API request's body; past it, 413
DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("auto", "bf16", "fp16", "fp32")
QUANTIZE = ("off", "int8", "int4")
DEFAULT_HISTORY_DB = PROJECT_ROOT / "data" / "history.db"
DEFAULT_PRESETS = PROJECT_ROOT / "presets"  # system-prompt presets (app.presets)
AUTH_MODES = ("none", "password")
DEFAULT_HEADER_TIMEOUT_S = 10.0  # a request's headers must arrive within this (app.http_server)
DEFAULT_BODY_TIMEOUT_S = 30.0  # and its body within this after them
SWITCH = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False, "0": False}


class SettingsError(ValueError):
    """A configuration value that cannot be used; the message names the variable."""


@dataclass(frozen=True)
class Settings:
    checkpoint: Path
    weights_dir: Path
    tokenizer: Path | None = None
    device: str = "auto"
    dtype: str = "auto"
    quantize: str = "off"  # "int8" / "int4": linear weights stored as int8 / int4 (faster decode)
    max_context: int = DEFAULT_MAX_CONTEXT
    system_prompt: str | None = None
    presets: Path = DEFAULT_PRESETS  # a folder of named system prompts, NAME.md each
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    threads: int | None = None
    kv_cache_mb: int = DEFAULT_KV_CACHE_MB  # KV caches kept between turns, all conversations together
    max_batch: int = DEFAULT_MAX_BATCH
    max_waiting: int = DEFAULT_MAX_WAITING
    max_body_mb: int = DEFAULT_MAX_BODY_MB
    history: bool = True
    history_db: Path = DEFAULT_HISTORY_DB
    auth: str = "none"  # "none": one local user, no login form; "password": a login form
    password: str | None = None
    users_file: Path | None = None
    api_key: str | None = None  # needed with sign-in on: the API and /metrics then take it
    backend_url: str | None = None  # an OpenAI-compatible server that generates instead of this process
    backend_key: str | None = None
    backend_model: str | None = None
    allowed_hosts: tuple[str, ...] = ()  # host names besides loopback that requests may name (app.guard)
    allowed_origins: tuple[str, ...] = ()  # web pages besides the app's own that may send requests (app.guard)
    trusted_proxies: tuple[str, ...] = ()  # addresses or networks whose X-Forwarded-For is believed
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S

    @property
    def is_default_checkpoint(self) -> bool:
        """True when the checkpoint is the default model, which the app may prepare itself."""
        return self.checkpoint.resolve() == (self.weights_dir / DEFAULT_MODEL_NAME).resolve()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = _Reader(os.environ if environ is None else environ)
        weights_dir = env.path("LLAMA_WEIGHTS_DIR") or DEFAULT_WEIGHTS_DIR
        auth, password, users_file = (env.choice("LLAMA_AUTH", AUTH_MODES), env.text("LLAMA_PASSWORD"),
                                      env.path("LLAMA_USERS"))
        settings = cls(
            checkpoint=env.path("LLAMA_CHECKPOINT") or weights_dir / DEFAULT_MODEL_NAME,
            weights_dir=weights_dir,
            tokenizer=env.path("LLAMA_TOKENIZER"),
            device=env.choice("LLAMA_DEVICE", DEVICES) or "auto",
            dtype=env.choice("LLAMA_DTYPE", DTYPES) or "auto",
            quantize=env.choice("LLAMA_QUANTIZE", QUANTIZE) or "off",
            max_context=env.integer("LLAMA_MAX_CONTEXT", low=16) or DEFAULT_MAX_CONTEXT,
            system_prompt=env.text("LLAMA_SYSTEM_PROMPT"),
            presets=env.path("LLAMA_PRESETS") or DEFAULT_PRESETS,
            max_new_tokens=env.integer("LLAMA_MAX_NEW_TOKENS", low=1) or DEFAULT_MAX_NEW_TOKENS,
            temperature=env.number("LLAMA_TEMPERATURE", low=0.0, high=100.0),
            top_k=env.integer("LLAMA_TOP_K", low=0),
            top_p=env.number("LLAMA_TOP_P", low=0.0, high=1.0, low_open=True),
            min_p=env.number("LLAMA_MIN_P", low=0.0, high=1.0),
            repetition_penalty=env.number("LLAMA_REPETITION_PENALTY", low=0.0, high=10.0, low_open=True),
            threads=env.integer("LLAMA_THREADS", low=1),
            kv_cache_mb=_default(env.integer("LLAMA_KV_CACHE_MB", low=0), DEFAULT_KV_CACHE_MB),
            max_batch=env.integer("LLAMA_MAX_BATCH", low=1) or DEFAULT_MAX_BATCH,
            max_waiting=_default(env.integer("LLAMA_MAX_WAITING", low=0), DEFAULT_MAX_WAITING),
            max_body_mb=env.integer("LLAMA_MAX_BODY_MB", low=1) or DEFAULT_MAX_BODY_MB,
            history=env.switch("LLAMA_HISTORY", default=True),
            history_db=env.path("LLAMA_HISTORY_DB") or DEFAULT_HISTORY_DB,
            auth=auth or ("password" if password or users_file else "none"),  # a password or users file: sign-in
            password=password,
            users_file=users_file,
            api_key=_strip(env.text("LLAMA_API_KEY")),
            backend_url=env.url("LLAMA_BACKEND_URL"),
            backend_key=_strip(env.text("LLAMA_BACKEND_KEY")),
            backend_model=_strip(env.text("LLAMA_BACKEND_MODEL")),
            allowed_hosts=env.items("LLAMA_ALLOWED_HOSTS"),
            allowed_origins=env.items("LLAMA_ALLOWED_ORIGINS"),
            trusted_proxies=env.networks("LLAMA_TRUSTED_PROXIES"),
            header_timeout=env.number("LLAMA_HEADER_TIMEOUT", 0.0, 3600.0, low_open=True) or DEFAULT_HEADER_TIMEOUT_S,
            body_timeout=env.number("LLAMA_BODY_TIMEOUT", 0.0, 3600.0, low_open=True) or DEFAULT_BODY_TIMEOUT_S,
        )
        _check_sign_in(settings, auth)
        return settings


def _check_sign_in(settings: Settings, auth: str | None) -> None:
    """LLAMA_PASSWORD or LLAMA_USERS turns sign-in on, and sign-in needs LLAMA_API_KEY (else the API and
    /metrics would stay open to anyone who reaches the port)."""
    given = " and ".join(name for name, value in [("LLAMA_PASSWORD", settings.password),
                                                  ("LLAMA_USERS", settings.users_file)] if value)
    if auth == "none" and given:
        raise SettingsError(f"LLAMA_AUTH=none with {given} set: unset LLAMA_AUTH (or set it to password) to have "
                            f"sign-in, or unset {given} to have one local user and no sign-in")
    if auth == "password" and not given:
        raise SettingsError("LLAMA_AUTH=password: expected LLAMA_PASSWORD or LLAMA_USERS to be set too")
    if given and not settings.api_key:
        raise SettingsError(f"sign-in is on ({given} set): the API and /metrics then need a key too, else anyone "
                            "who reaches the port could use them; set LLAMA_API_KEY to a long random string (e.g. "
                            "from: python -c 'import secrets; print(secrets.token_urlsafe(32))')")


def users_file(environ: Mapping[str, str] | None = None) -> Path | None:
    """LLAMA_USERS alone: `python -m app.users` needs no other setting."""
    return _Reader(os.environ if environ is None else environ).path("LLAMA_USERS")


def _default(value, default):
    return default if value is None else value


def _strip(value: str | None) -> str | None:
    return value.strip() if value is not None else None


class _Reader:
    """Typed reads of optional variables; each raises SettingsError naming the variable."""

    def __init__(self, environ: Mapping[str, str]):
        self.environ = environ

    def text(self, name: str) -> str | None:
        value = self.environ.get(name)
        return value if value is not None and value.strip() else None

    def items(self, name: str) -> tuple[str, ...]:
        """A comma-separated list (app.guard checks the entries, naming the variable)."""
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

    def path(self, name: str) -> Path | None:
        """Absolute: a relative path is taken from the working folder at start-up."""
        value = self.text(name)
        return Path(os.path.abspath(Path(value.strip()).expanduser())) if value else None

    def choice(self, name: str, choices: tuple[str, ...]) -> str | None:
        value = self.text(name)
        if value is None:
            return None
        if value.strip().lower() not in choices:
            raise SettingsError(f"{name}={value}: expected one of {', '.join(choices)}")
        return value.strip().lower()

    def switch(self, name: str, default: bool) -> bool:
        value = self.text(name)
        if value is None:
            return default
        if value.strip().lower() not in SWITCH:
            raise SettingsError(f"{name}={value}: expected on or off")
        return SWITCH[value.strip().lower()]

    def url(self, name: str) -> str | None:
        value = self.text(name)
        if value is None:
            return None
        url = value.strip().rstrip("/")
        scheme, _, rest = url.partition("://")
        if scheme.lower() not in ("http", "https") or not rest:
            raise SettingsError(f"{name}={value}: expected an http:// or https:// address")
        return url

    def integer(self, name: str, low: int) -> int | None:
        value = self.text(name)
        if value is None:
            return None
        try:
            number = int(value.strip())
        except ValueError:
            number = None
        if number is None or number < low:
            raise SettingsError(f"{name}={value}: expected a whole number of at least {low}")
        return number

    def number(self, name: str, low: float, high: float, low_open: bool = False) -> float | None:
        value = self.text(name)
        if value is None:
            return None
        try:
            number = float(value.strip())
        except ValueError:
            number = math.nan
        above_low = number > low if low_open else number >= low
        if not (above_low and number <= high):  # also catches nan
            raise SettingsError(f"{name}={value}: expected a number between {low:g} and {high:g}")
        return number
