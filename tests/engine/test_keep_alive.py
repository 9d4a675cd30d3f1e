"""Models give their memory back (app/engine/models.py, app/engine/core.py): a model unused for its keep-alive
(LLAMA_KEEP_ALIVE, or a request's KeepAlive until it is unloaded) is unloaded at the end of a step, with its
kept KV caches, and collected; never while a request for it runs or waits; the default model stays unless
LLAMA_KEEP_ALIVE is set; the next request loads it again and gets the same greedy reply. The models offered
are listed again on FindModels. The engine's clock is a fake one here."""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch
from support.checkpoints import write_tiny_checkpoint
from support.engine import EngineHarness, last, request

from app.messages import (Done, EngineStats, FindModels, KeepAlive, Load, Loading, ModelReady, ModelsFound,
                          ModelUnloaded, ReplySettings)
from model.checkpoint import load_checkpoint
from model.kv_cache import PREFILL_CHUNK

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]

GREEDY = ReplySettings(max_new_tokens=12, temperature=0.0)
LONG = "Tell me everything about the number seven. " * (PREFILL_CHUNK // 4)  # a prompt past one prefill chunk


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    """tiny (the default model) and other, the same weights under another name."""
    weights = tmp_path_factory.mktemp("weights")
    write_tiny_checkpoint(weights / "tiny")
    (weights / "other").mkdir()
    for file in ("config.json", "model.safetensors"):
        (weights / "other" / file).symlink_to(weights / "tiny" / file)
    return weights


class Clock:
    """The engine's clock: seconds pass when the test says so."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Loads:
    """A loader that loads from the folder each time (a reloaded model is a new object), and counts."""

    def __init__(self):
        self.names: list[str] = []

    def __call__(self, name: str, path: Path):
        self.names.append(name)
        return load_checkpoint(path, dtype=torch.float32)


def engine(weights: Path, clock: Clock, loads: Loads | None = None, **config) -> EngineHarness:
    return EngineHarness(weights / "tiny", loader=loads or Loads(), clock=clock, weights_dir=str(weights), **config)


def unloaded(events: list) -> list[str]:
    return [e.model for e in events if isinstance(e, ModelUnloaded)]


@pytest.mark.cpu_rules
def test_an_idle_model_is_unloaded_after_its_keep_alive_with_its_caches_and_is_collected(weights, caplog):
    clock = Clock()
    h = engine(weights, clock, keep_alive=60)
    assert isinstance(last(h.ask(r := request(LONG, GREEDY))[r.id]), Done)
    assert len(h.engine.prefix_cache) == 1  # the reply's cache is kept
    held = weakref.ref(h.engine.models.checkpoints["tiny"])
    model = weakref.ref(h.engine.models.checkpoints["tiny"].model)
    clock.now += 59.9
    h.step()
    assert unloaded(h.events) == [] and "tiny" in h.engine.models.checkpoints
    clock.now += 0.1
    gc.freeze()  # as the engine's loop does, the model in the frozen heap (the unload unfreezes it)
    with caplog.at_level(logging.INFO, logger="app.engine"):
        h.step()
    assert gc.get_freeze_count() == 0
    assert unloaded(h.events) == ["tiny"] and h.events[-2:] == [ModelUnloaded("tiny"), EngineStats()]  # none kept
    assert "unloaded tiny after 60 s idle" in caplog.messages
    assert h.engine.models.checkpoints == {} and h.engine.models.infos == {} and len(h.engine.prefix_cache) == 0
    gc.collect()
    assert held() is None and model() is None  # nothing holds it: its memory is free
    h.step()
    assert unloaded(h.events) == ["tiny"]  # told once


def test_an_unloaded_model_that_wrote_json_leaves_no_tokenizer_behind(weights):
    """A JSON reply compiles its format over the model's tokenizer, and those are kept for the next reply;
    unloading the model lets its tokenizer go too."""
    h = engine(weights, Clock(), keep_alive=60)
    json = ReplySettings(max_new_tokens=8, temperature=0.0)
    assert isinstance(last(h.ask(r := request("A JSON object, please.", json, json_object=True))[r.id]), Done)
    tokenizer = weakref.ref(h.engine.models.checkpoints["tiny"].tokenizer)
    h.engine.unload("tiny")
    gc.collect()
    assert tokenizer() is None
    h.engine.handle(r := request("Again.", json, json_object=True))  # loaded again, and compiled again
    while h.engine.requests or h.engine.models.loading:
        time.sleep(0.002)
        h.step()
    assert isinstance(last([e for e in h.events if getattr(e, "id", None) == r.id]), Done)


def test_a_model_is_not_unloaded_while_a_request_for_it_runs_or_waits(weights):
    clock, loads = Clock(), Loads()
    h = engine(weights, clock, loads, keep_alive=0, max_batch=1)  # 0: unloaded as soon as nothing uses it
    assert unloaded(h.events) == ["tiny"]  # loaded at start, used by nothing
    first, second = request("One", ReplySettings(max_new_tokens=20, temperature=0.0)), request("Two", GREEDY)
    h.engine.handle(first)
    h.engine.handle(second)  # waits for the model, then for the place the first one holds
    steps = 0
    while h.engine.requests:
        assert "tiny" in h.engine.models.checkpoints or h.engine.models.loading
        if h.engine.models.loading:
            time.sleep(0.002)  # the loader thread needs the interpreter more than this loop
        clock.now += 3600.0  # an hour a step: only use keeps the model
        h.step()
        steps += 1
    assert steps > 20 and loads.names == ["tiny", "tiny"]  # loaded again once for both
    events = [e for e in h.events if getattr(e, "id", None) in (first.id, second.id)]
    assert [type(e) for e in events][:2] == [Loading, Loading] and all(
        isinstance(last([e for e in events if e.id == r.id]), Done) for r in (first, second))
    assert unloaded(h.events) == ["tiny", "tiny"]  # after the last one ended, in the same step


def test_a_model_loading_is_not_unloaded_and_a_load_asked_for_counts_as_use(weights):
    clock, loads, release = Clock(), Loads(), threading.Event()

    def slow(name, path):
        if name == "other":
            release.wait(30)
        return loads(name, path)

    h = EngineHarness(weights / "tiny", loader=slow, clock=clock, weights_dir=str(weights), keep_alive=60)
    h.run(Load("other"), max_steps=1)
    clock.now += 600
    h.step()
    assert unloaded(h.events) == ["tiny"] and h.engine.models.loading  # other is loading: nothing to unload yet
    release.set()
    h.run()
    assert set(h.engine.models.checkpoints) == {"other"}
    clock.now += 50
    assert h.run(Load("other")) == [ModelReady(h.engine.models.infos["other"])]  # a chat chose it
    clock.now += 50
    h.step()
    assert unloaded(h.events) == ["tiny"]  # 100 s since it loaded, 50 s since it was asked for
    clock.now += 10
    h.step()
    assert unloaded(h.events) == ["tiny", "other"]


def test_the_default_model_stays_unless_keep_alive_is_set(weights):
    clock = Clock()
    h = engine(weights, clock)  # LLAMA_KEEP_ALIVE unset: 5 minutes, the default model always
    assert isinstance(last(h.ask(r := request("Hi", GREEDY, model="other"))[r.id]), Done)
    clock.now += 299
    h.step()
    assert set(h.engine.models.checkpoints) == {"tiny", "other"}
    clock.now += 1
    h.step()
    assert unloaded(h.events) == ["other"]
    clock.now += 10**9
    h.step()
    assert unloaded(h.events) == ["other"] and set(h.engine.models.checkpoints) == {"tiny"}

    h = engine(weights, clock, keep_alive=-1)  # never
    assert isinstance(last(h.ask(r := request("Hi", GREEDY, model="other"))[r.id]), Done)
    clock.now += 10**9
    h.step()
    assert unloaded(h.events) == [] and set(h.engine.models.checkpoints) == {"tiny", "other"}

    h = engine(weights, clock, keep_alive=300)  # set: for the default model too
    clock.now += 300
    h.step()
    assert unloaded(h.events) == ["tiny"]


@pytest.mark.cpu_rules
def test_the_next_request_loads_it_again_and_gets_the_same_greedy_reply(weights):
    clock, loads = Clock(), Loads()
    h = engine(weights, clock, loads, keep_alive=10)
    first = last(h.ask(r := request(LONG, GREEDY))[r.id])
    clock.now += 10
    h.step()
    assert unloaded(h.events) == ["tiny"]
    events = h.ask(r := request(LONG, GREEDY))[r.id]
    again = last(events)
    assert isinstance(events[0], Loading) and events[0].model == "tiny" and loads.names == ["tiny", "tiny"]
    assert isinstance(again, Done) and again.token_ids == first.token_ids and again.text == first.text
    assert again.stats.reused_tokens == 0  # its kept cache went with the model
    assert sum(isinstance(e, ModelReady) for e in h.events) == 2


def test_a_keep_alive_holds_from_when_it_is_sent_until_the_model_is_unloaded(weights):
    clock, loads = Clock(), Loads()
    h = engine(weights, clock, loads)  # LLAMA_KEEP_ALIVE unset: the default model stays
    r = request("Hi", GREEDY)
    events = h.run(r, KeepAlive("tiny", 0))  # (Ollama's keep_alive 0, sent after its request)
    assert isinstance(last([e for e in events if getattr(e, "id", None) == r.id]), Done)
    assert unloaded(h.events) == ["tiny"]  # once the request that came before it had ended
    assert isinstance(last(h.ask(r := request("Hi", GREEDY))[r.id]), Done) and loads.names == ["tiny", "tiny"]
    clock.now += 10**9
    h.step()
    assert unloaded(h.events) == ["tiny"]  # loaded again: the server's keep-alive again (the default model stays)
    h.run(KeepAlive("tiny", 30))
    clock.now += 29.9
    h.step()
    assert unloaded(h.events) == ["tiny"]
    h.run(KeepAlive("tiny", None))  # LLAMA_KEEP_ALIVE's rule again
    clock.now += 10**9
    h.step()
    assert unloaded(h.events) == ["tiny"]
    h.run(KeepAlive("tiny", 30))
    clock.now += 30
    h.step()
    assert unloaded(h.events) == ["tiny", "tiny"]
    h.run(KeepAlive("other", 0))  # neither loaded nor loading: nothing, and its next load keeps the rule
    assert isinstance(last(h.ask(r := request("Hi", GREEDY, model="other"))[r.id]), Done)
    clock.now += 299
    h.step()
    assert unloaded(h.events) == ["tiny", "tiny"] and "other" in h.engine.models.checkpoints


def test_the_models_are_listed_again_when_the_weights_folder_changes(weights, tmp_path):
    (tmp_path / "tiny").symlink_to(weights / "tiny", target_is_directory=True)
    h = EngineHarness(tmp_path / "tiny", loader=Loads(), weights_dir=str(tmp_path))
    assert list(h.engine.models.profiles) == ["tiny"]
    (tmp_path / "new").symlink_to(weights / "other", target_is_directory=True)
    (tmp_path / ".new.download").mkdir()  # a download under way is no model
    assert h.run(FindModels()) == [ModelsFound({"tiny": str(tmp_path / "tiny"), "new": str(tmp_path / "new")})]
    assert isinstance(last(h.ask(r := request("Hi", GREEDY, model="new"))[r.id]), Done)
    (tmp_path / "new").unlink()
    assert h.run(FindModels()) == [ModelsFound({"tiny": str(tmp_path / "tiny")})]
    assert "no model named 'new'" in last(h.ask(r := request("Hi", GREEDY, model="new"))[r.id]).message
