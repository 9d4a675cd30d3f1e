"""Sampling: greedy, temperature, top-k, top-p, min-p, penalties, seeds and logprobs."""

import math

import numpy as np
import pytest
import torch

from model.sampling import (QuotedRuns, Sampler, SamplingParams, filtered, host_sample, kept, make_generator, race,
                            sample, token_logprobs, top, uniforms)


def logits_fixture(vocab=1000, seed=0):
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_temperature_zero_is_argmax():
    for seed in range(20):
        logits = logits_fixture(seed=seed)
        assert int(sample(logits, temperature=0.0)) == int(logits.argmax())
    ties = torch.tensor([1.0, 3.0, -2.0, 3.0, 3.0]).bfloat16()  # bf16 logits often tie: the first of them
    assert int(sample(ties, temperature=0.0)) == 1


def test_top_k_never_leaves_the_top_k():
    logits = logits_fixture()
    top = set(torch.topk(logits, 5).indices.tolist())
    g = make_generator(1)
    drawn = {int(sample(logits, temperature=5.0, top_k=5, generator=g)) for _ in range(2000)}
    assert drawn <= top and len(drawn) == 5  # a high temperature reaches every one of the five


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    g = make_generator(2)
    drawn = [int(sample(logits, temperature=1.0, top_p=0.8, generator=g)) for _ in range(3000)]
    assert set(drawn) == {0, 1}  # 0.5 + 0.3 reaches 0.8; token 2 is outside the nucleus
    share = drawn.count(0) / len(drawn)
    assert abs(share - 0.5 / 0.8) < 0.04  # renormalized inside the nucleus
    # A nucleus smaller than the top token still keeps the top token.
    assert {int(sample(logits, 1.0, top_p=0.1, generator=g)) for _ in range(200)} == {0}


def test_top_k_and_top_p_together():
    logits = torch.tensor([2.0, 1.9, 1.8, 0.0, -1.0])
    g = make_generator(3)
    drawn = {int(sample(logits, 1.0, top_k=4, top_p=0.5, generator=g)) for _ in range(2000)}
    assert drawn == {0, 1}


def test_sampling_follows_the_distribution():
    logits = torch.tensor([0.0, 1.0, 2.0])
    g = make_generator(4)
    counts = torch.bincount(torch.stack([sample(logits, 1.0, generator=g) for _ in range(6000)]), minlength=3)
    expected = torch.softmax(logits, 0) * 6000
    assert ((counts - expected).abs() / expected).max() < 0.1


def test_seed_reproducibility():
    logits = logits_fixture()
    a = [int(sample(logits, 1.0, top_k=50, generator=g)) for g in [make_generator(7)] for _ in range(50)]
    b = [int(sample(logits, 1.0, top_k=50, generator=g)) for g in [make_generator(7)] for _ in range(50)]
    c = [int(sample(logits, 1.0, top_k=50, generator=g)) for g in [make_generator(8)] for _ in range(50)]
    assert a == b and a != c


# ---- The CPU's way (host_sample: the filters near the top, a race keyed by token id) against the GPU's (tensor ops) ----------

def kept_by_tensor_ops(logits: torch.Tensor, top_k, top_p, min_p) -> set[int]:
    values, ids = filtered(logits, top_k, top_p, min_p)
    positions = torch.isfinite(values).nonzero().flatten()
    return set((positions if ids is None else ids[positions]).tolist())


def mass_before(logits: torch.Tensor, top_k) -> dict[int, float]:
    """Each token's probability mass above it (top-k's set, or all, at temperature 1), in float64 from a full sort:
    where top-p's cut falls."""
    values, ids = torch.sort(logits.double(), descending=True, stable=True)
    if top_k:
        values, ids = values[:top_k], ids[:top_k]
    probs = torch.softmax(values, dim=0)
    return dict(zip(ids.tolist(), (torch.cumsum(probs, 0) - probs).tolist()))


