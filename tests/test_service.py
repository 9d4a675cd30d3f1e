"""GenerationService: streaming, cancel, the FIFO queue, multi-turn cache reuse, context trimming,
and the settings it is built from. Runs on a tiny random Llama checkpoint (Llama 3 vocabulary)."""

from __future__ import annotations

import asyncio
import gc
import re
import time
from pathlib import Path

import pytest
import torch

from app.service import (Conversation, Done, Failed, GenerationService, Loading, Queued, ReplySettings, Text,
                         Trimmed, find_profiles, fit_prompt)
from app.settings import DEFAULT_MAX_NEW_TOKENS, Settings, SettingsError
from e2e_helpers import write_tiny_checkpoint
from model.checkpoint import load_checkpoint
from model.generate import Generation

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("weights") / "tiny")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: on a busy 2-core machine two threads spin against each other and crawl."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tiny):
    return load_checkpoint(tiny)


@pytest.fixture
def service(tiny, checkpoint):
    service = GenerationService({"tiny": tiny}, loader=lambda name, path: checkpoint)
    service.checkpoint()  # loaded, as after the app's start
    yield service
    service.close()


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 90))


def ask(service, conversation: Conversation, settings: ReplySettings | None = None) -> list:
    """Every event of one reply (the request is made on the event loop that reads it)."""
    async def events():
        return await service.stream(conversation, settings).events()
    return run(events())


def chat(*texts: str, system: str | None = None) -> Conversation:
    conversation = Conversation(system_prompt=system)
    for i, text in enumerate(texts):
        conversation.add("user" if i % 2 == 0 else "assistant", text)
    return conversation


def reference(checkpoint, conversation: Conversation, settings: ReplySettings) -> str:
    """The reply as the engine gives it, with no service, queue or cache in between."""
    generation = Generation(checkpoint, checkpoint.chat_format.encode_dialog(conversation.dialog()),
                            max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                            top_k=settings.top_k or None, top_p=settings.top_p, seed=settings.seed)
    return "".join(generation)


# ---- streaming ----------------------------------------------------------------------------------

def test_stream_yields_text_then_done_with_the_engines_reply(service, checkpoint):
    conversation = chat("Hello there")
    settings = ReplySettings(max_new_tokens=40, temperature=1.0, top_k=50, top_p=0.95, seed=3)
    events = ask(service, conversation, settings)

    assert isinstance(events[-1], Done) and all(isinstance(e, Text) for e in events[:-1])
    done = events[-1]
    assert "".join(e.text for e in events[:-1]) == done.text
    assert done.text == reference(checkpoint, conversation, settings)
    assert done.finish_reason in ("length", "stop") and done.stats.new_tokens > 0
    assert done.stats.prompt_tokens == len(checkpoint.chat_format.encode_dialog(conversation.dialog()))
    assert "tokens" in done.summary and "first token" in done.summary


def test_pieces_are_joined_to_one_event_per_interval(tiny, checkpoint):
    service = GenerationService({"tiny": tiny}, loader=lambda name, path: checkpoint, stream_interval=0.2)
    try:
        async def timed():
            request = service.stream(chat("Hi"), ReplySettings(max_new_tokens=150, temperature=1.0, seed=1))
            return [(time.monotonic(), event) async for event in request]

        events = run(timed())
    finally:
        service.close()
    texts = [(t, e) for t, e in events if isinstance(e, Text)]
    done = events[-1][1]
    assert done.stats.new_tokens == 150
    assert len(texts) < done.stats.new_tokens / 3  # many tokens per UI update
    gaps = [later - earlier for (earlier, _), (later, _) in zip(texts, texts[1:])]
    assert min(gaps) >= 0.19


def test_follow_up_reuses_the_cache_and_matches_a_fresh_prompt(service, checkpoint):
    conversation = chat("What is the capital of France?")
    # greedy: a random model's flat distribution would turn float noise (cache vs. none) into other samples
    settings = ReplySettings(max_new_tokens=12, temperature=0.0, top_k=0, top_p=1.0)
    first = ask(service, conversation, settings)[-1]
    conversation.add("assistant", first.text)
    conversation.add("user", "And what river flows through it?")
    second = ask(service, conversation, settings)[-1]

    # Only the new turn was prefilled: the reply is in the prompt as the ids it was generated as (a
    # random model's tokens seldom come back the same from their text), all cached but the last.
    assert second.stats.reused_tokens == first.stats.prompt_tokens + first.stats.new_tokens - 1
    assert second.text == reference(checkpoint, conversation, settings)


