"""The fused decode step (model/decode_step.py, csrc/decode_step.cpp) against the reference, Llama.decode
with fused=False (the blocks' decode methods): on tiny random models, batched sequences of different
lengths, GQA ratios 1, 3 and 4, bf16, int8 and int4 weights (Q4_1 blocks with offsets, Q4_0 without),
fp32 and bf16 activations, in each kernel build (-march=native, znver3: the AVX2 code, x86-64: the
plain loops); an int4 model with one int8 matrix per layer (K not whole blocks of 32); and on the
default model in bf16 and in int4, the same greedy tokens for 32 tokens on 10 prompts.

Tolerances: with fp32 activations both paths do the same maths in fp32 and differ only in the order
of sums (attention's, the norm's, the kernel's across builds): logits within 1e-5 of their scale
(the largest |logit|, 10 to 30 on these models; what we see is about 1e-6 of it). With int8 weights
the kernel rounds each row of x to int16 (steps of max|x| / 32767), and a last-bit difference in x
can move a value by one such step: 3e-4 of the scale then (we see up to 2e-4), and the same tokens.
int4 weights round x to int16 the same way here (tests/support/kernels.py: the AVX-512 and AVX2 builds'
own int8 blocks of x, 258 times coarser steps, are switched off for these comparisons and tested on their
own at the end); on the default model, where every matrix of all 30 layers does it, we allow 2e-3 of
the scale (we see up to 8e-4) and ask for the same tokens. With bf16
activations the fused op rounds to bf16 where the reference stores bf16 tensors, so most logits come
out the same, but one rounding that goes the other way moves later values by a bf16 step (2^-8 of
them), and across builds the kernel's bf16 products differ (vdpbf16ps against fp32 x): we allow 2^-5
of the logits' scale and ask for the same greedy tokens but for ties (the reference's best logit
ahead of the fused op's pick by two bf16 steps at most).
"""

import copy
import math

import pytest
import torch
from support.checkpoints import hf_model
from support.gguf_checkpoints import random_blocks
from support.kernels import has_int8_x, x_in_int8
from support.special_checkpoints import default_model

import model.checkpoint
import model.decode_step
from model import KVCache, load_checkpoint
from model.decode_step import LayerWeights, decode_layers
from model.kernels import KernelBuildError, build
from model.blocks import dequantize_blocks
from model.kv_cache import LayerCache, dequantize_q8
from model.linear import Linear
from model.quantize import INT4_GROUP, INT4_LEVELS, Q4_0_ZERO, dequantize, dequantize_int4, pack_int4, quantize_int8
from model.rope import Rope

BUILDS = ["native", "znver3", "x86-64"]
CACHED = [1, 6, 17]  # positions already in each sequence's cache: one batch of three, each at its own position
STEPS = 4


class CountingOps:
    """A kernel build's ops that count decode_layers calls: a test must see the fused path run."""

    def __init__(self, ops):
        self.ops, self.calls = ops, 0

    def decode_layers(self, *args):
        self.calls += 1
        return self.ops.decode_layers(*args)


@pytest.fixture(autouse=True)
def int4_x_in_int16(request):
    """The tests here compare the fused op with the reference closely: int4's x in int16 in the build
    under test and in the reference's (the last test switches int8 blocks back on)."""
    with x_in_int8(False, request.getfixturevalue("ops") if "ops" in request.fixturenames else None):
        yield


@pytest.fixture(scope="module", params=BUILDS)
def ops(request):
    try:
        return build(request.param).ops
    except KernelBuildError as e:
        if request.param == "native":
            pytest.fail(f"the decode kernel did not build for this CPU: {e}")
        pytest.skip(f"the compiler cannot build -march={request.param} here: {e}")


def tiny(tmp_path, monkeypatch, n_heads, n_kv_heads, activations, quantize=None, weights=torch.bfloat16,
         ffn_dim=160, head_dim=16, hidden=None):
    """A random 3-layer model of head_dim 16 (or as given) and hidden size head_dim * n_heads (or as given)
    loaded with bf16 weights, or quantized ("int8", "int4": Q4_1 blocks, "q4_0"), and the given activations.
    Written to tmp_path unless a test wrote it there already (folders_by_shape)."""
    if not (tmp_path / "config.json").exists():
        hf_model(seed=n_heads * 10 + n_kv_heads, hidden_size=hidden or head_dim * n_heads, intermediate_size=ffn_dim,
                 num_attention_heads=n_heads, num_key_value_heads=n_kv_heads,
                 head_dim=head_dim).save_pretrained(tmp_path)
    # Activations follow the weights where the CPU computes natively in bf16: fp32 is asked for here.
    monkeypatch.setattr(model.checkpoint, "has_native_bf16", lambda: activations == torch.bfloat16)
    ckpt = load_checkpoint(tmp_path, dtype=weights, quantize="int4" if quantize == "q4_0" else quantize)
    assert ckpt.model.compute_dtype == activations
    if quantize == "q4_0":
        as_q4_0(ckpt.model)
    return ckpt


def as_q4_0(net):
    """Each int4 matrix of `net` quantized again as Q4_0 blocks, without offsets: weight = (q - 8) scale,
    scale = max |weight| / 8 of the block."""
    for module in net.modules():
        if isinstance(module, Linear) and module.weight.dtype == torch.uint8:
            w = dequantize_int4(module.weight, module.scale, module.offset)
            n = w.shape[0]
            blocks = w.view(n, -1, INT4_GROUP)  # (N, K // 32, 32)
            scale = (blocks.abs().amax(-1) / Q4_0_ZERO).half().clamp(min=torch.finfo(torch.float16).tiny)
            q = (torch.round(blocks / scale.float()[..., None]) + Q4_0_ZERO).clamp(0, INT4_LEVELS).to(torch.uint8)
            module.weight = torch.nn.Parameter(pack_int4(q).view(n, -1), requires_grad=False)  # (N, K // 2)
            module.scale, module.offset = scale, None