@pytest.mark.parametrize("vocab, scale", [(1000, 3.0), (128256, 4.0)])
@pytest.mark.parametrize("top_k, top_p, min_p", [
    (0, 0.9, 0.0), (0, 0.5, 0.0), (0, 0.99, 0.0), (0, 0.9, 0.05), (0, 1.0, 0.05), (0, 1.0, 0.2),
    (40, 1.0, 0.0), (40, 0.9, 0.0), (40, 0.9, 0.05), (5, 0.3, 0.0), (2000, 0.95, 0.0), (0, 1.0, 0.0),
])
def test_the_cpus_filters_keep_what_the_gpus_keep(vocab, scale, top_k, top_p, min_p):
    """The same tokens, found among the tokens near the top (the CPU) and by sorting all (the GPU), but where
    top-p's cut falls within the rounding of the GPU's float32 sums (1e-4 of the mass, over 128,256 tokens)."""
    for seed in range(2):
        logits = torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale
        logits[::7] -= 20.0  # a long tail, as a model's logits have
        ids, values = kept(logits.numpy(), top_k, top_p, min_p)
        assert len(set(ids.tolist())) == len(ids) and np.array_equal(values, logits.numpy()[ids])
        differ = set(ids.tolist()) ^ kept_by_tensor_ops(logits, top_k, top_p, min_p)
        if differ:
            assert top_p < 1.0
            before = mass_before(logits, top_k)
            assert max(abs(before[t] - top_p) for t in differ) < 1e-4, differ
        if top_p < 1.0:  # the float64 nucleus, but within the rounding of float32 exps (1e-6)
            before = mass_before(logits, top_k)
            inside = {t for t, m in before.items() if m < top_p}
            if min_p:
                inside = {t for t in inside if logits[t] >= logits.max() + math.log(min_p)}
            assert all(abs(before[t] - top_p) < 2e-6 for t in set(ids.tolist()) ^ inside)


def test_the_cpus_filters_never_keep_a_masked_token():
    logits = torch.full((5000,), -math.inf)
    logits[[3, 700, 4999]] = torch.tensor([1.0, 0.5, -2.0])  # what a constraint allows
    for top_k, top_p, min_p in [(40, 1.0, 0.0), (0, 0.999, 0.0), (0, 1.0, 0.01), (10, 0.99, 0.001)]:
        ids, _ = kept(logits.numpy(), top_k, top_p, min_p)
        assert set(ids.tolist()) <= {3, 700, 4999} and 3 in ids
    g = make_generator(1)
    assert {int(sample(logits, 1.0, top_k=40, generator=g)) for _ in range(300)} == {3, 700, 4999}


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-40])
def test_a_temperature_near_zero_is_greedy(temperature):
    logits = logits_fixture(vocab=128256, seed=4)
    for top_k, top_p, min_p in [(0, 1.0, 0.0), (40, 0.9, 0.05)]:
        assert int(sample(logits, temperature, top_k, top_p, make_generator(1), min_p)) == int(logits.argmax())


def test_top_is_the_k_largest():
    x = (torch.randn(128256, generator=torch.Generator().manual_seed(5)) * 3).numpy()
    for k in (1, 40, 5000, 128255):
        assert set(top(x, k).tolist()) == set(torch.topk(torch.from_numpy(x), k).indices.tolist())


@pytest.mark.parametrize("n", [7, 5000])
def test_the_keyed_race_draws_in_proportion_to_the_weights(n):
    """Over 40,000 keys each index wins about as often as its weight says (within 5 standard deviations of the
    binomial count), a zero weight never; the shortcut (logarithms only near the top score) picks what the race
    over all tokens picks; the uniform numbers lie in (0, 1) with mean 1/2."""
    weights = (torch.rand(n, generator=torch.Generator().manual_seed(n)) ** 4).numpy()
    weights[::3] = 0.0
    weights[1] = 1.0
    ids = np.arange(n) * 7 + 11  # any token ids
    keys = [k * 0x9E3779B97F4A7C15 % 2**63 for k in range(40_000)]
    wins = np.bincount([race(key, ids, weights) for key in keys], minlength=n)
    p = weights.astype(np.float64) / weights.sum(dtype=np.float64)
    assert np.all(np.abs(wins - len(keys) * p) <= 5 * np.sqrt(len(keys) * p * (1 - p)) + 1)
    assert wins[::3].sum() == 0
    for key in keys[:300]:
        assert race(key, ids, weights) == np.argmax(weights / -np.log(uniforms(key, ids)))
    u = np.concatenate([uniforms(key, ids) for key in keys[:200]])
    assert u.min() > 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.01