def test_kv_caches_stay_within_the_budget_least_recently_served_dropped_first(tiny, checkpoint):
    greedy = ReplySettings(max_new_tokens=8, temperature=0.0, top_k=0, top_p=1.0)
    probe = chat("Chat 0")
    unbounded = GenerationService({"tiny": tiny}, loader=lambda name, path: checkpoint)
    try:
        ask(unbounded, probe, greedy)
    finally:
        unbounded.close()
    one = probe.kv_cache.nbytes  # every conversation below gets a cache of this size

    service = GenerationService({"tiny": tiny}, loader=lambda name, path: checkpoint,
                                kv_cache_budget_mb=2.5 * one / 2**20)  # room for two caches, not three
    try:
        a, b, c = chat("Chat 1"), chat("Chat 2"), chat("Chat 3")
        for conversation in (a, b):
            ask(service, conversation, greedy)
        assert a.kv_cache.nbytes == b.kv_cache.nbytes == one
        assert service.cache_budget.nbytes == 2 * one

        ask(service, c, greedy)  # a was served longest ago: its cache goes
        assert a.kv_cache is None and b.kv_cache is not None and c.kv_cache is not None
        assert service.cache_budget.nbytes == 2 * one <= service.cache_budget.max_bytes

        a.add("assistant", "Hello.")
        a.add("user", "Again")
        again = ask(service, a, greedy)[-1]  # prefilled in full, same reply as with no cache at all
        assert again.stats.reused_tokens == 0
        assert again.text == reference(checkpoint, a, greedy)
        # a's cache is now larger; b goes first, and c only if a and c together do not fit
        assert a.kv_cache is not None and b.kv_cache is None
        assert (c.kv_cache is not None) == (a.kv_cache.nbytes + one <= service.cache_budget.max_bytes)
        assert service.cache_budget.nbytes <= service.cache_budget.max_bytes

        d = chat("Chat 4")
        ask(service, d, greedy)
        others = sum(x.kv_cache.nbytes for x in (a, b, c) if x.kv_cache is not None)
        assert service.cache_budget.nbytes == others + one
        del d  # a conversation its caller dropped leaves the budget with its cache
        gc.collect()
        assert service.cache_budget.nbytes == others
    finally:
        service.close()


def test_one_conversation_over_the_budget_still_keeps_its_cache(tiny, checkpoint):
    service = GenerationService({"tiny": tiny}, loader=lambda name, path: checkpoint, kv_cache_budget_mb=0)
    try:
        conversation = chat("Hello")
        ask(service, conversation, ReplySettings(max_new_tokens=4, temperature=0.0))
        assert conversation.kv_cache is not None  # the newest reply's cache always stays
        other = chat("Hi")
        ask(service, other, ReplySettings(max_new_tokens=4, temperature=0.0))
        assert conversation.kv_cache is None and other.kv_cache is not None
    finally:
        service.close()


# ---- cancel and the queue -----------------------------------------------------------------------

def test_cancel_stops_the_worker_within_a_token_or_two(service):
    async def scenario():
        request = service.stream(chat("Tell me a long story"), ReplySettings(max_new_tokens=3000, temperature=1.0))
        async for event in request:
            if isinstance(event, Text):
                break
        cancelled_at = time.monotonic()
        request.cancel()
        done = (await request.events())[-1]
        stopped_in = time.monotonic() - cancelled_at
        # the worker is free again: a next request runs at once
        after = await service.stream(chat("Hi"), ReplySettings(max_new_tokens=3)).events()
        return done, stopped_in, after

    done, stopped_in, after = run(scenario())
    assert done.finish_reason == "cancelled"
    assert done.stats.new_tokens < 3000
    assert stopped_in < 0.5
    assert isinstance(after[0], Text) and after[-1].stats.new_tokens == 3