def prefilled(ckpt, lengths, max_len=32, kv_type="bf16") -> list[KVCache]:
    caches = []
    for i, n in enumerate(lengths):
        cache = KVCache(ckpt.config, max_len, dtype=ckpt.model.compute_dtype, kv_type=kv_type)
        ids = [(7 * i + 3 * j + 11) % 500 for j in range(n)]
        with torch.inference_mode():
            ckpt.model(torch.tensor([ids]), 0, cache, last_only=True)  # (the cache is what is kept)
        cache.tokens = ids
        caches.append(cache)
    return caches


def decode_both(ckpt, ops, lengths=CACHED, steps=STEPS, kv_type="bf16", max_len=32):
    """Greedy decode of a batch by the fused op (`ops`) and by the reference, each on its own copy of
    the caches: per step (fused logits, reference logits), and the caches at the end."""
    fused_caches = prefilled(ckpt, lengths, max_len=max_len, kv_type=kv_type)
    reference_caches = copy.deepcopy(fused_caches)
    counting = CountingOps(ops)
    tokens = torch.tensor([5 + i for i in range(len(lengths))])
    steps_out = []
    with torch.inference_mode(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(model.decode_step, "kernels", lambda: counting)
        for _ in range(steps):
            fused = ckpt.model.decode(tokens, fused_caches)
            reference = ckpt.model.decode(tokens, reference_caches, fused=False)
            steps_out.append((fused, reference))
            for caches in (fused_caches, reference_caches):
                for cache, token in zip(caches, reference.argmax(-1).tolist()):
                    cache.tokens.append(token)
            tokens = reference.argmax(-1)
    assert counting.calls == steps, "the fused op did not run"
    return steps_out, fused_caches, reference_caches


def assert_kinds(ckpt, quantize):
    """The layers' matrices are stored as the test means them to be."""
    linears = [m for block in ckpt.model.layers for m in block.modules() if isinstance(m, Linear)]
    kind = {None: torch.bfloat16, "int8": torch.int8, "int4": torch.uint8, "q4_0": torch.uint8}[quantize]
    assert {m.weight.dtype for m in linears} == {kind}
    if kind == torch.uint8:
        assert all((m.offset is None) == (quantize == "q4_0") for m in linears)


QUANTIZE = [None, "int8", "int4", "q4_0"]  # bf16 weights, int8, int4 of Q4_1 blocks and of Q4_0 blocks


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (6, 2), (8, 2)])  # GQA ratios 1, 3, 4
@pytest.mark.parametrize("quantize", QUANTIZE)
def test_fp32_activations_give_the_reference_logits(ops, folders_by_shape, monkeypatch, n_heads, n_kv_heads, quantize):
    ckpt = tiny(folders_by_shape("3 layers", n_heads, n_kv_heads), monkeypatch, n_heads, n_kv_heads, torch.float32,
                quantize)
    assert_kinds(ckpt, quantize)
    steps, fused_caches, reference_caches = decode_both(ckpt, ops)
    tol = 1e-5 if quantize is None else 3e-4  # of the scale

    def close(fused, reference):
        scale = float(reference.abs().max())
        assert scale > 1  # not flat
        torch.testing.assert_close(fused, reference, atol=tol * scale, rtol=0)

    for fused, reference in steps:
        close(fused, reference)
        assert fused.argmax(-1).tolist() == reference.argmax(-1).tolist()
    for fused, reference in zip(fused_caches, reference_caches):
        n = fused.length
        close(fused.k[:, :, :, :n], reference.k[:, :, :, :n])
        close(fused.v[:, :, :, :n], reference.v[:, :, :, :n])


@pytest.fixture(scope="module")
def folders_by_shape(tmp_path_factory):
    """One folder per model shape for the module's tests, so each kernel build's test loads the same file
    (a checkpoint of Llama 3's vocabulary is 33 MB at hidden size 64, 534 MB at 1024)."""
    folders = {}
    return lambda *shape: folders.setdefault(shape, tmp_path_factory.mktemp("shape"))


@pytest.mark.parametrize("head_dim", [32, 64, 128, 48])  # 16 above; 48: no whole vectors, element by element
@pytest.mark.parametrize("n_heads,n_kv_heads", [(2, 1), (6, 1), (8, 1)])  # 6 and 8 query heads to a KV head: two passes
@pytest.mark.parametrize("activations", [torch.float32, torch.bfloat16])
def test_attention_of_each_head_size_and_grouping_gives_the_reference(ops, folders_by_shape, monkeypatch, head_dim,
                                                                      n_heads, n_kv_heads, activations):
    """The op's attention (csrc/decode_step.cpp) takes the query heads of a KV head in passes of up to 4 and
    the keys 16 at a time, the last fewer summed beside zeros: caches of 3, 16 and 27 positions (a part of a
    block, a whole one, one and a part) decoded 4 steps, against the reference. The attention's width
    (heads x head_dim) runs to 1024, so the sums of the products with wo differ from the reference's more
    than in the tests above. A query head paired with another's KV head, or a key left out, moves logits
    by a tenth of the scale or more."""
    folder = folders_by_shape(n_heads, n_kv_heads, head_dim)
    ckpt = tiny(folder, monkeypatch, n_heads, n_kv_heads, activations, head_dim=head_dim, hidden=8 * n_heads)
    steps, fused_caches, reference_caches = decode_both(ckpt, ops, lengths=[3, 16, 27])
    for fused, reference in steps:
        scale = float(reference.abs().max())
        tol = 2e-4 if activations == torch.float32 else 6e-2
        torch.testing.assert_close(fused.float(), reference.float(), atol=tol * scale, rtol=0)
    if activations == torch.float32:
        assert [f.argmax(-1).tolist() for f, _ in steps] == [r.argmax(-1).tolist() for _, r in steps]


