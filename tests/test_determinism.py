"""The same answer every time: a reply at temperature 0 (and its logprobs, which come from the fp32
logits) does not depend on what the prefix cache holds, on what else is in the batch, on how prefill
is spread over the engine's steps, or on the number of threads; on the default model (real weights: its
Q4_1 blocks as served, and widened to bf16) and on random Llama 3 shapes, in bf16 and fp32, through each
build of the decode kernel."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.checkpoints import hf_model
from support.engine import EngineHarness, last, request
from support.kernels import configured
from support.special_checkpoints import default_model

import model.checkpoint
import model.decode_step
import model.kernels
import model.linear
from app.backend.conversation import Conversation
from app.messages import Done, ReplySettings, Text
from model import KVCache, load_checkpoint
from model.kernels import KernelBuildError, build
from model.kv_cache import PREFILL_CHUNK
from model.options import ModelOptions
from model.linear import MAX_KERNEL_ROWS

pytestmark = pytest.mark.timeout(900)

# 16 tokens a reply: every token's logprobs are compared bit for bit, so a difference shows at the step it comes
# in (a cache taken whole where only whole chunks may be, or a batch sent to the unfused layers, fail here as with 32)
GREEDY = ReplySettings(max_new_tokens=16, temperature=0.0, repetition_penalty=1.0)
SEEDED = ReplySettings(max_new_tokens=16, temperature=0.8, top_p=0.95, seed=11)
QUESTIONS = ["What is the capital of France?", "How do I boil an egg?", "Write a haiku about autumn.",
             "What is the difference between a list and a tuple in Python?", "Why is the sky blue?",
             "Give me three tips for sleeping better."]
LONG_SYSTEM = "You are a helpful assistant. " + " ".join(f"Rule {i}: answer clearly, briefly and kindly."
                                                         for i in range(PREFILL_CHUNK // 10))
# (about 12 tokens a rule: a whole prefill chunk and part of another, 256 or 512 tokens a chunk)


def chat(*texts: str, system: str | None = None) -> Conversation:
    conversation = Conversation(system_prompt=system)
    for i, text in enumerate(texts):
        conversation.add("user" if i % 2 == 0 else "assistant", text)
    return conversation


class Asker:
    """An engine in this process on one loaded checkpoint: `ask` runs conversations together and gives
    each reply's (token ids, logprobs of every token with its two best alternatives)."""

    def __init__(self, folder: Path, checkpoint, **config):
        self.name = folder.name
        self.harness = EngineHarness(folder, loader=lambda name, path: checkpoint, **config)

    def ask(self, conversations: list[Conversation], settings: ReplySettings = GREEDY) -> list[tuple]:
        requests = [request(c, settings, model=self.name, logprobs=2) for c in conversations]
        events = self.harness.ask(*requests)
        replies = []
        for r in requests:
            done = last(events[r.id])
            assert isinstance(done, Done), done
            logprobs = [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top])
                        for e in events[r.id] if isinstance(e, Text) for t in e.logprobs]
            replies.append((done.token_ids, logprobs, done.stats.reused_tokens))
        return replies

    def one_by_one(self, conversations: list[Conversation], settings: ReplySettings = GREEDY) -> list[tuple]:
        return [self.ask([c], settings)[0] for c in conversations]


def same(a: list[tuple], b: list[tuple]) -> list[int]:
    """Indices of the replies whose tokens or logprobs differ (reuse counts aside)."""
    return [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x[:2] != y[:2]]


@pytest.fixture(scope="module", params=["served", "served-q8", "bf16"])
def default_model_as(request):
    """The default model as the engine serves it on this CPU (its Q4_1 blocks where the decode kernel runs,
    bf16 activations where the CPU has them), the same with a q8 KV cache (LLAMA_KV_TYPE=q8), and widened to
    bf16 (as served without the kernel)."""
    folder = default_model()
    if request.param == "served":
        return folder, load_checkpoint(folder, widen="auto")  # as app/engine/core.py loads it
    if request.param == "served-q8":
        return folder, load_checkpoint(folder, widen="auto", kv_type="q8")
    return folder, load_checkpoint(folder, dtype=torch.bfloat16, widen=True)


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


# ---- the default model ----------------------------------------------------------------------------

