"""The decoding policy (model/decoding.py) on its own, with the Llama 3 tokenizer and made-up logits: stop ids,
stop strings across token boundaries, the constraint's order, logprobs, finish reasons, tool calls, stats.
Then generate() and the engine on one tiny random checkpoint: the same request gives the same reply."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import torch
from support.engine import EngineHarness, last, request

from app.messages import Done, ReplySettings, Text
from app.engine.prompt import dialog
from model import load_checkpoint, load_tokenizer
from model.decoding import ConstraintFailed, Decoding, Logprob, StopScanner
from model.generation import Generation
from model.sampling import SamplingParams
from model.stats import Stats

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(tmp_path_factory.mktemp("empty"))  # Llama 3's, from the llama-models package


def decoding(tokenizer, prompt=(1, 2, 3), **options) -> Decoding:
    options = {"sampling": GREEDY, "max_new_tokens": 100, "context_limit": 1000, "stop_ids": tokenizer.stop_ids,
               **options}
    return Decoding(tokenizer, list(prompt), **options)


def feed(d: Decoding, ids: list[int]) -> list[str]:
    """accept() each id until the reply ends; the texts it gave out, end()'s last."""
    pieces = []
    for token in ids:
        pieces.append(d.accept(token))
        if d.finished:
            break
    return pieces + [d.end()]


def pieces_of(tokenizer, *texts: str) -> list[int]:
    """Token ids that spell each text as one or more tokens of its own (so a boundary falls between them)."""
    return [i for text in texts for i in tokenizer.encode(text)]


# ---- stop ids -----------------------------------------------------------------------------------

def test_a_stop_id_ends_the_reply_and_is_not_part_of_it(tokenizer):
    d = decoding(tokenizer)
    ids = tokenizer.encode("Hello world")
    pieces = feed(d, ids + [tokenizer.eot_id, *tokenizer.encode("never read")])
    assert d.finish_reason == "stop" and d.tokens == ids and d.stats.new_tokens == len(ids)
    assert "".join(pieces) == d.text == "Hello world"


def test_without_stop_ids_a_stop_token_is_a_hidden_token_of_the_reply(tokenizer):
    d = decoding(tokenizer, stop_ids=set(), max_new_tokens=4)  # ignore_eos
    ids = tokenizer.encode("Hello world") + [tokenizer.eot_id] + tokenizer.encode(" again")
    pieces = feed(d, ids)
    assert d.finish_reason == "length" and d.tokens == ids[:4] and d.text == "".join(pieces) == "Hello world again"


# ---- stop strings -------------------------------------------------------------------------------

def test_a_stop_string_split_across_tokens_is_held_back_then_cut(tokenizer):
    d = decoding(tokenizer, stop=["END"])
    ids = pieces_of(tokenizer, "Hello", " world", ".", " ", "E", "N", "D", " of it")
    given = [d.accept(token) for token in ids[:7]]
    assert given == ["Hello", " world", ".", " ", "", "", ""]  # "E", then "EN": maybe the stop string
    assert d.finish_reason == "stop" and d.tokens == ids[:7]  # the tokens that spelled it stay in the reply
    assert d.end() == "" and d.text == "Hello world. "


def test_a_false_start_of_a_stop_string_is_given_out_once_it_is_decided(tokenizer):
    d = decoding(tokenizer, stop=("END", "xyz"))
    given = [d.accept(token) for token in pieces_of(tokenizer, "A", "E", "N", "Z", "x", "y")]
    assert given == ["A", "", "", "ENZ", "", ""] and not d.finished
    d.cancel()
    assert d.end() == "xy" and d.text == "AENZxy" and d.finish_reason == "cancelled"


def test_a_stop_string_inside_one_token_and_the_earliest_of_two(tokenizer):
    d = decoding(tokenizer, stop="world")  # a single string is one stop string, not its characters
    assert "".join(feed(d, tokenizer.encode("Hello world, hello"))) == d.text == "Hello "
    d = decoding(tokenizer, stop=["lo", "Hel"])
    assert "".join(feed(d, tokenizer.encode("Hello"))) == "" and d.finish_reason == "stop"