@pytest.mark.parametrize("kv_type", ["bf16", "q8"])
@pytest.mark.parametrize("sharpness", [1.0, 30.0])
def test_caches_of_several_pieces_give_the_reference(ops, folders_by_shape, monkeypatch, kv_type, sharpness):
    """The op splits a cache into pieces of 256 positions (csrc/decode_step.cpp: kPositionsPerTask), takes each
    piece's softmax in vectors, its last positions beside padding, and merges the pieces by their maxima and
    sums: caches of 255, 256, 257 and 530 positions (one piece, one and one position, three with a part) decoded
    2 steps, fp32 activations, against the reference. sharpness 30: the queries' weights 30 times larger, so
    each query's scores spread over hundreds and most of a piece's exps fall below fp32's normal numbers (the
    op takes exp(-87) for those), and a piece whose maximum is far below another's weighs nothing in the
    merge. A lost piece, a padded position counted, or a weight off by the position of its key moves the
    logits by far more than the bound (2e-4 of their scale; q8 2e-3, where a new key may round to the other
    integer)."""
    ckpt = tiny(folders_by_shape(6, 2, 64), monkeypatch, 6, 2, torch.float32, head_dim=64)
    for block in ckpt.model.layers:  # (a new tensor: the loaded one maps the shared file)
        wq = block.attention.wq
        wq.weight = torch.nn.Parameter(wq.weight * sharpness, requires_grad=False)
    steps, _, _ = decode_both(ckpt, ops, lengths=[255, 256, 257, 530], steps=2, kv_type=kv_type, max_len=540)
    for fused, reference in steps:
        tol = 2e-3 if kv_type == "q8" else 2e-4
        torch.testing.assert_close(fused, reference, atol=tol * float(reference.abs().max()), rtol=0)
        assert fused.argmax(-1).tolist() == reference.argmax(-1).tolist()


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (6, 2), (8, 2)])
@pytest.mark.parametrize("quantize", QUANTIZE)
def test_bf16_activations_give_the_reference_tokens(ops, folders_by_shape, monkeypatch, n_heads, n_kv_heads, quantize):
    ckpt = tiny(folders_by_shape("3 layers", n_heads, n_kv_heads), monkeypatch, n_heads, n_kv_heads, torch.bfloat16,
                quantize)
    assert_kinds(ckpt, quantize)
    steps, _, _ = decode_both(ckpt, ops)
    for fused, reference in steps:
        assert fused.dtype == torch.float32  # logits are the head's fp32 sums whatever the activations
        scale = reference.float().abs().max()
        torch.testing.assert_close(fused.float(), reference.float(), atol=float(scale) * 2**-5, rtol=0)
        assert_reference_token_but_for_ties(fused, reference)


def assert_reference_token_but_for_ties(fused, reference):
    """bf16 activations: the fused op picks the reference's greedy token, or one the reference scores
    within two bf16 steps of its best: a tie that one rounding breaks either way (on these random
    models about one step in 25 has a lead of one step or none; a few of those go the other way)."""
    scores = reference.float()  # (b, vocab)
    best = scores.max(-1).values
    picked = scores.gather(-1, fused.argmax(-1, keepdim=True))[:, 0]  # the reference's score of the fused token
    step = 2.0 ** (torch.frexp(best.abs()).exponent - 8)  # a bf16 step at the best logit's size
    assert (best - picked <= 2 * step).all(), (
        f"the fused op picked tokens {fused.argmax(-1).tolist()}, the reference {scores.argmax(-1).tolist()}, "
        f"which leads them by {(best - picked).tolist()}, more than two bf16 steps {(2 * step).tolist()}")


def test_a_batch_of_eight_and_a_single_sequence(tmp_path, monkeypatch):
    ckpt = tiny(tmp_path, monkeypatch, 6, 2, torch.float32)
    for lengths in ([3], [1, 2, 3, 5, 8, 13, 21, 30]):
        steps, _, _ = decode_both(ckpt, build("native").ops, lengths, steps=2)
        for fused, reference in steps:
            torch.testing.assert_close(fused, reference, atol=1e-5 * float(reference.abs().max()), rtol=0)


def as_q5_0_beside_int8(net):
    """Each layer's matrices as Q5_0 blocks of random bytes (weights of the size they had), its wv in int8: a
    GGUF's fall-backs, two kinds in one product of q|k|v."""
    for b, block in enumerate(net.layers):
        for i, name in enumerate(model.decode_step.LAYER_MATRICES):
            module = block.get_submodule(name)
            n, k = module.weight.shape
            blocks = torch.from_numpy(random_blocks("Q5_0", n, k, seed=10 * b + i, typical=float(module.weight.std())))
            if name == "attention.wv":
                q, module.scale = quantize_int8(dequantize_blocks(blocks))
                module.weight = torch.nn.Parameter(q, requires_grad=False)
            else:
                module.weight = torch.nn.Parameter(blocks, requires_grad=False)


TEAM_KINDS = {  # the layers' weights (tiny's quantize, or the function above) and the KV cache
    "bf16": (None, "bf16"), "int8": ("int8", "bf16"), "int4, q8 cache": ("int4", "q8"),
    "q5_0 beside int8, q8 cache": ("q5_0+int8", "q8")}