def test_everyday_questions_get_the_same_answers_fresh_cached_and_together(default_model_as, threads):
    """Each question alone on an engine that keeps no cache; then twice in a row on one that does (the
    second time the whole prompt is in the cache); then all six at once, in a batch of four (two wait, then
    join as others end); then alone with one thread."""
    folder, checkpoint = default_model_as
    conversations = [chat(q) for q in QUESTIONS]
    threads(2)
    fresh = Asker(folder, checkpoint, kv_cache_mb=0).one_by_one(conversations)
    caching = Asker(folder, checkpoint, max_batch=4)
    first, second = caching.one_by_one(conversations), caching.one_by_one(conversations)
    together = caching.ask(conversations)  # 6 > max_batch 4: two wait, then join as others end
    threads(1)
    one_thread = Asker(folder, checkpoint, kv_cache_mb=0).one_by_one(conversations)
    assert len({tuple(tokens) for tokens, _, _ in fresh}) == len(QUESTIONS)  # six different answers
    assert same(fresh, first) == same(fresh, second) == same(fresh, together) == same(fresh, one_thread) == []


def test_follow_ups_and_a_shared_system_prompt_get_the_same_answers_as_on_a_fresh_engine(default_model_as):
    """Chats sharing a long system prompt, then a follow-up of each (their replies in the prompt): on one
    engine, taking kept caches, against an engine that computes every prompt from its start."""
    folder, checkpoint = default_model_as
    caching, fresh = Asker(folder, checkpoint), Asker(folder, checkpoint, kv_cache_mb=0)
    firsts = [chat(q, system=LONG_SYSTEM) for q in QUESTIONS[:3]]
    cached_firsts = caching.one_by_one(firsts)
    assert same(cached_firsts, fresh.one_by_one(firsts)) == []
    assert all(reused > 0 for _, _, reused in cached_firsts[1:])  # the system prompt's whole chunks
    follow_ups = []
    for conversation, (tokens, _, _) in zip(firsts, cached_firsts):
        conversation.add("assistant", checkpoint.tokenizer.decode(tokens), ids=tokens)
        conversation.add("user", "Tell me more, please.")
        follow_ups.append(conversation)
    cached = caching.ask(follow_ups)
    assert all(reused >= PREFILL_CHUNK for _, _, reused in cached)
    assert same(cached, fresh.one_by_one(follow_ups)) == []


def test_a_seeded_reply_is_the_same_fresh_cached_and_together(default_model_as):
    folder, checkpoint = default_model_as
    conversations = [chat(q, system=LONG_SYSTEM) for q in QUESTIONS[:4]]
    fresh = Asker(folder, checkpoint, kv_cache_mb=0).one_by_one(conversations, SEEDED)
    caching = Asker(folder, checkpoint)
    assert same(fresh, caching.one_by_one(conversations, SEEDED)) == []
    assert same(fresh, caching.ask(conversations, SEEDED)) == []


# ---- random Llama 3 shapes --------------------------------------------------------------------------

SHAPES = {  # hidden size, heads, KV heads, head_dim (hidden / heads), FFN: tails of the kernel's loops included
    "gqa-16": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=192),
    "mqa-32": dict(hidden_size=96, num_attention_heads=3, num_key_value_heads=1, intermediate_size=200),
    "mha-64": dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, intermediate_size=352),
    "gqa-128": dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, intermediate_size=688),
    "odd-80": dict(hidden_size=80, num_attention_heads=1, num_key_value_heads=1, intermediate_size=136),
}


