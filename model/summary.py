"""What a checkpoint folder holds, told without loading its weights: format, size, parameters, dtype.

    summarize("weights/SmolLM2-135M-Instruct")
    -> CheckpointSummary(format="GGUF import", bytes=96651768, parameters=134515008, dtype="int4")

The parameters and dtype of a safetensors file come from its header (names, dtypes and shapes: the
first few kilobytes); of a Meta or .pth checkpoint, from its config, counted as the model holds them.
A folder imported from a GGUF file says so in its config.json (`gguf_file`, model/convert/gguf.py).
No torch: the web process describes each model with this.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from .block_formats import FORMATS
from .checkpoint_files import CheckpointError, find_checkpoint
from .config import ConfigError, LlamaConfig

SAFETENSORS_DTYPES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F64": "fp64", "I8": "int8", "I4": "int4"}
CONFIG_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
FORMATS = {"hf": "safetensors", "meta": "Meta", "pth": ".pth", "gguf": "GGUF"}
MAX_HEADER = 100_000_000  # bytes: a safetensors header larger than this is not one


@dataclass(frozen=True)
class CheckpointSummary:
    format: str  # "safetensors", "GGUF import", "Meta" or ".pth"
    bytes: int  # the weight files on disk
    parameters: int | None = None
    dtype: str | None = None  # of most parameters: "bf16", "fp32", "int8", ...

    def describe(self) -> str:
        """One line for people: "135M parameters · 538 MB · safetensors · fp32"."""
        parts = [f"{count(self.parameters)} parameters"] if self.parameters else []
        parts += [size(self.bytes), self.format]
        return " · ".join(parts + ([self.dtype] if self.dtype else []))


def summarize(path: str | Path) -> CheckpointSummary:
    """Raises CheckpointError for a folder that holds no checkpoint, or a file that is not what it says."""
    files = find_checkpoint(path)
    total = sum(f.stat().st_size for f in files.weights)
    if files.format == "hf" and all(f.suffix == ".safetensors" for f in files.weights):
        by_dtype: dict[str, int] = {}
        for weights in files.weights:
            for name, (dtype, shape) in safetensors_tensors(weights).items():
                if name.endswith((".scale", ".offset")):  # a quantized weight's scales are part of that weight
                    continue
                n = math.prod(shape)
                if dtype == "U8" and len(shape) == 3 and shape[2] in FORMATS:  # llama.cpp's blocks (model/blocks.py)
                    dtype, n = FORMATS[shape[2]].name, shape[0] * shape[1] * FORMATS[shape[2]].block
                elif dtype == "U8":  # int4: two weights a byte (model/quantize.py)
                    dtype, n = "I4", 2 * n
                by_dtype[dtype] = by_dtype.get(dtype, 0) + n
        config = _json(files.config)
        dtype = max(by_dtype, key=by_dtype.get) if by_dtype else None
        return CheckpointSummary("GGUF import" if "gguf_file" in config else "safetensors", total,
                                 sum(by_dtype.values()), SAFETENSORS_DTYPES.get(dtype, dtype))
    if files.format == "gguf":  # (its parameters are in a header of megabytes: not read to list it)
        return CheckpointSummary("GGUF", total)
    try:
        config = (LlamaConfig.from_meta_params(files.config) if files.format == "meta"
                  else LlamaConfig.from_hf_config(files.config))
    except (ConfigError, KeyError, TypeError, ValueError):
        return CheckpointSummary(FORMATS[files.format], total)
    return CheckpointSummary(FORMATS[files.format], total, parameters(config),
                             CONFIG_DTYPES.get(config.dtype) if files.format != "meta" else None)


def safetensors_tensors(path: Path) -> dict[str, tuple[str, list[int]]]:
    """Tensor name -> (dtype, shape), from the file's header alone."""
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        if not 2 <= n <= MAX_HEADER:
            raise CheckpointError(f"{path}: expected a safetensors header of at most {MAX_HEADER} bytes, found {n}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: the safetensors header is not JSON: {e}") from None
    try:
        return {name: (str(t["dtype"]), [int(d) for d in t["shape"]])
                for name, t in header.items() if name != "__metadata__"}
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # (a header of another shape)
        raise CheckpointError(f"{path}: the safetensors header does not give each tensor's dtype and shape "
                              f"({type(e).__name__}: {e})") from None


def parameters(c: LlamaConfig) -> int:
    """Parameters of a Llama model with this config (the output matrix counted once when tied)."""
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    block = c.dim * q + 2 * c.dim * kv + q * c.dim + 3 * c.dim * c.ffn_dim + 2 * c.dim
    head = 0 if c.tie_word_embeddings else c.vocab_size * c.dim
    return c.vocab_size * c.dim + c.n_layers * block + c.dim + head


def count(n: int) -> str:
    """135M, 1.2B, 8.0B."""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def size(n: int) -> str:
    """538 MB, 2.5 GB."""
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return value if isinstance(value, dict) else {}