def test_logits_that_differ_in_the_last_bits_draw_the_same_tokens():
    """A batched step's logits and a single step's differ by float32 rounding: over 128,256 near-equal logits
    (a flat distribution, top-p keeping tens of thousands) the seeded draws stay the same. (A walk over the
    kept tokens' running sums, in their order of likelihood, parted on 16 of these 40 seeds.)"""
    logits = torch.randn(128256, generator=torch.Generator().manual_seed(3)) * 0.1
    nudged = logits + torch.randn(128256, generator=torch.Generator().manual_seed(4)) * 1e-6
    for top_p in (1.0, 0.9):
        for seed in range(40):
            assert (host_sample(logits, 1.0, 0, top_p, make_generator(seed))
                    == host_sample(nudged, 1.0, 0, top_p, make_generator(seed))), (top_p, seed)


def test_a_token_at_a_filters_edge_turns_the_draw_only_where_it_would_have_won():
    """The race's noise belongs to (key, token id): the same draw with one more or one fewer losing token kept
    (a top-p cut moved by a last-bit change in the logits) picks the same token, so a seeded reply repeats
    between a batched step and a single one."""
    logits = logits_fixture(vocab=128256, seed=9)
    for seed in range(30):
        chosen = host_sample(logits, 1.0, 0, 0.9, make_generator(seed))
        ids, _ = kept(logits.numpy(), 0, 0.9, 0.0)
        edge = ids[np.argmin(logits.numpy()[ids])]  # the last token top-p kept
        if edge != chosen:
            nudged = logits.clone()
            nudged[edge] -= 1e-3  # now the cut leaves it out and keeps another
            assert edge not in kept(nudged.numpy(), 0, 0.9, 0.0)[0]
            assert host_sample(nudged, 1.0, 0, 0.9, make_generator(seed)) == chosen


# ---- SamplingParams and Sampler: penalties (llama.cpp / OpenAI), min-p, order, seeds, logprobs -----

def test_params_reject_bad_values_naming_the_parameter():
    for bad in ({"temperature": -0.1}, {"top_k": -1}, {"top_k": 2.5}, {"top_p": 0.0}, {"top_p": 1.5},
                {"min_p": 1.2}, {"repetition_penalty": 0.0}, {"frequency_penalty": 2.5},
                {"presence_penalty": float("nan")}, {"penalty_last_n": -2}, {"seed": "7"}):
        name = next(iter(bad))
        with pytest.raises(ValueError, match=f"{name}="):
            SamplingParams(**bad)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_recent_tokens():
    sampler = Sampler(SamplingParams(repetition_penalty=2.0))
    sampler.accept([0, 1, 4, 0])
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0])
    assert sampler.penalized(logits).tolist() == [1.0, -2.0, 0.5, 3.0, 0.0]  # once per token, however often
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0, 0.0]  # the caller's logits are left alone


def test_repetition_penalty_follows_the_last_n_window_prompt_included():
    logits = torch.tensor([2.0, 2.0, 2.0, 2.0])
    sampler = Sampler(SamplingParams(repetition_penalty=2.0, penalty_last_n=2))
    sampler.accept([0, 1])  # the prompt
    assert sampler.penalized(logits).tolist() == [1.0, 1.0, 2.0, 2.0]
    sampler.sample(logits)
    sampler.accept([2])  # a generated token pushes the oldest prompt token out
    assert sampler.penalized(logits).tolist() == [2.0, 1.0, 1.0, 2.0]
    sampler.accept([3])
    assert sampler.penalized(logits).tolist() == [2.0, 2.0, 1.0, 1.0]
    everything = Sampler(SamplingParams(repetition_penalty=2.0, penalty_last_n=-1))
    everything.accept([0, 1, 2, 3])
    assert everything.penalized(logits).tolist() == [1.0, 1.0, 1.0, 1.0]
    off = Sampler(SamplingParams(repetition_penalty=2.0, penalty_last_n=0))
    off.accept([0, 1])
    assert off.penalized(logits).tolist() == logits.tolist()


def test_frequency_and_presence_penalties_count_generated_tokens_only():
    sampler = Sampler(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, penalty_last_n=2))
    sampler.accept([0, 0, 3])  # the prompt does not count
    logits = torch.zeros(4)
    assert sampler.penalized(logits).tolist() == [0.0, 0.0, 0.0, 0.0]
    sampler.sample(logits)
    sampler.accept([1, 1, 2, 1])  # no window either: every generated token counts
    assert sampler.penalized(logits).tolist() == [0.0, -(3 * 0.5 + 0.25), -(0.5 + 0.25), 0.0]


