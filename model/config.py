"""Hyper-parameters of a Llama 3.x model, read from a checkpoint's own config file."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MAX_CONTEXT = 8192  # tokens of prompt and reply together, unless asked otherwise


class ConfigError(ValueError):
    """A config file that cannot describe a Llama model."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 frequency scaling of RoPE (`rope_type: llama3`)."""

    factor: float = 32.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class RopeFreqFactors:
    """RoPE with each base frequency divided by its own factor (`rope_type: freq_factors`).

    llama.cpp's form of a scaling: a GGUF carries the Llama 3 scaling only as these factors
    (`rope_freqs.weight`), so they are applied as given rather than fitted back to a formula.
    """

    factors: tuple[float, ...]  # (head_dim // 2,)


@dataclass(frozen=True)
class LlamaConfig:
    dim: int = 2048
    n_layers: int = 16
    n_heads: int = 32
    n_kv_heads: int = 8
    vocab_size: int = 128256
    ffn_dim: int = 8192
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | RopeFreqFactors | None = RopeScaling()  # None: plain RoPE
    max_seq_len: int = 131072
    tie_word_embeddings: bool = True
    head_dim: int | None = None  # None: dim // n_heads
    dtype: str = "bfloat16"  # the dtype the weights were published in

    def __post_init__(self):
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)

        def need(ok: bool, message: str):
            if not ok:
                raise ConfigError(message)

        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "max_seq_len"):
            need(getattr(self, name) > 0, f"{name}={getattr(self, name)} must be positive")
        need(self.n_heads % self.n_kv_heads == 0,
             f"n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads}")
        need(self.head_dim % 2 == 0, f"head_dim={self.head_dim} must be even for RoPE")
        if isinstance(self.rope_scaling, RopeFreqFactors):
            factors = self.rope_scaling.factors
            need(len(factors) == self.head_dim // 2 and all(f > 0 for f in factors),
                 f"rope freq_factors: expected {self.head_dim // 2} positive factors (head_dim / 2), "
                 f"found {len(factors)} (smallest {min(factors, default=None)})")

    def replace(self, **changes) -> LlamaConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str) -> LlamaConfig:
        try:
            return PRESETS[name]
        except KeyError:
            raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None

    @classmethod
    def from_hf_config(cls, path: str | Path) -> LlamaConfig:
        """From a Hugging Face `config.json`, transformers 4.x or 5.x style."""
        path = Path(path)
        c = _read_json(path)
        if c.get("model_type", "llama") != "llama":
            raise ConfigError(f"{path}: model_type={c['model_type']!r}, expected 'llama'")
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                               "intermediate_size", "vocab_size") if k not in c]
        if missing:
            raise ConfigError(f"{path}: missing {', '.join(missing)}")
        # transformers 4.45 writes rope_theta + rope_scaling; 5.x writes rope_parameters.
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        elif rope_type == "freq_factors":
            factors = rope.get("factors")
            if not isinstance(factors, list) or not all(isinstance(f, (int, float)) for f in factors):
                raise ConfigError(f"{path}: rope_type 'freq_factors' expects a list of numbers 'factors', "
                                  f"found {type(factors).__name__}")
            scaling = RopeFreqFactors(tuple(float(f) for f in factors))
        elif rope_type == "default":
            scaling = None
        else:
            raise ConfigError(f"{path}: rope_type={rope_type!r} is not supported "
                              "(expected 'llama3', 'freq_factors' or 'default')")
        n_heads = c["num_attention_heads"]
        n_kv_heads = c.get("num_key_value_heads") or n_heads
        if n_heads % n_kv_heads:
            raise ConfigError(f"{path}: num_key_value_heads={n_kv_heads} does not divide "
                              f"num_attention_heads={n_heads}")
        return _build(path,
            dim=c["hidden_size"],
            n_layers=c["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            vocab_size=c["vocab_size"],
            ffn_dim=c["intermediate_size"],
            norm_eps=float(c.get("rms_norm_eps", 1e-5)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_seq_len=int(c.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            head_dim=c.get("head_dim") or c["hidden_size"] // n_heads,
            dtype=str(c.get("torch_dtype") or c.get("dtype") or "float32"),
        )

    @classmethod
    def from_meta_params(cls, path: str | Path, vocab_size: int | None = None,
                         tie_word_embeddings: bool | None = None) -> LlamaConfig:
        """From Meta's `params.json` (the `original/` folder of a Hugging Face repo)."""
        path = Path(path)
        p = _read_json(path)
        missing = [k for k in ("dim", "n_layers", "n_heads") if k not in p]
        if missing:
            raise ConfigError(f"{path}: missing {', '.join(missing)}")
        dim, n_heads = p["dim"], p["n_heads"]
        if vocab_size is None:
            vocab_size = p.get("vocab_size", -1)
        if vocab_size <= 0:  # Meta writes -1: the size comes from the tokenizer (128256 for Llama 3)
            vocab_size = 128256
        # params.json says use_scaled_rope but no factor: 32 for the 3.2 sizes, 8 for 3.1.
        scaling = None
        if p.get("use_scaled_rope", False):
            scaling = RopeScaling(factor=32.0 if dim in (2048, 3072) else 8.0)
        return _build(path,
            dim=dim,
            n_layers=p["n_layers"],
            n_heads=n_heads,
            n_kv_heads=p.get("n_kv_heads") or n_heads,
            vocab_size=vocab_size,
            ffn_dim=meta_ffn_dim(dim, p.get("multiple_of", 256), p.get("ffn_dim_multiplier")),
            norm_eps=float(p.get("norm_eps", 1e-5)),
            rope_theta=float(p.get("rope_theta", 500000.0)),
            rope_scaling=scaling,
            max_seq_len=131072 if scaling else 8192,
            # Llama 3.2 1B/3B share input and output embeddings; 3.1 8B does not.
            tie_word_embeddings=dim in (2048, 3072) if tie_word_embeddings is None else tie_word_embeddings,
            dtype="bfloat16",
        )

    def to_hf_config(self) -> dict:
        """A transformers-style `config.json` dict (used to save checkpoints in our own format)."""
        rope = {"rope_type": "default"}
        if isinstance(self.rope_scaling, RopeFreqFactors):
            rope = {"rope_type": "freq_factors", "factors": list(self.rope_scaling.factors)}
        elif self.rope_scaling:
            rope = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.ffn_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope if self.rope_scaling else None,
            "max_position_embeddings": self.max_seq_len,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.dtype,
        }


def meta_ffn_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Meta's rule for the SwiGLU hidden size: 2/3 of 4*dim, scaled, rounded up to multiple_of."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _build(path: Path, **fields) -> LlamaConfig:
    try:
        return LlamaConfig(**fields)
    except (ConfigError, TypeError) as e:
        raise ConfigError(f"{path}: {e}") from None


PRESETS: dict[str, LlamaConfig] = {
    "llama3.2-1b": LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                               head_dim=64, tie_word_embeddings=True),
    "llama3.2-3b": LlamaConfig(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192,
                               head_dim=128, tie_word_embeddings=True),
    "llama3.1-8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                               head_dim=128, rope_scaling=RopeScaling(factor=8.0),
                               tie_word_embeddings=False),
    # The embedded default model (SmolLM2-135M-Instruct): Llama architecture, plain RoPE.
    "smollm2-135m": LlamaConfig(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, vocab_size=49152,
                                ffn_dim=1536, rope_theta=100000.0, rope_scaling=None,
                                max_seq_len=8192, tie_word_embeddings=True),
}
