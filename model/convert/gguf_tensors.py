"""A GGUF's tensors as safetensors entries in Hugging Face names, each kept in the type it has.

F32, F16 and BF16 tensors are copied byte for byte. Quantized blocks are split into their parts, the
same values in the same bytes, nothing quantized twice and nothing widened to fp32:
- Q8_0 (an f16 scale, 32 int8 weights) into `<module>.weight` (int8, (N, K)) and `<module>.scale`
  (f16, (N, K // 32));
- Q4_1 (an f16 scale d, an f16 minimum m, 16 bytes of 32 nibbles) into `<module>.weight` (uint8,
  (N, K // 2)), `<module>.scale` (d) and `<module>.offset` (m), f16 (N, K // 32): weight = q d + m;
- Q4_0 (d, 16 bytes) into `<module>.weight` and `<module>.scale` only: weight = (q - 8) d, which
  the loader reads as offset -8 d (model/quantize.py's int4, whose nibble order is llama.cpp's).
- Q4_K, Q5_K, Q6_K, Q3_K, Q2_K, Q5_0 and Q5_1 (llama-quantize's K-quant presets, and their fall-backs for
  rows that are not whole blocks of 256) into `<module>.weight` uint8 (N, K // block, bytes): the blocks as
  they are, which the decode kernel reads (model/blocks.py).
Any other type (IQ2_XS, IQ3_S, TQ1_0, ...) is widened to bf16 by the gguf library, with a log line naming it
and the memory it then takes. q/k rows go from llama.cpp's interleaved RoPE order to ours. With `dequantize`
every quantized tensor becomes float32, which holds every dequantized value exactly (a folder transformers
can read: the reference of tests/model/test_gguf.py).
"""

from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from ..block_formats import BY_NAME
from ..quantize import INT4_GROUP
from ..rope import permute_qk_rows
from .folder import ConversionError, log

KEPT = {  # GGUF type -> safetensors dtype of the copy
    GGMLQuantizationType.F32: "F32",
    GGMLQuantizationType.F16: "F16",
    GGMLQuantizationType.BF16: "BF16",
}
Q8_0_GROUP = 32  # weights per Q8_0 block, each block with one f16 scale
Q4_HEADER = {GGMLQuantizationType.Q4_0: ["scale"], GGMLQuantizationType.Q4_1: ["scale", "offset"]}  # f16 each
ITEM_SIZE = {"F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1}
NUMPY = {"F32": np.float32, "F16": np.float16, "I8": np.int8, "U8": np.uint8}  # (numpy has no bf16)
ROWS_PER_CHUNK = 8192  # rows copied at a time, so a large embedding never has a second full copy

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
ROPE_FREQS = "rope_freqs.weight"  # RoPE factors: they go into config.json, not the weights


@dataclass
class Entry:
    """One tensor of the safetensors file, and how to produce its bytes."""

    name: str
    dtype: str  # safetensors dtype: F32, F16, BF16, I8, U8
    shape: list[int]
    chunks: Callable[[], Iterator[np.ndarray]]  # the data, in row order, in pieces

    @property
    def nbytes(self) -> int:
        return ITEM_SIZE[self.dtype] * int(np.prod(self.shape))


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


def qk_heads(name: str, config: dict) -> int | None:
    """The head count by which a q or k projection's rows are permuted; None for any other tensor."""
    if ".attn_q." in name:
        return config["num_attention_heads"]
    if ".attn_k." in name:
        return config["num_key_value_heads"]
    return None


def in_row_chunks(rows: np.ndarray, heads: int | None) -> Callable[[], Iterator[np.ndarray]]:
    """`rows` (N, ...) in pieces of ROWS_PER_CHUNK rows; a q/k projection whole, permuted (it is small). The
    callable's `whole()` gives them in one piece (a view of the file's map, but for q/k)."""
    def whole() -> np.ndarray:
        return rows if heads is None else permute_qk_rows(rows, heads, to="half")

    def chunks():
        if heads is not None:
            yield permute_qk_rows(rows, heads, to="half")
            return
        for start in range(0, rows.shape[0], ROWS_PER_CHUNK):
            yield rows[start:start + ROWS_PER_CHUNK]
    chunks.whole = whole
    return chunks


def entries(reader: GGUFReader, config: dict, path: Path, dequantize_others: bool) -> list[Entry]:
    """The safetensors entries of every tensor of the file (in its order), without reading their data."""
    found, widened = [], {}  # widened: type name -> tensors
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            continue
        name, shape, heads = hf_name(tensor.name, path), hf_shape(tensor), qk_heads(tensor.name, config)
        kind = tensor.tensor_type
        if kind in KEPT:
            # F32/F16 come as typed (N, K) arrays, BF16 as raw bytes (N, 2K): rows either way
            found.append(Entry(name, KEPT[kind], shape, in_row_chunks(tensor.data, heads)))
        elif kind == GGMLQuantizationType.Q8_0 and not dequantize_others:
            found += q8_0_entries(tensor, name, shape, heads, path)
        elif kind in Q4_HEADER and not dequantize_others:
            found += q4_entries(tensor, name, shape, heads, path)
        elif kind.name in BY_NAME and len(shape) == 2 and not dequantize_others:
            found.append(block_entry(tensor, name, shape, heads))
        elif dequantize_others:
            found.append(Entry(name, "F32", shape, dequantized(tensor, shape, heads, path)))
        else:  # a type no kernel reads (IQ2_XS, IQ3_S, TQ1_0, ...): widened once, here
            found.append(Entry(name, "BF16", shape, dequantized(tensor, shape, heads, path, torch.bfloat16)))
            widened[kind.name] = widened.get(kind.name, 0) + 1
    for kind_name, n in widened.items():
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind_name]]
        log(f"{n} tensor{'s' * (n > 1)} in {kind_name}, which no decode kernel here reads, widened to bf16: "
            f"{16 * block / (8 * size):.1f}x the memory they take in the file")
    return found


