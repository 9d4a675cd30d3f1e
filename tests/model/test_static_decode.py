"""Steps of fixed shapes over static KV slots (model/static_decode.py) against the reference decode.

On a GPU these steps are replayed CUDA graphs; here they run eagerly, the same function the graphs record,
so the maths, the padding of rows and key lengths, and the slots' bookkeeping are checked on any machine.
With LLAMA_TEST_DEVICE=cuda the same tests capture and replay the graphs.
"""

from __future__ import annotations

import gc

import pytest
import torch

from model.checkpoint import load_checkpoint
from model.kv_cache import KVCache
from model.static_decode import MIN_LENGTH, SlotCache, StaticDecoder, attach, new_cache

PROMPTS = [[5, 9, 13, 2, 7], list(range(20, 20 + MIN_LENGTH - 3)), [3] * 40]  # the second crosses MIN_LENGTH


@pytest.fixture
def model(tiny, device):
    return load_checkpoint(tiny, device=device, dtype="float32").model


def prefilled(model, prompts, make) -> list[KVCache]:
    caches = []
    for ids in prompts:
        cache = make()
        model(torch.tensor([ids], device=model.output.weight.device), kv_cache=cache)
        cache.tokens.extend(ids)
        caches.append(cache)
    return caches


def reference(model, max_len):
    return lambda: KVCache(model.config, max_len, device=model.output.weight.device, dtype=torch.float32)


def step_both(model, slots, plain, tokens, positions=None, rows=None):
    """One decode step through the static decoder (slots) and the reference (plain caches, op by op)."""
    rows = rows or list(range(len(slots)))
    device = model.output.weight.device
    ids = torch.tensor(tokens, device=device)
    got = model.decode(ids, [slots[r] for r in rows], positions=positions)
    want = model.decode(ids, [plain[r] for r in rows], fused=False, positions=positions)
    return got, want


def test_steps_give_the_reference_logits_for_every_batch_size_and_across_lengths(model):
    max_len = 2 * MIN_LENGTH + 40
    attach(model, slots=3, max_len=max_len)
    slots = prefilled(model, PROMPTS, lambda: new_cache(model, max_len))
    plain = prefilled(model, PROMPTS, reference(model, max_len))
    assert [cache.slot for cache in slots] == [0, 1, 2]
    for step in range(8):  # the second prompt's rows cross from MIN_LENGTH keys to 2 * MIN_LENGTH
        for rows in ([1], [0, 2], [2, 1, 0]):  # 1 row; 2; 3 padded to 4
            tokens = [(11 * step + 3 * r) % model.config.vocab_size for r in rows]
            got, want = step_both(model, slots, plain, tokens, rows=rows)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
            for r, t in zip(rows, tokens):
                slots[r].tokens.append(t)
                plain[r].tokens.append(t)
    assert slots[1].length > MIN_LENGTH
    shapes = {model.static.shape(n, slots[1].length) for n in (1, 2, 3)}
    assert shapes == {(1, 2 * MIN_LENGTH), (2, 2 * MIN_LENGTH), (4, 2 * MIN_LENGTH)}


def test_rows_sharing_a_slot_see_the_rows_before_them_as_in_a_speculative_check(model):
    max_len = MIN_LENGTH
    attach(model, slots=2, max_len=max_len)
    slots = prefilled(model, PROMPTS[:1], lambda: new_cache(model, max_len))
    plain = prefilled(model, PROMPTS[:1], reference(model, max_len))
    start = slots[0].length
    guesses = [17, 4, 4, 30, 8]  # a token and four guesses after it, each at the next position
    positions = list(range(start, start + len(guesses)))
    got, want = step_both(model, slots, plain, guesses, positions=positions, rows=[0] * len(guesses))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    # a row attends to the rows before it: the last logits differ from the same token decoded alone
    alone, _ = step_both(model, slots, plain, [8], positions=[start])
    assert not torch.allclose(alone[0], got[-1], atol=1e-3)


def test_padding_rows_write_only_the_scratch_slot(model):
    attach(model, slots=3, max_len=MIN_LENGTH)
    slots = prefilled(model, PROMPTS[:1] * 3, lambda: new_cache(model, MIN_LENGTH))
    store = model.static.cache
    before = store.k[:, :store.scratch].clone(), store.v[:, :store.scratch].clone()
    model.decode(torch.tensor([1, 2, 3], device=store.k.device), slots)  # 3 rows: one padding row
    written = (store.k[:, :store.scratch] != before[0]).any(dim=(0, 2, 4))  # (slots, positions) touched
    length = len(PROMPTS[0])
    assert written[:, length].all() and written.sum() == 3  # each row's own position, nothing else
    assert (store.v[:, :store.scratch] != before[1]).any(dim=(0, 2, 4)).sum() == 3


