"""int8 weights with one scale per group of a row; int4 with one scale and offset per block of 32."""

import pytest
import torch

from model.quantize import (
    INT4_GROUP,
    dequantize_int4,
    dequantize_int8,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)


@pytest.mark.parametrize("k,group", [(256, 64), (576, 64), (517, 47), (5, 5)])
def test_quantize_int8_error_is_within_half_a_step_of_its_group(k, group):
    w = torch.randn(64, k) * torch.linspace(0.01, 10, k)  # groups of very different ranges
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (64, k // group)
    steps = scale.repeat_interleave(group, dim=1)  # (64, k): each weight's own step
    assert (q.abs().view(64, -1, group).amax(-1) == 127).all()  # every group uses its full range
    assert ((dequantize_int8(q, scale) - w).abs() <= steps / 2 + 1e-6).all()
    # one scale per row would round the small weights more coarsely (all steps = the largest)
    per_row = w.abs().amax(1, keepdim=True) / 127
    assert (steps <= per_row + 1e-9).all()
    assert steps.mean() < 0.8 * per_row.mean() if k > group else torch.equal(steps, per_row.expand(64, k))


@pytest.mark.parametrize("n,k", [(64, 32), (64, 576), (3, 2048 + 32 * 3)])
def test_quantize_int4_error_is_within_half_a_step_of_its_block(n, k):
    w = torch.randn(n, k) * torch.linspace(0.01, 10, k) + torch.linspace(-3, 3, k)  # blocks of different ranges
    packed, scale, offset = quantize_int4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (n, k // 2)
    assert scale.dtype == offset.dtype == torch.float16 and scale.shape == offset.shape == (n, k // INT4_GROUP)
    q = unpack_int4(packed)  # (n, blocks, 32)
    assert (q <= 15).all() and (q.amax(-1) - q.amin(-1) >= 14).all()  # every block spans (nearly) all 16 levels
    steps = scale.float().repeat_interleave(INT4_GROUP, dim=1)
    rounded = offset.float().abs().repeat_interleave(INT4_GROUP, dim=1) * 2**-11  # the fp16 offset's rounding
    assert ((dequantize_int4(packed, scale, offset) - w).abs() <= steps / 2 + rounded + 1e-6).all()


def test_int4_nibble_order_is_llama_cpp_s():
    """Byte j of a block: weight j in the low nibble, weight 16 + j in the high one."""
    q = torch.arange(64, dtype=torch.uint8).remainder(16).view(1, 2, 32)  # two blocks: 0..15, 0..15
    packed = pack_int4(q).view(1, 32)
    assert packed[0, :16].tolist() == [j | (j << 4) for j in range(16)]
    q = torch.randint(0, 16, (5, 7, 32), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(q).view(5, -1)), q)


def test_int4_without_offsets_is_q4_0():
    scale = torch.tensor([[0.5, 2.0]], dtype=torch.float16)
    q = torch.arange(64, dtype=torch.uint8).remainder(16).view(1, 2, 32)
    w = dequantize_int4(pack_int4(q).view(1, 32), scale, None)
    assert torch.equal(w, ((q.float() - 8) * scale.float()[..., None]).view(1, 64))


def test_int4_refuses_rows_that_are_not_whole_blocks():
    with pytest.raises(ValueError, match=r"K a multiple of 32; got \(4, 48\)"):
        quantize_int4(torch.randn(4, 48))
