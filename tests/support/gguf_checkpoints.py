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
import torch
import transformers
from transformers.convert_slow_tokenizer import TikTokenConverter

from model.convert.gguf_tokenizer import llama3_special_tokens
from model.tokenizer import PAT_STR, meta_tokenizer_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # the benchmark's GGUF writer
from gguf_file import write_gguf

TYPES = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
         "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0,
         "q4_0": gguf.GGMLQuantizationType.Q4_0, "q4_1": gguf.GGMLQuantizationType.Q4_1,
         "q5_0": gguf.GGMLQuantizationType.Q5_0}
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


def write_llama3_gguf(model: transformers.LlamaForCausalLM, path: Path, kind: str, name: str = "Tiny Llama 3") -> Path:
    """`model` as llama.cpp's converter writes it with `--outtype kind` (f32, f16, bf16, q8_0), or with
    every matrix in Q4_0, Q4_1 or Q5_0 (as llama-quantize's pure mode writes them)."""
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        return write_gguf(Path(folder), path, kind, add_vocab=add_llama3_vocab, name=name)


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
