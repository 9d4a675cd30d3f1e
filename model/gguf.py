"""Turn a Llama GGUF file (llama.cpp's format) into a standard Hugging Face Llama folder.

A GGUF holds everything a checkpoint needs, under llama.cpp's names: the hyper-parameters and the
tokenizer as metadata, the weights as (mostly quantized) tensors. `convert_gguf` writes

    config.json  generation_config.json  model.safetensors (float32)
    tokenizer.json  tokenizer_config.json  special_tokens_map.json

into a new folder, atomically: it is built in a hidden sibling and renamed into place, so a folder
with the final name is always complete. Quantized weights are dequantized with the `gguf` package;
float32 holds every dequantized Q4/Q8 value exactly, bfloat16 would round them.
"""

from __future__ import annotations

import errno
import json
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

OUTPUT_FILES = ("config.json", "generation_config.json", "model.safetensors",
                "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# Sampling defaults when the file states none (SmolLM2's model card suggests these).
DEFAULT_TEMPERATURE = 0.2
DEFAULT_TOP_P = 0.9

# llama.cpp's token types (gguf.TokenType): control tokens are special, user-defined ones are whole words.
CONTROL, USER_DEFINED = 3, 4


class ConversionError(Exception):
    """A GGUF that cannot be converted, or a folder that cannot be written; the message says why."""


def log(message: str) -> None:
    print(f"[convert] {message}", file=sys.stderr, flush=True)


# ---- reading -------------------------------------------------------------------------------------

def open_gguf(path: Path) -> GGUFReader:
    """The file's reader, or a ConversionError naming the file if it is not a complete GGUF."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ConversionError(f"{path}: cannot read the GGUF file ({e.strerror})") from None
    if magic != b"GGUF":
        raise ConversionError(f"{path}: expected a GGUF file starting with b'GGUF', found {magic!r}")
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, struct.error) as e:
        size = path.stat().st_size
        raise ConversionError(f"{path}: truncated or corrupt GGUF file ({size} bytes): {e}. "
                              "Delete it and fetch it again.") from None
    arch = metadata(reader, path, "general.architecture")
    if arch != "llama":
        raise ConversionError(f"{path}: expected general.architecture 'llama', found {arch!r}")
    return reader


_REQUIRED = object()


def metadata(reader: GGUFReader, path: Path, key: str, default=_REQUIRED):
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise ConversionError(f"{path}: metadata key {key!r} is missing; a Llama GGUF has it")
        return default
    return field.contents()


def float32_value(value: float) -> float:
    """The shortest decimal that is this float32 (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def hf_config(reader: GGUFReader, path: Path) -> dict:
    """A transformers LlamaConfig dict (4.45-style keys, as the official Llama 3.2 configs have)."""
    def key(name, default=_REQUIRED):
        return metadata(reader, path, f"llama.{name}", default)

    unsupported = [k for k in reader.fields if k.startswith("llama.rope.scaling.")]
    if unsupported or "rope_freqs.weight" in tensor_names(reader):
        raise ConversionError(f"{path}: RoPE scaling ({unsupported or 'rope_freqs.weight'}) is not "
                              "supported; expected plain RoPE")
    n_heads, dim = key("attention.head_count"), key("embedding_length")
    head_dim = key("attention.key_length", dim // n_heads)
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ConversionError(f"{path}: llama.rope.dimension_count={key('rope.dimension_count')} but "
                              f"head_dim={head_dim}; expected RoPE over the whole head")
    eos = metadata(reader, path, "tokenizer.ggml.eos_token_id")
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
        "rope_scaling": None,
        "max_position_embeddings": key("context_length"),
        "vocab_size": len(metadata(reader, path, "tokenizer.ggml.tokens")),
        "tie_word_embeddings": "output.weight" not in tensor_names(reader),
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": metadata(reader, path, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": eos,
        "pad_token_id": metadata(reader, path, "tokenizer.ggml.padding_token_id", None),
        "torch_dtype": "float32",
        "use_cache": True,
    }


# ---- tensors -------------------------------------------------------------------------------------

GGUF_TO_HF = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def tensor_names(reader: GGUFReader) -> list[str]:
    return [t.name for t in reader.tensors]


def hf_name(name: str, path: Path) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in GGUF_TO_HF:
        return f"model.layers.{parts[1]}.{GGUF_TO_HF[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in GGUF_TO_HF:
        return f"{GGUF_TO_HF[parts[0]]}.{parts[1]}"
    raise ConversionError(f"{path}: unexpected tensor {name!r} for a Llama model")


def hf_shape(tensor: ReaderTensor) -> list[int]:
    return [int(n) for n in reversed(tensor.shape)]  # GGUF lists the fastest-varying dim first


def unpermute_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: it interleaves each head's two RoPE halves; HF keeps them apart.

    (n_heads * head_dim, dim) rows go from [h][i][half] (GGUF) back to [h][half][i] (Hugging Face).
    """
    rows, dim = weight.shape
    return weight.reshape(n_heads, rows // n_heads // 2, 2, dim).transpose(1, 2).reshape(rows, dim)


def hf_tensor(tensor: ReaderTensor, config: dict, path: Path) -> torch.Tensor:
    """One tensor dequantized to float32 in Hugging Face layout."""
    values = np.require(dequantize(tensor.data, tensor.tensor_type), np.float32, ["C", "W"])  # F32 ones are read-only views
    values = torch.from_numpy(values)
    if list(values.shape) != hf_shape(tensor):
        raise ConversionError(f"{path}: tensor {tensor.name} dequantized to {list(values.shape)}, "
                              f"expected {hf_shape(tensor)}")
    if ".attn_q." in tensor.name:
        values = unpermute_rope_rows(values, config["num_attention_heads"])
    elif ".attn_k." in tensor.name:
        values = unpermute_rope_rows(values, config["num_key_value_heads"])
    return values.contiguous()


def iter_hf_tensors(reader: GGUFReader, config: dict, path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, float32 tensor) in Hugging Face names and layout, one dequantized at a time."""
    for tensor in reader.tensors:
        yield hf_name(tensor.name, path), hf_tensor(tensor, config, path)


def write_safetensors(reader: GGUFReader, config: dict, path: Path, out: Path) -> None:
    """Stream float32 tensors into `out` one at a time (safetensors' own writer wants them all in memory).

    The format: 8-byte little-endian header length, a JSON header of dtype/shape/byte offsets, then the data.
    """
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for tensor in reader.tensors:
        shape = hf_shape(tensor)
        size = 4 * int(np.prod(shape))
        header[hf_name(tensor.name, path)] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # data starts 8-byte aligned
    started, total = time.monotonic(), len(reader.tensors)
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for i, (_, values) in enumerate(iter_hf_tensors(reader, config, path), 1):
            f.write(values.numpy().data)
            if i % 50 == 0 or i == total:
                log(f"tensors {i}/{total} ({time.monotonic() - started:.1f}s)")


def float32_bytes(reader: GGUFReader) -> int:
    return sum(4 * int(t.n_elements) for t in reader.tensors)


# ---- tokenizer -----------------------------------------------------------------------------------

def smollm_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """llama.cpp's "smollm" split (as StarCoder's): every digit alone, then GPT-2's regex."""
    return pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])


