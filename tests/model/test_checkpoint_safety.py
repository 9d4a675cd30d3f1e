"""Checkpoint safety: pickles are only read with weights_only=True, so a .pth that would run code is refused
with a clear message in the chat while the app goes on serving; paths from LLAMA_* variables are made
absolute and logged at start-up; a checkpoint folder that vanishes or changes while the app serves gives
an error message (or nothing at all, for a model already loaded), never a dead server.
"""

from __future__ import annotations

import ast
import asyncio
import logging
import os
import shutil
from pathlib import Path

import chainlit  # noqa: F401  (its configuration is read from the project root, before any test changes folder)
import pytest
import torch
from support.app import imported_app
from support.checkpoints import write_tiny_checkpoint
from support.engine import EngineHarness, request
from support.handlers import Chat
from support.servers import ROOT

from app.messages import Done, Failed, Loading, ReplySettings
from app.settings import Settings
from model.checkpoint import load_checkpoint

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_thread")]

GREEDY = ReplySettings(max_new_tokens=12, temperature=0.0)


class RunsCode:
    """Unpickling this calls os.mkdir(path): what a hostile .pth would do with something worse."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def write_hostile_checkpoint(folder: Path, config_from: Path, marker: Path) -> Path:
    """config.json and a model.pth whose unpickling would create `marker`."""
    folder.mkdir(parents=True)
    shutil.copyfile(config_from / "config.json", folder / "config.json")
    torch.save({"tok_embeddings.weight": RunsCode(marker)}, folder / "model.pth")
    return folder


def events(engine: EngineHarness, model: str | None = None) -> list:
    """Every event of a reply to "Hello" by the model (the default one if None)."""
    r = request("Hello", GREEDY, model=model or engine.engine.models.default)
    return engine.ask(r)[r.id]


def weights_with(tmp_path: Path, **folders: Path) -> Path:
    """A weights folder whose subfolders link to the given checkpoint folders."""
    weights = tmp_path / "weights"
    weights.mkdir()
    for name, folder in folders.items():
        (weights / name).symlink_to(folder)
    return weights


# ---- pickles ------------------------------------------------------------------------------------

def torch_loads(root: Path):
    """(file, line, call) of every torch.load(...) in the project's own Python code."""
    for folder in ("model", "app", "bench"):
        for file in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(file.read_text(), str(file))):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
                    yield file.relative_to(root), node.lineno, node


def test_every_torch_load_is_weights_only():
    calls = list(torch_loads(ROOT))
    assert calls, "found no torch.load at all: is the scan looking in the right place?"
    for file, line, call in calls:
        flags = {k.arg: k.value for k in call.keywords}
        assert isinstance(flags.get("weights_only"), ast.Constant) and flags["weights_only"].value is True, \
            f"{file}:{line}: torch.load without weights_only=True"


def test_the_engine_refuses_a_pickle_that_would_run_code_and_goes_on(tiny, tmp_path):
    marker = tmp_path / "the-pickle-ran"
    hostile = write_hostile_checkpoint(tmp_path / "hostile", tiny, marker)
    engine = EngineHarness(tiny, weights_dir=str(weights_with(tmp_path, hostile=hostile)))
    refused = events(engine, "hostile")
    assert isinstance(refused[0], Loading) and isinstance(refused[-1], Failed)
    assert refused[-1].reason == "load"
    assert "refused" in refused[-1].message and "could run code" in refused[-1].message
    assert "model.pth" in refused[-1].message
    assert not marker.exists(), "the pickle's code ran"
    assert isinstance(events(engine, "tiny")[-1], Done)
    assert isinstance(events(engine, "hostile")[-1], Failed)  # still refused, still serving


