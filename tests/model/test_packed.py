"""int8 and int4 matrices repacked for torch's weight-only matmul ops (model/packed.py).

On the CPU the ops' `_for_cpu` forms do the same maths as the GPU's, so everything here runs without a GPU;
`LLAMA_TEST_DEVICE=cuda` runs the tests that take the `device` fixture through the CUDA ops.
"""

import gguf
import pytest
import torch
import torch.nn.functional as F
from support import tinygemm
from support.checkpoints import prompt_ids
from support.gguf_checkpoints import random_blocks

import model.linear
from model.blocks import q4_k_as_int4
from model import load_checkpoint
from model.kv_cache import KVCache
from model.linear import Linear, fuse, out_features, widen
from model.packed import (
    INT8_MM_ROWS,
    inner_k_tiles,
    is_packed,
    packed_linear,
    repack_int8,
    repack_linear,
    repack_model,
    tinygemm_bytes,
)
from model.quantize import dequantize, pack_int4, quantize_int4, quantize_int8, unpack_int4

BF16_ROUNDING = 2.0**-8  # bf16's unit roundoff: 8 significant bits


def weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Random rows whose columns span ranges 20x apart, off centre: blocks and groups of different scales."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.linspace(0.1, 2, k) + 0.3


def stored_linear(w: torch.Tensor, kind: str, device) -> Linear:
    """A Linear holding w as int8, int4 (Q4_1: offsets) or Q4_0 (int4 without offsets), on `device`; or Q4_K
    (a GGUF's blocks of random bytes of w's shape and size, as int4 for torch's op: model/blocks.py)."""
    layer = Linear(w.shape[1], w.shape[0])
    if kind == "q4_k":
        blocks = random_blocks("Q4_K", *w.shape, seed=w.shape[1], typical=float(w.abs().mean()))
        q, layer.scale, layer.offset = q4_k_as_int4(torch.from_numpy(blocks))
    elif kind == "int8":
        q, layer.scale = quantize_int8(w)
    else:
        q, layer.scale, offset = quantize_int4(w)
        layer.offset = offset if kind == "q4_1" else None
    layer.weight = torch.nn.Parameter(q, requires_grad=False)
    return layer.to(device)


def rms_error(y: torch.Tensor, exact: torch.Tensor) -> float:
    return ((y.float() - exact).norm() / exact.norm()).item()


