"""Turn a Llama GGUF file (llama.cpp's format, as Ollama and LM Studio store them) into a model folder.

A GGUF holds everything a checkpoint needs, under llama.cpp's names: the hyper-parameters and the
tokenizer as metadata, the weights as (often quantized) tensors. `convert_gguf` writes

    config.json  generation_config.json  model.safetensors  + the tokenizer's files (gguf_tokenizer.py)

into a new folder, atomically (folder.py). Weights keep their type (gguf_tensors.py): F32/F16/BF16
as they are, Q8_0 as int8 with its scales, Q4_0 and Q4_1 as int4 with their scales (and minimums), the
K-quants, Q5_0 and Q5_1 as llama.cpp's blocks (model/blocks.py); other types widened to bf16;
the Llama 3 RoPE scaling, which a GGUF carries only as
`rope_freqs.weight`, becomes the config's per-frequency factors.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from gguf import GGMLQuantizationType, GGUFReader

from ..checkpoint_files import is_gguf
from ..quantize import INT4_GROUP
from .folder import (
    ConversionError,
    check_free_space,
    log,
    make_parent,
    model_folder,
    move_into_place,
    new_build_folder,
    remove_stale_siblings,
    undo,
    write_error,
    write_json,
)
from .gguf_reader import REQUIRED, float32_value, metadata, open_gguf
from .gguf_tensors import Q8_0_GROUP, ROPE_FREQS, entries, safetensors_bytes, write_safetensors
from .gguf_tensors import in_place as tensors_in_place
from .gguf_tokenizer import is_llama3, write_tokenizer

# Sampling defaults of SmolLM-style files that state none; a Llama 3 file without them gets none, and the
# engine uses Llama 3's own (generation.sampling_defaults). Temperature and top-p: SmolLM2's model card;
# repetition penalty (over the last 64 tokens) and min-p: chosen with bench/loops.py, which counts the
# answers that end in a loop (docs/benchmarks.md, "Answers that loop").
SMOLLM_TEMPERATURE = 0.2
SMOLLM_TOP_P = 0.9
SMOLLM_REPETITION_PENALTY = 1.1
SMOLLM_MIN_P = 0.05
SPARE_BYTES = 10_000_000  # room for the JSON and tokenizer files beside the weights
FLOAT_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def rope_scaling(reader: GGUFReader, path: Path, head_dim: int) -> dict | None:
    """Llama 3's scaling as llama.cpp keeps it: `rope_freqs.weight`, one divisor per frequency."""
    kinds = {k: metadata(reader, path, k) for k in reader.fields if k.startswith("llama.rope.scaling.")}
    if kinds and kinds.get("llama.rope.scaling.type", "none") != "none":
        raise ConversionError(f"{path}: RoPE scaling {kinds} is not supported; expected plain RoPE or "
                              f"Llama 3's {ROPE_FREQS}")
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is None:
        return None
    if freqs.tensor_type != GGMLQuantizationType.F32 or int(freqs.n_elements) != head_dim // 2:
        raise ConversionError(f"{path}: {ROPE_FREQS} is {freqs.tensor_type.name} {list(freqs.shape)}; "
                              f"expected F32 [{head_dim // 2}] (head_dim / 2)")
    return {"rope_type": "freq_factors", "factors": [float32_value(f) for f in freqs.data]}