@pytest.mark.parametrize("kind", list(TEAM_KINDS))
@pytest.mark.parametrize("activations", [torch.float32, torch.bfloat16])
def test_a_team_of_threads_gives_the_bits_of_one_thread(ops, folders_by_shape, monkeypatch, kind, activations):
    """With several threads the op runs a step's layers in one parallel region, its threads meeting at barriers
    (csrc/team.h), each computing its share of every product, of RoPE and the caches' writes, of attention's
    tasks and merge and of SwiGLU: with 2, 3 and 4 threads (more than this machine's cores: a thread that waits
    gives up its core) the logits and every cache row written are those of one thread, bit for bit, for one
    sequence, three and eight, at positions either side of attention's pieces of 256 (merged from two and
    three). A value one thread reads before another wrote it, a row or task left out or done twice, or a
    product's output not shared, changes them."""
    quantize, kv_type = TEAM_KINDS[kind]
    ckpt = tiny(folders_by_shape(4, 2, 32), monkeypatch, 4, 2, activations,
                None if quantize == "q5_0+int8" else quantize, head_dim=32)
    if quantize == "q5_0+int8":
        as_q5_0_beside_int8(ckpt.model)
    caches = prefilled(ckpt, [1, 300, 17, 600, 5, 256, 90, 2], max_len=640, kv_type=kv_type)
    tokens = torch.tensor([3, 5, 7, 11, 13, 17, 19, 23])
    counting = CountingOps(ops)
    monkeypatch.setattr(model.decode_step, "kernels", lambda: counting)
    before, teams = torch.get_num_threads(), ops.teams()
    try:
        for rows in ([3], [0, 1, 5], list(range(8))):
            results = []
            for threads in (1, 2, 3, 4):
                torch.set_num_threads(threads)
                step_caches = copy.deepcopy([caches[r] for r in rows])
                with torch.inference_mode():
                    logits = ckpt.model.decode(tokens[rows], step_caches)
                results.append((logits, [c.k.view(torch.uint8) for c in step_caches],  # bits (NaNs of unwritten rows too)
                                [c.v.view(torch.uint8) for c in step_caches]))
            for threads, (logits, ks, vs) in zip((2, 3, 4), results[1:]):
                assert torch.equal(logits, results[0][0]), (rows, threads)
                assert all(map(torch.equal, ks + vs, results[0][1] + results[0][2])), (rows, threads)
    finally:
        torch.set_num_threads(before)
    assert counting.calls == 3 * 4  # every step fused
    assert ops.teams() - teams == 3 * 3  # and those of 2, 3 and 4 threads ran as a team


def test_an_error_in_a_team_reaches_the_caller_and_the_next_step_runs(tmp_path, monkeypatch):
    """A check that fails inside the team's region (an int8 matrix's scales of the wrong shape, which the
    product checks): its message is raised to the caller, no thread is left waiting at a barrier, and the
    next step runs as a team and gives one thread's logits."""
    ckpt = tiny(tmp_path, monkeypatch, 4, 2, torch.float32, "int8")
    ops = build("native").ops
    monkeypatch.setattr(model.decode_step, "kernels", lambda: ops)
    wk = ckpt.model.layers[1].attention.wk
    good = wk.scale
    before, teams = torch.get_num_threads(), ops.teams()
    try:
        torch.set_num_threads(2)
        wk.scale = good[:, :1].repeat(1, 3).contiguous()  # 3 groups a row of 64 weights
        with torch.inference_mode(), pytest.raises(RuntimeError, match=r"matvec_int8: scale\[1\]"):
            ckpt.model.decode(torch.tensor([5]), prefilled(ckpt, [3]))
        wk.scale = good
        with torch.inference_mode():
            logits = ckpt.model.decode(torch.tensor([5]), prefilled(ckpt, [3]))
        assert ops.teams() - teams == 1
        torch.set_num_threads(1)
        with torch.inference_mode():
            assert torch.equal(logits, ckpt.model.decode(torch.tensor([5]), prefilled(ckpt, [3])))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("activations", [torch.float32, torch.bfloat16])
def test_an_int4_model_with_an_int8_matrix_is_fused(ops, folders_by_shape, monkeypatch, activations):
    """int4 keeps a matrix whose K is not whole blocks of 32 as int8: with an FFN of 176, each layer's w2
    (K = 176, int8 groups of 44) is int8 and its other matrices int4, and the op takes them side by side."""
    ckpt = tiny(folders_by_shape("ffn 176", 6, 2), monkeypatch, 6, 2, activations, "int4", ffn_dim=176)
    for block in ckpt.model.layers:
        assert block.feed_forward.w2.weight.dtype == torch.int8
        others = [block.attention.wq, block.attention.wk, block.attention.wv, block.attention.wo,
                  block.feed_forward.w1, block.feed_forward.w3]
        assert {m.weight.dtype for m in others} == {torch.uint8}
    steps, _, _ = decode_both(ckpt, ops)
    tol = 3e-4 if activations == torch.float32 else 2**-5  # of the scale, as for one kind of weights
    for fused, reference in steps:
        scale = float(reference.float().abs().max())
        torch.testing.assert_close(fused.float(), reference.float(), atol=tol * scale, rtol=0)
        if activations == torch.float32:
            assert fused.argmax(-1).tolist() == reference.argmax(-1).tolist()
        else:
            assert_reference_token_but_for_ties(fused, reference)


