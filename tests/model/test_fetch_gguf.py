"""`python -m model.fetch file.gguf`: a Llama-3-shaped random GGUF written in llama.cpp's layout
(gguf_checkpoints.py) imports into a folder that gives the source's logits, keeps each tensor's type
(Q8_0 as int8 values and scales, Q4_0/Q4_1 as int4 nibbles, scales and minimums, none quantized
again), has Meta's tokenizer and the file's chat template, and never holds a tensor widened to fp32.
Plus folders of GGUFs (LM Studio, Ollama) and the refusals."""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import json
import os
import shutil
import struct
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from support.checkpoints import hf_model, prompt_ids
from support.gguf_checkpoints import (CHAT_TEMPLATE, as_stored, gguf_name, gguf_writer, random_blocks,
                                      write_llama3_gguf, write_other_architecture)
from support.kernels import x_in_int8

import model.checkpoint
import model.linear
import model.convert.gguf as gguf_module
import model.convert.gguf_tensors as tensors_module
from model.convert.folder import ConversionError
from model.convert.gguf_reader import ArrayField, Reader, open_gguf
from model import ChatFormat, Tokenizer, generate, load_checkpoint
from model.checkpoint import CheckpointError, blocks_decode_fast
from model.kernels import kernels
from model.block_formats import BY_NAME as FORMATS_BY_NAME
from model.blocks import is_blocks
from model.packed import is_packed
from model.config import RopeFreqFactors
from model.decode_step import LayerWeights
from model.kv_cache import KVCache
from model.fetch import main
from model.quantize import dequantize, dequantize_int8
from model.rope import inv_freq, permute_qk_rows
from model.tokenizer import meta_tokenizer_model

KINDS = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]
UNTIED = {"f16"}  # one float kind with its own output head
LOGIT_TOLERANCE = 1e-4  # float32; RoPE from llama.cpp's per-frequency factors vs the llama3 formula: ~1e-5
SAFETENSORS_DTYPE = {"f32": "F32", "f16": "F16", "bf16": "BF16"}


@pytest.fixture(scope="module")
def sources() -> dict[bool, transformers.LlamaForCausalLM]:
    return {True: hf_model(seed=0), False: hf_model(tie=False, seed=1)}


@pytest.fixture(scope="module")
def imported(sources, tmp_path_factory):
    """kind -> (the GGUF, the folder `python -m model.fetch` made of it, the source model), each made once."""
    made = {}
    root = tmp_path_factory.mktemp("gguf")

    def get(kind):
        if kind not in made:
            source = sources[kind not in UNTIED]
            path = write_llama3_gguf(source, root / f"Tiny-Llama-3-{kind}.gguf", kind)
            main([str(path), "--weights-dir", str(root / "weights")])
            made[kind] = path, root / "weights" / f"Tiny-Llama-3-{kind}", source
        return made[kind]
    return get


