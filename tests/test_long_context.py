"""Long contexts on the default model's real weights: a password placed at 10%, 50% and 90% of a 1,100-token
document (tests/support/needle.py) is found by the greedy answer to a question at the end, with the KV cache
in bf16 and in q8 (LLAMA_KV_TYPE) alike (bench/kv_quality.py measures the rest at 6,000 tokens and more:
perplexity, agreement, the needle).
1,100 tokens (a prompt of 1,214) is past every length at which the code takes another way: several prefill chunks
(5 of 256, or 3 of 512 as on AMX CPUs), each decode step's attention split into pieces of 256 positions (5 here;
csrc/decode_step.cpp's kPositionsPerTask: no branch depends on how many), q8 blocks written by prefill and by
decode; at 6,000, 3,000 and 2,000 the test took 5.5, 2.7 and 1.8 times as long for the same branches. (A cache
that keeps no prefilled keys past position 1,024 fails each place in both KV types.)"""

from __future__ import annotations

import pytest
from support.needle import PLACES, found, needle_prompt
from support.special_checkpoints import default_model

from model.checkpoint import load_checkpoint
from model.generation import generate

pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module", params=["bf16", "q8"])
def served(request):
    """The default model as the engine serves it (its Q4_1 blocks, the decode kernel), with that KV type."""
    return load_checkpoint(default_model(), widen="auto", kv_type=request.param)


def test_a_needle_in_1100_tokens_is_found_wherever_it_lies(served):
    """Three prefills of 1,100 tokens (the length the module's docstring gives the reasons for), one thread: 9 s
    alone on a Zen 4, up to 20 s beside the suite's two other workers."""
    replies = {}
    for place in PLACES:
        ids = needle_prompt(served, place, tokens=1100)
        assert 1100 <= len(ids) < 8192 - 32  # a long document, within the model's context and the reply's room
        reply = generate(served, ids, max_new_tokens=24, temperature=0.0, speculate="off")
        replies[place] = "".join(reply)
        assert reply.kv_cache.quantized == (served.model.kv_type == "q8")
    assert all(found(text) for text in replies.values()), replies