def test_int8_beside_int4_is_taken_and_a_bf16_matrix_among_int4_goes_to_the_reference(tmp_path, monkeypatch):
    """An int8 wk beside int4 wq and wv (one kernel call, two kinds, as a GGUF's fall-backs leave Q8_0 beside
    Q5_0): decode_layers takes it, each kind's run in its own product, with the reference's logits (within the
    fp32 tolerance of the fused tests above); a bf16 matrix among int4 ones: it declines."""
    ckpt = tiny(tmp_path, monkeypatch, 4, 2, torch.float32, "int4")
    caches = prefilled(ckpt, [3])
    x = torch.zeros(1, ckpt.config.dim)
    rope = Rope(torch.zeros(1, ckpt.config.head_dim), torch.zeros(1, ckpt.config.head_dim))
    wk = ckpt.model.layers[1].attention.wk
    w = dequantize_int4(wk.weight, wk.scale, wk.offset)
    q, scale = quantize_int8(w)
    wk.weight, wk.scale, wk.offset = torch.nn.Parameter(q, requires_grad=False), scale, None
    assert decode_layers(ckpt.model, x, rope, copy.deepcopy(caches)) is not None
    tokens = torch.tensor([7])
    with torch.inference_mode():
        fused = ckpt.model.decode(tokens, copy.deepcopy(caches))
        reference = ckpt.model.decode(tokens, copy.deepcopy(caches), fused=False)
    torch.testing.assert_close(fused, reference, atol=3e-4 * float(reference.abs().max()), rtol=0)
    wk.weight, wk.scale = torch.nn.Parameter(w.bfloat16(), requires_grad=False), None
    assert decode_layers(ckpt.model, x, rope, copy.deepcopy(caches)) is None


def test_int4_scales_and_offsets_are_converted_once_when_gathered(tmp_path, monkeypatch):
    """The int4 kernel reads fp16 scales and offsets: stored wider, they are converted when the op's
    arguments are gathered, and the next step finds the same converted tensors."""
    ckpt = tiny(tmp_path, monkeypatch, 4, 2, torch.float32, "int4")
    wq = ckpt.model.layers[0].attention.wq
    wq.scale, wq.offset = wq.scale.float(), wq.offset.float()
    layer_weights = LayerWeights(ckpt.model)
    _, _, scales, offsets = layer_weights.current(torch.float32)
    assert scales[0].dtype == offsets[0].dtype == torch.float16
    assert torch.equal(scales[0], wq.scale.half()) and torch.equal(offsets[0], wq.offset.half())
    _, _, again, offsets_again = layer_weights.current(torch.float32)
    assert again[0] is scales[0] and offsets_again[0] is offsets[0]


def test_weights_the_op_does_not_take_go_to_the_reference(tmp_path, monkeypatch):
    ckpt = tiny(tmp_path, monkeypatch, 4, 2, torch.float32, weights=torch.float32)
    caches = prefilled(ckpt, [3])
    x = torch.zeros(1, ckpt.config.dim)
    rope = Rope(torch.zeros(1, ckpt.config.head_dim), torch.zeros(1, ckpt.config.head_dim))
    assert decode_layers(ckpt.model, x, rope, caches) is not None  # fp32 matrices, all of them: taken
    ckpt = tiny(tmp_path, monkeypatch, 4, 2, torch.float32)
    assert decode_layers(ckpt.model, x, rope, caches) is not None
    layer = ckpt.model.layers[1].feed_forward.w2
    layer.weight = torch.nn.Parameter(layer.weight.float(), requires_grad=False)  # one matrix of another kind
    assert decode_layers(ckpt.model, x, rope, caches) is None
    with pytest.MonkeyPatch.context() as patch:  # LLAMA_KERNELS=0, or no compiler
        patch.setattr(model.decode_step, "kernels", lambda: None)
        assert decode_layers(ckpt.model, x, rope, caches) is None


def test_a_full_cache_is_refused_as_the_reference_refuses_it(tmp_path, monkeypatch):
    ckpt = tiny(tmp_path, monkeypatch, 4, 2, torch.float32)
    caches = prefilled(ckpt, [8], max_len=8)
    for fused in (True, False):
        with pytest.raises(ValueError, match="KV cache holds 8 positions; asked to write up to 9"):
            ckpt.model.decode(torch.tensor([1]), caches, fused=fused)


def test_the_op_says_what_it_expected(tmp_path, monkeypatch):
    ckpt = tiny(tmp_path, monkeypatch, 4, 2, torch.float32)
    caches = prefilled(ckpt, [3])
    found = LayerWeights(ckpt.model).current(torch.float32)
    norms, weights, scales, offsets = found
    x, cos = torch.zeros(1, ckpt.config.dim), torch.zeros(1, ckpt.config.head_dim)
    ops = build("native").ops
    args = dict(norms=norms, weights=weights, scales=scales, offsets=offsets, cos=cos, sin=cos,
                k_caches=[caches[0].k], v_caches=[caches[0].v], positions=[3], n_heads=4, eps=1e-5)
    with pytest.raises(RuntimeError, match=r"layer 0 matrix 0 is \[64, 32\] of BFloat16; expected \(64, 64\)"):
        ops.decode_layers(x, **(args | {"weights": [w[:, :32] for w in weights]}))
    with pytest.raises(RuntimeError, match=r"writes position 32 of a cache that holds 32"):
        ops.decode_layers(x, **(args | {"positions": [32]}))
    with pytest.raises(RuntimeError, match=r"1 rows of x but 2 key caches"):
        ops.decode_layers(x, **(args | {"k_caches": [caches[0].k] * 2}))
    with pytest.raises(RuntimeError, match=r"cos must be a contiguous CPU tensor of Float and shape \[1, 16\]"):
        ops.decode_layers(x, **(args | {"cos": cos.bfloat16()}))
    with pytest.raises(RuntimeError, match=r"21 weights, 0 scales, 1 offsets"):
        ops.decode_layers(x, **(args | {"offsets": [None]}))
    int4 = tiny(tmp_path / "int4", monkeypatch, 4, 2, torch.float32, "int4")
    norms, weights, scales, offsets = LayerWeights(int4.model).current(torch.float32)
    args |= dict(norms=norms, weights=weights, scales=scales, offsets=offsets)
    with pytest.raises(RuntimeError, match=r"layer 0 matrix 0 is \[64, 64\] of Byte; expected \(64, 32\)"):
        ops.decode_layers(x, **(args | {"weights": [torch.cat([w, w], 1) for w in weights]}))
    # layer 0's wk as int8 beside the int4 wq and wv (as a GGUF's fall-backs mix kinds): each run of a kind in its call
    q, scale = quantize_int8(dequantize(weights[1], scales[1], offsets[1]))
    mixed = {"weights": [*weights[:1], q, *weights[2:]], "scales": [*scales[:1], scale, *scales[2:]],
             "offsets": [*offsets[:1], None, *offsets[2:]]}
    alone, together = ops.decode_layers(x.clone(), **args), ops.decode_layers(x.clone(), **(args | mixed))
    assert together.shape == alone.shape and torch.isfinite(together).all()
    assert (together - alone).abs().max() <= 0.05 * alone.abs().max()  # wk's int8 rounding (1/254 of a group's max)