def test_a_stop_string_after_a_split_character(tokenizer):
    d = decoding(tokenizer, stop=["🦙!"])
    ids = tokenizer.encode("ok 🦙🦙!")
    pieces = feed(d, ids)
    assert not any("\ufffd" in p for p in pieces) and d.text == "ok 🦙" and d.finish_reason == "stop"


def test_the_stop_scanner_holds_back_what_may_begin_a_stop_string():
    scanner = StopScanner(["END", "xyz"])
    assert scanner.feed("Hello E") == "Hello "  # "E" may begin END
    assert scanner.feed("N") == ""
    assert scanner.feed("Dless") == "" and scanner.stopped
    scanner = StopScanner(["END"])
    assert scanner.feed("AEN") == "A" and scanner.feed("ZZ") == "ENZZ" and scanner.flush() == ""


# ---- the constraint -----------------------------------------------------------------------------

class Script:
    """A constraint that allows the ids of `allowed` in turn (then stop ids), finished after `finish_after`.
    fails: ("mask" or "advance", k): its grammar engine fails there once k ids were taken."""

    def __init__(self, allowed: list[int], vocab: int, stop_ids, finish_after: int, fails=("", 0)):
        self.allowed, self.vocab, self.stop_ids, self.finish_after = allowed, vocab, set(stop_ids), finish_after
        self.taken: list[int] = []
        self.fails = fails

    def _fail(self, where: str) -> None:
        if self.fails == (where, len(self.taken)):
            raise ConstraintFailed(f"the grammar failed in {where} after {len(self.taken)} ids")

    @property
    def finished(self) -> bool:
        return len(self.taken) >= self.finish_after

    def mask(self) -> torch.Tensor:
        self._fail("mask")
        mask = torch.zeros(self.vocab, dtype=torch.bool)
        if len(self.taken) < len(self.allowed):
            mask[self.allowed[len(self.taken)]] = True
        else:
            mask[sorted(self.stop_ids)] = True
        return mask

    def advance(self, token: int) -> None:
        assert self.mask()[token], f"token {token} was not allowed"
        self._fail("advance")
        self.taken.append(token)


def test_the_constraint_masks_sampling_and_takes_every_sampled_id_a_stop_id_too(tokenizer):
    vocab = 128256
    ids = tokenizer.encode('{"a": 1}')
    constraint = Script(ids, vocab, tokenizer.stop_ids, finish_after=len(ids) + 1)
    d = decoding(tokenizer, constraint=constraint)
    logits = torch.zeros(vocab)
    logits[42] = 10.0  # the model's favourite, never allowed
    while not d.finished:
        d.accept(d.sample(logits))
    assert d.tokens == ids and d.text == '{"a": 1}' and d.finish_reason == "stop"
    assert constraint.taken == ids + [min(tokenizer.stop_ids)]  # the stop id went through advance() first


def test_a_finished_document_ends_the_reply_as_stop_even_at_the_token_limit(tokenizer):
    ids = tokenizer.encode('{"a": 1}')
    constraint = Script(ids, 128256, tokenizer.stop_ids, finish_after=len(ids))
    d = decoding(tokenizer, constraint=constraint, max_new_tokens=len(ids))
    feed(d, ids)
    assert d.finish_reason == "stop" and d.tokens == ids  # complete, not cut by its length
    d = decoding(tokenizer, stop=["1}"], max_new_tokens=len(ids))
    feed(d, ids)
    assert d.finish_reason == "stop" and d.text == '{"a": '  # a stop string at the last token: "stop" too


@pytest.mark.parametrize("where", ["mask", "advance"])
def test_a_constraint_that_fails_midway_ends_the_reply_with_its_text_so_far(tokenizer, where):
    ids = pieces_of(tokenizer, '{"a": "', "caf", "é", '"}')
    constraint = Script(ids, 128256, tokenizer.stop_ids, finish_after=len(ids) + 1, fails=(where, len(ids) - 2))
    d = decoding(tokenizer, constraint=constraint)
    texts = []
    while not d.finished:
        texts.append(d.accept(d.sample(torch.zeros(128256))))
    texts.append(d.end())
    assert d.finish_reason == "constraint_failed" and d.error == f"the grammar failed in {where} after {len(ids) - 2} ids"
    assert d.tokens == ids[:-2] and "".join(texts) == d.text == '{"a": "caf'  # not the id it failed at
    assert d.accept(ids[-2]) == "" and d.tokens == ids[:-2]  # nothing is taken once it ended