def test_cancel_by_id_and_while_waiting(service):
    async def scenario():
        running = service.stream(chat("One"), ReplySettings(max_new_tokens=3000, temperature=1.0))
        assert isinstance(await anext(running), Text)
        waiting = service.stream(chat("Two"), ReplySettings(max_new_tokens=3000, temperature=1.0))
        assert await anext(waiting) == Queued(1)
        assert service.cancel(waiting.id)
        waited = await waiting.events()
        assert service.waiting == 0
        running.cancel()
        return waited, (await running.events())[-1]

    waited, running_done = run(scenario())
    assert waited == [Done("", "cancelled", waited[-1].stats)] and waited[-1].stats.new_tokens == 0
    assert running_done.finish_reason == "cancelled"
    assert not service.cancel("no-such-request")


def test_two_conversations_at_once_give_what_each_gives_alone(service):
    settings = [ReplySettings(max_new_tokens=30, temperature=1.0, seed=seed) for seed in (11, 22)]

    def conversations():
        return [chat("Write a poem"), chat("Write a poem")]

    async def alone():
        return [(await service.stream(c, s).events())[-1].text for c, s in zip(conversations(), settings)]

    async def together():
        requests = [service.stream(c, s) for c, s in zip(conversations(), settings)]
        return await asyncio.gather(*(r.events() for r in requests))

    texts_alone = run(alone())
    first, second = run(together())
    assert texts_alone[0] != texts_alone[1]  # the seeds matter
    assert [first[-1].text, second[-1].text] == texts_alone
    assert second[0] == Queued(1)  # the second waited, and was told so
    assert not any(isinstance(e, Queued) for e in first)


def test_queue_positions_count_down(service):
    async def scenario():
        requests = [service.stream(chat(f"Story {i}"), ReplySettings(max_new_tokens=40, temperature=1.0))
                    for i in range(3)]
        return await asyncio.gather(*(r.events() for r in requests))

    events = run(scenario())
    positions = [[e.position for e in request if isinstance(e, Queued)] for request in events]
    assert positions == [[], [1], [2, 1]]
    assert all(isinstance(request[-1], Done) for request in events)


# ---- context ------------------------------------------------------------------------------------

def long_chat(turns: int, system: str = "You are a pirate.") -> Conversation:
    texts = []
    for i in range(turns):
        texts += [f"Question {i}: " + "tell me more " * 20, f"Answer {i}: " + "here is more " * 20]
    return chat(*texts, f"Last question {turns}", system=system)


def test_trimming_keeps_the_system_prompt_and_the_newest_turns(checkpoint):
    conversation = long_chat(10)
    ids, left_out = fit_prompt(checkpoint.chat_format, conversation, limit=512, max_new_tokens=128)
    text = checkpoint.tokenizer.decode(ids)

    assert len(ids) <= 512 - 128
    assert left_out > 0 and left_out % 2 == 0  # whole exchanges, starting at a user message
    assert conversation.messages[left_out].role == "user"
    assert text.count("You are a pirate.") == 1
    assert "Last question 10" in text and "Answer 9:" in text
    assert "Question 0:" not in text and f"Question {left_out // 2 - 1}:" not in text
    assert f"Question {left_out // 2}:" in text
    # room to spare, so the next turns keep this prefix (and the cache)
    assert len(ids) <= (512 - 128) * 3 // 4


def test_trimmed_conversation_is_told_once_and_keeps_its_start(service):
    service.max_context = 512
    conversation = long_chat(10)

    async def turn():
        events = await service.stream(conversation, ReplySettings(max_new_tokens=8)).events()
        conversation.add("assistant", events[-1].text)
        conversation.add("user", "Short question")
        return events

    first, second = run(turn()), run(turn())
    assert [e for e in first if isinstance(e, Trimmed)] == [Trimmed(conversation.left_out)]
    assert not any(isinstance(e, Trimmed) for e in second)  # still fits: same start, cache reused
    assert second[-1].stats.reused_tokens > 0


def test_untrimmed_conversation_is_sent_whole(checkpoint):
    conversation = long_chat(2)
    ids, left_out = fit_prompt(checkpoint.chat_format, conversation, limit=4096, max_new_tokens=512)
    assert left_out == 0 and ids == checkpoint.chat_format.encode_dialog(conversation.dialog())