def block_entry(tensor: ReaderTensor, name: str, shape: list[int], heads: int | None) -> Entry:
    """A matrix in one of llama.cpp's block formats (model/blocks.py), its blocks as they are: uint8 (N, K / block, bytes)."""
    n, k = shape
    f = BY_NAME[tensor.tensor_type.name]
    blocks = tensor.data.reshape(n, k // f.block, f.bytes)
    return Entry(name, "U8", [n, k // f.block, f.bytes], in_row_chunks(blocks, heads))


def q8_0_entries(tensor: ReaderTensor, name: str, shape: list[int], heads: int | None,
                 path: Path) -> list[Entry]:
    if len(shape) != 2:
        raise ConversionError(f"{path}: tensor {tensor.name} is Q8_0 with shape {shape}; expected a matrix")
    n, k = shape
    blocks = tensor.data.reshape(n, k // Q8_0_GROUP, 2 + Q8_0_GROUP)  # per block: f16 scale, 32 int8
    weights = in_row_chunks(blocks[:, :, 2:], heads)
    scales = in_row_chunks(blocks[:, :, :2], heads)
    return [Entry(name, "I8", shape, weights),
            Entry(name.removesuffix(".weight") + ".scale", "F16", [n, k // Q8_0_GROUP], scales)]


def q4_entries(tensor: ReaderTensor, name: str, shape: list[int], heads: int | None,
               path: Path) -> list[Entry]:
    """A Q4_0/Q4_1 matrix as the packed nibbles (uint8 (N, K // 2)) and the f16 block header's values."""
    kind = tensor.tensor_type
    if len(shape) != 2:
        raise ConversionError(f"{path}: tensor {tensor.name} is {kind.name} with shape {shape}; expected a matrix")
    n, k = shape
    header = 2 * len(Q4_HEADER[kind])  # bytes of f16 values before the nibbles
    blocks = tensor.data.reshape(n, k // INT4_GROUP, header + INT4_GROUP // 2)  # per block: f16 d (and m), 16 bytes
    module = name.removesuffix(".weight")
    found = [Entry(name, "U8", [n, k // 2], in_row_chunks(blocks[:, :, header:], heads))]
    for i, part in enumerate(Q4_HEADER[kind]):
        found.append(Entry(f"{module}.{part}", "F16", [n, k // INT4_GROUP],
                           in_row_chunks(blocks[:, :, 2 * i:2 * i + 2], heads)))
    return found


def dequantized(tensor: ReaderTensor, shape: list[int], heads: int | None, path: Path,
                dtype: torch.dtype = torch.float32) -> Callable[[], Iterator[np.ndarray]]:
    """The tensor's values from the gguf library's dequantization, in `dtype` (float32 holds each exactly)."""
    def chunks():
        values = dequantize(tensor.data, tensor.tensor_type)
        if list(values.shape) != shape:
            raise ConversionError(f"{path}: tensor {tensor.name} dequantized to {list(values.shape)}, "
                                  f"expected {shape}")
        values = np.asarray(values, np.float32) if heads is None else permute_qk_rows(values, heads, to="half")
        # bf16 through torch's rounding (to nearest even), as bytes: numpy has no bf16
        yield values if dtype == torch.float32 else torch.from_numpy(values).to(dtype).view(torch.int16).numpy()
    return chunks


def write_safetensors(found: list[Entry], out: Path) -> None:
    """Stream the entries into `out` one piece at a time (safetensors' own writer wants them all in memory).

    The format: 8-byte little-endian header length, a JSON header of dtype/shape/byte offsets, then the data.
    """
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for entry in found:
        header[entry.name] = {"dtype": entry.dtype, "shape": entry.shape,
                              "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # data starts 8-byte aligned
    started, total = time.monotonic(), len(found)
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for i, entry in enumerate(found, 1):
            written = 0
            for piece in entry.chunks():
                written += f.write(memoryview(np.ascontiguousarray(piece)).cast("B"))
            if written != entry.nbytes:
                raise ConversionError(f"{out}: wrote {written} bytes for {entry.name}, expected {entry.nbytes}")
            if i % 50 == 0 or i == total:
                log(f"tensors {i}/{total} ({time.monotonic() - started:.1f}s)")


def safetensors_bytes(found: list[Entry]) -> int:
    return sum(entry.nbytes for entry in found)


def in_place(found: list[Entry]) -> dict[str, tuple[np.ndarray, str]]:
    """Each entry's whole array and safetensors dtype, for loading a GGUF where it lies: a view of the file's map
    where the entry is one piece of it (float tensors, llama.cpp's blocks), else a copy (Q8_0/Q4 split into values
    and scales, q/k rows permuted, types widened). A block's parts come as bytes: viewed as their type; bf16 as
    uint8 (N, 2K), for the caller to view as bf16."""
    arrays = {}
    for entry in found:
        whole = getattr(entry.chunks, "whole", None)
        array = np.ascontiguousarray(whole() if whole is not None else np.concatenate(list(entry.chunks())))
        if entry.dtype in NUMPY and array.dtype != NUMPY[entry.dtype]:  # raw bytes of a block's part
            array = array.view(NUMPY[entry.dtype])
        if entry.dtype == "BF16":
            array = array.view(np.uint8).reshape(*entry.shape[:-1], 2 * entry.shape[-1])
        else:
            array = array.reshape(entry.shape)
        arrays[entry.name] = (array, entry.dtype)
    return arrays