def test_quoted_runs_give_every_id_that_follows_a_run_of_the_prompt():
    runs = QuotedRuns([5, 6, 7, 8, 1, 5, 6, 7, 9, 5, 6, 7], run=3)
    assert sorted(runs.after([5, 6, 7]).tolist()) == [8, 9]  # the last run has nothing after it
    assert runs.after([0, 6, 7, 8]).tolist() == [1]  # the last `run` ids count
    assert runs.after([7, 8, 5]).tolist() == []  # not a run of the prompt
    assert runs.after([6, 7]).tolist() == []  # fewer ids than a run
    assert runs.after([5, 6, 1 << 40]).tolist() == []  # an id past any of the prompt's (and past 32 bits)
    assert runs.after([-1, 5, 6]).tolist() == []
    assert QuotedRuns([1, 2, 3], run=3).after([1, 2, 3]).tolist() == []  # a prompt no longer than a run
    assert QuotedRuns([], run=3).after([1, 2, 3]).tolist() == []
    # Llama 3's largest ids (17 bits each, 51 bits a run) pack without colliding with small ones
    big = [128_255, 128_254, 128_253, 7, 1, 2, 3, 8]
    assert QuotedRuns(big, run=3).after([128_255, 128_254, 128_253]).tolist() == [7]
    assert QuotedRuns(big, run=3).after([1, 2, 3]).tolist() == [8]