def test_slots_come_back_when_their_caches_are_collected_and_none_left_falls_back(model):
    decoder = attach(model, slots=2, max_len=MIN_LENGTH)
    first, second = new_cache(model, 100), new_cache(model, 100)
    assert {first.slot, second.slot} == {0, 1} and decoder.cache.take() is None
    third = new_cache(model, 100)  # no slot free: a cache of its own, decoded op by op
    assert third.slot is None and third.max_len == 100
    longer = new_cache(model, MIN_LENGTH + 1)  # longer than a slot: its own too
    assert longer.slot is None
    del first
    gc.collect()
    again = new_cache(model, 100)
    assert again.slot is not None and again.max_len == MIN_LENGTH
    assert decoder.cache.holds([again, second]) and not decoder.cache.holds([again, third])


def test_a_batch_mixing_slots_and_other_caches_runs_the_reference(model, monkeypatch):
    attach(model, slots=1, max_len=MIN_LENGTH)
    mixed = prefilled(model, PROMPTS[:1], lambda: new_cache(model, MIN_LENGTH))
    mixed += prefilled(model, PROMPTS[:1], reference(model, MIN_LENGTH))
    monkeypatch.setattr(StaticDecoder, "decode", lambda *a: pytest.fail("static step for a mixed batch"))
    logits = model.decode(torch.tensor([4, 4], device=model.output.weight.device), mixed)
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-4)  # same prompt, same token


def test_a_storage_of_another_shape_is_refused(model):
    store = SlotCache(model.config, 2, 64)
    with pytest.raises(ValueError, match="KV storage of shape"):
        KVCache(model.config, 32, storage=(store.k[:, :1], store.v[:, :1]))


def test_the_step_traces_as_one_graph_for_torch_compile(model, monkeypatch):
    """torch.compile (fullgraph: no Python breaks) is how the step's small ops are fused before capture on
    a GPU; here it compiles for the CPU, with the decode kernel off (its C++ calls are not traceable)."""
    from model import kernels
    monkeypatch.setattr(kernels, "kernels", lambda: None)
    monkeypatch.setattr("model.linear.kernels", lambda: None)
    torch._dynamo.reset()
    attach(model, slots=1, max_len=MIN_LENGTH, compile=True)
    slots = prefilled(model, PROMPTS[:1], lambda: new_cache(model, MIN_LENGTH))
    plain = prefilled(model, PROMPTS[:1], reference(model, MIN_LENGTH))
    got, want = step_both(model, slots, plain, [6])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)


def test_a_reply_through_static_slots_is_the_reply_of_the_reference(tiny, device):
    """load_checkpoint(graphs=True) (the default on CUDA): prefill and decode in a slot, speculation's
    checks (several rows of one slot) included, give the greedy reply of a model without slots."""
    from model.generation import generate

    plain = load_checkpoint(tiny, device=device, dtype="float32", graphs=False)
    static = load_checkpoint(tiny, device=device, dtype="float32", graphs=True, slots=2)
    assert plain.model.static is None and static.model.static is not None
    prompt = [7, 8, 9, 10, 7, 8, 9, 10, 7, 8]  # repeats: prompt lookup guesses, so steps check several rows
    replies = [generate(checkpoint, prompt, max_new_tokens=40, temperature=0, stop_ids=set(), speculate=how)
               for checkpoint in (plain, static) for how in ("off", "auto")]
    texts = [list(reply) and reply.tokens for reply in replies]
    assert texts[0] == texts[1] == texts[2] == texts[3] and len(texts[0]) == 40
    assert replies[3].kv_cache.slot is not None and replies[3].stats.decode_steps < 40  # it guessed, in a slot


def test_the_step_with_the_triton_kernels_gives_the_reference_logits_in_one_length(model, monkeypatch):
    """The step as a GPU runs it (model/step_ops.py's Triton forms, here in Triton's interpreter): attention
    reads each row's own keys, so a single key length (one graph a batch size) serves every position."""
    from model import static_decode, step_ops
    if step_ops.triton_ops() is None:
        pytest.skip("Triton is not installed (requirements-test.txt has it)")
    monkeypatch.setattr(static_decode, "step_ops", lambda device, head_dim: step_ops.triton_ops())
    max_len = MIN_LENGTH + 40
    decoder = attach(model, slots=2, max_len=max_len)
    assert decoder.ops.name == "triton" and decoder.lengths() == [max_len]
    slots = prefilled(model, PROMPTS[:2], lambda: new_cache(model, max_len))
    plain = prefilled(model, PROMPTS[:2], reference(model, max_len))
    for step in range(3):
        got, want = step_both(model, slots, plain, [3 + step, 40 + step])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        for cache, token in zip(slots + plain, [3 + step, 40 + step] * 2):
            cache.tokens.append(token)
    start = slots[0].length  # and a speculative check: rows of one slot see the rows before them
    got, want = step_both(model, slots, plain, [5, 6, 7], positions=[start, start + 1, start + 2], rows=[0, 0, 0])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_attaching_fuses_q_k_v_and_gate_up_keeping_one_copy_of_the_weights(model):
    attention = model.layers[0].attention
    before = {name: t.clone() for name, t in model.state_dict().items()}
    decoder = attach(model, slots=1, max_len=MIN_LENGTH)
    (qkv,), (gate_up,) = decoder.projections[0]
    assert qkv.weight.shape[0] == sum(layer.weight.shape[0] for layer in (attention.wq, attention.wk, attention.wv))
    assert attention.wk.weight.data_ptr() == qkv.weight[attention.wq.weight.shape[0]:].data_ptr()  # a view
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[name], t) for name, t in before.items())
    assert decoder.held_bytes() == decoder.inputs.nbytes  # fp32 RoPE tables are the model's own, no graphs here