def test_a_message_longer_than_the_context_is_a_polite_error_and_service_goes_on(service):
    service.max_context = 256
    too_long = chat("word " * 1000)

    events = ask(service, too_long)
    assert len(events) == 1 and isinstance(events[0], Failed)
    assert events[0].reason == "prompt_too_long"
    assert "too long" in events[0].message and "256 tokens" in events[0].message

    events = ask(service, chat("Hi"), ReplySettings(max_new_tokens=4))
    assert isinstance(events[-1], Done)


def test_edit_truncates_at_the_message_id():
    conversation = Conversation()
    conversation.add("user", "one", id="u1")
    conversation.add("assistant", "two", id="a1")
    conversation.add("user", "three", id="u2")
    conversation.add("assistant", "four", id="a2")
    conversation.left_out = 4
    assert conversation.truncate("u2")
    assert [m.content for m in conversation.messages] == ["one", "two"] and conversation.left_out == 2
    assert not conversation.truncate("unknown")


# ---- models -------------------------------------------------------------------------------------

def test_models_load_lazily_once_and_a_broken_one_is_reported(tiny, checkpoint, tmp_path):
    loads = []

    def loader(name, path):
        loads.append(name)
        return load_checkpoint(path)

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    service = GenerationService({"tiny": tiny, "broken": broken}, loader=loader)
    try:
        assert loads == [] and not service.is_loaded("tiny")
        events = ask(service, Conversation(model="broken", messages=chat("Hi").messages))
        assert isinstance(events[0], Loading) and isinstance(events[-1], Failed)
        assert events[-1].reason == "load" and "broken" in events[-1].message

        for _ in range(2):
            events = ask(service, Conversation(model="tiny", messages=chat("Hi").messages),
                         ReplySettings(max_new_tokens=2))
            assert isinstance(events[-1], Done)
        assert loads.count("tiny") == 1
    finally:
        service.close()


def test_reply_defaults_come_from_the_checkpoint_then_the_service(tiny, checkpoint):
    service = GenerationService({"tiny": tiny}, loader=lambda name, path: checkpoint,
                                defaults=ReplySettings(temperature=0.0, max_new_tokens=77))
    try:
        defaults = service.reply_defaults()
    finally:
        service.close()
    # tiny's generation_config.json says nothing: Llama 3's temperature 0.6 / top_p 0.9, overridden here
    assert defaults == ReplySettings(max_new_tokens=77, temperature=0.0, top_k=0, top_p=0.9, seed=None)


def test_profiles_are_the_checkpoint_then_each_checkpoint_folder(tiny, tmp_path):
    weights = tmp_path / "weights"
    for name in ("b-model", "a-model"):
        folder = weights / name
        folder.mkdir(parents=True)
        for file in ("config.json", "model.safetensors"):
            (folder / file).symlink_to(tiny / file)
    (weights / "not-a-model").mkdir()
    (weights / ".hidden-build").mkdir()
    (weights / "README.md").write_text("notes")

    profiles = find_profiles(tiny, weights)
    assert list(profiles) == ["tiny", "a-model", "b-model"]
    assert find_profiles(weights / "a-model", weights) == {"a-model": weights / "a-model",
                                                          "b-model": weights / "b-model"}


# ---- settings -----------------------------------------------------------------------------------

def test_settings_defaults():
    settings = Settings.from_env({})
    assert settings.checkpoint.name == "SmolLM2-135M-Instruct" and settings.is_default_checkpoint
    assert settings.weights_dir.name == "weights"
    assert (settings.device, settings.dtype, settings.max_context) == ("auto", "auto", 8192)
    assert settings.max_new_tokens == DEFAULT_MAX_NEW_TOKENS
    assert (settings.temperature, settings.top_k, settings.top_p, settings.threads) == (None, None, None, None)
    assert settings.system_prompt is None


