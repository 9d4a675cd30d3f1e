"""Speculative decoding in the engine: the same replies as without it, alone and batched, sampled or
greedy, with logprobs and stop strings; guesses only in the rows a batch leaves free; a draft model."""

from __future__ import annotations

import pytest
from support.engine import EngineHarness, last, request
from support.special_checkpoints import default_model, write_chatml_checkpoint

from app.messages import Done, Failed, ModelFailed, ReplySettings
from model.linear import MAX_KERNEL_ROWS
from model.speculation import Draft
from model.options import DEFAULT_MODEL_NAME

pytestmark = [pytest.mark.timeout(600)]

SMOLLM2 = DEFAULT_MODEL_NAME
PARAGRAPH = ("Teh quick brown fox jumpd over the lazzy dog. It was a sunny day and the fox was verry happy. "
             "The dog did not care, it just slept under the tree all day long.")
ASKS = [f"Fix the spelling in this paragraph and give it back in full:\n\n{PARAGRAPH}",
        "Reformat as a Markdown list, one a line: apples, pears, plums, cherries, grapes, lemons.",
        "Repeat exactly: the train leaves at nine from platform two, every day but Sunday.",
        "What is the capital of France?", "Write a haiku about autumn.", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def engines():
    folder = default_model()
    return {mode: EngineHarness(folder, speculate=mode, kv_cache_mb=0, dtype="bf16") for mode in ("off", "auto")}


def replies(harness, settings, asks=ASKS, together=False, model=SMOLLM2, **fields) -> list[Done]:
    requests = [request(ask, settings, model=model, **fields) for ask in asks]
    if together:
        events = harness.ask(*requests)
        return [last(events[r.id]) for r in requests]
    return [last(harness.ask(r)[r.id]) for r in requests]


@pytest.mark.parametrize("together", [False, True])
@pytest.mark.parametrize("penalty", [1.0, None])  # None: the model's own (SmolLM2: 1.1, which copies less)
def test_greedy_replies_are_those_of_plain_decoding(engines, fixed_step_times, together, penalty):
    settings = ReplySettings(max_new_tokens=48, temperature=0.0, repetition_penalty=penalty)
    off = replies(engines["off"], settings, together=together)
    auto = replies(engines["auto"], settings, together=together)
    for a, b in zip(off, auto):
        assert isinstance(b, Done) and a.token_ids == b.token_ids and a.text == b.text
        assert a.stats.guesses == 0 and a.stats.tokens_per_step in (0.0, 1.0)
    if penalty == 1.0:  # (with SmolLM2's own 1.1 the replies copy their prompts much less)
        assert max(d.stats.tokens_per_step for d in auto) > 2.0  # the spelling fix repeats its paragraph
        assert not any("step" in d.summary for d in auto)  # (the page's line under a reply says no jargon)


def test_sampled_replies_with_logprobs_and_stop_strings_are_those_of_plain_decoding(engines):
    settings = ReplySettings(max_new_tokens=40, temperature=0.7, top_p=0.95, seed=11, stop=["Sunday"])
    off = replies(engines["off"], settings, together=True, logprobs=2)
    auto = replies(engines["auto"], settings, together=True, logprobs=2)
    for a, b in zip(off, auto):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
    texts = {"off": [], "auto": []}
    for mode in texts:  # the logprobs streamed with the text
        harness = engines[mode]
        asked = request(ASKS[2], settings, model=SMOLLM2, logprobs=2)
        texts[mode] = [(lp.token, lp.logprob) for event in harness.ask(asked)[asked.id]
                       if hasattr(event, "logprobs") for lp in event.logprobs]
    assert texts["off"] == texts["auto"] and texts["off"]


def test_guesses_go_only_in_the_rows_a_batch_leaves_free(engines, fixed_step_times, monkeypatch):
    harness = engines["auto"]
    model = harness.engine.models.checkpoints[SMOLLM2].model
    decode, steps = model.decode, []

    def counting(tokens, caches, *args, **kwargs):
        steps.append((len(tokens), len({id(c) for c in caches})))
        return decode(tokens, caches, *args, **kwargs)

    monkeypatch.setattr(model, "decode", counting)
    settings = ReplySettings(max_new_tokens=32, temperature=0.0)
    replies(harness, settings, asks=ASKS + ASKS[:3], together=True)  # 9 requests: a full batch of 8, then fewer
    assert all(rows <= MAX_KERNEL_ROWS for rows, _ in steps)
    assert any(sequences == MAX_KERNEL_ROWS for _, sequences in steps)
    assert all(rows == sequences for rows, sequences in steps if sequences == MAX_KERNEL_ROWS)
    assert any(rows > sequences for rows, sequences in steps)  # and guesses where there was room


def test_a_model_drafting_for_itself_has_every_guess_stand(tiny, fixed_step_times, monkeypatch):
    monkeypatch.setattr(Draft, "cost_per_guess", 0.0)  # else a draft as slow as the model is never asked
    settings = ReplySettings(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    off = EngineHarness(tiny, speculate="off", dtype="fp32")
    drafted = EngineHarness(tiny, draft=str(tiny), dtype="fp32")
    a, b = (replies(h, settings, asks=["Hello there"], model="tiny")[0] for h in (off, drafted))
    assert a.token_ids == b.token_ids and len(b.token_ids) == 30
    s = b.stats
    assert s.guesses > 0 and s.decoded_tokens - s.decode_steps == s.guesses


def test_a_draft_with_another_tokenizer_is_refused(tiny, tmp_path):
    other = write_chatml_checkpoint(tmp_path / "chatml")
    harness = EngineHarness(tiny, draft=str(other), dtype="fp32")
    failed = [e for e in harness.events if isinstance(e, ModelFailed)]
    assert failed and "LLAMA_DRAFT=" in failed[0].message and "vocabularies differ" in failed[0].message
    asked = request("Hello", ReplySettings(max_new_tokens=4), model="tiny")
    assert isinstance(last(harness.ask(asked)[asked.id]), Failed)
