"""Linear layers (bf16, int8 and int4 weights, the decode kernel behind them) against the plain PyTorch path."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support.checkpoints import hf_model, prompt_ids
from support.gguf_checkpoints import random_blocks
from support.kernels import has_int8_x, x_in_int8, x_in_int8_blocks

import model.linear
from model import generate, load_checkpoint
from model.blocks import dequantize_blocks
from model.kernels import kernels
from model.linear import FEW_ROWS, MAX_KERNEL_ROWS, Linear, linear, project
from model.quantize import dequantize, dequantize_int8, quantize_int4, quantize_int8


class Spy:
    """Stands in for the kernel's ops: records the x each op was given, then runs the real op."""

    def __init__(self, ops):
        self.ops, self.calls = ops, []

    def matvec_bf16(self, x, ws, fp32_out=False):
        self.calls.append(tuple(x.shape))
        return self.ops.matvec_bf16(x, ws, fp32_out)

    def matvec_int8(self, x, ws, scales, fp32_out=False):
        self.calls.append(tuple(x.shape))
        return self.ops.matvec_int8(x, ws, scales, fp32_out)

    def matvec_int4(self, x, ws, scales, offsets, fp32_out=False):
        self.calls.append(tuple(x.shape))
        return self.ops.matvec_int4(x, ws, scales, offsets, fp32_out)


def stored(w: torch.Tensor, kind: str) -> tuple:
    """(weight, scale, offset) of w stored as `kind`."""
    if kind == "bf16":
        return w.bfloat16(), None, None
    return (*quantize_int8(w), None) if kind == "int8" else quantize_int4(w)


def direct(ops, x, weight, scale, offset):
    if weight.dtype == torch.uint8:
        return ops.matvec_int4(x, [weight], [scale], [offset])
    return ops.matvec_bf16(x, [weight]) if scale is None else ops.matvec_int8(x, [weight], [scale])


@pytest.fixture
def spy(monkeypatch):
    ops = kernels()
    assert ops is not None, "the C++ decode kernel did not build (is a C++ compiler installed?)"
    spy = Spy(ops)
    monkeypatch.setattr(model.linear, "kernels", lambda: spy)
    return spy


@pytest.mark.parametrize("shape", [(576,), (1, 576), (1, 1, 576), (8, 1, 576), (2, 4, 576), (3, 1, 1, 576)])
@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
def test_up_to_eight_rows_go_to_the_kernel_in_any_leading_shape(spy, shape, kind):
    g = torch.Generator().manual_seed(len(shape))
    x = torch.randn(shape, generator=g)
    w = torch.randn(7, 576, generator=g)
    weight, scale, offset = stored(w, kind)
    ours = linear(x, weight, scale, offset)
    rows = x.numel() // 576
    assert spy.calls == [(rows, 576)]
    assert ours.shape == (*shape[:-1], 7)
    assert torch.equal(ours.reshape(rows, 7), direct(spy.ops, x.reshape(rows, 576), weight, scale, offset))
    if kind == "int4" and has_int8_x(spy.ops):  # x rounded to int8 per block of 32 (AVX-512, AVX2)
        x = x_in_int8_blocks(x.reshape(rows, 576))[0].float().reshape(shape)
    plain = F.linear(x, dequantize(weight, scale, offset))
    assert (ours - plain).norm() < 1e-4 * plain.norm()  # test_kernels.py bounds the error per output


@pytest.mark.parametrize("shape", [(17, 576), (3, 6, 576), (1, 512, 576)])
def test_more_rows_go_to_f_linear(spy, shape):
    x = torch.randn(shape)
    assert FEW_ROWS < x.numel() // 576
    linear(x, torch.randn(7, 576).bfloat16())
    assert spy.calls == []


@pytest.mark.parametrize("rows", [9, 13, 16])
def test_a_few_more_rows_go_to_the_kernel_in_groups(spy, rows):
    x, w = torch.randn(1, rows, 576), torch.randn(7, 576).bfloat16()
    ours = linear(x, w)
    assert spy.calls == [(MAX_KERNEL_ROWS, 576), (rows - MAX_KERNEL_ROWS, 576)] and ours.shape == (1, rows, 7)
    assert torch.equal(ours[0], torch.cat([linear(x[0, i:i + 1], w) for i in range(rows)]))