PRE_TOKENIZERS = {  # tokenizer.ggml.pre -> the split the merges were learned on
    "smollm": smollm_pre_tokenizer,
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
}


def build_tokenizer(reader: GGUFReader, path: Path) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` from the vocabulary, merges and token types in the file."""
    kind = metadata(reader, path, "tokenizer.ggml.model")
    pre = metadata(reader, path, "tokenizer.ggml.pre", "gpt2")
    if kind != "gpt2" or pre not in PRE_TOKENIZERS:
        raise ConversionError(f"{path}: tokenizer model={kind!r} pre={pre!r} is not supported; expected "
                              f"model 'gpt2' (byte-level BPE) with pre in {sorted(PRE_TOKENIZERS)}")
    if metadata(reader, path, "tokenizer.ggml.add_bos_token", False):
        raise ConversionError(f"{path}: tokenizer.ggml.add_bos_token=true is not supported; expected false")
    tokens = metadata(reader, path, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in metadata(reader, path, "tokenizer.ggml.merges")]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    types = metadata(reader, path, "tokenizer.ggml.token_type", [1] * len(tokens))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types) if kind == CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, types) if kind == USER_DEFINED])
    return tokenizer


def special_tokens(reader: GGUFReader, path: Path) -> dict[str, str]:
    tokens = metadata(reader, path, "tokenizer.ggml.tokens")
    ids = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
           "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
    found = {name: metadata(reader, path, f"tokenizer.ggml.{key}", None) for name, key in ids.items()}
    return {name: tokens[i] for name, i in found.items() if i is not None}


def tokenizer_config(reader: GGUFReader, path: Path, config: dict) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_tokens(reader, path),
        "add_bos_token": False,
        "add_eos_token": bool(metadata(reader, path, "tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": metadata(reader, path, "tokenizer.chat_template"),
    }


def generation_config(reader: GGUFReader, path: Path, config: dict) -> dict:
    """Ids from the config; sampling from `general.sampling.*` when the file has it, else the defaults."""
    sampling = {
        "temperature": metadata(reader, path, "general.sampling.temp", DEFAULT_TEMPERATURE),
        "top_p": metadata(reader, path, "general.sampling.top_p", DEFAULT_TOP_P),
        "top_k": metadata(reader, path, "general.sampling.top_k", None),
    }
    ids = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return {**ids, "do_sample": True,
            **{k: float32_value(v) if isinstance(v, float) else v for k, v in sampling.items() if v is not None}}


# ---- writing -------------------------------------------------------------------------------------

def write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_folder(reader: GGUFReader, gguf_path: Path, folder: Path) -> None:
    """Every output file into `folder` (which exists and is empty)."""
    config = hf_config(reader, gguf_path)
    log("config.json, generation_config.json")
    write_json(folder / "config.json", config)
    write_json(folder / "generation_config.json", generation_config(reader, gguf_path, config))
    log("tokenizer.json, tokenizer_config.json, special_tokens_map.json")
    build_tokenizer(reader, gguf_path).save(str(folder / "tokenizer.json"))
    write_json(folder / "tokenizer_config.json", tokenizer_config(reader, gguf_path, config))
    write_json(folder / "special_tokens_map.json", special_tokens(reader, gguf_path))
    log(f"model.safetensors ({float32_bytes(reader) / 1e6:.0f} MB, float32)")
    write_safetensors(reader, config, gguf_path, folder / "model.safetensors")


def remove_stale_siblings(out_dir: Path) -> None:
    """Temp folders left by a conversion that crashed: `.NAME.tmp-*` and `.NAME.old-*`."""
    for pattern in (f".{out_dir.name}.tmp-*", f".{out_dir.name}.old-*"):
        for stale in out_dir.parent.glob(pattern):
            log(f"removing {stale} left by an earlier conversion")
            shutil.rmtree(stale, ignore_errors=True)


def check_free_space(folder: Path, needed: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise ConversionError(f"{folder}: not enough disk space for the converted model: need "
                              f"{needed / 1e6:.0f} MB, {free / 1e6:.0f} MB free")


def move_into_place(built: Path, out_dir: Path) -> None:
    """`os.replace` cannot overwrite a full folder, so an old one is first moved aside, then deleted."""
    if not out_dir.exists():
        built.replace(out_dir)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    out_dir.replace(aside / out_dir.name)
    try:
        built.replace(out_dir)
    except OSError:
        (aside / out_dir.name).replace(out_dir)  # put the old folder back
        raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Convert a Llama GGUF into a Hugging Face folder at `out_dir` (replacing any there); returns it.

    Raises ConversionError for a bad file or a full disk, and leaves `out_dir`'s parent as it was.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    started = time.monotonic()
    log(f"reading {gguf_path}")
    reader = open_gguf(gguf_path)
    made_parent = not out_dir.parent.exists()
    building = None
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_siblings(out_dir)
        check_free_space(out_dir.parent, float32_bytes(reader) + 10_000_000)
        building = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        building.chmod(0o755)  # mkdtemp makes it private; the final folder should not be
        write_folder(reader, gguf_path, building)
        move_into_place(building, out_dir)
    except BaseException as e:
        undo(building, out_dir.parent if made_parent else None)
        if isinstance(e, OSError):
            raise write_error(e, out_dir, float32_bytes(reader)) from None
        raise
    log(f"wrote {out_dir} in {time.monotonic() - started:.1f}s")
    return out_dir


def undo(building: Path | None, made_parent: Path | None) -> None:
    if building is not None:
        shutil.rmtree(building, ignore_errors=True)
    if made_parent is not None:
        try:
            made_parent.rmdir()  # only if still empty
        except OSError:
            pass


def write_error(e: OSError, out_dir: Path, size: int) -> ConversionError:
    if e.errno == errno.ENOSPC:
        return ConversionError(f"{out_dir.parent}: no space left on device while writing the converted "
                               f"model ({size / 1e6:.0f} MB); free some space and run again")
    return ConversionError(f"{out_dir}: cannot write the converted model: {e}")
