"""The Triton kernels of the GPU decode step (model/triton_kernels.py) against their torch forms
(model/step_ops.py). Here they run in Triton's interpreter on the CPU (tests/conftest.py sets TRITON_INTERPRET);
with LLAMA_TEST_DEVICE=cuda they compile and run on the GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from model import step_ops

ops = step_ops.triton_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="Triton is not installed (requirements-test.txt has it)")
from model.triton_kernels import BLOCK_KEYS, SPLITS  # noqa: E402  (after the skip: Triton may be absent)

DTYPES = [torch.float32, torch.bfloat16]


def tolerance(dtype):
    """The kernels round once where the torch forms round after each op: a bf16 step or two apart."""
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_adds_in_place_then_normalizes(device, dtype, with_delta):
    g = torch.Generator().manual_seed(1)
    norm = nn.RMSNorm(96, eps=1e-5).to(device, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96, generator=g) + 0.5)
    x = (torch.randn(3, 96, generator=g) * 4).to(device, dtype)
    delta = torch.randn(3, 96, generator=g).to(device, dtype) if with_delta else None
    want_x = x.clone()
    want = step_ops.add_rms_norm(want_x, delta, norm)
    got = ops.add_rms_norm(x, delta, norm)
    torch.testing.assert_close(x, want_x)  # the residual stream as the reference adds it, rounded alike
    torch.testing.assert_close(got, want, **tolerance(dtype))


def slot_caches(slots: int, n_kv: int, max_len: int, d: int, dtype, device, seed=2):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(slots, n_kv, max_len, d, generator=g).to(device, dtype)
    v = torch.randn(slots, n_kv, max_len, d, generator=g).to(device, dtype)
    return k, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_heads,n_kv,d", [(4, 2, 64), (9, 3, 32), (2, 2, 128)])
def test_rope_write_rotates_and_writes_each_rows_slot_at_its_position(device, dtype, n_heads, n_kv, d):
    from model.config import LlamaConfig
    from model.rope import Rope
    config = LlamaConfig(dim=n_heads * d, n_layers=1, n_heads=n_heads, n_kv_heads=n_kv, vocab_size=16,
                         ffn_dim=32, max_seq_len=64)
    rope = Rope.tables(config, 64, device=device)
    cos, sin = rope.cos.to(dtype), rope.sin.to(dtype)
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(4, (n_heads + 2 * n_kv) * d, generator=g).to(device, dtype)
    positions = torch.tensor([0, 5, 63, 6], device=device)
    slots = torch.tensor([2, 0, 1, 0], device=device)  # two rows share slot 0 (a speculative check's rows)
    k, v = slot_caches(3, n_kv, 64, d, dtype, device)
    want_k, want_v = k.clone(), v.clone()
    want = step_ops.rope_write(qkv, cos, sin, positions, slots, want_k, want_v, n_heads)
    got = ops.rope_write(qkv, cos, sin, positions, slots, k, v, n_heads)
    torch.testing.assert_close(got, want, **tolerance(dtype))
    torch.testing.assert_close(k, want_k, **tolerance(dtype))
    assert torch.equal(v, want_v)  # values are copied as they are
    assert (k != want_k).float().mean() < 0.01 or dtype == torch.bfloat16  # nothing else written


@pytest.mark.parametrize("n_heads,n_kv,d,dtype", [(8, 2, 64, torch.float32), (3, 3, 32, torch.bfloat16),
                                                  (9, 3, 64, torch.float32)])
def test_attention_reads_each_rows_keys_up_to_its_position(device, dtype, n_heads, n_kv, d):
    """Positions from the first key to past SPLITS parts of BLOCK_KEYS keys each, so parts with no keys, parts
    of one block and parts of several are all merged; GQA groups of 4, 1 and 3 (padded to 4)."""
    max_len = SPLITS * BLOCK_KEYS * 2 + 40
    k, v = slot_caches(4, n_kv, max_len, d, dtype, device)
    positions = torch.tensor([0, 1, 37, SPLITS * BLOCK_KEYS + 5, max_len - 1], device=device)
    slots = torch.tensor([3, 1, 0, 2, 1], device=device)
    q = torch.randn(5, n_heads, d, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    want = step_ops.attend(q, k, v, slots, positions, max_len)
    got = ops.attend(q, k, v, slots, positions, 1)  # the length argument is not read: each row's own
    torch.testing.assert_close(got, want, **tolerance(dtype))
    assert got.dtype == dtype and got.shape == (5, n_heads, d)


def test_attention_never_reads_past_a_rows_position(device):
    k, v = slot_caches(2, 2, 512, 64, torch.float32, device)
    positions, slots = torch.tensor([100, 300], device=device), torch.tensor([0, 1], device=device)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(5)).to(device)
    before = ops.attend(q, k, v, slots, positions, 512)
    k[0, :, 101:], v[0, :, 101:] = float("nan"), float("nan")  # beyond row 0's position: never read
    k[1, :, 301:], v[1, :, 301:] = float("nan"), float("nan")
    assert torch.equal(ops.attend(q, k, v, slots, positions, 512), before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(device, dtype):
    gate_up = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(6)).to(device, dtype) * 3
    torch.testing.assert_close(ops.silu_mul(gate_up), step_ops.silu_mul(gate_up), **tolerance(dtype))


def test_the_step_takes_triton_on_cuda_only_and_for_heads_of_a_power_of_two():
    assert step_ops.step_ops(torch.device("cpu"), 64) is step_ops.TORCH
    assert step_ops.step_ops(torch.device("cuda"), 64) is ops
    assert step_ops.step_ops(torch.device("cuda"), 80) is step_ops.TORCH


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_int8_rows_give_torchs_int8_op(device, m, out_dtype):
    """The int8 decode product (rows of x against int8 rows with one scale each) against torch's
    `_weight_int8pack_mm`: the same fp32 sums of the same products, in another order."""
    from model.triton_kernels import int8_rows
    g = torch.Generator().manual_seed(m)
    q = torch.randint(-127, 128, (200, 320), generator=g, dtype=torch.int8).to(device)  # N, K not tile multiples
    scale = (torch.rand(200, generator=g) / 100).to(device)
    x = torch.randn(m, 320, generator=g).to(device)
    want = torch.ops.aten._weight_int8pack_mm(x, q, scale if device.type == "cuda" else scale.to(x.dtype))
    got = int8_rows(x, q, scale, out_dtype)
    assert got.dtype == out_dtype
    torch.testing.assert_close(got.float(), want.to(out_dtype).float(), **tolerance(out_dtype))


def test_attention_on_cuda_leaves_cudnn_out():
    """cuDNN's SDPA builds a plan for each new key length: every decode step and prefill chunk would pay it."""
    from torch.nn.attention import SDPBackend

    from model.llama import CUDA_ATTENTION
    assert SDPBackend.CUDNN_ATTENTION not in CUDA_ATTENTION and SDPBackend.MATH in CUDA_ATTENTION
