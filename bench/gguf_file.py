"""The random checkpoint as a GGUF file for llama.cpp: the same weights, in bf16, f16 or Q8_0.

Written the way llama.cpp's convert_hf_to_gguf.py writes a Llama: q/k rows permuted back to
interleaved RoPE pairs, llama3 RoPE scaling as a `rope_freqs.weight` tensor, no output.weight when
tied. The vocabulary is `no_vocab` (llama.cpp's dummy tokens): the benchmark feeds token ids.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from common import CACHE
from model.config import LlamaConfig
from model.rope import inv_freq

GGUF_TYPES = ("bf16", "f16", "q8_0")

GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)  # model.layers.N.<module>.weight
    return f"blk.{layer}.{GGUF_NAMES[rest.removesuffix('.weight')]}.weight"


def interleave_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Half-split RoPE layout (HF) -> interleaved pairs (Meta, llama.cpp). w: (n_heads * head_dim, dim)"""
    rows, dim = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, dim).transpose(1, 2).reshape(rows, dim)


def gguf_checkpoint(folder: Path, shape: str, kind: str) -> Path:
    """`bench/.cache/<shape>-<kind>.gguf` from the safetensors folder, written once."""
    import gguf
    from safetensors import safe_open

    path = CACHE / f"{shape}-{kind}.gguf"
    if path.is_file():
        return path
    qtype = {"bf16": gguf.GGMLQuantizationType.BF16, "f16": gguf.GGMLQuantizationType.F16,
             "q8_0": gguf.GGMLQuantizationType.Q8_0}[kind]
    file_type = {"bf16": gguf.LlamaFileType.MOSTLY_BF16, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[kind]
    c = LlamaConfig.from_hf_config(folder / "config.json")
    w = gguf.GGUFWriter(path.with_suffix(".partial"), "llama", use_temp_file=True)
    w.add_name(f"random {shape}")
    w.add_context_length(c.max_seq_len)
    w.add_embedding_length(c.dim)
    w.add_block_count(c.n_layers)
    w.add_feed_forward_length(c.ffn_dim)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    w.add_rope_dimension_count(c.head_dim)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(file_type)
    w.add_tokenizer_model("no_vocab")
    if c.rope_scaling is not None:  # llama.cpp divides each base frequency by its factor
        factors = inv_freq(c.replace(rope_scaling=None)) / inv_freq(c)
        w.add_tensor("rope_freqs.weight", factors.numpy().astype(np.float32))
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            if name.endswith("q_proj.weight"):
                t = interleave_rope_rows(t, c.n_heads)
            elif name.endswith("k_proj.weight"):
                t = interleave_rope_rows(t, c.n_kv_heads)
            data = t.float().numpy()
            if data.ndim == 1:  # norms stay float32, as llama.cpp's converter keeps them
                w.add_tensor(gguf_name(name), data)
            else:
                w.add_tensor(gguf_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    path.with_suffix(".partial").rename(path)
    return path