@functools.cache
def reader(path: Path) -> gguf.GGUFReader:
    return Reader(path)  # each file read once


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG], ids=["little", "big"])
def test_the_reader_reads_what_the_gguf_library_reads(tmp_path, endian):
    """model/convert/gguf_reader.Reader (the library's reader, values sliced from a plain view of the map,
    arrays read whole) gives the library's fields and tensors: every value type, arrays of strings and of
    numbers (an array's items are one part, not one part each: the parts before them are the library's), strings
    that are not ASCII, an empty array, tensors of a float and a quantized type, either byte order."""
    path = tmp_path / "values.gguf"
    writer = gguf.GGUFWriter(path, "llama", endianess=endian)
    writer.add_uint8("u8", 255)
    writer.add_int8("i8", -128)
    writer.add_uint16("u16", 65535)
    writer.add_int16("i16", -32768)
    writer.add_uint32("u32", 2**32 - 1)
    writer.add_int32("i32", -2**31)
    writer.add_uint64("u64", 2**64 - 1)
    writer.add_int64("i64", -2**63)
    writer.add_float32("f32", -1.5e-5)
    writer.add_float64("f64", 2.0 ** -1074)
    writer.add_bool("bool", True)
    writer.add_string("str", "Grüße, 世界 🦙")
    writer.add_array("strings", ["a", "", "ĠHello", "日本"] * 50)
    writer.add_array("numbers", list(range(-5, 300)))
    writer.add_array("floats", [0.5, -2.25, 1e30])
    writer.add_array("bools", [True, False, True])
    writer.add_array("nothing", [])
    writer.add_tensor("w", np.arange(24, dtype=np.float32).reshape(4, 6))
    q8 = gguf.quants.quantize(np.linspace(-1, 1, 64 * 2, dtype=np.float32).reshape(2, 64), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours, theirs = Reader(path), gguf.GGUFReader(path)
    assert ours.endianess == theirs.endianess == endian
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.types) == (field.offset, field.types), name
        whole = isinstance(mine, ArrayField)  # the key, the types, the count as parts; then the items as one
        assert whole == (field.types[0] == gguf.GGUFValueType.ARRAY and len(field.parts) > 5), name
        parts = field.parts[:5] if whole else field.parts
        assert [p.tobytes() for p in mine.parts[:len(parts)]] == [p.tobytes() for p in parts], name
        assert [p.dtype for p in mine.parts[:len(parts)]] == [p.dtype for p in parts], name
        assert whole or mine.data == field.data, name
        if whole:
            assert mine.contents(1) == field.contents(1) and mine.contents(slice(2, 4)) == field.contents(slice(2, 4))
        if name.startswith("GGUF.") or field.types[0] != gguf.GGUFValueType.ARRAY or field.types[-1] == gguf.GGUFValueType.STRING:
            assert mine.contents() == field.contents(), name
        else:
            assert np.array_equal(mine.contents(), field.contents()), name
    assert ours.fields["strings"].contents()[2] == "ĠHello" and ours.fields["u64"].contents() == 2**64 - 1
    assert ours.data_offset == theirs.data_offset
    assert len(ours.tensors) == len(theirs.tensors) == 2
    for mine, tensor in zip(ours.tensors, theirs.tensors):
        assert (mine.name, mine.tensor_type, list(mine.shape), mine.data_offset) == \
            (tensor.name, tensor.tensor_type, list(tensor.shape), tensor.data_offset)
        assert mine.data.dtype == tensor.data.dtype and np.array_equal(mine.data, tensor.data)


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG], ids=["little", "big"])
def test_the_test_files_writer_writes_the_gguf_librarys_bytes(tmp_path, endian):
    """bench/gguf_file.py's writer (arrays of strings, and of numbers, packed in one pass) writes what
    gguf.GGUFWriter writes, and refuses what it refuses."""
    files = []
    for make in (gguf.GGUFWriter, gguf_writer):
        path = tmp_path / f"{len(files)}.gguf"
        writer = make(path, "llama", endianess=endian)
        writer.add_array("strings", ["a", "", "ĠHello", "日本", "🦙"] * 20)
        writer.add_array("numbers", [1, 2, 3])
        writer.add_array("ints", [-5, 0, 2**31 - 1] * 7)
        writer.add_array("floats", [0.5, -1.25, 3e38, 1e-45] * 5)
        writer.add_key_value("unsigned", [0, 2**32 - 1], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT32)
        writer.add_array("flags", [True, False, True])
        writer.add_token_types([gguf.TokenType.NORMAL, gguf.TokenType.CONTROL])  # (IntEnum: the library's path)
        writer.add_string("one", "x")
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        files.append(path.read_bytes())
    assert files[0] == files[1]
    for make in (gguf.GGUFWriter, gguf_writer):
        for bad, error in (([1, 2.5], ValueError), ([2**31], struct.error)):  # mixed types; past INT32
            writer = make(tmp_path / "bad.gguf", "llama", endianess=endian)
            writer.add_array("bad", bad)
            writer.write_header_to_file()
            with pytest.raises(error):
                writer.write_kv_data_to_file()
            writer.close()


@pytest.mark.parametrize("items", [["ĠHello"] * 3, [7, 8, 9]], ids=["strings", "numbers"])
def test_an_array_that_runs_past_the_end_is_a_corrupt_file(tmp_path, items):
    """A header cut inside an array (a string's length, or a count, larger than what is left of the file)
    is refused as a corrupt file, as every other cut is."""
    path = tmp_path / "cut.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_array("items", items)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    whole = path.read_bytes()
    assert Reader(path).fields["items"].contents() == items
    for cut in (len(whole) - 1, len(whole) - 5):
        path.write_bytes(whole[:cut])
        with pytest.raises(ConversionError, match="truncated or corrupt GGUF"):
            open_gguf(path)
    count = whole.index(b"items") + len(b"items") + 8  # past the value's type and the items' type: the count
    path.write_bytes(whole[:count] + (2**62).to_bytes(8, "little") + whole[count + 8:])
    with pytest.raises(ConversionError, match="truncated or corrupt GGUF"):
        open_gguf(path)


def tensor_dtypes(folder: Path) -> dict[str, str]:
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        return {name: f.get_slice(name).get_dtype() for name in f.keys()}


