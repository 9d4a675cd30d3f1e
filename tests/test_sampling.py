"""Sampling: greedy, temperature, top-k, top-p and seeds."""

import torch

from model.sampling import make_generator, sample


def logits_fixture(vocab=1000, seed=0):
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_temperature_zero_is_argmax():
    for seed in range(20):
        logits = logits_fixture(seed=seed)
        assert int(sample(logits, temperature=0.0)) == int(logits.argmax())


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