# ---- the token limit, cancelling ----------------------------------------------------------------

def test_the_token_limit_and_the_context_limit(tokenizer):
    d = decoding(tokenizer, max_new_tokens=3)
    feed(d, tokenizer.encode("one two three four"))
    assert d.finish_reason == "length" and len(d.tokens) == 3 and d.text == "one two three"
    d = decoding(tokenizer, prompt=range(10), max_new_tokens=50, context_limit=12)
    assert d.max_new_tokens == 2
    d = decoding(tokenizer, prompt=range(12), max_new_tokens=50, context_limit=12)
    assert d.max_new_tokens == 0 and d.finish_reason == "length"  # nothing to sample


def test_a_cancelled_reply_keeps_what_it_has_and_gives_out_what_it_held(tokenizer):
    d = decoding(tokenizer)
    ids = tokenizer.encode("ok 🦙")  # "ok", then " " and the llama's bytes in three tokens
    given = "".join(d.accept(token) for token in ids[:-1])
    assert given == "ok"  # the llama's last byte is missing
    d.cancel()
    rest = d.end()
    assert d.finish_reason == "cancelled" and rest.startswith(" \ufffd") and given + rest == d.text
    assert d.end() == ""  # once
    d = decoding(tokenizer)
    assert d.end() == "" and d.finish_reason == "cancelled" and d.text == ""


# ---- logprobs -----------------------------------------------------------------------------------

def test_logprobs_are_the_models_own_one_per_token_of_the_reply(tokenizer):
    vocab = 128256
    d = decoding(tokenizer, logprobs=2, sampling=SamplingParams(temperature=0.0, repetition_penalty=5.0))
    raw = torch.full((vocab,), -5.0)
    raw[[11, 12, 13]] = torch.tensor([3.0, 2.0, 1.0])
    expected = torch.log_softmax(raw, -1)
    first = d.sample(raw)
    assert first == 11
    d.accept(first)
    second = d.sample(raw)  # the penalty on 11 (3.0 / 5) makes 12 the choice; its logprob is still the model's
    assert second == 12
    d.accept(second)
    assert d.sample(torch.where(torch.arange(vocab) == tokenizer.eot_id, 50.0, raw)) == tokenizer.eot_id
    d.accept(tokenizer.eot_id)
    top = [(11, pytest.approx(expected[11].item())), (12, pytest.approx(expected[12].item()))]
    assert d.logprobs == [Logprob(11, pytest.approx(expected[11].item()), top),
                          Logprob(12, pytest.approx(expected[12].item()), top)]  # none for the stop id
    assert len(d.logprobs) == len(d.tokens) == d.stats.new_tokens
    plain = decoding(tokenizer)
    plain.accept(plain.sample(raw))
    assert plain.logprobs == []


# ---- tool calls ---------------------------------------------------------------------------------

def test_a_tool_call_is_held_back_and_parsed(tokenizer):
    d = decoding(tokenizer, tools={"get_weather"})
    pieces = feed(d, tokenizer.encode('[get_weather(city="Paris"), get_weather(city="Oslo")]') + [tokenizer.eot_id])
    assert pieces == [""] * len(pieces) and d.text == ""
    assert [(c.name, c.arguments) for c in d.tool_calls] == [("get_weather", {"city": "Paris"}),
                                                             ("get_weather", {"city": "Oslo"})]
    d = decoding(tokenizer, tools={"get_weather"}, parallel_tool_calls=False)
    feed(d, tokenizer.encode('[get_weather(city="Paris"), get_weather(city="Oslo")]'))
    assert [c.arguments for c in d.tool_calls] == [{"city": "Paris"}]


def test_text_that_is_no_call_is_given_out_and_an_undeclared_call_at_the_end(tokenizer):
    d = decoding(tokenizer, tools={"get_weather"})
    pieces = feed(d, tokenizer.encode("It is sunny") + [tokenizer.eot_id])
    assert pieces[0] == "It" and "".join(pieces) == d.text == "It is sunny" and d.tool_calls == []
    d = decoding(tokenizer, tools={"get_weather"})
    pieces = feed(d, tokenizer.encode('[launch(target="moon")]') + [tokenizer.eot_id])
    assert pieces[-1] == d.text == '[launch(target="moon")]' and not any(pieces[:-1]) and d.tool_calls == []