# ---- parity ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_the_source_weights(imported, kind, widened_prefill):
    """F32 against the source; F16/BF16 against the source rounded to that type; Q8_0, Q4_0 and Q4_1
    against gguf.quants.dequantize's values. Both in float32 (Q5_0 and Q5_1's blocks widened for F.linear: the
    values the file stands for, exactly; the kernel's prefill in their integers is tested below)."""
    _, folder, source = imported(kind)
    ckpt = load_checkpoint(folder, dtype=torch.float32)
    ids = prompt_ids(n=48)
    with torch.no_grad():
        ours, theirs = ckpt.model(ids), as_stored(source, kind)(ids).logits
    diff = (ours - theirs).abs().max().item()
    assert diff <= LOGIT_TOLERANCE, f"{kind}: max abs logit difference {diff}"


def test_rope_factors_are_applied_as_the_file_gives_them(imported, sources):
    path, folder, _ = imported("q8_0")
    config = load_checkpoint(folder, dtype=torch.float32).config
    factors = next(t for t in reader(path).tensors if t.name == "rope_freqs.weight").data
    assert isinstance(config.rope_scaling, RopeFreqFactors)
    assert np.array_equal(np.array(config.rope_scaling.factors, np.float32), factors)  # float32 as in the file
    plain = inv_freq(config.replace(rope_scaling=None))
    assert torch.equal(inv_freq(config), plain / torch.tensor(factors))
    hf_inv_freq = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(sources[True].config).inv_freq
    assert torch.allclose(inv_freq(config), hf_inv_freq, rtol=1e-6, atol=0)
    assert not torch.allclose(plain, hf_inv_freq, rtol=1e-3)  # the scaling is there, and it matters


def test_q8_0_greedy_decode_matches_transformers_on_the_dequantized_weights(imported):
    """Default dtype: bf16 activations where the CPU has them, the int8 decode kernel, the int8 embedding.
    Our logits are the head's fp32 sums and transformers' are rounded to bf16, where near-ties are common:
    the tokens are the same up to the first step whose best transformers logit leads the next by two bf16
    steps or less (and that step must come late: most choices are clear)."""
    _, folder, source = imported("q8_0")
    ckpt = load_checkpoint(folder)
    ids = [128000, 9906, 11, 856, 836, 374]
    reply = generate(ckpt, ids, max_new_tokens=16, temperature=0.0)
    for _ in reply:
        pass
    theirs = as_stored(source, "q8_0")
    expected = theirs.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    with torch.no_grad():
        logits = theirs(torch.tensor([ids + expected])).logits[0, len(ids) - 1:-1].float()  # (16, vocab)
    top = logits.topk(2, dim=-1).values
    step = 2.0 ** (torch.frexp(top[:, 0].abs()).exponent - 8)  # a bf16 step at the best logit's size
    clear = next((i for i in range(16) if top[i, 0] - top[i, 1] <= 2 * step[i]), 16)
    assert clear >= 4 and reply.tokens[:clear] == expected[:clear]


@pytest.mark.parametrize("kind", ["q4_0", "q4_1"])
def test_q4_greedy_decode_matches_transformers_on_the_dequantized_weights(imported, kind):
    """fp32 activations: the int4 decode kernel (Q4_0's blocks without offsets, Q4_1's with) and the int4
    embedding give the tokens transformers picks on gguf.quants.dequantize's weights. x in int16 (as the
    AVX2 build rounds it): on random weights of 128k logits a near-tie is never far, and one x value
    rounded the other way in int8 blocks moves outputs by 1/127 of a block's largest |x|."""
    _, folder, source = imported(kind)
    ckpt = load_checkpoint(folder, dtype=torch.float32)
    ids = [128000, 9906, 11, 856, 836, 374]
    with x_in_int8(False):
        reply = generate(ckpt, ids, max_new_tokens=16, temperature=0.0)
        for _ in reply:
            pass
    expected = as_stored(source, kind).generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    assert reply.tokens == expected[0, len(ids):].tolist()


# ---- llama.cpp's blocks: a Q4_K_M-like file with every format the kernel reads -------------------------------

# Per layer, GGUF tensor -> type: layer 0 as llama-quantize's Q4_K_M writes a Llama (q, k, o, gate, up in Q4_K;
# v and down in Q6_K), layer 1 every other block format, and IQ4_NL, which no kernel here reads (widened to bf16).
# The tied embedding (the output head) in Q6_K.
BLOCK_MIX = [{"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
              "ffn_up": "Q4_K", "ffn_down": "Q6_K"},
             {"attn_q": "Q5_K", "attn_k": "Q5_K", "attn_v": "Q3_K", "attn_output": "IQ4_NL", "ffn_gate": "Q5_0",
              "ffn_up": "Q5_1", "ffn_down": "Q2_K"}]


