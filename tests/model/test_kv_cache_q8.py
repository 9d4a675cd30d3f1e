"""The q8 KV cache (model/kv_cache.py): GGUF's Q8_0 layout, each number within half a step of its block,
0.53x the memory of bf16, kept through copies; and the context a model gets (model/context.py)."""

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from model.config import LlamaConfig
from model.context import choose_context
from model.kv_cache import KVCache, dequantize_q8, q8_row_bytes, quantize_q8


def test_blocks_are_laid_out_as_gguf_q8_0():
    """Bytes that gguf's own Q8_0 quantizer wrote read back here to the numbers gguf reads, and ours read
    back in gguf to ours: the same layout (an fp16 scale, then 32 int8, per block)."""
    x = torch.randn(6, 128) * torch.tensor([0.01, 1.0, 30.0, 1e3, 1.0, 1.0])[:, None]
    theirs = torch.from_numpy(gguf_quantize(x.numpy(), GGMLQuantizationType.Q8_0))
    assert theirs.shape == (6, q8_row_bytes(128)) == (6, 136)
    expected = torch.from_numpy(gguf_dequantize(theirs.numpy(), GGMLQuantizationType.Q8_0))
    assert torch.equal(dequantize_q8(theirs), expected)
    ours = quantize_q8(x)
    assert torch.equal(torch.from_numpy(gguf_dequantize(ours.numpy(), GGMLQuantizationType.Q8_0)), dequantize_q8(ours))
    # the same scales; gguf divides by the scale before its rounding to fp16, here by the scale stored, so a
    # number near a half step may land one step apart (here the step is the one dequantizing uses)
    ours_blocks, their_blocks = ours.unflatten(-1, (-1, 34)), theirs.unflatten(-1, (-1, 34))
    assert torch.equal(ours_blocks[..., :2], their_blocks[..., :2])
    apart = ours_blocks[..., 2:].view(torch.int8).int() - their_blocks[..., 2:].view(torch.int8).int()
    assert apart.abs().max() <= 1 and (apart != 0).float().mean() < 0.05


@pytest.mark.parametrize("scale", [1e-3, 1.0, 500.0])
def test_each_number_is_within_half_a_step_of_its_block(scale):
    x = torch.randn(3, 4, 50, 64) * scale
    x[0, 0, 0] = 0  # a block of zeros: scale 0, numbers 0
    x[0, 0, 1, :32] = scale  # a block of one value: 127 steps of its fp16 scale
    blocks = quantize_q8(x)
    assert blocks.dtype == torch.uint8 and blocks.shape == (3, 4, 50, 68)
    back = dequantize_q8(blocks)
    step = (x.abs().unflatten(-1, (-1, 32)).amax(-1, keepdim=True) / 127).expand(-1, -1, -1, -1, 32).flatten(-2)
    assert ((back - x).abs() <= step * 0.5 * 1.002 + 1e-12).all()  # half a step (its fp16 scale: 1 + 2^-11)
    assert torch.equal(back[0, 0, 0], torch.zeros(64))
    # the scale's own rounding to fp16: 2^-11 of it, coarser where it is subnormal (below 2^-14: scale 1e-3)
    torch.testing.assert_close(back[0, 0, 1, :32], x[0, 0, 1, :32], rtol=2**-11 if scale >= 0.01 else 1e-3, atol=0)
    assert torch.isfinite(dequantize_q8(quantize_q8(torch.full((64,), 6e4)))).all()  # near fp16's largest scale


def test_a_q8_cache_takes_0_53x_the_bytes_of_bf16_and_keeps_its_type_through_copies():
    config = LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=8192,
                         head_dim=64)
    bf16 = KVCache(config, 1024, dtype=torch.bfloat16)
    q8 = KVCache(config, 1024, dtype=torch.bfloat16, kv_type="q8")
    assert q8.nbytes / bf16.nbytes == 34 / 64 <= 0.55
    assert KVCache.bytes_per_position(config, "q8", torch.bfloat16) * 1024 == q8.nbytes
    assert KVCache.bytes_per_position(config, "bf16", torch.bfloat16) * 1024 == bf16.nbytes == 32 * 1024 * 1024
    q8.k[:, :, :, :10] = 7
    q8.tokens = list(range(10))
    copy = q8.copy_prefix(10, 20)
    assert copy.quantized and copy.dtype == torch.bfloat16 and torch.equal(copy.k[:, :, :, :10], q8.k[:, :, :, :10])
    assert q8.resized(5).k.dtype == torch.uint8
    with pytest.raises(ValueError, match="multiple of 32"):
        KVCache(LlamaConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=10, ffn_dim=8, head_dim=16), 8,
                kv_type="q8")
    with pytest.raises(ValueError, match="expected one of bf16, q8"):
        KVCache(config, 8, kv_type="q4")


def test_the_context_is_the_models_own_where_a_quarter_of_the_memory_holds_it():
    per_token = 32 * 1024  # Llama 3.2 1B in bf16
    assert choose_context(131072, None, per_token, 24 * 2**30) == (131072, "the model's own")
    tokens, why = choose_context(131072, None, per_token, 8 * 2**30)  # a quarter: 2 GiB, 65,536 tokens
    assert tokens == 65536 and "quarter" in why
    assert choose_context(131072, None, per_token // 2, 8 * 2**30)[0] == 131072  # q8 fits twice as many
    assert choose_context(131072, None, per_token, 10 * 2**20)[0] == 256  # never below 256
    assert choose_context(8192, 2048, per_token, 1) == (2048, "LLAMA_MAX_CONTEXT")  # asked: taken as asked
    assert choose_context(8192, 100_000, per_token, 1)[0] == 8192  # never more than the model's own