# ---- stats --------------------------------------------------------------------------------------

def test_stats_count_the_prompt_the_reply_and_the_time_from_the_start(tokenizer):
    started = time.perf_counter() - 5.0
    d = decoding(tokenizer, prompt=range(7), started=started)
    time.sleep(0.01)
    feed(d, tokenizer.encode("one two three") + [tokenizer.eot_id])
    s = d.stats
    assert (s.prompt_tokens, s.reused_tokens, s.new_tokens) == (7, 0, 3)
    assert 5.0 < s.time_to_first_token < s.total_time < 60
    assert s.tokens_per_second == pytest.approx(2 / (s.total_time - s.time_to_first_token))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(s), type=Stats) == s


def test_one_stats_type_the_web_process_reads_without_torch():
    import app.messages
    assert app.messages.Stats is Stats
    code = "import sys, app.messages, model.stats; assert 'torch' not in sys.modules, 'torch'"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


# ---- generate() and the engine: one policy ------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tiny):
    return load_checkpoint(tiny, dtype=torch.float32)


@pytest.fixture(scope="module")
def engine(tiny, checkpoint):
    return EngineHarness(tiny, loader=lambda name, path: checkpoint, kv_cache_mb=0)


def both(engine, checkpoint, settings: ReplySettings, question="Tell me a story.", **fields):
    """The engine's reply to a request and generate()'s reply to the same prompt and settings: the engine's
    Done, the Generation, and the logprobs the engine streamed."""
    r = request(question, settings, **fields)
    events = engine.ask(r)[r.id]
    done = last(events)
    assert isinstance(done, Done), done
    assert "".join(e.text for e in events if isinstance(e, Text)) == done.text  # what streamed is the reply
    s = settings
    sampling = SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                              repetition_penalty=s.repetition_penalty, frequency_penalty=s.frequency_penalty,
                              presence_penalty=s.presence_penalty, seed=s.seed)
    constraint = None
    if fields.get("json_object"):
        from model.structured import JsonConstraint
        constraint = JsonConstraint(checkpoint.tokenizer, None, vocab_size=checkpoint.config.vocab_size,
                                    stop_ids=checkpoint.stop_ids)
    prompt = checkpoint.chat_format.encode_dialog(dialog(r.messages), tools=r.tools, tool_choice=r.tool_choice)
    gen = Generation(checkpoint, prompt, max_new_tokens=s.max_new_tokens, sampling=sampling, stop=s.stop,
                     stop_ids=set() if s.ignore_eos else None, constraint=constraint,
                     logprobs=fields.get("logprobs"), tools=fields.get("tools"))
    assert "".join(gen) == gen.text
    events = [e for e in events if isinstance(e, Text)]
    return done, gen, [lp for e in events for lp in e.logprobs]


def assert_same(done: Done, gen: Generation) -> None:
    assert (done.text, done.finish_reason, done.token_ids) == (gen.text, gen.finish_reason, gen.tokens)
    counts = ("prompt_tokens", "reused_tokens", "new_tokens")
    assert {f: getattr(done.stats, f) for f in counts} == {f: getattr(gen.stats, f) for f in counts}
    assert set(done.stats.__struct_fields__) == set(Stats.__struct_fields__)
    for stats in (done.stats, gen.stats):
        assert 0 < stats.time_to_first_token <= stats.total_time


