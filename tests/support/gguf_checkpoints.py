"""Llama 3 GGUF files that the tests write themselves, as llama.cpp's convert_hf_to_gguf.py writes a
Llama 3.2 checkpoint: the benchmark's writer (bench/gguf_file.py: llama.cpp's layout, rope_freqs,
permuted q/k) plus the tokenizer as llama.cpp's `_set_vocab_gpt2` stores Llama 3's: model "gpt2",
pre "llama-bpe", the byte-level vocabulary and merges of Meta's tokenizer.json (transformers'
TikTokenConverter of Meta's tokenizer.model), special tokens as CONTROL, bos 128000, eos 128009,
add_bos_token true, a chat template.
"""

from __future__ import annotations

import copy
import functools
import json
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from transformers.convert_slow_tokenizer import TikTokenConverter

from model.convert.gguf_tokenizer import llama3_special_tokens
from model.tokenizer import PAT_STR, meta_tokenizer_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # the benchmark's GGUF writer
from gguf_file import gguf_name, gguf_writer, write_gguf  # noqa: F401  (gguf_name, gguf_writer: for the tests)

TYPES = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
         "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0,
         "q4_0": gguf.GGMLQuantizationType.Q4_0, "q4_1": gguf.GGMLQuantizationType.Q4_1,
         "q5_0": gguf.GGMLQuantizationType.Q5_0, "q5_1": gguf.GGMLQuantizationType.Q5_1}
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                 "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
                 "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


@functools.cache
def llama3_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges "a b") of Meta's Llama 3 tokenizer.json, as llama.cpp stores them."""
    converted = TikTokenConverter(vocab_file=str(meta_tokenizer_model()), pattern=PAT_STR,
                                  extra_special_tokens=llama3_special_tokens()).converted()
    vocab = converted.get_vocab(with_added_tokens=False)
    special = llama3_special_tokens()
    tokens = sorted(vocab, key=vocab.get) + special
    types = [int(gguf.TokenType.NORMAL)] * len(vocab) + [int(gguf.TokenType.CONTROL)] * len(special)
    merges = json.loads(converted.to_str())["model"]["merges"]  # [["a", "b"], ...]
    return tokens, types, [" ".join(m) if isinstance(m, list) else m for m in merges]


def add_llama3_vocab(writer: gguf.GGUFWriter, chat_template: str = CHAT_TEMPLATE) -> None:
    tokens, types, merges = llama3_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(128000)
    writer.add_eos_token_id(128009)
    writer.add_add_bos_token(True)
    writer.add_chat_template(chat_template)


def write_llama3_gguf(model: transformers.LlamaForCausalLM, path: Path, kind: str, name: str = "Tiny Llama 3",
                      encode=None) -> Path:
    """`model` as llama.cpp's converter writes it with `--outtype kind` (f32, f16, bf16, q8_0), or with
    every matrix in Q4_0, Q4_1, Q5_0 or Q5_1 (as llama-quantize's pure mode writes them); `encode` stores
    matrices otherwise (bench/gguf_file.py)."""
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        return write_gguf(Path(folder), path, kind, add_vocab=add_llama3_vocab, name=name, encode=encode)


def as_stored(model: transformers.LlamaForCausalLM, kind: str) -> transformers.LlamaForCausalLM:
    """A copy of `model` with each matrix as the GGUF of that kind holds it (rounded, or dequantized by
    gguf.quants.dequantize)."""
    stored = copy.deepcopy(model)
    with torch.no_grad():
        for p in stored.parameters():
            if p.dim() == 2 and kind != "f32":
                values = gguf.quants.quantize(p.numpy(), TYPES[kind])
                p.copy_(torch.from_numpy(gguf.quants.dequantize(values, TYPES[kind])))
    return stored


def write_other_architecture(path: Path, architecture: str = "phi3") -> Path:
    """A GGUF of a model that is not a Llama: its architecture and one tensor."""
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


HALVES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,), "Q2_K": (80, 82), "Q5_0": (0,),
          "Q5_1": (0, 2), "IQ4_NL": (0,)}  # where each format's blocks hold fp16 values (d, dmin or min)
# About how many times d a weight of each format is, on random bytes: d = typical / this gives weights of that size
UNITS = {"Q4_K": 200, "Q5_K": 400, "Q6_K": 1000, "Q3_K": 40, "Q2_K": 10, "Q5_0": 8, "Q5_1": 15, "IQ4_NL": 60}


def random_blocks(name: str, n: int, k: int, seed: int, extremes: bool = False, typical: float | None = None):
    """uint8 (n, k / block, bytes): n rows of k weights in the blocks of GGML type `name`, random bytes with the
    fp16 values random too: normal around 1e-2, or about `typical` / UNITS for weights of about that size, or
    with `extremes` any finite fp16 (subnormals, the largest, both signs)."""
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for offset in HALVES[name]:
        if extremes:
            bits = rng.integers(0, 0x7C00, (n, k // block), dtype=np.uint16) | (rng.integers(0, 2, (n, k // block), dtype=np.uint16) << 15)
            values = bits.view(np.float16)
        else:
            values = (rng.standard_normal((n, k // block)) * (typical / UNITS[name] if typical else 1e-2)).astype(np.float16)
        blocks[..., offset:offset + 2] = values.view(np.uint8).reshape(n, k // block, 2)
    return blocks
