"""The decode kernel and int8 weights, against the plain PyTorch path."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model import generate, load_checkpoint
from model.matvec import dequantize_int8, kernels, linear, quantize_int8

from checkpoints import hf_model, prompt_ids


def test_kernel_builds_here():
    assert kernels() is not None, "the C++ decode kernel did not build (is a C++ compiler installed?)"


SIZES = [(1, 1), (3, 5), (7, 64), (1003, 517), (4096, 2048), (5, 8200)]  # tails, blocks, 2 threads


@pytest.mark.parametrize("n,k", SIZES)
def test_bf16_matvec_matches_f_linear(n, k):
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(1, 1, k, generator=g)
    ours = linear(x, w)
    assert ours.shape == (1, 1, n) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, F.linear(x, w.float()), rtol=1e-4, atol=1e-4 * k ** 0.5)


@pytest.mark.parametrize("n,k", SIZES)
def test_bf16_matvec_of_bf16_activations_is_exact_up_to_its_rounding(n, k):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(1, k, generator=g).to(torch.bfloat16)
    ours = linear(x, w)
    assert ours.dtype == torch.bfloat16  # y comes back in x's dtype
    exact = F.linear(x.double(), w.double())  # bf16 x bf16 products are exact; only the sum order differs
    torch.testing.assert_close(ours.double(), exact, rtol=2**-8, atol=1e-5 * k ** 0.5)


@pytest.mark.parametrize("n,k", [(5, 3), (1003, 517), (9, 8200)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_matvec_matches_dequantized_linear(n, k, dtype):
    g = torch.Generator().manual_seed(k)
    q, scale = quantize_int8(torch.randn(n, k, generator=g))
    x = torch.randn(1, k, generator=g).to(dtype)
    reference = F.linear(x.float(), dequantize_int8(q, scale))
    # Decode rounds x to int16 (one scale per vector): a relative error near 2**-16.
    ours = linear(x, q, scale)
    assert ours.dtype == dtype
    assert ((ours.float() - reference).norm() / reference.norm()) < (1e-4 if dtype == torch.float32 else 2**-8)
    if dtype == torch.float32:  # several rows: F.linear on the dequantized weights
        torch.testing.assert_close(linear(x.repeat(4, 1), q, scale), reference.repeat(4, 1), rtol=1e-4, atol=1e-4)


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


def test_compiled_decode_gives_the_same_tokens(folder):
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
print(a.tokens == b.tokens, len(a.tokens))
"""
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["True", "12"]
