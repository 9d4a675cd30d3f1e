"""The engine's models (app/engine/models.py): profiles found in the weights folder, a model loaded on a
thread once however often it is asked for, handed over with its info and token table, or what failed."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from app.engine.models import Models, find_profiles
from app.messages import EngineConfig, ReplySettings
from model.checkpoint import CheckpointError, load_checkpoint

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def checkpoint(tiny):
    return load_checkpoint(tiny, dtype=torch.float32)


def loaded(models: Models) -> list:
    """What take_loaded() hands over once the loading thread is done."""
    deadline = time.monotonic() + 60
    while not (handed := list(models.take_loaded())) and time.monotonic() < deadline:
        time.sleep(0.01)
    return handed


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

    assert list(find_profiles(tiny, weights)) == ["tiny", "a-model", "b-model"]
    assert find_profiles(weights / "a-model", weights) == {"a-model": weights / "a-model",
                                                          "b-model": weights / "b-model"}
    models = Models(EngineConfig(checkpoint=str(tiny), weights_dir=str(weights)))
    assert list(models.profiles) == ["tiny", "a-model", "b-model"] and models.default == "tiny"


def test_a_model_loads_once_on_a_thread_and_is_handed_over_with_its_info_and_token_table(tiny, checkpoint,
                                                                                       monkeypatch):
    release, calls, reads = threading.Event(), [], []
    table = checkpoint.tokenizer.token_bytes()
    monkeypatch.setattr(checkpoint.tokenizer, "token_bytes", lambda: reads.append(1) or table)

    def loader(name, path):
        calls.append((name, path, threading.current_thread() is threading.main_thread()))
        release.wait(10)
        return checkpoint

    models = Models(EngineConfig(checkpoint=str(tiny), defaults=ReplySettings(max_new_tokens=77)), loader)
    models.load("tiny")
    models.load("tiny")  # loading already
    assert models.loading and list(models.take_loaded()) == [] and models.checkpoints == {}
    release.set()
    (name, result, seconds), = loaded(models)
    assert calls == [("tiny", tiny, False)] and (name, result) == ("tiny", checkpoint) and seconds > 0
    assert not models.loading and models.checkpoints == {"tiny": checkpoint}
    info = models.infos["tiny"]
    assert (info.name, info.context_limit, info.defaults.max_new_tokens) == ("tiny", 131072, 77)  # its own
    assert info.load_seconds == seconds
    assert reads == [1] and models.token_bytes("tiny") is table and reads == [1]  # read as it loaded, once
    models.load("tiny")  # loaded: nothing more
    assert not models.loading and calls == [("tiny", tiny, False)]


def test_a_model_that_fails_to_load_is_handed_over_as_its_error_and_may_be_tried_again(tiny):
    def loader(name, path):
        raise CheckpointError(f"config.json in {path}: broken")

    models = Models(EngineConfig(checkpoint=str(tiny)), loader)
    models.load("tiny")
    (name, error, _), = loaded(models)
    assert name == "tiny" and isinstance(error, CheckpointError) and "broken" in str(error)
    assert models.checkpoints == {} and models.infos == {} and not models.loading
    models.load("tiny")
    assert isinstance(loaded(models)[0][1], CheckpointError)


def test_the_context_is_the_models_own_within_a_quarter_of_the_memory_and_the_log_says_so(tiny, checkpoint,
                                                                                         monkeypatch, caplog):
    """LLAMA_MAX_CONTEXT unset: the model's own 131,072 tokens where a quarter of the free memory holds one
    conversation's KV cache at that length, else what that quarter holds; set: as asked."""
    import app.engine.models
    from app.engine.models import context_of
    per_token = 2 * checkpoint.config.n_layers * checkpoint.config.n_kv_heads * checkpoint.config.head_dim * 4
    monkeypatch.setattr(app.engine.models, "available_bytes", lambda device: 4 * per_token * 131072)
    with caplog.at_level("INFO", logger="app.engine"):
        assert context_of("tiny", checkpoint, None) == 131072
    assert "tiny: context of 131072 tokens (the model's own); KV cache in float32, " in caplog.text
    monkeypatch.setattr(app.engine.models, "available_bytes", lambda device: 4 * per_token * 10_000)
    assert context_of("tiny", checkpoint, None) == 9984  # 10,000 in whole 256s
    assert context_of("tiny", checkpoint, 4096) == 4096
    models = Models(EngineConfig(checkpoint=str(tiny), max_context=2048), lambda name, path: checkpoint)
    models.load("tiny")
    loaded(models)
    assert models.infos["tiny"].context_limit == 2048


def test_llama_kv_type_reaches_the_models_load_and_a_head_size_q8_cannot_take_is_refused_by_name(tiny, tmp_path):
    from support.checkpoints import hf_model
    wide = tmp_path / "wide"
    hf_model(num_hidden_layers=2, hidden_size=128).save_pretrained(wide)  # head_dim 32
    models = Models(EngineConfig(checkpoint=str(wide), kv_type="q8", dtype="fp32"))
    models.load("wide")
    (name, checkpoint, _), = loaded(models)
    assert checkpoint.model.kv_type == "q8" and models.infos["wide"].context_limit > 0
    narrow = Models(EngineConfig(checkpoint=str(tiny), kv_type="q8"))  # head_dim 16
    narrow.load("tiny")
    (name, error, _), = loaded(narrow)
    assert isinstance(error, CheckpointError) and "multiple of 32" in str(error) and "LLAMA_KV_TYPE=bf16" in str(error)