@pytest.mark.parametrize("kind", ["q4_1", "q4_0"])
@pytest.mark.parametrize("n,k", [(48, 96), (64, 576)])
def test_int4_repacked_on_the_cpu_multiplies_exactly_the_weights_it_stores(kind, n, k):
    """fp32 scales and zeros, fp32 x: the CPU's tinygemm sums the stored weights exactly, so any slip in the
    nibble order, the blocks or the zeros (offset + 8 scale; Q4_0: 0) shows at once."""
    layer = stored_linear(weights(n, k), kind, "cpu")
    exact = dequantize(layer.weight, layer.scale, layer.offset)
    assert repack_linear(layer, torch.float32)
    assert layer.weight.dtype == torch.uint8 and layer.scale.shape == (k // 32, n, 2) and layer.offset is None
    for rows in (1, 5, 40):
        x = torch.randn(rows, k)
        torch.testing.assert_close(layer(x), x @ exact.T, rtol=0, atol=1e-6 * (x.abs() @ exact.abs().T).max().item())


@pytest.mark.parametrize("k,kind", [(k, kind) for k in (96, 512, 576) for kind in ("q4_1", "q4_0")] + [(512, "q4_k")],
                         ids=lambda v: str(v))  # tinygemm's inner k-tiles 2, 8 and 4 on a GPU; a GGUF's Q4_K
def test_int4_packed_in_bf16_computes_what_the_devices_kernel_is_written_to(device, kind, k):
    """With bf16 scales and zeros (a GPU's only kind) and bf16 x, y against an emulation of the kernel of the
    device (tests/support/tinygemm.py: on CUDA each weight rounded to bf16 before the product, on the CPU not):
    within one bf16 step of y, the emulation's fp32 sums being in another order. A wrong layout is off by
    about 100%. The emulated error against the exact sums of the stored weights stays below 2^-8 and, on
    CUDA, within 1.6x widening to bf16's (measured here 0.98x to 1.33x; widening also rounds each weight)."""
    layer = stored_linear(weights(64, k), kind, device)
    stored = layer.weight, layer.scale, layer.offset
    exact, q = dequantize(*stored).cpu(), unpack_int4(layer.weight).view(64, k).cpu()
    assert repack_linear(layer, torch.bfloat16)
    if device.type == "cuda":  # tinygemm's tiles (N / 8, K / (16 tiles), 32, tiles / 2)
        tiles = inner_k_tiles(k)
        assert layer.weight.dtype == torch.int32 and layer.weight.shape == (8, k // (16 * tiles), 32, tiles // 2)
    kernel_weights = tinygemm.dequantized(q, layer.scale, device.type)
    for rows in (1, 7, 40):
        x = torch.randn(rows, k, device=device).bfloat16()
        truth = x.float().cpu() @ exact.T
        packed, emulated = layer(x).cpu(), tinygemm.product(x, kernel_weights)
        assert packed.dtype == torch.bfloat16
        slack = 1e-6 * (x.float().abs().cpu() @ kernel_weights.abs().T)  # fp32 sums in another order
        assert (tinygemm.bf16_steps(packed, emulated) <= 1 + slack / emulated.abs().clamp(min=1e-30)).all(), rows
        widened = F.linear(x, widen(*stored, torch.bfloat16)).cpu()
        assert rms_error(emulated, truth) < min(BF16_ROUNDING, 1.6 * rms_error(widened, truth)), rows


@pytest.mark.parametrize("k", [96, 576])
def test_int4_packing_is_exact_bit_for_bit_on_one_hot_rows(device, k):
    """x = the identity: row i of y is column i of the weights as the kernel stored them. Scales are powers
    of two and zeros whole multiples of them, so every weight is exact in bf16 and in fp16 and no rounding
    anywhere hides a nibble, block or tile in the wrong place: y must equal the weights exactly."""
    n = 64
    g = torch.Generator().manual_seed(k)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.ldexp(torch.ones(n, k // 32), torch.randint(-6, 1, (n, k // 32), generator=g)).half()
    offset = (torch.randint(-16, 9, (n, k // 32), generator=g) * scale.float()).half()  # q + m, m in -16..8, times scale
    layer = Linear(k, n)
    layer.weight = torch.nn.Parameter(pack_int4(q.view(n, -1, 32)).view(n, k // 2), requires_grad=False)
    layer.scale, layer.offset = scale, offset
    layer = layer.to(device)
    exact = dequantize(layer.weight, layer.scale, layer.offset).cpu()  # (N, K), each weight exact
    assert torch.equal(exact, q.float() * scale.float().repeat_interleave(32, 1)
                       + offset.float().repeat_interleave(32, 1))
    assert repack_linear(layer, torch.bfloat16)
    y = layer(torch.eye(k, device=device, dtype=torch.bfloat16)).cpu()  # (K, N)
    assert torch.equal(y.float(), exact.T)


def test_int8_rows_packing_is_exact_on_one_hot_rows(device):
    """The same for `_weight_int8pack_mm`: row i of y is each row's q[:, i] times its scale, exactly."""
    layer = stored_linear(weights(48, 256), "int8", device)
    assert repack_linear(layer)
    y = layer(torch.eye(256, device=device)[:INT8_MM_ROWS]).cpu()  # up to INT8_MM_ROWS rows: the op itself
    want = (layer.weight.float() * layer.scale[:, None]).T[:INT8_MM_ROWS].cpu()
    assert torch.equal(y, want)


@pytest.mark.parametrize("rows", [1, INT8_MM_ROWS, INT8_MM_ROWS + 1, 40])
def test_int8_rows_requantized_move_each_weight_by_at_most_half_a_row_step(device, rows):
    """One scale per row (max |w| / 127) in place of one per 64 weights: each weight rounded again, by up to
    half the row's step, so a sum moves by at most half a step times sum |x| (fp32 x: no other rounding to
    speak of). Up to INT8_MM_ROWS rows go to `_weight_int8pack_mm`, more to F.linear of the widened rows."""
    k = 576
    layer = stored_linear(weights(96, k), "int8", device)
    exact = dequantize(layer.weight, layer.scale).cpu()
    assert repack_linear(layer)
    assert layer.weight.dtype == torch.int8 and layer.scale.shape == (96,) and layer.scale.dtype == torch.float32
    step = exact.abs().amax(dim=1) / 127  # (N,): each row's one step
    x = torch.randn(rows, k, device=device)
    y, truth = layer(x).cpu(), x.cpu() @ exact.T
    bound = step / 2 * x.abs().sum(dim=1, keepdim=True).cpu() + 1e-5 * (x.abs().cpu() @ exact.abs().T)
    assert ((y - truth).abs() <= bound).all()
    assert (y - truth).abs().max() > 1e-3 * bound.max()  # the second rounding is there: the bound is not idle
    sums = packed_linear(x.bfloat16(), layer.weight, layer.scale, fp32_out=True)  # the head's: fp32, not rounded
    assert sums.dtype == torch.float32 and torch.equal(sums, layer(x.bfloat16().float()))


def test_int8_requantization_is_exact_where_a_rows_groups_share_a_scale():
    q = torch.randint(-127, 128, (32, 256), dtype=torch.int8)
    q[:, 0] = 127  # every row's largest weight at full scale
    scale = torch.rand(32, 1).expand(32, 4).contiguous()  # four groups of 64, one scale a row
    rows, row_scale = repack_int8(q, scale)
    assert torch.equal(rows, q) and torch.equal(row_scale, scale[:, 0])
    scale[:, 1] /= 3  # a group of smaller weights: rounded again, to the row's step
    rows, row_scale = repack_int8(q, scale)
    assert torch.equal(rows[:, :64], q[:, :64]) and not torch.equal(rows[:, 64:128], q[:, 64:128])


def test_the_cuda_op_gets_even_k_in_the_high_nibble():
    """`_convert_weight_to_int4pack` (CUDA, torch >= 2.5) reads byte j of a row as k = 2j high, 2j + 1 low, as
    torch's own tests and gpt-fast pack it; ours hold a block's k and k + 16 (model/quantize.py)."""
    packed, _, _ = quantize_int4(weights(16, 64))
    q = unpack_int4(packed).view(16, 64)
    tiny = tinygemm_bytes(q)
    assert tiny.dtype == torch.uint8 and tiny.shape == (16, 32) and tiny.is_contiguous()
    assert torch.equal(tiny >> 4, q[:, 0::2]) and torch.equal(tiny & 0xF, q[:, 1::2])


def test_tinygemm_takes_the_widest_inner_k_tiles_that_divide_k():
    """The CUDA op packs 16 k a tile, inner_k_tiles of them side by side, and refuses a K they do not divide:
    the default model's 576 takes 4 (gpt-fast's 8 needs K a multiple of 128), its 1536 8, any K of whole blocks
    of 32 at least 2."""
    assert [inner_k_tiles(k) for k in (576, 1536, 4096, 96, 32)] == [4, 8, 8, 2, 2]


@pytest.fixture(scope="module")
def unpacked_logits(tiny):
    """Each quantized model of `tiny`, unpacked, fp32, on the CPU, without the decode kernel (which rounds x):
    logits of a prompt and of the decode step after its first 31 tokens, all through F.linear of the
    widened rows, exact."""
    found, kernels = {}, model.linear.kernels
    model.linear.kernels = lambda: None
    try:
        for quantize in ("int8", "int4"):
            net = load_checkpoint(tiny, dtype=torch.float32, quantize=quantize).model
            found[quantize] = logits(net, "cpu", fused=False)
    finally:
        model.linear.kernels = kernels
    return found


def logits(net, device, fused=None) -> tuple[torch.Tensor, torch.Tensor]:
    ids = prompt_ids(n=32)[:1].to(device)
    cache = KVCache(net.config, 64, device=device, dtype=net.compute_dtype)
    with torch.no_grad():
        prompt = net(ids)
        net(ids[:, :31], kv_cache=cache)
        cache.tokens = ids[0, :31].tolist()
        step = net.decode(ids[0, 31:], [cache], fused=fused)
    return prompt.float().cpu(), step.float().cpu()


@pytest.fixture(scope="module")
def cuda_int4_floor(tiny, unpacked_logits):
    """How far CUDA's int4 arithmetic alone takes the int4 model's logits from the exact ones: the largest
    error over the prompt's and the decode step's logits, relative to the largest logit, of the unpacked
    model on the CPU with its int4 products emulated as tinygemm on CUDA does them (support/tinygemm.py)."""
    with pytest.MonkeyPatch.context() as patch:
        tinygemm.emulate_cuda_int4(patch)
        net = load_checkpoint(tiny, dtype=torch.float32, quantize="int4").model
        emulated = logits(net, "cpu", fused=False)
    wanted = unpacked_logits["int4"]
    assert all((got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9 for got, want in zip(emulated, wanted))
    return max(((got - want).abs().max() / want.abs().max()).item() for got, want in zip(emulated, wanted))


def logits_tolerance(device, quantize: str, cuda_int4_floor: float) -> float:
    """The largest relative logit error a packed fp32 model may show: on the CPU, int4 is exact and int8 rounds
    each weight a second time (rows of groups of other scales); on CUDA, tinygemm's bf16 arithmetic adds up to
    twice its emulated effect (the sums' order and bf16 steps of the kernel's own)."""
    cpu = 1e-5 if quantize == "int4" else 2e-2
    return cpu + (2 * cuda_int4_floor if device.type == "cuda" and quantize == "int4" else 0.0)


def test_the_emulated_cuda_int4_arithmetic_stays_near_the_exact_logits(cuda_int4_floor):
    """What the GPU's tolerance rests on: bf16 weights and sums (8 significant bits) move the tiny random int4
    model's logits by a few % of the largest (4.3% here: its logits are small beside the sums that make them),
    keep nine greedy choices in ten (the fixture asserts it), and are not idle."""
    assert 1e-3 < cuda_int4_floor < 0.1


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_a_repacked_model_gives_the_unpacked_models_logits(tiny, unpacked_logits, cuda_int4_floor, device,
                                                           monkeypatch, quantize):
    """Every matrix packed (the tied head its own int8 copy, the embedding as it was), none widened, prefill
    and a decode step alike, activations fp32 on every device (tinygemm's products alone in bf16 on CUDA)."""
    ckpt = load_checkpoint(tiny, device=device, dtype=torch.float32, quantize=quantize, pack=True)
    net = ckpt.model
    linears = [m for m in net.modules() if isinstance(m, Linear)]
    assert all(is_packed(m.scale) for m in linears)
    assert net.tok_embeddings.scale is None and net.tok_embeddings.weight.dtype == torch.float32  # lookups as before
    assert net.output.weight is not net.tok_embeddings.weight
    monkeypatch.setattr(model.linear, "blockwise_linear", None)  # what widens: any call fails
    tolerance = logits_tolerance(device, quantize, cuda_int4_floor)
    for got, want in zip(logits(net, device), unpacked_logits[quantize]):  # the fused decode step declines
        error = (got - want).abs().max() / want.abs().max()
        assert error < tolerance, (error, tolerance)
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    assert repack_model(net) == 0  # packed once


def test_a_tied_quantized_embedding_keeps_its_blocks_and_the_head_gets_its_own_rows(tiny):
    """A GGUF's tied Q8_0 table: lookups still widen only their rows, exactly as before; the head is
    requantized per row into a copy of its own."""
    net = load_checkpoint(tiny, dtype=torch.float32).model
    table = net.tok_embeddings
    q, scale = quantize_int8(table.weight)
    table.weight, table.scale = torch.nn.Parameter(q, requires_grad=False), scale
    net.tie_weights()
    net.output.scale = table.scale
    ids = prompt_ids(n=20)[:1]
    with torch.no_grad():
        before_rows, before = table(ids), net(ids)
        assert repack_model(net) == 1  # the head: the layers are fp32
        assert table.weight is not net.output.weight and table.weight.data_ptr() == q.data_ptr()
        assert table.scale is scale and net.output.scale.shape == (q.shape[0],)
        assert torch.equal(table(ids), before_rows)
        after = net(ids)
    assert (after - before).abs().max() < 2e-2 * before.abs().max()


@pytest.mark.parametrize("extremes", [False, True])
def test_q4_k_blocks_as_int4_stand_for_the_gguf_librarys_values_bit_for_bit(extremes):
    """A GGUF's Q4_K matrix as int4 for torch's op (model/blocks.py q4_k_as_int4): scale d sc and offset -dmin m
    per sub-block of 32, each weight the gguf library's exactly (fp16 extremes: subnormals, the largest), done a
    few rows at a time (rows=3: a last part shorter than the others)."""
    blocks = torch.from_numpy(random_blocks("Q4_K", 10, 512, seed=4, extremes=extremes))
    packed, scale, offset = q4_k_as_int4(blocks, rows=3)
    assert packed.shape == (10, 256) and scale.shape == offset.shape == (10, 16)
    expected = gguf.quants.dequantize(blocks.numpy().reshape(10, -1), gguf.GGMLQuantizationType.Q4_K)
    assert torch.equal(dequantize(packed, scale, offset), torch.from_numpy(expected))


def test_load_checkpoint_packs_on_a_gpu_or_when_asked(tiny):
    unpacked = load_checkpoint(tiny, dtype=torch.float32, quantize="int4").model  # the CPU: its decode kernel
    assert not any(is_packed(m.scale) for m in unpacked.modules() if isinstance(m, Linear))
    with pytest.raises(ValueError, match="pack="):
        load_checkpoint(tiny, pack="yes")


def test_int8_quantized_at_load_for_packing_is_rounded_once_to_row_scales(tiny):
    """Quantized at load where it will be packed, each int8 row gets one scale at once: the packed weights are
    those the float weights give, not a second rounding of 64-weight groups."""
    floats = load_checkpoint(tiny, dtype=torch.float32).model
    packed = load_checkpoint(tiny, dtype=torch.float32, quantize="int8", pack=True).model
    twice = load_checkpoint(tiny, dtype=torch.float32, quantize="int8", pack=False).model
    repack_model(twice)  # groups of 64 first, then requantized to rows
    differ = 0
    for name in ("layers.0.attention.wq", "layers.1.feed_forward.w2", "output"):
        w = floats.get_submodule(name).weight
        q, scale = quantize_int8(w, group=w.shape[1])
        layer = packed.get_submodule(name)
        assert torch.equal(layer.weight, q) and torch.equal(layer.scale, scale[:, 0])
        differ += (twice.get_submodule(name).weight != q).sum().item()
    assert differ > 0  # (rounding twice does move some weights: the comparison can tell)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the CPU's ops are tested above)")
def test_on_a_gpu_load_checkpoint_packs_for_tinygemm_by_default(tiny, unpacked_logits, cuda_int4_floor):
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("tinygemm needs compute capability 8.0")
    net = load_checkpoint(tiny, device="cuda", dtype=torch.float32, quantize="int4").model
    assert net.layers[0].attention.wq.weight.dtype == torch.int32 and net.layers[0].attention.wq.weight.dim() == 4
    tolerance = logits_tolerance(torch.device("cuda"), "int4", cuda_int4_floor)
    for got, want in zip(logits(net, "cuda"), unpacked_logits["int4"]):
        assert (got - want).abs().max() < tolerance * want.abs().max()


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8", "q4_1", "q4_0", "packed int8", "packed int4"])
def test_fused_layers_give_each_layers_rows_and_keep_one_copy(device, kind):
    """model/linear.py's fuse (q|k|v and gate|up of the static decode step): the fused product is the layers'
    products side by side, bit for bit, a few rows (the decode kernel on the CPU) and many; the layers' own
    tensors become views of the fused ones, and still give what they gave."""
    sizes = (128, 64, 64)  # a multiple of the CPU's int4 tiles that fuse may cut at
    layers = []
    for i, n in enumerate(sizes):
        w = weights(n, 256, seed=i)
        if kind in ("float32", "bfloat16"):
            layer = Linear(256, n)
            layer.weight = torch.nn.Parameter(w.to(getattr(torch, kind)), requires_grad=False)
            layer = layer.to(device)
        else:
            layer = stored_linear(w, kind.removeprefix("packed ").replace("int4", "q4_1"), device)
            if kind.startswith("packed"):
                assert repack_linear(layer, torch.float32 if device.type == "cpu" else torch.bfloat16)
        layers.append(layer)
    x_few, x_many = torch.randn(3, 256, device=device), torch.randn(40, 256, device=device)
    if kind == "packed int4" and device.type == "cuda":
        x_few, x_many = x_few.bfloat16(), x_many.bfloat16()
    before = [torch.cat([layer(x) for layer in layers], dim=-1) for x in (x_few, x_many)]
    fused = fuse(*layers)
    assert fused is not None and out_features(fused) == sum(sizes)
    for x, want in zip((x_few, x_many), before):
        assert torch.equal(fused(x), want)
        assert torch.equal(torch.cat([layer(x) for layer in layers], dim=-1), want)
    storage = fused.weight.untyped_storage().data_ptr()
    assert all(layer.weight.untyped_storage().data_ptr() == storage for layer in layers)


def test_layers_of_different_kinds_are_not_fused():
    a, b = stored_linear(weights(64, 256), "int8", "cpu"), stored_linear(weights(64, 256), "q4_1", "cpu")
    assert fuse(a, b) is None
    c, d = stored_linear(weights(64, 256), "q4_1", "cpu"), stored_linear(weights(48, 256), "q4_1", "cpu")
    assert repack_linear(c, torch.float32) and repack_linear(d, torch.float32)
    assert fuse(c, d) is None  # 64 rows and 48: the CPU's int4 tiles cannot be cut after 64 + 48 rows
