"""Sampling: greedy, temperature, top-k, top-p, min-p, penalties, seeds and logprobs."""

import pytest
import torch

from model.sampling import Sampler, SamplingParams, make_generator, sample, token_logprobs


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
