"""Speculative decoding (model/speculation.py): rows that share a cache, the guessers, and the rule that
makes a reply the one plain decoding gives."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from support.checkpoints import hf_model
from support.special_checkpoints import default_model

from model import generate, load_checkpoint
from model.kv_cache import KVCache
from model.sampling import Sampler, SamplingParams
from model.speculation import Draft, PromptLookup, Speculation, StepTimes, check


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    hf_model(seed=3).save_pretrained(folder)
    return load_checkpoint(folder, dtype=torch.float32)


@pytest.fixture(scope="module")
def other_tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("other")
    hf_model(seed=4, num_hidden_layers=1).save_pretrained(folder)
    return load_checkpoint(folder, dtype=torch.float32)


@pytest.fixture(scope="module")
def smollm2():
    return load_checkpoint(default_model(), dtype=torch.bfloat16, widen=True)  # its Q4_1 blocks widened to bf16


# ---- rows that share a cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [True, False])
def test_rows_at_consecutive_positions_of_one_cache_equal_decoding_one_at_a_time(tiny, dtype, fused):
    model = tiny.model.to(dtype)
    model.compute_dtype = dtype
    try:
        prompt = list(range(1000, 1040))
        one, many = (KVCache(tiny.config, 64, dtype=dtype) for _ in range(2))
        with torch.inference_mode():
            for cache in (one, many):
                model(torch.tensor([prompt]), kv_cache=cache, last_only=True)
                cache.extend(prompt)
            inputs = [7, 70, 700, 7000, 70000, 17, 170]
            alone = []
            for token in inputs:
                alone.append(model.decode(torch.tensor([token]), [one], fused=fused)[0])
                one.extend([token])
            together = model.decode(torch.tensor(inputs), [many] * len(inputs), fused=fused,
                                    positions=list(range(40, 40 + len(inputs))))
        for a, b in zip(alone, together):
            assert torch.equal(a, b)
        assert torch.equal(one.k[:, :, :, :47], many.k[:, :, :, :47])
    finally:
        model.to(torch.float32)
        model.compute_dtype = torch.float32


def test_a_row_past_the_cache_is_refused(tiny):
    cache = KVCache(tiny.config, 4)
    with pytest.raises(ValueError, match="holds 4 positions"):
        tiny.model.decode(torch.tensor([1, 2]), [cache, cache], positions=[3, 4])


# ---- guessers


def test_prompt_lookup_proposes_what_followed_the_longest_latest_match():
    lookup = PromptLookup(max_ngram=3, min_ngram=1)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 6, 7, 1, 2, 3]
    # "1 2 3" occurred at 0..2 (followed by 4 5 9), "2 3" latest at 6..7 (followed by 6 7): the longest wins
    assert lookup.propose(tokens, 3) == [4, 5, 9]
    assert lookup.propose(tokens + [6], 2) == [7, 1]  # "2 3 6" at 6..8, then 7 1
    assert lookup.propose([5, 6, 7], 4) == []  # another sequence: the index starts again, nothing repeats
    assert PromptLookup(min_ngram=2).propose([1, 2, 1], 3) == []  # one token matching is not enough


def test_prompt_lookup_guesses_little_after_a_match_of_one_token():
    tokens = [4, 1, 5, 6, 7, 8, 9, 1]  # only "1" occurred before: 5 6 7 ... followed it
    assert PromptLookup().propose(tokens, 6) == [5, 6]
    assert PromptLookup(one_token=4).propose(tokens, 6) == [5, 6, 7, 8]
    assert PromptLookup().propose(tokens, 1) == [5]
    assert PromptLookup().propose([4, 1, 5, 6, 7, 8, 9, 4, 1], 6) == [5, 6, 7, 8, 9, 4]  # two tokens: all k


def test_prompt_lookup_grown_a_token_at_a_time_proposes_as_one_built_at_once():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 12, (400,), generator=g).tolist()
    grown = PromptLookup()
    for n in range(2, len(tokens)):
        assert grown.propose(tokens[:n], 5) == PromptLookup().propose(tokens[:n], 5)


def times(per_row: float) -> StepTimes:
    measured = StepTimes()
    for rows in range(1, 9):
        measured.observe(rows, 1.0 + per_row * (rows - 1))
    return measured


class Always:
    cost_per_guess = 0.0
    kinds, kind = (0,), 0

    def propose(self, tokens, k):
        return [0] * k


def test_speculation_guesses_as_many_as_raise_the_tokens_per_second():
    hits = Speculation(Always(), times(0.05))
    for _ in range(5):
        hits.checked(7, 7)  # every guess stood
    assert len(hits.guesses(lambda: [1], 7)) == 7
    assert hits.stood[0] == pytest.approx(35 * Speculation.DECAY)  # a step that guessed: the counts fade faster
    assert len(hits.guesses(lambda: [1], 3)) == 3  # no more than the room
    assert Speculation(Always(), times(0.5)).guesses(lambda: [1], 7) == []  # a guess at 1/2 for half a step: none
    misses = Speculation(Always(), times(0.2))
    for _ in range(5):
        misses.checked(3, 0)  # none stood
    assert misses.guesses(lambda: [1], 7) == []
    assert misses.missed[0] == pytest.approx(5 * Speculation.IDLE_DECAY)  # a step without guesses: a slow fade
    for _ in range(60):  # the misses fade, slowly while it does not guess, and it tries again
        misses.guesses(lambda: [1], 7)
    assert misses.guesses(lambda: [1], 7)
    batched = Speculation(Always(), times(0.2))
    assert batched.guesses(lambda: [1], 7, rows=1, expected=1.0)  # alone, a guess at 1/2 for a fifth of a step pays
    assert batched.guesses(lambda: [1], 1, rows=7, expected=7.0) == []  # beside 6 other streams it would not


def test_a_step_slowed_once_does_not_keep_guesses_off_for_good():
    """One slow step of 8 rows (another server's threads on the cores) made every row count look dear through the
    estimate, and guesses were never made again, so never measured again: it is forgotten after STALE_STEPS."""
    fresh = StepTimes()
    fresh.observe(1, 1.0)
    fresh.observe(8, 100.0)  # the first measure of 8 rows, slowed
    speculation = Speculation(Always(), fresh)
    for _ in range(3):
        speculation.checked(3, 3)  # guesses that stand
    assert speculation.planned(7) == 0  # every row count looks dear
    for _ in range(StepTimes.STALE_STEPS):
        fresh.observe(1, 1.0)  # steps without guesses
    assert 8 not in fresh.seconds and fresh.cost(8) == pytest.approx(1.0 + 7 * StepTimes.PRIOR_ROW_COST)
    assert speculation.planned(7) > 0  # tried again, and measured again


def test_a_long_match_is_guessed_although_single_token_matches_missed():
    """A reply that quotes its prompt: the quote's matches of several tokens stand, the single tokens between
    them miss. Counted together, those misses stopped every guess where a row costs 42% of a step (AVX2)."""
    speculation = Speculation(PromptLookup(), times(0.42))
    for _ in range(4):
        speculation.checked(2, 0)  # single-token matches that missed (the first kind)
    assert speculation.acceptance(0) < 0.2 and speculation.acceptance(1) == 0.5
    assert speculation.guesses(lambda: [1, 2, 3, 4, 1], 7) == []  # a match of one token: not worth a row
    quote = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert speculation.guesses(lambda: quote + [5, 6, 7], 7) == [8]  # a match of three: worth one at 1/2
    speculation.checked(1, 1)
    speculation.checked(1, 1)
    assert speculation.guesses(lambda: quote + [5, 6, 7, 8], 7) == [9, 10]  # more as they stand
    assert speculation.expected(2) == pytest.approx(speculation.acceptance(1) + speculation.acceptance(1) ** 2)
    assert speculation.planned(7) == 2  # the next step is judged by the kind of the last guesses
    assert speculation.guesses(lambda: [1, 2, 3, 4, 1], 7) == []  # single tokens still are not guessed


def test_step_times_estimate_the_rows_not_measured_from_those_that_were():
    measured = StepTimes()
    assert measured.cost(1) == 1.0 and measured.cost(3) == pytest.approx(1.3)  # the prior
    measured.observe(1, 0.010)
    assert measured.cost(2) == pytest.approx(0.0115)
    measured.observe(4, 0.016)
    assert measured.cost(4) == 0.016 and measured.cost(8) == pytest.approx(0.024)
    measured.observe(4, 0.026)  # a moving average
    assert measured.cost(4) == pytest.approx(0.018)
    measured.observe(1, 0.004)  # that falls at once to a faster step
    assert measured.cost(1) == 0.004


# ---- the acceptance rule


class Fixed:
    """A decoding whose every row samples from one distribution (for the statistics of check())."""

    def __init__(self, seed):
        self.sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
        self.tokens = []
        self.finished = False

    def sample(self, logits):
        return self.sampler.sample(logits)

    def accept(self, token):
        self.tokens.append(token)
        return ""


def test_check_keeps_the_distribution_of_plain_sampling():
    """With p = (0.5, 0.3, 0.2) and guesses [0, 1]: the first token is distributed as p whatever was
    guessed; the first guess stands with probability p(0), the second with p(0) p(1)."""
    p = torch.tensor([0.5, 0.3, 0.2])
    logits = p.log().repeat(3, 1)
    n = 6000
    first, lengths = Counter(), Counter()
    for seed in range(n):
        taken = list(check(Fixed(seed), logits, [0, 1]))
        first[taken[0][0]] += 1
        lengths[len(taken)] += 1
    chi2 = sum((first[i] - n * p[i].item()) ** 2 / (n * p[i].item()) for i in range(3))
    assert chi2 < 13.8  # chi-square, 2 degrees of freedom: p = 0.001
    expected = {1: 1 - 0.5, 2: 0.5 * (1 - 0.3), 3: 0.5 * 0.3}
    for length, probability in expected.items():
        assert abs(lengths[length] / n - probability) < 4 * math.sqrt(probability * (1 - probability) / n)


def test_a_seeded_reply_is_the_same_with_and_without_speculation(smollm2, fixed_step_times):
    text = ("The train leaves at nine. The train leaves at nine from platform two. The train leaves at "
            "nine from platform two, every day but Sunday.")
    prompt = smollm2.chat_format.encode_dialog([{"role": "user", "content": f"Repeat this exactly: {text}"}])
    steps = Counter()
    for sampling in (dict(temperature=0.8, top_p=0.9), dict(temperature=1.2, top_k=40),
                     dict(sampling=SamplingParams(temperature=0.7, repetition_penalty=1.1, min_p=0.05))):
        for seed in range(3):
            replies = [generate(smollm2, prompt, max_new_tokens=60, seed=seed, speculate=s, **sampling)
                       for s in ("off", "auto")]
            texts = ["".join(reply) for reply in replies]
            assert texts[0] == texts[1] and replies[0].tokens == replies[1].tokens
            steps["off"] += replies[0].stats.decode_steps
            steps["auto"] += replies[1].stats.decode_steps
    assert steps["auto"] < steps["off"]  # some guesses stood (a sampled reply repeats its prompt less)
    nine = smollm2.tokenizer.encode(" nine")[0]  # banned: each guess of the prompt's " nine" must be refused
    replies = [generate(smollm2, prompt, max_new_tokens=40, speculate=s,
                        sampling=SamplingParams(logit_bias=((nine, -100.0),))) for s in ("off", "auto")]
    assert "".join(replies[0]) == "".join(replies[1]) and replies[0].tokens == replies[1].tokens
    assert nine not in replies[0].tokens and replies[1].stats.guesses > 0


# ---- the library


def test_greedy_prompt_lookup_gives_the_plain_reply_in_fewer_steps(smollm2, fixed_step_times):
    paragraph = ("Teh quick brown fox jumpd over the lazzy dog. It was a sunny day and the fox was verry "
                 "happy. The dog did not care, it just slept under the tree all day long.")
    prompt = smollm2.chat_format.encode_dialog(
        [{"role": "user", "content": f"Fix the spelling in this paragraph and give it back in full:\n\n{paragraph}"}])
    off = generate(smollm2, prompt, max_new_tokens=80, speculate="off")
    auto = generate(smollm2, prompt, max_new_tokens=80)  # "auto" is the default
    assert "".join(off) == "".join(auto) and off.tokens == auto.tokens
    assert off.stats.tokens_per_step == 1.0 and off.stats.guesses == 0
    assert auto.stats.tokens_per_step > 2.0
    assert auto.stats.decoded_tokens == off.stats.decoded_tokens  # one per token, the stop token too


def test_a_model_drafting_for_itself_has_every_guess_accepted(tiny, fixed_step_times, monkeypatch):
    monkeypatch.setattr(Draft, "cost_per_guess", 0.0)  # else a draft as slow as the model is never asked
    prompt = list(range(2000, 2030))
    plain = generate(tiny, prompt, max_new_tokens=40, speculate="off")
    drafted = generate(tiny, prompt, max_new_tokens=40, speculate=tiny)
    assert "".join(plain) == "".join(drafted) and plain.tokens == drafted.tokens
    s = drafted.stats
    assert s.guesses > 0 and s.decoded_tokens - s.decode_steps == s.guesses  # every guess stood


def test_another_random_draft_changes_nothing(tiny, other_tiny, fixed_step_times, monkeypatch):
    monkeypatch.setattr(Draft, "cost_per_guess", 0.0)
    prompt = list(range(3000, 3030))
    plain = generate(tiny, prompt, max_new_tokens=40, speculate="off")
    drafted = generate(tiny, prompt, max_new_tokens=40, speculate=other_tiny)
    assert "".join(plain) == "".join(drafted) and plain.tokens == drafted.tokens
    assert drafted.stats.guesses > 0


def test_a_draft_with_another_tokenizer_is_refused(tiny, smollm2):
    with pytest.raises(ValueError, match="cannot draft for .*: their vocabularies differ"):
        generate(tiny, [1, 2, 3], speculate=smollm2)
    with pytest.raises(ValueError, match="speculate='sometimes'"):
        generate(tiny, [1, 2, 3], speculate="sometimes")


def test_a_draft_keeps_its_cache_in_step(tiny):
    draft = Draft(tiny, 64)
    tokens = list(range(100, 120))
    first = draft.propose(tokens, 4)
    assert draft.cache.tokens == tokens + first[:3]
    # The sequence took two of the guesses and then another token: the draft keeps what agrees.
    grown = tokens + first[:2] + [5]
    assert draft.propose(grown, 3) == Draft(tiny, 64).propose(grown, 3)
    assert len(Draft(tiny, 64).propose(list(range(62)), 10)) == 2  # no more than its cache holds


@pytest.mark.parametrize("options", [{"quantize": "int8", "widen": True}, {"quantize": "int4", "widen": True}, {}],
                         ids=["int8", "int4", "q4_1-blocks"])  # {}: the default model's own blocks, as served
def test_quantized_weights_give_the_plain_reply_too(options, fixed_step_times):
    checkpoint = load_checkpoint(default_model(), dtype=torch.bfloat16, **options)
    text = "Quote exactly: the river runs past the old mill, and fishermen wait by the river before dawn."
    prompt = checkpoint.chat_format.encode_dialog([{"role": "user", "content": text}])
    off = generate(checkpoint, prompt, max_new_tokens=40, speculate="off")
    auto = generate(checkpoint, prompt, max_new_tokens=40)
    assert "".join(off) == "".join(auto) and off.tokens == auto.tokens
    assert auto.stats.guesses > 0


def test_a_draft_that_costs_as_much_as_the_model_steps_aside(tiny):
    prompt = list(range(4000, 4030))
    drafted = generate(tiny, prompt, max_new_tokens=40, speculate=tiny)
    plain = generate(tiny, prompt, max_new_tokens=40, speculate="off")
    assert "".join(drafted) == "".join(plain)
    s = drafted.stats
    assert s.guesses < s.decode_steps  # after its first guesses its time is known: few, or none, follow