def test_repetition_penalty_spares_a_token_that_continues_a_quote_of_the_prompt():
    logits = torch.full((10,), 2.0)
    sampler = Sampler(SamplingParams(repetition_penalty=2.0))
    sampler.accept([1, 2, 3, 4, 5])  # the prompt
    sampler.sample(logits)
    sampler.accept([2, 3])  # the reply quotes the prompt: 1 2 3 | 2 3 is no run of it yet
    assert sampler.penalized(logits).tolist() == [2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    sampler.accept([4])  # 2 3 4 is: the prompt's next id, 5, is spared; the rest are penalized
    assert sampler.penalized(logits).tolist() == [2.0, 1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    sampler.accept([5])  # the quote reached the prompt's end: every recent id is penalized again
    assert sampler.penalized(logits).tolist() == [2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0]


def test_repetition_penalty_still_penalizes_a_reply_that_repeats_itself():
    logits = torch.full((10,), 2.0)
    sampler = Sampler(SamplingParams(repetition_penalty=2.0))
    sampler.accept([1, 2, 3])  # the prompt
    sampler.sample(logits)
    sampler.accept([7, 8, 9, 7, 8, 9])  # a loop of the reply's own: 8 9 7 is no run of the prompt
    assert sampler.penalized(logits).tolist() == [2.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 1.0, 1.0, 1.0]
    # a prompt token the reply met again by chance, not quoting, stays penalized too
    sampler.accept([1])
    assert sampler.penalized(logits)[1] == 1.0


def test_a_quote_of_the_prompt_survives_a_penalty_that_would_change_it():
    # The prompt 1 2 3 4 5; the model prefers to quote it (4 after 1 2 3, then 5), and token 9 comes a close
    # second. With llama.cpp's penalty 4 and 5, both in the window, would lose to 9.
    def logits(last: int) -> torch.Tensor:
        out = torch.zeros(10)
        out[9] = 2.0
        out[last + 1 if last < 5 else 0] = 3.0
        return out
    sampler = Sampler(SamplingParams(repetition_penalty=2.0))
    sampler.accept([1, 2, 3, 4, 5, 0, 1, 2, 3])  # the prompt ends "... 1 2 3", quoting its own start
    reply = []
    for _ in range(2):
        token = sampler.sample(logits(([3] + reply)[-1]))
        sampler.accept([token])
        reply.append(token)
    assert reply == [4, 5]


def test_repetition_and_frequency_penalties_combine_in_llama_cpp_order():
    sampler = Sampler(SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0))
    sampler.sample(torch.zeros(2))
    sampler.accept([0, 0])
    # (4 / 2) - 2 * 1: the repetition penalty scales first, the additive penalties follow.
    assert sampler.penalized(torch.tensor([4.0, 4.0])).tolist() == [0.0, 4.0]


def test_greedy_applies_the_penalties():
    logits = torch.tensor([3.0, 2.0, -1.0])
    plain = Sampler(SamplingParams())
    plain.accept([0])
    assert plain.sample(logits) == 0
    penalized = Sampler(SamplingParams(repetition_penalty=2.0))
    penalized.accept([0])
    assert penalized.sample(logits) == 1  # 3 / 2 < 2


def test_min_p_is_relative_to_the_top_probability_before_temperature():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    g = make_generator(5)
    assert {int(sample(logits, 1.0, min_p=0.25, generator=g)) for _ in range(2000)} == {0, 1, 2}
    assert {int(sample(logits, 1.0, min_p=0.5, generator=g)) for _ in range(2000)} == {0, 1}
    # After temperature 2 token 2 would hold 0.55 of the top probability and pass min_p=0.5;
    # llama.cpp filters first, so it stays out.
    assert {int(sample(logits, 2.0, min_p=0.5, generator=g)) for _ in range(2000)} == {0, 1}


def test_top_p_is_measured_before_temperature():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    g = make_generator(6)
    # At temperature 3 the top two hold only 0.62 of the mass (nucleus {0, 1, 2} after temperature);
    # before temperature they hold 0.8, so the nucleus is {0, 1}.
    assert {int(sample(logits, 3.0, top_p=0.8, generator=g)) for _ in range(3000)} == {0, 1}


def test_min_p_keeps_the_probabilities_of_what_it_keeps():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    g = make_generator(9)
    drawn = [int(sample(logits, 1.0, min_p=0.5, generator=g)) for _ in range(4000)]
    assert abs(drawn.count(0) / len(drawn) - 0.5 / 0.8) < 0.04


def test_a_seeded_sampler_repeats_and_another_seed_differs():
    def draws(seed):
        sampler = Sampler(SamplingParams(temperature=1.0, top_k=50, repetition_penalty=1.3, seed=seed))
        sampler.accept([1, 2, 3])
        tokens = []
        for step in range(60):
            token = sampler.sample(logits_fixture(seed=step % 3))
            sampler.accept([token])
            tokens.append(token)
        return tokens

    assert draws(11) == draws(11)
    assert draws(11) != draws(12)


def test_token_logprobs_are_the_models_own_distribution():
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    expected = torch.log_softmax(logits, dim=0)
    chosen, top = token_logprobs(logits, 2, top_n=3)
    assert chosen == pytest.approx(float(expected[2]))
    assert [i for i, _ in top] == [1, 2, 0]
    assert [lp for _, lp in top] == pytest.approx([float(expected[i]) for i in (1, 2, 0)])
    assert token_logprobs(logits, 3, top_n=0) == (pytest.approx(float(expected[3])), [])
    assert len(token_logprobs(logits, 0, top_n=20)[1]) == 4  # at most the whole vocabulary


def test_logit_bias_is_added_before_the_penalties_and_bans_or_forces_tokens():
    logits = torch.tensor([3.0, 2.0, -1.0, 0.5])
    biased = Sampler(SamplingParams(repetition_penalty=2.0, logit_bias=((1, 4.0), (3, -0.5))))
    biased.accept([1])
    # token 1: (2 + 4) / 2, the bias first, then the repetition penalty (llama.cpp's chain); token 3: 0.5 - 0.5
    assert biased.penalized(logits).tolist() == [3.0, 3.0, -1.0, 0.0]
    assert biased.sample(logits) == 0  # greedy: the first of equals
    assert Sampler(SamplingParams(logit_bias=((0, -100.0),))).sample(logits) == 1
    torch.manual_seed(0)
    vocab = torch.randn(1000) * 5
    best = vocab.topk(20).indices.tolist()
    for seed in range(50):  # sampled at temperature 1: a banned token never comes, a forced one always
        banned = Sampler(SamplingParams(temperature=1.0, seed=seed, logit_bias=tuple((i, -100.0) for i in best)))
        assert banned.sample(vocab) not in best
        forced = Sampler(SamplingParams(temperature=1.0, top_p=0.9, seed=seed, logit_bias=((int(vocab.argmin()), 100.0),)))
        assert forced.sample(vocab) == int(vocab.argmin())


def test_logit_bias_outside_its_range_or_the_vocabulary_is_refused_naming_it():
    for bad in (((1, 100.5),), ((1, float("nan")),), ((1, True),), ((-1, 1.0),), (("1", 1.0),), ((1.0, 1.0),)):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(ValueError, match="logit_bias: token id 4 is not in the vocabulary"):
        Sampler(SamplingParams(logit_bias=((4, 1.0), (2, 1.0)))).sample(torch.zeros(4))