PROMPTS = [  # batches of 8 and of 2, of different lengths
    "What is the capital of France?", "Write a haiku about the sea.", "Explain recursion to a child.",
    "List three prime numbers.", "How do I boil an egg?", "Translate 'good morning' into Spanish.",
    "What is 17 times 23?", "Summarize the plot of Romeo and Juliet.", "Why is the sky blue?",
    "Write a Python function that adds two numbers.",
]
TOKENS = 32  # greedy tokens per prompt: the first from prefill (not fused), then TOKENS - 1 decode steps
STEPS_IN_ALL = len(PROMPTS) * (TOKENS - 1)  # the greedy choices the fused op makes


def default_model_steps(monkeypatch, activations, forced: bool, quantize=None):
    """Greedy decode of TOKENS tokens on the PROMPTS (its Q4_1 blocks widened at load to their float32
    values, then stored in bf16, or `quantize`d), in batches of up to 8
    sequences of different lengths, by the fused op and by the reference: (fused tokens, reference
    tokens), each (prompts, TOKENS), and per step of each prompt (fused logits, reference logits). forced: both
    paths are fed the reference's tokens (teacher forcing), so each step compares the same inputs; else
    each follows its own."""
    monkeypatch.setattr(model.checkpoint, "has_native_bf16", lambda: activations == torch.bfloat16)
    ckpt = load_checkpoint(default_model(), dtype=torch.bfloat16, quantize=quantize, widen=True)
    net = ckpt.model
    assert net.compute_dtype == activations
    counting = CountingOps(model.decode_step.kernels())
    monkeypatch.setattr(model.decode_step, "kernels", lambda: counting)
    prompts = [ckpt.chat_format.encode_dialog([{"role": "user", "content": text}]) for text in PROMPTS]
    tokens = {True: [], False: []}
    logits = []
    with torch.inference_mode():
        for first in range(0, len(prompts), 8):
            batch = prompts[first:first + 8]
            caches = {True: [], False: []}
            current = []  # the prefill's greedy tokens (prefill is not fused: the same for both paths)
            for ids in batch:  # prefilled once, the cache copied for the other path
                cache = KVCache(ckpt.config, len(ids) + TOKENS, dtype=net.compute_dtype)
                last = net(torch.tensor([ids]), 0, cache, last_only=True)[0, -1]
                cache.tokens = list(ids)
                caches[True].append(cache)
                caches[False].append(copy.deepcopy(cache))
                current.append(int(last.argmax()))
            current = {True: current, False: current}
            generated = {True: [current[True]], False: [current[False]]}
            for _ in range(TOKENS - 1):
                step = {fused: net.decode(torch.tensor(current[fused]), caches[fused], fused=fused)
                        for fused in (True, False)}
                logits.append((step[True].float(), step[False].float()))
                for fused in (True, False):
                    for cache, token in zip(caches[fused], current[fused]):
                        cache.tokens.append(token)
                    current[fused] = step[False if forced else fused].argmax(-1).tolist()
                    generated[fused].append(current[fused])
            for fused in (True, False):
                tokens[fused] += [list(reply) for reply in zip(*generated[fused])]  # (sequences, TOKENS)
    assert counting.calls == math.ceil(len(PROMPTS) / 8) * (TOKENS - 1)
    return tokens[True], tokens[False], logits