def block_type(name: str) -> str:
    if name == "token_embd.weight":
        return "Q6_K"
    _, layer, part, _ = name.split(".")
    return BLOCK_MIX[int(layer)][part]


@pytest.fixture
def widened_prefill(monkeypatch):
    """Prefill with llama.cpp's blocks widened for F.linear, the values the file stands for exactly, not multiplied
    in their integers by x rounded to int8 (model/linear.py prefill_ops)."""
    monkeypatch.setattr(model.linear, "prefill_ops", lambda x: None)


@pytest.fixture(scope="module")
def block_files(tmp_path_factory):
    """(the GGUF, the folder imported from it, the source model with the weights the file stands for, the import's
    log): the 1B model's proportions at a small size (dim 256, so every row is whole blocks of 256), random
    blocks of about the size of its weights."""
    root = tmp_path_factory.mktemp("blocks")
    source = hf_model(hidden_size=256, intermediate_size=512, num_hidden_layers=2, seed=3)
    stands_for = {}  # GGUF name -> the gguf library's values of its blocks (q/k rows in the file's order)

    def encode(name, data):
        kind = gguf.GGMLQuantizationType[block_type(name)]
        n, k = data.shape
        blocks = random_blocks(kind.name, n, k, seed=len(name) + n, typical=0.05).reshape(n, -1)
        values = torch.from_numpy(gguf.quants.dequantize(blocks, kind))
        stands_for[name] = values.bfloat16().float() if kind.name == "IQ4_NL" else values  # (kept in bf16)
        return blocks, kind
    path = write_llama3_gguf(source, root / "Tiny-Llama-3-Q4_K_M.gguf", "f32", encode=encode)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        main([str(path), "--weights-dir", str(root / "weights")])
    reference = copy.deepcopy(source)
    c = reference.config
    with torch.no_grad():
        for hf, p in reference.named_parameters():
            if (values := stands_for.get(gguf_name(hf))) is not None:
                heads = c.num_attention_heads if "q_proj" in hf else c.num_key_value_heads if "k_proj" in hf else None
                p.copy_(values if heads is None else permute_qk_rows(values, heads, to="half"))
    return path, root / "weights" / "Tiny-Llama-3-Q4_K_M", reference, err.getvalue()