@pytest.fixture(scope="module", params=list(SHAPES))
def random_folder(request, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("shapes") / request.param
    hf_model(seed=3, num_hidden_layers=2, **SHAPES[request.param]).save_pretrained(folder)
    return folder


def prompts() -> list[Conversation]:
    """Prompts of one chunk or less, of several chunks, and sharing a start of whole chunks."""
    words = "the quick brown fox jumps over the lazy dog and keeps running far away ".split()
    long = " ".join(words[i % len(words)] for i in range(PREFILL_CHUNK + 90))
    return [chat("Hello there"), chat("Count to ten"), chat(long + " First?"), chat(long + " Second?"),
            chat(long + " " + long + " Third?"), chat("Hi", system=long)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_random_shapes_answer_the_same_fresh_cached_together_and_on_one_thread(random_folder, dtype, threads):
    checkpoint = load_checkpoint(random_folder, dtype=dtype)
    conversations = prompts()
    threads(2)
    fresh = Asker(random_folder, checkpoint, kv_cache_mb=0).one_by_one(conversations)
    caching = Asker(random_folder, checkpoint, max_batch=4)
    first = caching.one_by_one(conversations)
    second = caching.one_by_one(conversations)
    together = caching.ask(conversations)  # several prompts prefilling in the same steps, two waiting
    threads(1)
    alone = Asker(random_folder, checkpoint, kv_cache_mb=0).one_by_one(conversations)
    assert max(reused for _, _, reused in second) >= PREFILL_CHUNK  # the cache was used
    assert same(fresh, first) == same(fresh, second) == same(fresh, together) == same(fresh, alone) == []


# ---- each build of the decode kernel ------------------------------------------------------------------

def builds() -> list[str]:
    found = []
    for march in ("native", "znver3", "x86-64"):  # this CPU's best, AVX2, plain loops
        try:
            build(march)
            found.append(march)
        except KernelBuildError:
            pass
    return found


@pytest.mark.parametrize("march", builds())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32-activations"])
@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_a_decode_step_gives_each_sequence_the_same_logits_alone_or_in_a_batch(monkeypatch, batch_folder, march, dtype,
                                                                               quantize):
    """The fused decode step and the output head of each kernel build: sequences at different positions
    (past a piece of the attention's split), decoded alone and in batches of 2 to 8, bit for bit."""
    ops = build(march).ops

    class Counting:  # the build's ops, counting the fused steps
        count = 0

        def __getattr__(self, name):
            return getattr(ops, name)

        def decode_layers(self, *args):
            Counting.count += 1
            return ops.decode_layers(*args)

    decoded = Counting()
    monkeypatch.setattr(model.linear, "kernels", lambda: ops)
    monkeypatch.setattr(model.decode_step, "kernels", lambda: decoded)
    monkeypatch.setattr(model.checkpoint, "has_native_bf16", lambda: dtype == torch.bfloat16)
    net = load_checkpoint(batch_folder, dtype=torch.bfloat16, quantize=quantize).model  # matrices bf16 or quantized
    torch.manual_seed(0)
    assert net.compute_dtype == dtype
    lengths = [3, 40, 300, 17, 5, 260, 90, 1]
    caches = []
    for n in lengths:
        cache = KVCache(net.config, n + 1, dtype=net.compute_dtype)
        with torch.inference_mode():
            net(torch.randint(0, 1000, (1, n)), 0, cache, last_only=True)
        cache.tokens = [0] * n  # each step below writes position n again: every call sees the same inputs
        caches.append(cache)
    tokens = torch.randint(0, 1000, (MAX_KERNEL_ROWS,))

    def step(rows: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return net.decode(tokens[rows], [caches[r] for r in rows])

    alone = {r: step([r]) for r in range(MAX_KERNEL_ROWS)}
    assert alone[0].dtype == torch.float32
    for size in range(2, MAX_KERNEL_ROWS + 1):
        rows = list(range(MAX_KERNEL_ROWS))[-size:]
        together = step(rows)
        for i, r in enumerate(rows):
            assert torch.equal(together[i:i + 1], alone[r]), (march, size, r)
    assert decoded.count == len(lengths) + MAX_KERNEL_ROWS - 1  # every step took the fused op


@pytest.fixture(scope="module")
def batch_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("batch")
    hf_model(seed=4, num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=352).save_pretrained(folder)
    return folder


def test_llama_deterministic_keeps_int8_batches_out_of_amx_tiles():
    """LLAMA_DETERMINISTIC=1, read as a process reads it (model.options, then model.kernels.configure, as the
    engine's main does): the kernel build has its int8 tiles switched off (csrc/matvec.cpp); without it they are
    on where the build has them (AMX CPUs; elsewhere the switch always reads off)."""
    def tiles_were_on(environ: dict) -> tuple[bool, bool]:
        with configured(**ModelOptions.from_env(environ).kernel_options):
            ops = model.kernels.kernels()
            return ops.set_amx_int8(True), "AMX" in ops.path()

    was, amx = tiles_were_on({"LLAMA_DETERMINISTIC": "1"})
    assert was is False
    was, amx = tiles_were_on({"LLAMA_DETERMINISTIC": "off"})
    assert was == amx  # on where the build takes int8 batches in tiles