@pytest.mark.parametrize("quantize", [None, "int4"])  # int4: its layers' matrices all int4, the output head int8
def test_the_default_model_with_fp32_activations_decodes_the_same_greedy_tokens(monkeypatch, quantize):
    """The same greedy tokens, but where a near-tie (the reference's best logit ahead of the next by
    less than twice what the two paths may differ) breaks the other way: then each path goes on with
    its own token, and the comparison ends there. bf16 weights give every prompt the same tokens."""
    fused, reference, logits = default_model_steps(monkeypatch, torch.float32, forced=False, quantize=quantize)
    tol = 1e-5 if quantize is None else 2e-3  # of the scale: x rounded to int16 (the module's docstring)
    same_until = []  # per prompt: the first token the paths differ in (TOKENS: none)
    for p, (prompt, ours, theirs) in enumerate(zip(PROMPTS, fused, reference)):
        assert len(ours) == TOKENS
        same_until.append(next((j for j in range(TOKENS) if ours[j] != theirs[j]), TOKENS))
        if ours == theirs:
            continue
        at = same_until[-1]  # >= 1: token 0 is the prefill's, not fused
        scores = logits[p // 8 * (TOKENS - 1) + at - 1][1][p % 8]  # the reference's logits that chose token `at`
        top = scores.topk(2).values
        assert top[0] - top[1] < 2 * tol * float(scores.abs().max()), (
            f"{prompt!r}: the fused op's tokens part from the reference's at {at}, where the reference's "
            f"choice led by {float(top[0] - top[1]):.4f}")
    assert sum(n < TOKENS for n in same_until) <= (0 if quantize is None else 1)
    for i, (ours, theirs) in enumerate(logits):  # step i % (TOKENS - 1) of batch i // (TOKENS - 1): same inputs
        batch, step = divmod(i, TOKENS - 1)
        rows = [r for r in range(len(ours)) if step < same_until[batch * 8 + r]]
        torch.testing.assert_close(ours[rows], theirs[rows], atol=tol * float(theirs.abs().max()), rtol=0)


@pytest.mark.parametrize("quantize", [None, "int4"])
def test_the_default_model_with_bf16_activations_picks_the_reference_tokens_but_for_ties(monkeypatch, quantize):
    """In bf16 the greedy token is often a tie or nearly (logits of 10 to 40 in steps of 2^-4 to 2^-2),
    and one bf16 rounding that goes the other way can break it either way: the fused op and the reference
    round in other places and sum in other orders (each alone gives the same tokens in any batch,
    tests/test_determinism.py). So both paths are fed the reference's tokens; their logits may differ by a few bf16 steps (bf16
    weights: at the largest |logit|'s size, the largest difference of a step was 4.5 steps in the
    median and 11-13 at most, with the attention's dot products summed in three different orders;
    more with int4 weights), and at every step where the
    reference's best logit leads the next by more than four steps, the fused op must pick the same
    token. (With two steps as the line, the summation order alone decided whether one choice of
    1,260, on 20 prompts of 64 tokens, led by 2 or 3 steps, went the other way.)"""
    _, _, logits = default_model_steps(monkeypatch, torch.bfloat16, forced=True, quantize=quantize)
    decided = agree = 0
    for ours, theirs in logits:
        top = theirs.topk(2, dim=-1).values  # (b, 2)
        step = 2.0 ** (torch.frexp(top[:, 0].abs()).exponent - 8)  # (b,) a bf16 step at the best logit's size
        clear = (top[:, 0] - top[:, 1]) > 4 * step
        same = ours.argmax(-1) == theirs.argmax(-1)
        assert same[clear].all(), "the fused op picked another token where the reference's choice was clear"
        decided += int(clear.sum())
        agree += int(same.sum())
    assert decided > 0.7 * STEPS_IN_ALL  # most steps are clear choices: the comparison above is not empty
    assert agree > 0.95 * STEPS_IN_ALL


def test_the_default_model_in_int4_with_x_in_int8_blocks_picks_the_reference_tokens_where_clear(monkeypatch):
    """The AVX-512 and AVX2 builds round x to int8 per block of 32 for int4 weights (as llama.cpp's Q8 activations):
    one x value rounded the other way moves an output by 1/127 of its block's largest |x|, and the last-bit
    differences between the fused op's activations and the reference's flip such roundings in every layer.
    Fed the reference's tokens, the two paths' logits differ by 0.6% of their scale (the largest |logit| of
    the sequence) on average and by up to 6-13% (a step's largest difference: 2.4% in the median step), and
    23-36 of 1,260 greedy choices differ on 20 prompts of 64 tokens (two versions of the kernel, which sum in other orders), where the
    reference's best led the next by under 1.2% of the scale but once by 2.4%. Asked: within 15%, and the
    same token wherever the lead is over 3% (two thirds of the steps)."""
    with x_in_int8(True):
        if not has_int8_x(model.decode_step.kernels()):
            pytest.skip("this CPU's kernel build rounds x to int16 for int4 (no AVX2): the tests above")
        _, _, logits = default_model_steps(monkeypatch, torch.float32, forced=True, quantize="int4")
    decided = agree = 0
    for ours, theirs in logits:
        scale = theirs.abs().max(-1, keepdim=True).values  # (b, 1)
        assert ((ours - theirs).abs() <= 0.15 * scale).all()
        top = theirs.topk(2, dim=-1).values  # (b, 2)
        clear = (top[:, 0] - top[:, 1]) > 0.03 * scale[:, 0]
        same = ours.argmax(-1) == theirs.argmax(-1)
        assert same[clear].all(), "the fused op picked another token where the reference's choice was clear"
        decided += int(clear.sum())
        agree += int(same.sum())
    assert decided > 0.6 * STEPS_IN_ALL
    assert agree > 0.95 * STEPS_IN_ALL


def reading_only(ckpt, tokens, caches) -> torch.Tensor:
    """The reference's decode step over copies of q8 caches that already hold this step's keys and values (the op
    wrote them): it reads them as they are and writes nothing."""
    def read(cache, start, k, v):
        end = start + k.shape[2]
        return dequantize_q8(cache.k[:, :, :end]), dequantize_q8(cache.v[:, :, :end])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LayerCache, "update", read)
        return ckpt.model.decode(tokens, copy.deepcopy(caches), fused=False)


def fp32_order_bound(net) -> float:
    """How far two fp32 computations of one logit may be apart when they sum the same terms in orders of
    their own, from the arithmetic: each sum of K products rounds by at most 2^-24 of its running value per
    addition, and rounding errors of random signs grow like sqrt(K), so 4 sqrt(K) 2^-24 E for the sum
    E = sum_k |w[n, k] h[k]|, as tests/model/test_kernels.py allows one product. The output head's E is at most
    |w[n]|_2 |h|_2 (Cauchy-Schwarz), with |h|_2 <= sqrt(K) max|g| after the final RMSNorm of weight g. Each
    layer's sums (attention, wo, the FFN) feed the last hidden state: their errors reach the logits through
    the same head, so the bound is taken once per layer and once for the head itself."""
    k = net.config.dim
    head = net.output.weight.float()
    e = float(head.norm(dim=-1).max()) * math.sqrt(k) * float(net.norm.weight.float().abs().max())
    return (net.config.n_layers + 1) * 4 * math.sqrt(k) * 2**-24 * e