@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
def test_without_the_kernel_every_product_goes_to_f_linear_a_few_rows_one_at_a_time(monkeypatch, kind):
    monkeypatch.setattr(model.linear, "kernels", lambda: None)
    w, x = torch.randn(7, 64), torch.randn(2, 1, 64)
    weight, scale, offset = stored(w, kind)
    plain = torch.stack([F.linear(x[i], dequantize(weight, scale, offset)) for i in range(2)])
    assert torch.equal(linear(x, weight, scale, offset), plain)
    many = torch.randn(FEW_ROWS + 1, 64)
    assert torch.equal(linear(many, weight, scale, offset), F.linear(many, dequantize(weight, scale, offset)))


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("kind", ["bf16", "fp32", "int8", "int4"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_a_rows_product_is_the_same_whatever_rows_come_with_it(monkeypatch, kernel, kind, x_dtype):
    """Up to FEW_ROWS rows: each row's output bit for bit the same alone or among others, so a sequence
    decodes the same tokens alone or in a batch (K = 8192 is several pieces of the kernel's loop)."""
    if not kernel:
        monkeypatch.setattr(model.linear, "kernels", lambda: None)
    g = torch.Generator().manual_seed(5)
    for k_dim in (576, 8192):
        w = torch.randn(96, k_dim, generator=g) * 0.05
        weight, scale, offset = (w, None, None) if kind == "fp32" else stored(w, kind)
        x = torch.randn(FEW_ROWS, k_dim, generator=g).to(x_dtype)
        alone = [linear(x[i:i + 1], weight, scale, offset) for i in range(FEW_ROWS)]
        for rows in range(2, FEW_ROWS + 1):
            together = linear(x[:rows], weight, scale, offset)
            for i in range(rows):
                assert torch.equal(together[i:i + 1], alone[i]), (k_dim, rows, i)


@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_fp32_out_gives_the_sums_before_their_rounding(spy, kind, x_dtype):
    """The output head's logits: the kernel's fp32 sums, which rounded to x's dtype are its usual output."""
    g = torch.Generator().manual_seed(6)
    weight, scale, offset = stored(torch.randn(300, 576, generator=g) * 0.05, kind)
    x = torch.randn(3, 576, generator=g).to(x_dtype)
    wide = model.linear.linears(x, [weight], [scale], [offset], fp32_out=True)
    narrow = linear(x, weight, scale, offset)
    assert wide.dtype == torch.float32 and narrow.dtype == x_dtype and spy.calls == [(3, 576), (3, 576)]
    assert torch.equal(wide.to(x_dtype), narrow)
    if x_dtype == torch.bfloat16:
        assert not torch.equal(wide, narrow.float())  # digits that bf16 drops


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_prefill_dequantizes_a_block_of_rows_at_a_time(monkeypatch, kind, x_dtype):
    """Many rows: F.linear on blocks of the dequantized matrix, each of at most DEQUANTIZE_BLOCK_BYTES."""
    monkeypatch.setattr(model.linear, "DEQUANTIZE_BLOCK_BYTES", 10 * 64 * x_dtype.itemsize)  # blocks of 10 rows
    widened = []
    real = model.linear.widen
    monkeypatch.setattr(model.linear, "widen", lambda *a: widened.append(a[0].shape[0]) or real(*a))
    w, x = torch.randn(25, 64), torch.randn(3, 12, 64).to(x_dtype)
    weight, scale, offset = stored(w, kind)
    ours = linear(x, weight, scale, offset)
    assert widened == [10, 10, 5] and ours.dtype == x_dtype
    torch.testing.assert_close(ours, F.linear(x, dequantize(weight, scale, offset, x_dtype)))  # dtype's tolerance


@pytest.mark.parametrize("kind", ["int8", "int4", "q4_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_widen_takes_the_kernels_loops_where_built_and_the_reference_elsewhere(monkeypatch, kind, dtype):
    w = torch.randn(40, 96)
    weight, scale, offset = stored(w, "int4" if kind == "q4_0" else kind)
    offset = None if kind == "q4_0" else offset
    reference = dequantize(weight, scale, offset, torch.float32)
    called = []
    ops = model.linear.kernels()
    if ops is not None:  # the kernel's op is what runs
        for name in ("dequantize_int4", "dequantize_int8"):
            real = getattr(ops, name)
            monkeypatch.setattr(ops, name, lambda *a, real=real, name=name: called.append(name) or real(*a),
                                raising=False)
    ours = model.linear.widen(weight, scale, offset, dtype)
    assert ours.dtype == dtype
    if ops is not None:
        assert called == ["dequantize_int8" if kind == "int8" else "dequantize_int4"]
    torch.testing.assert_close(ours.float(), reference, rtol=2**-8 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)
    monkeypatch.setattr(model.linear, "kernels", lambda: None)  # no kernel built: model/quantize.py's loops
    assert torch.equal(model.linear.widen(weight, scale, offset, dtype), dequantize(weight, scale, offset, dtype))


def test_prefill_multiplies_blocks_in_their_integers_where_the_kernel_has_them(monkeypatch):
    """A GGUF's K-quant matrix and a prompt chunk's many rows: the kernel's prefill_blocks, nothing widened, where the
    build has it (AVX2, AVX-512); where oneDNN's AMX bf16 tiles are faster, the blocks widened for F.linear."""
    widened = []
    real = model.linear.widen
    monkeypatch.setattr(model.linear, "widen", lambda *a: widened.append(a[0].shape[0]) or real(*a))
    blocks, x = torch.from_numpy(random_blocks("Q4_K", 24, 512, seed=1)), torch.randn(2, 20, 512)
    ours = linear(x, blocks)
    ops = model.linear.prefill_ops(x)
    assert (ops is None) == (kernels() is None or not hasattr(kernels(), "prefill_blocks") or model.linear.has_amx())
    if ops is not None:
        assert widened == [] and torch.equal(ours, ops.prefill_blocks(x.reshape(40, 512), [blocks]).view(2, 20, 24))
        q6_k = torch.from_numpy(random_blocks("Q6_K", 8, 512, seed=2))  # q|k|v of two formats: one call, fp32 out
        both = model.linear.linears(x.bfloat16(), [blocks, q6_k], [None, None], fp32_out=True)
        assert both.dtype == torch.float32 and torch.equal(
            both, ops.prefill_blocks(x.bfloat16().reshape(40, 512), [blocks, q6_k], True).view(2, 20, 32))
    monkeypatch.setattr(model.linear, "has_amx", lambda: True)
    widened.clear()
    torch.testing.assert_close(linear(x, blocks), F.linear(x, dequantize_blocks(blocks)), rtol=1e-5, atol=1e-4)
    assert widened == [24]


def test_prefill_widens_bf16_weights_for_fp32_activations_a_block_of_rows_at_a_time(monkeypatch):
    """CPUs without bf16 arithmetic compute in fp32: the bf16 matrix is never held whole in fp32."""
    monkeypatch.setattr(model.linear, "DEQUANTIZE_BLOCK_BYTES", 10 * 64 * 4)  # blocks of 10 fp32 rows
    widened = []
    real = model.linear.widen
    monkeypatch.setattr(model.linear, "widen", lambda *a: widened.append(a[0].shape[0]) or real(*a))
    w, x = torch.randn(25, 64).bfloat16(), torch.randn(3, 12, 64)
    ours = linear(x, w)
    assert widened == [10, 10, 5] and ours.dtype == torch.float32
    torch.testing.assert_close(ours, F.linear(x, w.float()), rtol=1e-6, atol=1e-5)


def test_project_gives_the_layers_outputs_side_by_side(spy):
    layers = [Linear(64, n) for n in (64, 16, 16)]
    for layer in layers:
        layer.weight = torch.nn.Parameter(layer.weight.detach().bfloat16(), requires_grad=False)
    x = torch.randn(5, 1, 64)
    ours = project(x, *layers)
    assert ours.shape == (5, 1, 96) and spy.calls == [(5, 64)]
    torch.testing.assert_close(ours, torch.cat([F.linear(x, layer.weight.float()) for layer in layers], -1),
                               rtol=1e-4, atol=1e-4)


def test_scales_cast_by_to_dtype_still_work(spy):
    """model.to(torch.bfloat16) casts the float scale buffers too; the kernel takes them back in fp32."""
    layer = Linear(64, 8)
    q, layer.scale = quantize_int8(layer.weight.detach())
    layer.weight = torch.nn.Parameter(q, requires_grad=False)
    layer.to(torch.bfloat16)
    assert layer.weight.dtype == torch.int8 and layer.scale.dtype == torch.bfloat16
    x = torch.randn(2, 64)
    plain = F.linear(x, dequantize_int8(q, layer.scale.float()))
    assert (layer(x) - plain).norm() < 1e-4 * plain.norm()
    assert spy.calls == [(2, 64)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    hf_model(seed=9).save_pretrained(folder)
    return folder


def test_bf16_weights_decode_like_prefill(folder):
    """Greedy decode through the kernel picks the tokens that full forwards (F.linear) rank first.

    Where activations are bf16 (CPUs with native bf16), the two paths sum in different orders and
    round their outputs to bf16, so a near-tie may fall either way: the token decode picked must
    then be within two bf16 steps of the best logit. With fp32 activations they agree exactly.
    """
    ckpt = load_checkpoint(folder, dtype=torch.bfloat16)
    prompt = prompt_ids(n=10)[0].tolist()
    gen = generate(ckpt, prompt, max_new_tokens=20, stop_ids=set())
    list(gen)
    ids = prompt + gen.tokens
    with torch.no_grad():
        logits = ckpt.model(torch.tensor([ids]))[0].float()  # many rows: F.linear
    rows = logits[len(prompt) - 1:-1]
    picked = rows.gather(-1, torch.tensor(gen.tokens)[:, None])[:, 0]
    best = rows.max(-1).values
    if ckpt.dtype == torch.float32:
        assert gen.tokens == rows.argmax(-1).tolist()
    else:
        assert ((best - picked) <= 2 * 2**-8 * best.abs()).all()
        assert (picked == best).sum() >= 18
    assert rows.std(-1).min() > 0.5  # logits spread out: a broken kernel would pick far from the best


def test_int8_scales_are_buffers_that_move_and_are_saved(folder):
    ckpt = load_checkpoint(folder, dtype=torch.float32, quantize="int8")
    wq = ckpt.model.layers[0].attention.wq
    state = ckpt.model.state_dict()
    assert torch.equal(state["layers.0.attention.wq.scale"], wq.scale)
    assert wq.scale.shape == (wq.out_features, wq.in_features // 64) and wq.scale.dtype == torch.float32
    assert "output.scale" in state  # the tied head's own int8 copy
    moved = ckpt.model.layers[0].attention.to("meta")
    assert moved.wq.scale.device.type == "meta" and moved.wq.weight.device.type == "meta"


def test_int4_scales_and_offsets_are_buffers_that_move_and_are_saved(folder):
    ckpt = load_checkpoint(folder, dtype=torch.float32, quantize="int4")
    wq = ckpt.model.layers[0].attention.wq
    state = ckpt.model.state_dict()
    assert wq.weight.dtype == torch.uint8 and wq.weight.shape == (wq.out_features, wq.in_features // 2)
    for buffer in ("scale", "offset"):
        assert torch.equal(state[f"layers.0.attention.wq.{buffer}"], getattr(wq, buffer))
        assert getattr(wq, buffer).shape == (wq.out_features, wq.in_features // 32)
        assert getattr(wq, buffer).dtype == torch.float16
    assert {"output.weight", "output.scale"} <= set(state) and "output.offset" not in state
    assert state["output.weight"].dtype == torch.int8  # the tied head's own copy, int8 (OUTPUT_HEAD)
    assert ckpt.model.tok_embeddings.weight.dtype == torch.float32
    moved = ckpt.model.layers[0].attention.to("meta")
    assert moved.wq.offset.device.type == "meta" and moved.wq.weight.device.type == "meta"
    layer = ckpt.model.layers[1].feed_forward.w2
    x = torch.randn(3, layer.in_features)
    expected = F.linear(x, dequantize(layer.weight, layer.scale, layer.offset))
    layer.to(torch.bfloat16)  # casts the fp16 scales and offsets; the kernel takes them back in fp16
    assert layer.weight.dtype == torch.uint8 and layer.offset.dtype == torch.bfloat16
    assert (layer(x) - expected).norm() < 1e-2 * expected.norm()


def test_unquantized_linears_have_no_scales_to_load(folder):
    """A checkpoint carries no scales: they must not count as missing tensors."""
    ckpt = load_checkpoint(folder, dtype=torch.float32)
    assert ckpt.model.layers[0].attention.wq.scale is None
    assert not [name for name in ckpt.model.state_dict() if name.endswith(".scale")]


def test_int8_model_stays_close_to_float32(folder):
    full = load_checkpoint(folder, dtype=torch.float32)
    int8 = load_checkpoint(folder, dtype=torch.float32, quantize="int8")
    assert int8.model.layers[0].attention.wq.weight.dtype == torch.int8
    assert int8.model.tok_embeddings.weight.dtype == torch.float32  # lookups stay exact
    ids = prompt_ids(n=32)
    with torch.no_grad():
        a, b = full.model(ids), int8.model(ids)
    # Random weights make near-ties among 128k logits common; real checkpoints agree more closely
    # (bench/quality.py measures that on the default model).
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8
    assert (a - b).abs().mean() / a.abs().mean() < 0.05


def test_int4_model_is_the_float_model_with_its_dequantized_weights(folder):
    full = load_checkpoint(folder, dtype=torch.float32)
    int4 = load_checkpoint(folder, dtype=torch.float32, quantize="int4")
    ids = prompt_ids(n=32)
    with torch.no_grad():
        a, b = full.model(ids), int4.model(ids)
        # 16 levels per block of 32 random weights (a step of range / 15, against int8's max / 127): the
        # logits of this random model move by about 40% of their size, int8's by 3.5%
        assert 0.1 < (a - b).abs().mean() / a.abs().mean() < 0.6
        full.model.output.weight = torch.nn.Parameter(full.model.output.weight.clone())  # untied, as int4's
        for name, module in int4.model.named_modules():
            if isinstance(module, Linear):
                assert module.weight.dtype == (torch.int8 if name == "output" else torch.uint8), name
                full.model.get_submodule(name).weight.copy_(dequantize(module.weight, module.scale, module.offset))
        torch.testing.assert_close(full.model(ids), b, rtol=1e-4, atol=1e-4 * a.abs().max().item())


def test_int4_decode_picks_what_int4_prefill_ranks_first(folder):
    """Greedy decode through matvec_int4 against full forwards of the same int4 model (F.linear on
    blocks of dequantized rows): fp32 activations and x in int16 (x in int8 blocks, the AVX-512 and AVX2
    builds' default, moves an output by up to 1/127 of a block's largest |x|: near-ties break either way), so the
    two agree token for token."""
    ckpt = load_checkpoint(folder, dtype=torch.float32, quantize="int4")
    prompt = prompt_ids(n=FEW_ROWS + 4)[0].tolist()  # prefilled by F.linear, as the full forwards
    gen = generate(ckpt, prompt, max_new_tokens=16, stop_ids=set())
    with x_in_int8(False):
        list(gen)
    with torch.no_grad():
        logits = ckpt.model(torch.tensor([prompt + gen.tokens]))[0]
    assert gen.tokens == logits[len(prompt) - 1:-1].argmax(-1).tolist()


def test_compiled_decode_gives_the_same_tokens(folder):
    """Inductor compiles the decode step to C++ in a fresh interpreter (16-43 s on a Zen 4, 39 s on a fresh clone,
    whose path torch's cache in /tmp has not seen), once: a step at the next position runs the same graph (a graph per
    position, guarded on its value, would recompile at each step and fall back to eager after eight)."""
    # In a fresh interpreter: once chainlit is imported (other tests import the app), its lazy
    # module __getattr__ raises KeyError for unknown names, which breaks torch.compile's inductor.
    script = f"""
import torch
from model import generate, load_checkpoint
plain = load_checkpoint({str(folder)!r}, dtype=torch.bfloat16)
compiled = load_checkpoint({str(folder)!r}, dtype=torch.bfloat16, compile=True)
assert compiled.model.decode is not compiled.model.forward
prompt = list(range(1000, 1010))
a = generate(plain, prompt, max_new_tokens=12, stop_ids=set())
b = generate(compiled, prompt, max_new_tokens=12, stop_ids=set())
list(a), list(b)
from torch._dynamo.utils import counters
print(a.tokens == b.tokens, len(a.tokens), counters["stats"]["unique_graphs"])
"""
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["True", "12", "1"]  # the same tokens, 12 of them, from one compiled graph