@pytest.mark.parametrize("settings", [dict(temperature=0), dict(temperature=1.0, top_p=0.9, seed=3),
                                      dict(temperature=0.8, top_k=20, seed=5, repetition_penalty=1.3)])
def test_a_reply_queued_a_token_ahead_is_plain_decodings_reply(tiny, device, monkeypatch, settings):
    """In a slot, without speculation, Generation queues each step on the token sampled on the device before
    reading it (model/generation.py's _pipelined): the same tokens, stats and cache as plain decoding, a
    seeded draw and a repetition penalty included; it ends at a stop id and at the token limit alike."""
    from model.generation import Generation, generate
    from model.sampling import SamplingParams

    plain = load_checkpoint(tiny, device=device, dtype="float32", graphs=False)
    static = load_checkpoint(tiny, device=device, dtype="float32", graphs=True, slots=1)
    prompt = [7, 8, 9, 10, 11, 3, 5]
    params = SamplingParams(**{"top_k": 0, **settings})

    def reply(checkpoint, **options):
        gen = generate(checkpoint, prompt, max_new_tokens=30, sampling=params, speculate="off", **options)
        return gen, "".join(gen)

    want, want_text = reply(plain, stop_ids=set())
    queued = []
    monkeypatch.setattr(Generation, "_pipelined", lambda self, logits, real=Generation._pipelined:
                        queued.append(1) or real(self, logits))
    got, got_text = reply(static, stop_ids=set())
    assert queued and got.kv_cache.slot is not None
    assert got.tokens == want.tokens and got_text == want_text and len(got.tokens) == 30
    assert got.stats.decode_steps == want.stats.decode_steps == 29 and got.finish_reason == "length"
    assert got.kv_cache.tokens == want.kv_cache.tokens  # the last token's step ran for nothing: not recorded
    stop = want.tokens[10]
    want, _ = reply(plain, stop_ids={stop})
    got, _ = reply(static, stop_ids={stop})
    assert got.tokens == want.tokens and got.finish_reason == want.finish_reason == "stop"
    assert got.kv_cache.tokens == want.kv_cache.tokens


def test_a_step_whose_triton_kernels_fail_at_capture_falls_back_to_the_torch_forms(model, monkeypatch, caplog):
    """On a GPU whose Triton cannot build a kernel, the load still works: the capture's first run fails, the
    decoder is made again with the torch forms (one graph a power-of-two length), and the log says so."""
    from types import SimpleNamespace

    from model import static_decode, step_ops

    def broken(*args):
        raise RuntimeError("no kernel for this GPU")

    failing = SimpleNamespace(name="triton", reads_own_length=True, add_rms_norm=broken, rope_write=broken,
                              attend=broken, silu_mul=broken)
    monkeypatch.setattr(static_decode, "step_ops", lambda device, head_dim: failing)
    monkeypatch.setattr(StaticDecoder, "capture_all", lambda self: self.step(self.tokens[:1], self.slots[:1],
                                                                             self.positions[:1], MIN_LENGTH))
    with caplog.at_level("WARNING", logger="model.static_decode"):
        decoder = attach(model, slots=1, max_len=MIN_LENGTH)
    assert decoder.ops is step_ops.TORCH and model.static is decoder
    assert "the Triton kernels failed here" in caplog.text and "no kernel for this GPU" in caplog.text
    monkeypatch.setattr(StaticDecoder, "capture_all", lambda self: broken())
    monkeypatch.setattr(static_decode, "step_ops", lambda device, head_dim: step_ops.TORCH)
    with pytest.raises(RuntimeError, match="no kernel"):  # the torch forms failing is not hidden
        attach(model, slots=1, max_len=MIN_LENGTH)
