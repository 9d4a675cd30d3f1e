"""Find a checkpoint: which of the formats a folder (or file) holds, and its files: a Hugging Face, Meta or .pth
folder, or a GGUF file (an Ollama blob has no .gguf suffix: its first bytes tell).

Reads only names and small JSON files, never the weights, and imports no torch: the web process
lists and describes the models (model/summary.py) with it; model/checkpoint.py loads what it finds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class CheckpointError(Exception):
    """A checkpoint that cannot be loaded; the message names the file and what was expected."""


@dataclass
class CheckpointFiles:
    format: str  # "hf", "meta", "pth" or "gguf" (a GGUF file used where it lies)
    config: Path  # config.json or params.json
    weights: list[Path]
    folder: Path


def find_checkpoint(path: str | Path) -> CheckpointFiles:
    """Tell which format `path` holds (a folder, a .pth/.safetensors file with config.json beside it, or a GGUF file)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    if path.is_file() and is_gguf(path):  # its metadata is its config (model/convert/gguf.py in_place)
        return CheckpointFiles("gguf", path, [path], path.parent)
    if path.is_file():
        config = path.parent / "config.json"
        if path.suffix not in (".pth", ".pt", ".safetensors"):
            raise CheckpointError(f"{path}: expected a checkpoint folder, a .pth or a .safetensors file")
        if not config.is_file():
            raise CheckpointError(f"{path}: expected a config.json beside the weights file")
        return CheckpointFiles("pth" if path.suffix != ".safetensors" else "hf", config, [path], path.parent)

    config = path / "config.json"
    index = path / "model.safetensors.index.json"
    if config.is_file() and index.is_file():
        return CheckpointFiles("hf", config, _shards_from_index(index), path)
    if config.is_file() and (path / "model.safetensors").is_file():
        return CheckpointFiles("hf", config, [path / "model.safetensors"], path)
    consolidated = sorted(path.glob("consolidated.*.pth"))
    if (path / "params.json").is_file() and consolidated:
        if len(consolidated) > 1:
            raise CheckpointError(f"{path}: {len(consolidated)} model-parallel shards "
                                  "(consolidated.*.pth); only single-file Meta checkpoints are supported")
        return CheckpointFiles("meta", path / "params.json", consolidated, path)
    pth = sorted(p for p in path.glob("*.pth") if not p.name.startswith("consolidated."))
    if config.is_file() and len(pth) == 1:
        return CheckpointFiles("pth", config, pth, path)
    if (path / "original" / "params.json").is_file():
        return find_checkpoint(path / "original")
    found = ", ".join(sorted(p.name for p in path.iterdir())[:10]) or "nothing"
    raise CheckpointError(
        f"{path}: no checkpoint found. Expected config.json + model.safetensors (Hugging Face), "
        f"params.json + consolidated.00.pth (Meta), or config.json + one .pth file; found: {found}")


def is_gguf(path: Path) -> bool:
    """Whether the file starts with GGUF's magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _shards_from_index(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: expected JSON with a 'weight_map' ({e})") from None
    shards = [index.parent / name for name in sorted(set(weight_map.values()))]
    missing = [s.name for s in shards if not s.is_file()]
    if missing:
        raise CheckpointError(f"{index}: lists shards that are missing: {', '.join(missing)}")
    return shards


def tokenizer_file(folder: Path) -> Path | None:
    """The tokenizer a checkpoint folder has: tokenizer.model (Llama 3's, also in original/), else tokenizer.json;
    None: neither (load_tokenizer falls back on the one shipped with llama-models)."""
    for candidate in (folder / "tokenizer.model", folder / "original" / "tokenizer.model", folder / "tokenizer.json"):
        if candidate.is_file():
            return candidate
    return None
