"""A checkpoint folder as a GGUF file for llama.cpp: the same weights, in f32, bf16, f16 or Q8_0 (Q4_0 by
llama.cpp's own quantizer, below).

Written the way llama.cpp's convert_hf_to_gguf.py writes a Llama (LlamaModel in its conversion/
llama.py): llama.* hyper-parameters with head_dim as key/value length and RoPE dimension; q/k rows
permuted back to interleaved RoPE pairs; the llama3 RoPE scaling only as a `rope_freqs.weight`
tensor, one factor per frequency, computed as its generate_extra_tensors does; no output.weight when
tied; every matrix (the embedding included) in the chosen type, norms in F32. The benchmark's files
carry llama.cpp's dummy `no_vocab` tokenizer (it feeds token ids); the tests add Llama 3's
(tests/gguf_checkpoints.py).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from common import CACHE

from model.config import LlamaConfig, RopeFreqFactors
from model.rope import permute_qk_rows

# Files made by llama.cpp's own quantizer (llama-quantize, through llama-cpp-python) from the bf16 file: the
# way users get a Q4_0 model (convert_hf_to_gguf.py writes no Q4_0). Its recipe keeps the output head (the
# tied embedding) in Q6_K, or Q8_0 where rows are not whole 256-blocks (the 135M model's 576); "-pure"
# is its --pure flag: every matrix Q4_0.
LLAMA_QUANTIZE = {"q4_0": ("LLAMA_FTYPE_MOSTLY_Q4_0", False), "q4_0-pure": ("LLAMA_FTYPE_MOSTLY_Q4_0", True),
                  "q4_k_m": ("LLAMA_FTYPE_MOSTLY_Q4_K_M", False), "q5_k_m": ("LLAMA_FTYPE_MOSTLY_Q5_K_M", False),
                  "q6_k": ("LLAMA_FTYPE_MOSTLY_Q6_K", False), "q3_k_m": ("LLAMA_FTYPE_MOSTLY_Q3_K_M", False),
                  "q2_k": ("LLAMA_FTYPE_MOSTLY_Q2_K", False)}

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


def rope_factors(config: LlamaConfig) -> np.ndarray:
    """The RoPE scaling as llama.cpp's converter stores it: one divisor per frequency, float32."""
    s = config.rope_scaling
    if isinstance(s, RopeFreqFactors):  # a folder imported from a GGUF: its own factors
        return np.array(s.factors, dtype=np.float32)
    dim = config.head_dim
    freqs = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor)
            factors.append(1 / ((1 - smooth) / s.factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def gguf_writer(path: Path, architecture: str = "llama", **options):
    """gguf.GGUFWriter, but an array of strings, or of numbers, packed in one pass: the library packs each item
    through its own calls: a Llama 3 vocabulary and its merges (400,000 strings) in 0.35 s, not 0.62, and its
    128,256 token types in 0.008 s, not 0.21 (Zen 4), in every file the tests write."""
    import struct

    import gguf

    numbers = {int: gguf.GGUFValueType.INT32, float: gguf.GGUFValueType.FLOAT32}  # (the library's own choice)

    class Writer(gguf.GGUFWriter):
        def _pack_val(self, val, vtype, add_vtype, sub_type=None):
            if vtype == gguf.GGUFValueType.ARRAY and val and not isinstance(val, bytes) and type(val[0]) in numbers:
                item = sub_type or numbers[type(val[0])]
                fmt = self._simple_value_packing.get(item)
                if fmt and item != gguf.GGUFValueType.BOOL and all(type(v) is type(val[0]) for v in val):
                    head = (self._pack("I", vtype) if add_vtype else b"") + self._pack("I", item)
                    order = "<" if self.endianess == gguf.GGUFEndian.LITTLE else ">"
                    return head + self._pack("Q", len(val)) + struct.pack(f"{order}{len(val)}{fmt}", *val)
            if vtype != gguf.GGUFValueType.ARRAY or not val or not all(isinstance(v, str) for v in val) \
                    or sub_type not in (None, gguf.GGUFValueType.STRING):
                return super()._pack_val(val, vtype, add_vtype, sub_type)
            length = struct.Struct("<Q" if self.endianess == gguf.GGUFEndian.LITTLE else ">Q").pack
            encoded = [v.encode("utf-8") for v in val]
            head = (self._pack("I", vtype) if add_vtype else b"") + self._pack("I", gguf.GGUFValueType.STRING)
            return b"".join([head, self._pack("Q", len(val)), *(part for e in encoded for part in (length(len(e)), e))])

    return Writer(path, architecture, **options)


def write_gguf(folder: Path, path: Path, kind: str, add_vocab: Callable | None = None, name: str = "random",
               encode: Callable | None = None) -> Path:
    """The safetensors checkpoint in `folder` as `path`, as `convert_hf_to_gguf.py --outtype kind` writes it.

    add_vocab(writer) adds the tokenizer's metadata; without it the file has llama.cpp's `no_vocab`.
    encode(gguf name, float32 matrix) -> (its data, GGML type), or None for `kind`'s: a matrix stored otherwise.
    """
    import gguf
    from safetensors import safe_open

    qtype = {"f32": gguf.GGMLQuantizationType.F32, "bf16": gguf.GGMLQuantizationType.BF16,
             "f16": gguf.GGMLQuantizationType.F16, "q8_0": gguf.GGMLQuantizationType.Q8_0,
             "q4_0": gguf.GGMLQuantizationType.Q4_0, "q4_1": gguf.GGMLQuantizationType.Q4_1,
             "q5_0": gguf.GGMLQuantizationType.Q5_0, "q5_1": gguf.GGMLQuantizationType.Q5_1}[kind]
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                 "f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                 "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
                 "q5_0": gguf.LlamaFileType.MOSTLY_Q5_0, "q5_1": gguf.LlamaFileType.MOSTLY_Q5_1}[kind]
    c = LlamaConfig.from_hf_config(folder / "config.json")
    w = gguf_writer(path, "llama", use_temp_file=True)
    w.add_name(name)
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
    if add_vocab is None:
        w.add_tokenizer_model("no_vocab")
    else:
        add_vocab(w)
    if c.rope_scaling is not None:
        w.add_tensor("rope_freqs.weight", rope_factors(c))
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        for hf in f.keys():
            t = f.get_tensor(hf)
            if hf.endswith("q_proj.weight"):
                t = permute_qk_rows(t, c.n_heads, to="interleaved")
            elif hf.endswith("k_proj.weight"):
                t = permute_qk_rows(t, c.n_kv_heads, to="interleaved")
            data = t.float().numpy()
            if data.ndim == 1:  # norms stay float32, as llama.cpp's converter keeps them
                w.add_tensor(gguf_name(hf), data)
            elif encode is not None and (stored := encode(gguf_name(hf), data)) is not None:
                w.add_tensor(gguf_name(hf), stored[0], raw_dtype=stored[1])
            else:
                w.add_tensor(gguf_name(hf), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_quantize(source: Path, path: Path, kind: str, requantize: bool = False) -> Path:
    """`source` (a bf16 GGUF; with `requantize`, a quantized one) quantized by llama.cpp's llama_model_quantize,
    as `llama-quantize` does (`--allow-requantize`)."""
    import llama_cpp

    ftype, pure = LLAMA_QUANTIZE[kind]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.pure, params.allow_requantize = getattr(llama_cpp, ftype), pure, requantize
    if llama_cpp.llama_model_quantize(str(source).encode(), str(path).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {kind}")
    return path


def gguf_checkpoint(folder: Path, shape: str, kind: str) -> Path:
    """`bench/.cache/<shape>-<kind>.gguf` from the safetensors folder, written once."""
    if kind in LLAMA_QUANTIZE:
        path = CACHE / f"{shape}-{kind}-llama-quantize.gguf"
        if not path.is_file():
            source = gguf_checkpoint(folder, shape, "bf16")
            llama_quantize(source, path.with_suffix(".partial"), kind).rename(path)
        return path
    path = CACHE / f"{shape}-{kind}.gguf"
    if not path.is_file():
        write_gguf(folder, path.with_suffix(".partial"), kind, name=f"random {shape}").rename(path)
    return path


def imported_checkpoint(folder: Path, shape: str, kind: str) -> Path:
    """The GGUF of gguf_checkpoint(folder, shape, kind) as our import keeps its tensors (model/convert/
    gguf_tensors.py: blocks as they are), beside `folder`'s config and tokenizer (the benchmark's files carry
    llama.cpp's dummy tokenizer, which the import does not read): `bench/.cache/<shape>-<kind>-imported`."""
    import json
    import shutil

    from model.convert.gguf import Q8_0_GROUP
    from model.convert.gguf_reader import open_gguf
    from model.convert.gguf_tensors import entries, write_safetensors

    out = CACHE / f"{shape}-{kind}-imported"
    if not (out / "model.safetensors").is_file():
        path = gguf_checkpoint(folder, shape, kind)
        partial = out.with_suffix(".partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(folder, partial, ignore=shutil.ignore_patterns("*.safetensors*"))
        config = json.loads((partial / "config.json").read_text())
        found = entries(open_gguf(path), config, path, dequantize_others=False)
        if any(e.dtype == "I8" for e in found):  # llama.cpp keeps some rows in Q8_0
            config["quantization"] = {"method": "int8", "group_size": Q8_0_GROUP}
            (partial / "config.json").write_text(json.dumps(config))
        write_safetensors(found, partial / "model.safetensors")
        partial.rename(out)
    return out