def hf_config(reader: GGUFReader, path: Path) -> dict:
    """A transformers-style LlamaConfig dict (4.45-style keys, as the official Llama 3.2 configs have)."""
    def key(name, default=REQUIRED):
        return metadata(reader, path, f"llama.{name}", default)

    n_heads, dim = key("attention.head_count"), key("embedding_length")
    head_dim = key("attention.key_length", dim // n_heads)
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ConversionError(f"{path}: llama.rope.dimension_count={key('rope.dimension_count')} but "
                              f"head_dim={head_dim}; expected RoPE over the whole head")
    names = {t.name for t in reader.tensors}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": dim,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": key("attention.head_count_kv", n_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float32_value(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float32_value(key("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling(reader, path, head_dim),
        "max_position_embeddings": key("context_length"),
        "vocab_size": len(metadata(reader, path, "tokenizer.ggml.tokens")),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": metadata(reader, path, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": metadata(reader, path, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata(reader, path, "tokenizer.ggml.padding_token_id", None),
        "torch_dtype": "float32",  # set from the weights in write_folder
        "use_cache": True,
        "gguf_file": path.name,  # where it came from (model/summary.py tells it by this)
    }


def generation_config(reader: GGUFReader, path: Path, config: dict) -> dict:
    """Ids from the config; sampling from `general.sampling.*` when the file has it, else the defaults."""
    smollm = not is_llama3(reader, path)
    sampling = {
        "temperature": metadata(reader, path, "general.sampling.temp", SMOLLM_TEMPERATURE if smollm else None),
        "top_p": metadata(reader, path, "general.sampling.top_p", SMOLLM_TOP_P if smollm else None),
        "top_k": metadata(reader, path, "general.sampling.top_k", None),
        "min_p": metadata(reader, path, "general.sampling.min_p", SMOLLM_MIN_P if smollm else None),
        "repetition_penalty": metadata(reader, path, "general.sampling.penalty_repeat",
                                       SMOLLM_REPETITION_PENALTY if smollm else None),
    }
    ids = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return {**ids, "do_sample": True,
            **{k: float32_value(v) if isinstance(v, float) else v for k, v in sampling.items() if v is not None}}


def write_metadata(reader: GGUFReader, gguf_path: Path, folder: Path, config: dict, found: list) -> None:
    """config.json (with the weights' dtype and quantization), generation_config.json and the tokenizer's files."""
    weights = [e for e in found if e.dtype in FLOAT_DTYPES and not e.name.endswith((".scale", ".offset"))]
    config["torch_dtype"] = FLOAT_DTYPES[max(weights, key=lambda e: e.nbytes).dtype] if weights else "float32"
    if any(e.dtype == "U8" and len(e.shape) == 2 for e in found):  # int4, and any int8 beside it (same group size)
        config["quantization"] = {"method": "int4", "group_size": INT4_GROUP}
    elif any(e.dtype == "I8" for e in found):
        config["quantization"] = {"method": "int8", "group_size": Q8_0_GROUP}
    log("config.json, generation_config.json")
    write_json(folder / "config.json", config)
    write_json(folder / "generation_config.json", generation_config(reader, gguf_path, config))
    log(", ".join(write_tokenizer(reader, gguf_path, folder, config)))


def write_folder(reader: GGUFReader, gguf_path: Path, folder: Path, config: dict, found: list) -> None:
    """Every output file into `folder` (which exists and is empty)."""
    write_metadata(reader, gguf_path, folder, config, found)
    dtypes = sorted({e.dtype for e in found})
    log(f"model.safetensors ({safetensors_bytes(found) / 1e6:.0f} MB, {'/'.join(dtypes)})")
    write_safetensors(found, folder / "model.safetensors")


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, dequantize: bool = False) -> Path:
    """Convert a Llama GGUF into a model folder at `out_dir` (replacing any there); returns it.

    dequantize: tensor types other than F32/F16/BF16 become float32 (else each is kept as gguf_tensors.py
    says). Raises ConversionError for a bad file or a full disk, and leaves
    `out_dir`'s parent as it was.
    """
    gguf_path = Path(gguf_path)
    log(f"reading {gguf_path}")
    return convert(open_gguf(gguf_path), gguf_path, Path(out_dir), dequantize)


def convert(reader: GGUFReader, gguf_path: Path, out_dir: Path, dequantize: bool) -> Path:
    started = time.monotonic()
    config = hf_config(reader, gguf_path)
    found = entries(reader, config, gguf_path, dequantize)
    size = safetensors_bytes(found)
    made_parent = make_parent(out_dir)
    building = None
    try:
        remove_stale_siblings(out_dir)
        check_free_space(out_dir.parent, size + SPARE_BYTES)
        building = new_build_folder(out_dir)
        write_folder(reader, gguf_path, building, config, found)
        move_into_place(building, out_dir)
    except BaseException as e:
        undo(building, made_parent)
        if isinstance(e, OSError):
            raise write_error(e, out_dir, size) from None
        raise
    log(f"wrote {out_dir} in {time.monotonic() - started:.1f}s")
    return out_dir


def folder_name(gguf_path: Path, reader: GGUFReader | None = None) -> str:
    """The model folder's name: the file's name without .gguf; for an Ollama blob (`sha256-<hex>`, no
    extension) the model's own `general.name` with its spaces as dashes."""
    if is_ollama_blob(gguf_path) and reader is not None:
        name = metadata(reader, gguf_path, "general.name", None)
        if name:
            return re.sub(r"[^\w.+-]+", "-", name).strip("-.") or gguf_path.name
    return gguf_path.name.removesuffix(".gguf")


def import_ggufs(source: Path, weights_dir: Path, name: str | None = None, force: bool = False) -> list[Path]:
    """Import `source`, a GGUF file or a folder searched for them (LM Studio's models folder, Ollama's
    blobs), each into `weights_dir/<name>`; returns the folders written.

    In a folder, a file that cannot be imported (another architecture) is skipped with a line saying why; it is an error only when nothing could be imported.
    """
    if source.is_file():
        return [import_one(source, weights_dir, name, force)]
    if name is not None:
        raise ConversionError(f"{source}: --name names one model; expected a single .gguf file, found a folder")
    written, skipped = [], []
    for path in gguf_files(source):
        try:
            written.append(import_one(path, weights_dir, None, force))
        except ConversionError as e:
            log(f"skipping {path}: {e}")
            skipped.append(path.name)
    if not written:
        found = f"skipped {len(skipped)}: {', '.join(skipped[:5])}" if skipped else "found no GGUF file"
        raise ConversionError(f"{source}: imported no Llama GGUF ({found})")
    return written


def import_one(path: Path, weights_dir: Path, name: str | None, force: bool) -> Path:
    log(f"reading {path}")
    reader = None if name or not is_ollama_blob(path) else open_gguf(path)  # the name is in its metadata
    out_dir = model_folder(weights_dir, name or folder_name(path, reader))
    if out_dir.exists() and not force:
        raise ConversionError(f"{out_dir} already exists; pass --force to replace it, or --name to choose "
                              "another folder")
    return convert(reader or open_gguf(path), path, out_dir, dequantize=False)


def is_ollama_blob(path: Path) -> bool:
    return path.name.startswith("sha256-")


def gguf_files(folder: Path) -> list[Path]:
    """Files under `folder` that start with GGUF's magic bytes (Ollama's blobs have no .gguf suffix)."""
    def hidden(path: Path) -> bool:
        return any(part.startswith(".") for part in path.relative_to(folder).parts)
    return sorted(p for p in folder.rglob("*") if p.is_file() and not hidden(p) and is_gguf(p))


def in_place(gguf_path: Path, cache_dir: Path) -> tuple[Path, dict]:
    """A GGUF used where it lies (another app's store: never copied): (a folder of its metadata as files,
    cache_dir/gguf/<key>/, the folder's config.json, generation_config.json and tokenizer, made once per file and
    kept; its tensors as arrays, most of them views of the file's map (gguf_tensors.in_place)). The key: the file's
    path, size and time, so a file replaced gets a folder of its own."""
    import hashlib
    import os
    import shutil

    reader = open_gguf(gguf_path)
    config = hf_config(reader, gguf_path)
    found = entries(reader, config, gguf_path, dequantize_others=False)
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = cache_dir / "gguf" / key
    if not (folder / "config.json").is_file():
        building = folder.with_name(f".{key}.tmp-{os.getpid()}")
        shutil.rmtree(building, ignore_errors=True)
        building.mkdir(parents=True)
        try:
            write_metadata(reader, gguf_path, building, config, found)
            building.rename(folder)
        except OSError:  # another process made it first
            shutil.rmtree(building, ignore_errors=True)
            if not (folder / "config.json").is_file():
                raise
    return folder, tensors_in_place(found)