@pytest.mark.parametrize("head_dim,n_heads,n_kv_heads", [(32, 4, 4), (64, 6, 2), (128, 8, 2), (96, 3, 1)])
@pytest.mark.parametrize("activations", [torch.float32, torch.bfloat16])
def test_q8_caches_give_the_reference_logits(ops, folders_by_shape, monkeypatch, head_dim, n_heads, n_kv_heads,
                                             activations):
    """Keys and values in q8 blocks (model/kv_cache.py), written and read by the op a block at a time, against
    the reference, which writes the same blocks and widens them to fp32 to attend (96: no whole vectors of 16
    in the op's element-by-element path). Both attend in fp32 over the same numbers.

    fp32 activations: while a row's caches hold the same bytes, both sides compute the same sums in their own
    orders, and its logits agree within fp32_order_bound (from the sums' lengths and fp32's epsilon). The new
    key and value come out of the products a last bit apart, and one number in a few thousand then rounds to
    the other integer: the first layer's blocks (computed from the same x) must be the reference's but for
    such numbers, one step apart with the same scale. How far one such step moves the logits depends on the
    weights, not on the arithmetic (we saw 3e-4 to 2.5e-3 of the scale): so that row is compared with the
    reference run again over the op's own bytes (its caches as the op left them, the reference's writes left
    out), within fp32_order_bound again.
    bf16 activations: a key rounded to bf16 the other way changes its block's scale too, so every number of the
    block may move by a step of 1/127 of its largest, and such differences would add up over the steps: so
    before each step the reference takes the op's caches (the same bytes), and one step's logits must agree
    as closely as the same steps over bf16 caches do (up to 6% of the scale at head_dim 64 here), 2^-5
    more. A key left out or attended by another head moves them by a tenth of the scale or more."""
    ckpt = tiny(folders_by_shape(head_dim, n_heads, n_kv_heads, "q8"), monkeypatch, n_heads, n_kv_heads, activations,
                head_dim=head_dim, hidden=16 * n_heads)  # (narrow: the 128K-row output head is most of the work)
    lengths = [1, 6, 17, 25]
    fused_caches = prefilled(ckpt, lengths, kv_type="q8")
    reference_caches = copy.deepcopy(fused_caches)
    assert all(cache.k.dtype == torch.uint8 for cache in fused_caches)
    tokens = torch.tensor([5 + i for i in range(len(lengths))])
    apart = [False] * len(lengths)  # rows whose caches came to differ by a number rounded the other way
    counting = CountingOps(ops)
    same_bytes = fp32_order_bound(ckpt.model)
    if activations != torch.float32:  # as far apart as the same steps over caches in bf16 on this model, and 2^-5 more
        steps, _, _ = decode_both(ckpt, ops, lengths=lengths, steps=6)
        tight = max(float((f - r).abs().max() / r.abs().max()) for f, r in steps) + 2**-5
    with torch.inference_mode(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(model.decode_step, "kernels", lambda: counting)
        for _ in range(6):
            if activations != torch.float32:  # the same bytes in both at each step (see the docstring)
                reference_caches = copy.deepcopy(fused_caches)
            fused = ckpt.model.decode(tokens, fused_caches)
            reference = ckpt.model.decode(tokens, reference_caches, fused=False)
            on_the_ops_bytes = None
            for row, (a, b) in enumerate(zip(fused_caches, reference_caches)):
                at = a.length  # the position this step wrote, in every layer
                for blocks_a, blocks_b in ((a.k[:, :, :, at], b.k[:, :, :, at]), (a.v[:, :, :, at], b.v[:, :, :, at])):
                    if torch.equal(blocks_a, blocks_b):
                        continue
                    apart[row] = True
                    if activations != torch.float32:
                        continue
                    # the first layer's blocks (from the same x): the same scales, numbers a step apart at most
                    first_a, first_b = blocks_a[0].unflatten(-1, (-1, 34)), blocks_b[0].unflatten(-1, (-1, 34))
                    assert torch.equal(first_a[..., :2], first_b[..., :2])
                    q_a, q_b = first_a[..., 2:].view(torch.int8).int(), first_b[..., 2:].view(torch.int8).int()
                    assert (q_a - q_b).abs().max() <= 1
                    assert (q_a != q_b).float().mean() < 0.01
                if activations != torch.float32:
                    scale = float(reference[row].abs().max())
                    torch.testing.assert_close(fused[row], reference[row], atol=tight * scale, rtol=0)
                    continue
                if apart[row] and on_the_ops_bytes is None:
                    on_the_ops_bytes = reading_only(ckpt, tokens, fused_caches)
                theirs = on_the_ops_bytes if apart[row] else reference
                torch.testing.assert_close(fused[row], theirs[row], atol=same_bytes, rtol=0)
                assert int(fused[row].argmax()) == int(theirs[row].argmax())
            for caches in (fused_caches, reference_caches):
                for cache, token in zip(caches, reference.argmax(-1).tolist()):
                    cache.tokens.append(token)
            tokens = reference.argmax(-1)
    assert counting.calls == 6, "the fused op did not run"
    if activations == torch.float32:
        assert not all(apart), "every row drifted: the comparison above tested little"


def test_q8_and_plain_caches_in_one_batch_go_to_the_reference(tmp_path, monkeypatch):
    ckpt = tiny(tmp_path, monkeypatch, 4, 2, torch.float32, head_dim=32)
    caches = prefilled(ckpt, [3], kv_type="q8") + prefilled(ckpt, [5])
    x = torch.zeros(2, ckpt.config.dim)
    rope = Rope(torch.ones(2, 32), torch.zeros(2, 32))
    assert decode_layers(ckpt.model, x, rope, caches) is None
    one = Rope(torch.ones(1, 32), torch.zeros(1, 32))
    assert decode_layers(ckpt.model, x[:1], one, caches[:1]) is not None