def test_settings_from_values():
    settings = Settings.from_env({
        "LLAMA_CHECKPOINT": "/models/llama", "LLAMA_WEIGHTS_DIR": "/models", "LLAMA_TOKENIZER": "/t/tokenizer.model",
        "LLAMA_DEVICE": "CPU", "LLAMA_DTYPE": "bf16", "LLAMA_MAX_CONTEXT": "2048",
        "LLAMA_SYSTEM_PROMPT": "Be brief.", "LLAMA_MAX_NEW_TOKENS": "64", "LLAMA_TEMPERATURE": "0",
        "LLAMA_TOP_K": "40", "LLAMA_TOP_P": "0.95", "LLAMA_THREADS": "2", "LLAMA_SEED_UNUSED": "x",
    })
    assert settings == Settings(checkpoint=Path("/models/llama"), weights_dir=Path("/models"),
                                tokenizer=Path("/t/tokenizer.model"), device="cpu", dtype="bf16", max_context=2048,
                                system_prompt="Be brief.", max_new_tokens=64, temperature=0.0, top_k=40,
                                top_p=0.95, threads=2)
    assert not settings.is_default_checkpoint
    assert Settings.from_env({"LLAMA_TEMPERATURE": "  ", "LLAMA_TOP_P": ""}).temperature is None


@pytest.mark.parametrize("name, value, message", [
    ("LLAMA_TOP_P", "abc", "LLAMA_TOP_P=abc: expected a number between 0 and 1"),
    ("LLAMA_TOP_P", "0", "LLAMA_TOP_P=0: expected a number between 0 and 1"),
    ("LLAMA_TOP_P", "nan", "LLAMA_TOP_P=nan: expected a number between 0 and 1"),
    ("LLAMA_TEMPERATURE", "-1", "LLAMA_TEMPERATURE=-1: expected a number between 0 and 100"),
    ("LLAMA_TOP_K", "1.5", "LLAMA_TOP_K=1.5: expected a whole number of at least 0"),
    ("LLAMA_MAX_NEW_TOKENS", "0", "LLAMA_MAX_NEW_TOKENS=0: expected a whole number of at least 1"),
    ("LLAMA_MAX_CONTEXT", "lots", "LLAMA_MAX_CONTEXT=lots: expected a whole number of at least 16"),
    ("LLAMA_THREADS", "-2", "LLAMA_THREADS=-2: expected a whole number of at least 1"),
    ("LLAMA_DEVICE", "tpu", "LLAMA_DEVICE=tpu: expected one of auto, cpu, cuda, mps"),
    ("LLAMA_DTYPE", "int4", "LLAMA_DTYPE=int4: expected one of auto, bf16, fp16, fp32"),
])
def test_bad_settings_name_the_variable(name, value, message):
    with pytest.raises(SettingsError) as error:
        Settings.from_env({name: value})
    assert str(error.value) == message


def test_every_setting_is_documented():
    root = Path(__file__).resolve().parents[1]
    read = set(re.findall(r'"(LLAMA_[A-Z_]+)"', (root / "app" / "settings.py").read_text()))
    table = set(re.findall(r"^\| `(LLAMA_[A-Z_]+)`", (root / "chainlit.md").read_text(), re.MULTILINE))
    example = set(re.findall(r"^(LLAMA_[A-Z_]+)=", (root / ".env.example").read_text(), re.MULTILINE))
    assert len(read) == 23 and read == table == example


def test_kv_cache_budget_setting():
    assert Settings.from_env({}).kv_cache_mb == 1024
    assert Settings.from_env({"LLAMA_KV_CACHE_MB": "0"}).kv_cache_mb == 0  # only the newest chat keeps its cache
    assert Settings.from_env({"LLAMA_KV_CACHE_MB": " 300 "}).kv_cache_mb == 300
    with pytest.raises(SettingsError, match="LLAMA_KV_CACHE_MB=-1: expected a whole number of at least 0"):
        Settings.from_env({"LLAMA_KV_CACHE_MB": "-1"})


def test_llama_quantize_setting():
    from app.settings import Settings, SettingsError
    settings = Settings.from_env({"LLAMA_QUANTIZE": "INT8"})
    assert settings.quantize == "int8"
    assert Settings.from_env({}).quantize == "off"
    with pytest.raises(SettingsError, match="LLAMA_QUANTIZE=int4: expected one of off, int8"):
        Settings.from_env({"LLAMA_QUANTIZE": "int4"})
