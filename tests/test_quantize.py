"""int8 weights with one scale per group of a row."""

import pytest
import torch

from model.quantize import dequantize_int8, quantize_int8


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