def settings(**fields) -> ReplySettings:
    """Every sampling setting given: the engine's defaults (the model's) never fill one in."""
    return ReplySettings(**{"max_new_tokens": 40, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                            "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                            **fields})


def test_generate_and_the_engine_give_the_same_reply(engine, checkpoint):
    full, _, _ = both(engine, checkpoint, settings())
    assert full.finish_reason == "length" and len(full.text) > 20
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 4]
    cases = [settings(stop=(stop, "never there")),  # cut in the middle
             settings(temperature=0.9, top_k=50, top_p=0.95, seed=7, stop=("zzqx",), repetition_penalty=1.3),
             settings(temperature=1.0, min_p=0.05, frequency_penalty=1.0, presence_penalty=0.5, seed=3,
                      max_new_tokens=25, ignore_eos=True)]
    for s in cases:
        done, gen, _ = both(engine, checkpoint, s)
        assert_same(done, gen)
    done, gen, _ = both(engine, checkpoint, cases[0])
    assert done.finish_reason == "stop" and stop not in done.text and done.text == full.text[:full.text.index(stop)]


def test_generate_and_the_engine_give_the_same_logprobs_and_json(engine, checkpoint):
    spelled = checkpoint.tokenizer.token_bytes()
    done, gen, logprobs = both(engine, checkpoint, settings(max_new_tokens=30), logprobs=2, json_object=True)
    assert_same(done, gen)
    assert done.text.startswith("{") and len(logprobs) == len(gen.logprobs) == len(gen.tokens)
    for sent, own in zip(logprobs, gen.logprobs):
        assert bytes(sent.bytes) == spelled[own.token] and sent.logprob == pytest.approx(own.logprob, abs=1e-5)
        assert [bytes(t.bytes) for t in sent.top] == [spelled[t] for t, _ in own.top]
        assert all(math.isfinite(t.logprob) for t in sent.top)


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize("reply, stop", [
    ("It is sunny in Paris today.", ()),
    ("It is sunny in Paris. The end.", ("Paris.",)),  # " Paris" and "." are two tokens
    ('[get_weather(city="Paris")]', ()),
    ('[launch(target="moon")]', ()),
])
def test_scripted_replies_end_alike_stop_token_stop_string_tool_call(engine, checkpoint, monkeypatch, reply, stop):
    """Each reply samples the ids of `reply`, then <|eot_id|>, through Decoding's sample (on the host) and draw
    (on the device, the engine's plain rows)."""
    ids = checkpoint.tokenizer.encode(reply) + [checkpoint.tokenizer.eot_id]
    monkeypatch.setattr(Decoding, "sample", lambda self, logits: ids[len(self.tokens)])
    monkeypatch.setattr(Decoding, "draw", lambda self, logits: torch.tensor(ids[len(self.tokens)]))
    done, gen, _ = both(engine, checkpoint, settings(stop=stop), question="Weather?", tools=WEATHER)
    assert_same(done, gen)
    assert done.finish_reason == "stop"
    assert [c["function"] for c in done.tool_calls] == [c.to_openai()["function"] for c in gen.tool_calls]
    if "get_weather" in reply:
        assert len(gen.tool_calls) == 1 and done.text == gen.text == ""
    elif stop:
        assert done.text == "It is sunny in "


FORCED = '{"type": "function", "name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'


@pytest.mark.parametrize("parallel", [False, True], ids=["one", "array"])
def test_a_forced_call_cut_by_the_token_limit_is_the_call_as_far_as_it_went(tokenizer, parallel):
    """tool_choice "required" or a name (its JSON: model/tool_choice.py) cut by max_new_tokens at every token: the
    whole calls, then the last with its arguments as written so far, its name the one allowed name it can be."""
    text = f"[{FORCED}, {FORCED.replace('get_weather', 'get_time')}]" if parallel else FORCED
    ids = tokenizer.encode(text)
    names = {"get_weather", "get_time"}
    seen = set()
    for limit in range(1, len(ids)):
        d = decoding(tokenizer, tools=names | {"other"}, forced=names, max_new_tokens=limit)
        assert not any(feed(d, ids)) and d.finish_reason == "length" and d.text == ""
        written = tokenizer.decode(ids[:limit])
        calls = [(c.name, c.arguments) for c in d.tool_calls]
        whole = written.count('}}')  # the calls written whole
        assert calls[:whole] == [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"city": "Paris", "days": 3})][:whole]
        if len(calls) > whole:
            name, arguments = calls[-1]
            assert isinstance(arguments, str) and written.endswith('"parameters": ' + arguments if arguments else "")
            assert name in names or sum(n.startswith(name) for n in names) > 1  # cut in "get_": either
            seen.add((name in names, bool(arguments)))
        assert d.tool_calls or written == "["  # nothing of a call yet: no call, and no text
    assert seen >= {(True, True), (True, False)}
    d = decoding(tokenizer, tools=names, max_new_tokens=8)  # "auto": a cut reply is text, not a call
    assert "".join(feed(d, ids)) == tokenizer.decode(ids[:8]) and d.tool_calls == []
