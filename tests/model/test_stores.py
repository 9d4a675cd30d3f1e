"""GGUF models already on the machine (model/stores.py): an Ollama store, LM Studio's folders and the Hugging Face
cache laid out as those apps lay them out, found and named as the apps name them, used where they lie (the engine
offers them, load_checkpoint reads the file in place with the logits of the same file imported), and those that
cannot be used said to be so, with why."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from support.checkpoints import hf_model, prompt_ids
from support.gguf_checkpoints import write_llama3_gguf, write_other_architecture

from app.engine.models import find_profiles
from model import load_checkpoint
from model.fetch import main
from model.stores import find_store_models, gguf_architecture


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_llama3_gguf(hf_model(seed=3), tmp_path_factory.mktemp("gguf") / "Tiny-Llama-3-Q8_0.gguf", "q8_0")


def ollama_model(models: Path, name: str, tag: str, blob_source: Path, host="registry.ollama.ai/library") -> Path:
    """A model as `ollama pull` leaves it: the weights as a blob named by their digest, a manifest naming it."""
    digest = "sha256:" + f"{abs(hash((name, tag))):064x}"[:64]
    blob = models / "blobs" / digest.replace(":", "-")
    blob.parent.mkdir(parents=True, exist_ok=True)
    os.link(blob_source, blob)
    (models / "blobs" / "sha256-7e").write_text("{{ .Prompt }}")  # a template layer: not the model
    manifest = models / "manifests" / host / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:7e", "size": 14},
        {"mediaType": "application/vnd.ollama.image.model", "digest": digest, "size": blob.stat().st_size}]}))
    return blob


@pytest.fixture
def home(tmp_path, tiny_gguf) -> dict[str, str]:
    """A home folder with each app's store holding models, and the environment that points at it."""
    home = tmp_path / "home"
    ollama = home / ".ollama" / "models"
    ollama_model(ollama, "llama3.2", "3b", tiny_gguf)
    ollama_model(ollama, "bartowski/Llama-3.2-1B-Instruct-GGUF", "Q4_K_M", tiny_gguf, host="hf.co")
    ollama_model(ollama, "qwen2.5", "7b", write_other_architecture(tmp_path / "qwen.gguf", "qwen2"))
    (ollama / "manifests" / "registry.ollama.ai" / "library" / "broken").mkdir(parents=True)
    (ollama / "manifests" / "registry.ollama.ai" / "library" / "broken" / "latest").write_text("not json")
    (ollama / "manifests" / "registry.ollama.ai" / "library" / "broken" / "escape").write_text(json.dumps({"layers": [
        {"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:../../../../qwen.gguf"}]}))
    lm_studio = home / ".lmstudio" / "models" / "lmstudio-community" / "Tiny-GGUF"
    lm_studio.mkdir(parents=True)
    os.link(tiny_gguf, lm_studio / "Tiny-Llama-3-Q8_0.gguf")
    (lm_studio / "Big-Q4_K_M-00001-of-00002.gguf").write_bytes(b"GGUF part one")
    (lm_studio / "Big-Q4_K_M-00002-of-00002.gguf").write_bytes(b"GGUF part two")
    snapshot = home / ".cache" / "huggingface" / "hub" / "models--acme--Tiny-GGUF" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    os.link(tiny_gguf, snapshot / "tiny-hf-Q8_0.gguf")
    return {"HOME": str(home)}


def test_each_stores_models_are_found_and_named_as_their_app_names_them(home):
    found = {m.name: m for m in find_store_models(home)}
    assert sorted(found) == ["Big-Q4_K_M", "Tiny-Llama-3-Q8_0", "hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M",
                             "llama3.2:3b", "qwen2.5:7b", "tiny-hf-Q8_0"]
    assert {name: m.store for name, m in found.items()} == {
        "llama3.2:3b": "Ollama", "hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M": "Ollama", "qwen2.5:7b": "Ollama",
        "Tiny-Llama-3-Q8_0": "LM Studio", "Big-Q4_K_M": "LM Studio", "tiny-hf-Q8_0": "Hugging Face cache"}
    assert found["llama3.2:3b"].path.parent.name == "blobs" and found["llama3.2:3b"].unusable is None
    assert found["qwen2.5:7b"].unusable == "a qwen2 model: this engine runs Llama-architecture ones"
    assert found["Big-Q4_K_M"].unusable == "split in 2 files: merge them first (llama-gguf-split --merge)"
    assert find_store_models(home | {"LLAMA_MODEL_STORES": "off"}) == []


def test_more_folders_by_llama_model_stores_and_ollama_models(home, tmp_path, tiny_gguf):
    extra = tmp_path / "my-models"
    extra.mkdir()
    os.link(tiny_gguf, extra / "Mine.gguf")
    moved = tmp_path / "elsewhere"
    shutil.move(Path(home["HOME"]) / ".ollama" / "models", moved)
    env = home | {"LLAMA_MODEL_STORES": str(extra), "OLLAMA_MODELS": str(moved)}
    found = {m.name: m.store for m in find_store_models(env)}
    assert found["Mine"] == str(extra) and found["llama3.2:3b"] == "Ollama"


def test_a_store_model_loads_where_it_lies_with_the_logits_of_its_import(home, tiny_gguf, tmp_path, monkeypatch):
    """Read in place (the file's map: nothing copied into the weights folder) and imported: the same logits."""
    blob = next(m.path for m in find_store_models(home) if m.name == "llama3.2:3b")
    monkeypatch.setattr("model.checkpoint.configured", lambda: type("O", (), {"cache_dir": tmp_path / "cache"})())
    in_place = load_checkpoint(blob, dtype=torch.float32)
    main([str(tiny_gguf), "--weights-dir", str(tmp_path / "weights")])
    imported = load_checkpoint(tmp_path / "weights" / "Tiny-Llama-3-Q8_0", dtype=torch.float32)
    ids = prompt_ids(n=16)
    with torch.no_grad():
        assert torch.equal(in_place.model(ids), imported.model(ids))
    assert in_place.tokenizer.encode("Hello, world") == imported.tokenizer.encode("Hello, world")
    assert sorted(p.name for p in (tmp_path / "cache" / "gguf").iterdir()) != []  # its metadata's folder, kept
    assert load_checkpoint(blob, dtype=torch.float32).path  # a second load reuses that folder


def test_the_engine_offers_usable_store_models_after_the_weights_folders(home, monkeypatch, tmp_path):
    monkeypatch.setattr(os, "environ", {**os.environ, **home, "LLAMA_MODEL_STORES": ""})
    weights = tmp_path / "weights"
    (weights / "llama3.2:3b").mkdir(parents=True)  # a model of the weights folder of the same name comes first
    (weights / "llama3.2:3b" / "config.json").write_text("{}")
    (weights / "llama3.2:3b" / "model.safetensors").write_bytes(b"")
    profiles = find_profiles(weights / "llama3.2:3b", weights)
    assert list(profiles) == ["llama3.2:3b", "hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M", "Tiny-Llama-3-Q8_0",
                              "tiny-hf-Q8_0"]
    assert profiles["llama3.2:3b"] == weights / "llama3.2:3b"


def test_the_architecture_is_read_from_the_first_bytes(tiny_gguf, tmp_path):
    assert gguf_architecture(tiny_gguf) == "llama"
    (tmp_path / "short").write_bytes(b"GGUF\x03\x00")
    (tmp_path / "text").write_text("not a model")
    assert gguf_architecture(tmp_path / "short") is None and gguf_architecture(tmp_path / "text") is None