def test_blocks_are_imported_as_the_file_has_them(block_files):
    """Each block-format matrix is the file's bytes, (N, K / block, bytes) (q/k rows back in our RoPE order); the
    IQ4_NL matrix is the gguf library's values in bf16, with a line saying so and what it costs."""
    path, folder, _, log = block_files
    tensors = {t.name: t for t in reader(path).tensors}
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        for name, tensor in tensors.items():
            if tensor.tensor_type in (gguf.GGMLQuantizationType.F32, ) or name == "rope_freqs.weight":
                continue
            ours = f.get_tensor(tensors_module.hf_name(name, path))
            n = int(tensor.shape[1])
            kind = tensor.tensor_type.name
            if kind == "IQ4_NL":
                expected = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type))
                assert ours.dtype == torch.bfloat16 and torch.equal(ours, expected.bfloat16())
                continue
            heads = tensors_module.qk_heads(name, {"num_attention_heads": 4, "num_key_value_heads": 2})
            data = np.asarray(tensor.data).reshape(n, int(tensor.shape[0]) // FORMATS_BY_NAME[kind].block, -1)
            expected = torch.from_numpy(np.array(data if heads is None else permute_qk_rows(data, heads, to="half")))
            assert ours.dtype == torch.uint8 and torch.equal(ours, expected), name
    assert "1 tensor in IQ4_NL, which no decode kernel here reads, widened to bf16: 3.6x the memory" in log
    assert load_checkpoint(folder).model.layers[0].attention.wq.weight.shape == (256, 1, 144)  # Q4_K blocks, kept


def test_blocks_give_transformers_logits_on_the_gguf(block_files, monkeypatch):
    """fp32, the blocks widened for F.linear (the gguf library's values, bit for bit), against transformers on the
    values the file stands for (the IQ4_NL matrix rounded to bf16, as the import keeps it). Then prefill as it runs
    where the kernel has prefill_blocks: x rounded to int8 per 256 moves each product by up to half a step (1/254 of
    its block's largest |x|) per element, a few percent of a logit's spread over the layers on average (x per 32 in
    decode, below: 0.7-1.7%); a block read in a wrong format, order or row moves them by the spread."""
    _, folder, reference, _ = block_files
    ckpt = load_checkpoint(folder, dtype=torch.float32)
    ids = prompt_ids(n=48)
    with torch.no_grad():
        theirs = reference(ids).logits
        integers = ckpt.model(ids) if model.linear.prefill_ops(ids.float()) else None
        monkeypatch.setattr(model.linear, "prefill_ops", lambda x: None)
        ours = ckpt.model(ids)
    assert (ours - theirs).abs().max().item() <= LOGIT_TOLERANCE
    if integers is not None:
        spread = theirs.std(dim=-1, keepdim=True)
        assert ((integers - theirs).abs() / spread).mean().item() <= 0.05  # (seen: 0.024; minimums left out: 0.24)
        assert not torch.equal(integers, ours)  # (the integers' path ran)


def test_blocks_decode_through_the_kernel_as_prefill_does(block_files):
    """Decode steps (the kernel on the blocks, x in int8 per 32), through the fused layers' op and through the
    modules, against prefill's logits at the same positions. x rounded to int8 per 32 moves a product by up to
    half a step (1/254 of its block's largest |x|) per element, about 1% of a logit's spread over the layers
    (seen: 0.7-1.7% on average); blocks read in a wrong format, order or row give errors of the spread's size.
    Where prefill's best token leads by a third of the spread, each step chooses it."""
    _, folder, _, _ = block_files
    ckpt = load_checkpoint(folder, dtype=torch.float32)
    wo = ckpt.model.layers[1].attention.wo  # IQ4_NL in bf16 -> Q4_K blocks: every matrix in blocks, as the fused op takes them
    wo.weight = torch.nn.Parameter(torch.from_numpy(random_blocks("Q4_K", 256, 256, seed=5, typical=0.05)), requires_grad=False)
    assert LayerWeights(ckpt.model).current(torch.float32) is not None
    ids = prompt_ids(n=24)[:1]
    with torch.no_grad():
        prefill = ckpt.model(ids)[0, 8:]  # (16, vocab): the logits after tokens 8..23
        spread = prefill.std(dim=-1, keepdim=True)
        top = prefill.topk(2, dim=-1).values
        clear = (top[:, 0] - top[:, 1]) > spread[:, 0] / 3
        for fused in (True, False):
            cache = KVCache(ckpt.config, 24, dtype=torch.float32)
            ckpt.model(ids[:, :8], kv_cache=cache, last_only=True)
            cache.tokens = ids[0, :8].tolist()
            steps = []
            for i in range(8, 24):
                steps.append(ckpt.model.decode(ids[0, i:i + 1], [cache], fused=fused)[0])
                cache.tokens.append(int(ids[0, i]))
            steps = torch.stack(steps)
            assert ((steps - prefill).abs().mean(dim=-1, keepdim=True) <= 0.03 * spread).all()
            assert clear.sum() >= 4 and torch.equal(steps.argmax(-1)[clear], prefill.argmax(-1)[clear])

def test_q4_k_becomes_torchs_int4_where_weights_are_packed(block_files, widened_prefill):
    """pack=True (a GPU's default; the CPU's op does the same maths): Q4_K matrices are repacked once, at load,
    for torch's int4 op (model/packed.py: their sub-blocks of 32 are its groups), the other blocks stay blocks
    here (a GPU widens them). With fp32 scales and activations the logits are the blocks' to fp32's rounding: a
    sub-block, nibble or minimum out of place moves them by the spread."""
    _, folder, _, _ = block_files
    ids = prompt_ids(n=24)
    plain = load_checkpoint(folder, dtype=torch.float32)  # (its blocks widened for F.linear: widened_prefill)
    packed = load_checkpoint(folder, dtype=torch.float32, pack=True)
    first = packed.model.layers[0]
    assert is_packed(first.attention.wq.scale) and is_packed(first.feed_forward.w3.scale)
    assert is_blocks(first.attention.wv.weight) and not is_packed(first.attention.wv.scale)  # Q6_K
    with torch.no_grad():
        expected, ours = plain.model(ids), packed.model(ids)
    assert (ours - expected).abs().max().item() <= 1e-4 * expected.std().item()


# ---- what is written -------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["f32", "f16", "bf16"])
def test_float_tensors_keep_their_type_and_values(imported, kind):
    """The GGUF holds the source rounded to its type (round to nearest even, as torch rounds): the folder
    holds exactly that, q/k rows back in the source's order."""
    _, folder, source = imported(kind)
    dtypes = tensor_dtypes(folder)
    assert {d for n, d in dtypes.items() if "norm" not in n} == {SAFETENSORS_DTYPE[kind]}
    assert {d for n, d in dtypes.items() if "norm" in n} == {"F32"}  # as llama.cpp stores norms
    expected = source.state_dict()
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        for name in ["model.layers.1.mlp.down_proj.weight", "model.layers.2.self_attn.q_proj.weight",
                     "model.layers.0.self_attn.k_proj.weight", "model.embed_tokens.weight"]:
            ours = f.get_tensor(name)
            assert torch.equal(ours, expected[name].to(ours.dtype)), name


def test_q8_0_keeps_int8_values_and_f16_scales_as_they_are(imported):
    path, folder, _ = imported("q8_0")
    dtypes = tensor_dtypes(folder)
    assert dtypes["model.embed_tokens.weight"] == "I8" and dtypes["model.embed_tokens.scale"] == "F16"
    assert {d for n, d in dtypes.items() if n.endswith(".weight") and "norm" not in n} == {"I8"}
    assert "lm_head.weight" not in dtypes  # tied: the head is the embedding
    with safe_open(folder / "model.safetensors", framework="np") as f:
        for gguf_name, name, heads in [("blk.2.ffn_gate.weight", "model.layers.2.mlp.gate_proj", None),
                                       ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj", 2)]:
            tensor = next(t for t in reader(path).tensors if t.name == gguf_name)
            blocks = tensor.data.reshape(tensor.shape[1], -1, 34)  # per block: f16 scale, then 32 int8
            if heads:
                blocks = permute_qk_rows(blocks, heads, to="half")
            assert np.array_equal(f.get_tensor(name + ".weight"), blocks[:, :, 2:].view(np.int8).reshape(len(blocks), -1))
            assert np.array_equal(f.get_tensor(name + ".scale"), blocks[:, :, :2].copy().view(np.float16)[..., 0])
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization"] == {"method": "int8", "group_size": 32}


@pytest.mark.parametrize("kind", ["q4_0", "q4_1"])
def test_q4_keeps_nibbles_and_f16_scales_as_they_are(imported, kind):
    """Q4_1 blocks (f16 d, f16 m, 16 bytes) split into nibbles, scale and offset; Q4_0 (f16 d, 16 bytes)
    into nibbles and scale."""
    path, folder, _ = imported(kind)
    header = {"q4_0": ["scale"], "q4_1": ["scale", "offset"]}[kind]
    dtypes = tensor_dtypes(folder)
    assert {d for n, d in dtypes.items() if n.endswith(".weight") and "norm" not in n} == {"U8"}
    assert {n.rsplit(".", 1)[1] for n in dtypes if n.startswith("model.embed_tokens.")} == {"weight", *header}
    with safe_open(folder / "model.safetensors", framework="np") as f:
        for gguf_name, name, heads in [("blk.2.ffn_down.weight", "model.layers.2.mlp.down_proj", None),
                                       ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj", 4),
                                       ("token_embd.weight", "model.embed_tokens", None)]:
            tensor = next(t for t in reader(path).tensors if t.name == gguf_name)
            blocks = tensor.data.reshape(tensor.shape[1], -1, 2 * len(header) + 16)
            if heads:
                blocks = permute_qk_rows(blocks, heads, to="half")
            nibbles = blocks[:, :, 2 * len(header):].reshape(len(blocks), -1)
            assert np.array_equal(f.get_tensor(name + ".weight"), nibbles)
            for i, part in enumerate(header):
                assert np.array_equal(f.get_tensor(f"{name}.{part}"),
                                      blocks[:, :, 2 * i:2 * i + 2].copy().view(np.float16)[..., 0])
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization"] == {"method": "int4", "group_size": 32}


@pytest.mark.parametrize("kind", ["q4_0", "q4_1"])
def test_q4_loads_as_int4_with_the_file_scales(imported, kind):
    _, folder, source = imported(kind)
    m = load_checkpoint(folder, dtype=torch.float32).model
    wq = m.layers[0].attention.wq
    assert wq.weight.dtype == torch.uint8 and wq.weight.shape == (64, 32) and wq.scale.dtype == torch.float16
    assert wq.offset is None if kind == "q4_0" else wq.offset.dtype == torch.float16
    assert m.tok_embeddings.weight.dtype == torch.uint8 and m.output.weight is m.tok_embeddings.weight
    assert m.output.scale is m.tok_embeddings.scale and m.output.offset is m.tok_embeddings.offset
    stored = as_stored(source, kind)
    w2 = m.layers[2].feed_forward.w2
    assert torch.equal(dequantize(w2.weight, w2.scale, w2.offset), stored.model.layers[2].mlp.down_proj.weight)
    rows = torch.tensor([[0, 5, 128009]])
    assert torch.equal(m.tok_embeddings(rows), stored.model.embed_tokens(rows))


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_1"])
def test_widened_at_load_the_weights_are_the_values_the_file_stands_for(imported, kind):
    """widen=True: every matrix, the embedding and its tied head too, float32 holding exactly what the
    blocks stand for (Q4_0's included, which has no offsets); in bf16, those values rounded once."""
    _, folder, source = imported(kind)
    stored = as_stored(source, kind).state_dict()
    for dtype in (torch.float32, torch.bfloat16):
        m = load_checkpoint(folder, dtype=dtype, widen=True).model
        w2 = m.layers[2].feed_forward.w2
        assert w2.weight.dtype == dtype and w2.scale is None and w2.offset is None
        assert torch.equal(w2.weight, stored["model.layers.2.mlp.down_proj.weight"].to(dtype))
        assert m.output.weight is m.tok_embeddings.weight and m.tok_embeddings.scale is None
        assert torch.equal(m.tok_embeddings.weight, stored["model.embed_tokens.weight"].to(dtype))


def test_widen_auto_keeps_the_blocks_only_where_the_kernel_multiplies_them(imported, monkeypatch):
    _, folder, _ = imported("q4_1")
    m = load_checkpoint(folder, dtype=torch.bfloat16, widen="auto").model
    assert m.layers[0].attention.wq.weight.dtype == (torch.uint8 if kernels() else torch.bfloat16)
    monkeypatch.setattr(model.checkpoint, "kernels", lambda: None)  # no compiler, or LLAMA_KERNELS=off
    m = load_checkpoint(folder, dtype=torch.bfloat16, widen="auto").model
    assert m.layers[0].attention.wq.weight.dtype == torch.bfloat16 and m.layers[0].attention.wq.scale is None
    assert not blocks_decode_fast(torch.device("mps"))  # no op takes the blocks there: widened at every product
    monkeypatch.setattr(model.checkpoint, "packed_kinds", lambda device: ("int4", "int8"))
    assert blocks_decode_fast(torch.device("cuda"))  # a GPU whose ops take them repacked: kept, and packed
    monkeypatch.setattr(model.checkpoint, "packed_kinds", lambda device: ("int8",))  # before Ampere: no tinygemm
    assert not blocks_decode_fast(torch.device("cuda"))
    with pytest.raises(ValueError, match="widen='yes': expected True, False or auto"):
        load_checkpoint(folder, widen="yes")


def test_q8_0_loads_as_int8_with_the_file_scales(imported):
    _, folder, source = imported("q8_0")
    ckpt = load_checkpoint(folder, dtype=torch.float32)
    m = ckpt.model
    wq = m.layers[0].attention.wq
    assert wq.weight.dtype == torch.int8 and wq.scale.dtype == torch.float32 and wq.scale.shape == (64, 2)
    assert m.tok_embeddings.weight.dtype == torch.int8 and m.output.weight is m.tok_embeddings.weight
    assert m.output.scale is m.tok_embeddings.scale
    stored = as_stored(source, "q8_0")
    assert torch.equal(dequantize_int8(m.layers[2].feed_forward.w2.weight, m.layers[2].feed_forward.w2.scale),
                       stored.model.layers[2].mlp.down_proj.weight)
    rows = torch.tensor([[0, 5, 128009]])
    assert torch.equal(m.tok_embeddings(rows), stored.model.embed_tokens(rows))


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_1"])
def test_no_file_is_larger_than_the_gguf_data(imported, kind):
    """Q8_0 as int8 + f16 scales is 34 bytes per 32 weights, Q4_0 as nibbles + f16 scales 18, Q4_1 with f16
    offsets 20, as in the GGUF (float types are copied as they are)."""
    path, folder, _ = imported(kind)
    data = sum(int(t.n_bytes) for t in reader(path).tensors if t.name != "rope_freqs.weight")
    file = folder / "model.safetensors"
    header = struct.unpack("<Q", file.read_bytes()[:8])[0]
    assert file.stat().st_size - 8 - header == data
    assert sum(p.stat().st_size for p in folder.iterdir()) < path.stat().st_size


@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
def test_converting_never_widens_a_tensor_to_fp32(imported, tmp_path, monkeypatch, kind):
    """Only a row chunk at a time is copied: the peak while writing is far below one fp32 embedding."""
    path, folder, _ = imported(kind)
    monkeypatch.setattr(tensors_module, "dequantize", lambda *a: pytest.fail("dequantized a tensor"))
    found = tensors_module.entries(reader(path), gguf_module.hf_config(reader(path), path), path, False)
    tracemalloc.start()
    try:
        tensors_module.write_safetensors(found, tmp_path / "model.safetensors")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (tmp_path / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    fp32_embedding = 128256 * 64 * 4
    assert peak < fp32_embedding / 8, f"peak {peak / 1e6:.1f} MB while writing"


def test_tokenizer_is_metas_llama3_and_the_template_is_the_files(imported):
    _, folder, _ = imported("bf16")
    assert (folder / "tokenizer.model").read_bytes() == meta_tokenizer_model().read_bytes()
    ckpt = load_checkpoint(folder)
    assert isinstance(ckpt.tokenizer, Tokenizer) and isinstance(ckpt.chat_format, ChatFormat)
    assert {128001, 128008, 128009} <= ckpt.stop_ids
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == CHAT_TEMPLATE
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == ("<|begin_of_text|>", "<|eot_id|>")
    config = json.loads((folder / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["torch_dtype"]) == (128000, 128009, "bfloat16")
    assert "quantization" not in config
    generation = json.loads((folder / "generation_config.json").read_text())
    assert "temperature" not in generation  # none in the file: the engine's Llama 3 defaults apply


# ---- folders of GGUFs, and refusals ----------------------------------------------------------------

@pytest.fixture(scope="module")
def other_architecture(tmp_path_factory) -> Path:
    """A GGUF of a model that is not a Llama."""
    return write_other_architecture(tmp_path_factory.mktemp("other") / "phi.gguf")


def test_a_folder_of_ggufs_as_ollama_keeps_them(imported, other_architecture, tmp_path, capsys):
    """Ollama: blobs named by their hash, no .gguf; other blobs (a template, params) are not GGUFs."""
    path, folder, _ = imported("q8_0")
    blobs = tmp_path / "ollama" / "models" / "blobs"
    blobs.mkdir(parents=True)
    os.link(path, blobs / "sha256-1f3a")
    os.link(other_architecture, blobs / "sha256-9c2b")  # not a Llama: skipped, with the reason
    (blobs / "sha256-77aa").write_text('{"stop": ["<|eot_id|>"]}')
    weights = tmp_path / "weights"
    main([str(tmp_path / "ollama"), "--weights-dir", str(weights)])
    out = capsys.readouterr()
    assert out.out.split() == [str(weights / "Tiny-Llama-3")]  # named after general.name
    assert f"skipping {blobs / 'sha256-9c2b'}: " in out.err and "phi3" in out.err
    assert sorted(p.name for p in weights.iterdir()) == ["Tiny-Llama-3"]
    assert (weights / "Tiny-Llama-3" / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()


def fails(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_an_existing_model_folder_is_kept_unless_forced(imported, tmp_path, capsys):
    path, _, _ = imported("q8_0")
    (tmp_path / "Tiny-Llama-3-q8_0").mkdir()
    line = fails([str(path), "--weights-dir", str(tmp_path)], capsys)
    assert line == (f"error: {tmp_path / 'Tiny-Llama-3-q8_0'} already exists; pass --force to replace it, or "
                    "--name to choose another folder")


def test_a_folder_with_no_llama_gguf(tmp_path, capsys):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "notes.txt").write_text("no models here")
    line = fails([str(tmp_path / "models"), "--weights-dir", str(tmp_path / "weights")], capsys)
    assert line == f"error: {tmp_path / 'models'}: imported no Llama GGUF (found no GGUF file)"


# ---- loading quantized checkpoints: what must hold -----------------------------------------------

@pytest.fixture
def q8_0_copy(imported, tmp_path) -> Path:
    _, folder, _ = imported("q8_0")
    return Path(shutil.copytree(folder, tmp_path / "copy"))


def test_int8_weights_need_the_quantization_entry(q8_0_copy):
    config = json.loads((q8_0_copy / "config.json").read_text())
    del config["quantization"]
    (q8_0_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r'config.json: the weights hold int8 tensors with scales, so expected '
                                              r'"quantization": \{"method": "int8", "group_size": N\} or '
                                              r'\{"method": "int4", "group_size": 32\}, found None'):
        load_checkpoint(q8_0_copy)


def test_int8_scales_must_fit_the_group_size(q8_0_copy):
    config = json.loads((q8_0_copy / "config.json").read_text())
    (q8_0_copy / "config.json").write_text(json.dumps(config | {"quantization": {"method": "int8", "group_size": 16}}))
    with pytest.raises(CheckpointError, match=r"copy/model.safetensors: quantized weights: "
                                              r"model.layers.0.self_attn.k_proj"
                                              r".weight: \(32, 64\) with scale \(32, 2\), expected \(32, 4\) "
                                              r"for group_size 16, "):
        load_checkpoint(q8_0_copy)


def test_int4_weights_need_the_int4_quantization_entry(imported, tmp_path):
    _, folder, _ = imported("q4_1")
    copy = Path(shutil.copytree(folder, tmp_path / "copy"))
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(config | {"quantization": {"method": "int8", "group_size": 32}}))
    with pytest.raises(CheckpointError, match=r"config.json: the weights hold int4 \(uint8\) tensors, so expected "
                                              r".*found \{'method': 'int8', 'group_size': 32\}"):
        load_checkpoint(copy)