def test_chat_shows_why_a_hostile_checkpoint_is_refused_and_the_app_goes_on(tiny, tmp_path):
    marker = tmp_path / "the-pickle-ran"
    weights = tmp_path / "weights"
    shutil.copytree(tiny, weights / "tiny")
    write_hostile_checkpoint(weights / "hostile", tiny, marker)
    with imported_app(checkpoint=weights / "tiny", weights_dir=weights, max_new_tokens=8, threads=1,
                      history="off") as main:
        hostile, working = Chat(main, profile="hostile"), Chat(main)

        async def scenario():
            await hostile.start()
            await hostile.send("Hi")
            await working.start()
            await working.send("Hi")

        asyncio.run(asyncio.wait_for(scenario(), 60))
    assert len(hostile.errors()) == 2  # on choosing the model, and on the message
    for error in hostile.errors():
        assert "could not be loaded" in error and "refused" in error and "could run code" in error
    assert not marker.exists(), "the pickle's code ran"
    assert [r for r in working.replies() if not r.startswith("Loading")] and not working.errors()
    assert len(working.stats()) == 1


# ---- paths --------------------------------------------------------------------------------------

def test_paths_from_the_environment_are_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    settings = Settings.from_env({"LLAMA_CHECKPOINT": "weights/../weights/mine", "LLAMA_WEIGHTS_DIR": "weights",
                                  "LLAMA_TOKENIZER": "~/tokenizer.model"})
    assert settings.checkpoint == tmp_path / "weights" / "mine"
    assert settings.weights_dir == tmp_path / "weights"
    assert settings.tokenizer == Path.home() / "tokenizer.model"
    monkeypatch.chdir(ROOT)
    assert settings.checkpoint == tmp_path / "weights" / "mine"  # whatever the working folder becomes later


def test_start_up_logs_where_each_model_comes_from(tiny, tmp_path, monkeypatch, caplog):
    weights = tmp_path / "weights"
    weights.mkdir()
    shutil.copytree(tiny, tmp_path / "real-folder")
    (weights / "linked").symlink_to(tmp_path / "real-folder")
    monkeypatch.chdir(tmp_path)
    with imported_app(checkpoint="weights/linked", weights_dir="weights", threads=1, history="off") as main:
        async def start():
            await main.start_backend()
            await main.BACKEND.load()

        with caplog.at_level(logging.INFO, logger="app"):
            asyncio.run(start())
        assert main.BACKEND.is_loaded()
    assert f"model linked (default): {(tmp_path / 'real-folder').resolve()}" in caplog.messages


# ---- folders that change while serving ----------------------------------------------------------

def test_a_folder_deleted_before_its_model_loads_is_an_error_and_other_models_go_on(tiny, tmp_path):
    weights = tmp_path / "weights"
    gone = shutil.copytree(tiny, weights / "gone")
    engine = EngineHarness(tiny, weights_dir=str(weights))
    shutil.rmtree(gone)
    failed = events(engine, "gone")[-1]
    assert isinstance(failed, Failed) and failed.reason == "load"
    assert f"The model gone could not be loaded: {gone}: no such file or folder" == failed.message
    assert isinstance(events(engine, "tiny")[-1], Done)
    shutil.copytree(tiny, gone)  # put back: the next request loads it
    assert isinstance(events(engine, "gone")[-1], Done)


def test_a_folder_half_deleted_before_its_model_loads_is_an_error(tiny, tmp_path):
    weights = tmp_path / "weights"
    half = shutil.copytree(tiny, weights / "half")
    engine = EngineHarness(tiny, weights_dir=str(weights))
    (half / "model.safetensors").unlink()
    failed = events(engine, "half")[-1]
    assert isinstance(failed, Failed) and failed.reason == "load" and str(half) in failed.message


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["memory-mapped", "converted"])
def test_a_loaded_model_keeps_working_when_its_files_are_deleted_or_replaced(tiny, tmp_path, dtype):
    """fp32 weights stay memory-mapped from the file; the deleted file's pages stay readable until unmapped.
    (Overwriting a mapped file in place is another matter: replace files by renaming a new one over them.)"""
    folder = shutil.copytree(tiny, tmp_path / "model")
    engine = EngineHarness(folder, loader=lambda name, path: load_checkpoint(path, dtype=dtype), kv_cache_mb=0)
    before = events(engine)[-1]
    assert isinstance(before, Done)
    shutil.rmtree(folder)
    after = events(engine)[-1]
    assert isinstance(after, Done) and after.text == before.text
    write_tiny_checkpoint(tmp_path / "other", seed=5).rename(folder)  # another model in its place
    replaced = events(engine)[-1]
    assert isinstance(replaced, Done) and replaced.text == before.text  # the loaded one still answers
