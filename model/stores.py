"""GGUF models already on this machine, in other apps' stores, used where they lie (never copied):

- Ollama's: `$OLLAMA_MODELS`, else `~/.ollama/models` (and the Linux service's `/usr/share/ollama/.ollama/models`):
  `manifests/<host>/<namespace>/<model>/<tag>` (JSON) names the model's layers, the weights being the layer of
  media type `application/vnd.ollama.image.model`, a blob `blobs/sha256-<hex>`. Named as Ollama names them:
  `llama3.2:3b` (its library), `namespace/model:tag`, `host/namespace/model:tag` (hf.co/...).
- LM Studio's: `~/.lmstudio/models` and `~/.cache/lm-studio/models`, `<publisher>/<repo>/<file>.gguf`: named by the
  file (`Llama-3.2-1B-Instruct-Q4_K_M`).
- Hugging Face's cache: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`:
  `models--<owner>--<name>/snapshots/<revision>/<file>.gguf`, named by the file.
- Folders named in LLAMA_MODEL_STORES (separated by the OS's path separator): every .gguf under them, by file;
  LLAMA_MODEL_STORES=off: no store is looked at.

Only GGUFs of a Llama-family architecture can be used (model/convert/gguf.py reads `llama.*` keys); the others are
listed with why not, from the file's first metadata key (`general.architecture`), read without the rest. Nothing
here reads more than a manifest and a header's first bytes: the engine lists the stores at start and each time it
lists its models again. No torch: the web process may call it.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_LIBRARY = "registry.ollama.ai/library/"
LLAMA_ARCHITECTURES = ("llama",)  # general.architecture values whose llama.* keys the importer reads
SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")  # llama-gguf-split's parts
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
MAX_MANIFEST_BYTES = 1 << 20  # an Ollama manifest is a few hundred bytes
MAX_FILES = 2000  # GGUF files looked at per store (a folder of a whole disk is not walked to its end)


@dataclass(frozen=True)
class StoreModel:
    name: str
    path: Path  # the GGUF file (an Ollama blob has no .gguf suffix)
    store: str  # "Ollama", "LM Studio", "Hugging Face cache" or the folder named in LLAMA_MODEL_STORES
    size: int
    unusable: str | None = None  # why it cannot be used here, or None


def store_folders(env: Mapping[str, str]) -> list[tuple[str, Path, str]]:
    """(store, folder, kind) of each store this machine may have: kind "ollama", or "files" (GGUFs under it)."""
    home = Path(env.get("HOME") or Path.home())
    ollama = [Path(env["OLLAMA_MODELS"])] if env.get("OLLAMA_MODELS") else [
        home / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]
    hub = Path(env["HF_HUB_CACHE"]) if env.get("HF_HUB_CACHE") else (
        Path(env["HF_HOME"]) / "hub" if env.get("HF_HOME") else home / ".cache" / "huggingface" / "hub")
    folders = [("Ollama", folder, "ollama") for folder in ollama]
    folders += [("LM Studio", home / ".lmstudio" / "models", "files"),
                ("LM Studio", home / ".cache" / "lm-studio" / "models", "files"),
                ("Hugging Face cache", hub, "files")]
    folders += [(extra, Path(extra).expanduser(), "files")
                for extra in (env.get("LLAMA_MODEL_STORES") or "").split(os.pathsep) if extra.strip() not in ("", "off")]
    return folders


def find_store_models(env: Mapping[str, str]) -> list[StoreModel]:
    """Every GGUF model of every store, each name once (the first store's); sorted by store, then name. None where
    LLAMA_MODEL_STORES is "off". `env`: the environment (model.options.Environment's), which names the folders."""
    if (env.get("LLAMA_MODEL_STORES") or "").strip().lower() == "off":
        return []
    found: dict[str, StoreModel] = {}
    for store, folder, kind in store_folders(env):
        if not folder.is_dir():
            continue
        for model in (ollama_models(folder) if kind == "ollama" else gguf_files(folder, store)):
            found.setdefault(model.name, model)
    return list(found.values())


def ollama_models(folder: Path) -> list[StoreModel]:
    """The models of an Ollama store: each manifest's model layer, named as Ollama names it."""
    models = []
    manifests = folder / "manifests"
    for manifest in sorted(p for p in manifests.rglob("*") if p.is_file())[:MAX_FILES] if manifests.is_dir() else []:
        try:
            if manifest.stat().st_size > MAX_MANIFEST_BYTES:
                continue
            layers = json.loads(manifest.read_text(encoding="utf-8")).get("layers") or []
            digest = next(layer["digest"] for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER)
        except (OSError, ValueError, AttributeError, KeyError, StopIteration, TypeError):
            continue  # not a model's manifest (or a broken one): not a model
        parts = manifest.relative_to(manifests).parts  # host, namespace, model, tag
        if len(parts) != 4 or not isinstance(digest, str) or not DIGEST.fullmatch(digest):
            continue  # (a digest is the blob's name: never a path)
        name = "/".join(parts[:3]) + ":" + parts[3]
        name = name.removeprefix(OLLAMA_LIBRARY)
        blob = folder / "blobs" / digest.replace(":", "-")
        if blob.is_file():
            models.append(store_model(name, blob, "Ollama"))
    return models


def gguf_files(folder: Path, store: str) -> list[StoreModel]:
    """The .gguf files under `folder`, named by their file; a file split in parts once, by its first, as unusable."""
    models = []
    for path in sorted(folder.rglob("*.gguf"))[:MAX_FILES]:
        if not path.is_file():
            continue
        split = SPLIT.search(path.name)
        if split is None:
            models.append(store_model(path.name.removesuffix(".gguf"), path, store))
        elif split.group(1) == "00001":
            models.append(StoreModel(path.name[:split.start()], path, store, path.stat().st_size,
                                     f"split in {int(split.group(2))} files: merge them first (llama-gguf-split --merge)"))
    return models


def store_model(name: str, path: Path, store: str) -> StoreModel:
    try:
        size = path.stat().st_size
        architecture = gguf_architecture(path)
    except OSError as e:
        return StoreModel(name, path, store, 0, f"not readable: {e.strerror or e}")
    if architecture is None:
        return StoreModel(name, path, store, size, "not a GGUF file, or one without general.architecture first")
    if architecture not in LLAMA_ARCHITECTURES:
        return StoreModel(name, path, store, size, f"a {architecture} model: this engine runs Llama-architecture ones")
    return StoreModel(name, path, store, size)


def gguf_architecture(path: Path) -> str | None:
    """general.architecture from a GGUF's header, where it is among the first keys (llama.cpp's writers put it
    first); None where the file is not a GGUF or the key is not there. Reads a few hundred bytes."""
    with open(path, "rb") as f:
        head = f.read(24)
        if len(head) < 24 or head[:4] != b"GGUF":
            return None
        version = struct.unpack("<I", head[4:8])[0]
        if not 2 <= version <= 3:
            return None
        n_kv = struct.unpack("<Q", head[16:24])[0]
        for _ in range(min(n_kv, 4)):
            key_length = struct.unpack("<Q", f.read(8))[0]
            if key_length > 256:
                return None
            key = f.read(key_length)
            kind = struct.unpack("<I", f.read(4))[0]
            if kind != 8:  # not a string: skip no further (its size needs its type's table)
                return None
            length = struct.unpack("<Q", f.read(8))[0]
            if length > 256:
                return None
            value = f.read(length)
            if key == b"general.architecture":
                return value.decode("utf-8", "replace")
    return None
