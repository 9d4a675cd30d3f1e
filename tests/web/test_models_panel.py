"""The chat's models panel (app.web.models_panel), through the Chainlit handlers: the models listed, a first start's
suggestion, a pull from a stand-in hub with its progress, a cancel and the pull that goes on from it, use, make
default (kept in the data folder, LLAMA_CHECKPOINT first), remove, and who may do what (LLAMA_MODEL_ADMINS)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import threading
import time

import pytest
from support.app import imported_app
from support.checkpoints import hf_model, write_tiny_checkpoint
from support.fake_hub import FakeHub
from support.gguf_checkpoints import write_llama3_gguf
from support.handlers import Chat

from app.settings import Settings
from app.weights import bytes_here
from app.web import models_panel

PULLED, GATED = "acme/Tiny-Pulled", "acme/Tiny-Gated"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    hub = FakeHub()
    hub.add_folder(PULLED, write_tiny_checkpoint(tmp_path_factory.mktemp("hub") / "Tiny-Pulled", seed=1))
    hub.add_folder(GATED, write_tiny_checkpoint(tmp_path_factory.mktemp("gated") / "Tiny-Gated", seed=2), gated=True)
    yield hub
    hub.stop()


@pytest.fixture(scope="module")
def main(hub, tmp_path_factory):
    weights = tmp_path_factory.mktemp("weights")
    write_tiny_checkpoint(weights / "tiny")
    data = tmp_path_factory.mktemp("data")
    saved = {name: os.environ.get(name) for name in ("HF_ENDPOINT", "HF_HOME", "HF_TOKEN")}
    os.environ.update(HF_ENDPOINT=hub.url, HF_HOME=str(data / "hf"))
    os.environ.pop("HF_TOKEN", None)
    try:
        with imported_app(checkpoint=weights / "tiny", weights_dir=weights, max_context=512, max_new_tokens=4,
                          threads=1, history="off", history_db=data / "history.db") as main:
            yield main
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)


def run(coroutine, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


def panel(chat: Chat) -> dict:
    import chainlit as cl
    chat.enter()
    return cl.user_session.get("models_panel").props


async def click(chat: Chat, **payload) -> dict:
    import chainlit as cl
    chat.enter()
    await chat.main.models_action(cl.Action(name="models", payload=payload))
    return panel(chat)


async def until(chat: Chat, check, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while not check(props := panel(chat)):
        assert time.monotonic() < deadline, props
        await asyncio.sleep(0.1)
    return props


def test_the_panel_lists_the_models_and_a_first_start_suggests_llama(main):
    chat = Chat(main)

    async def scenario():
        await chat.start()
        await chat.send("/models")
        return panel(chat), await main.starters()

    props, starters = run(scenario())
    (tiny,) = props["models"]
    assert tiny["name"] == "tiny" and tiny["default"] and tiny["current"] and tiny["loaded"]
    assert "parameters" in tiny["details"] and tiny["context"] == 512
    assert tiny["memory"].endswith("MB in memory"), tiny
    assert "**tiny**" in props["note"] and props["admin"]
    assert [(s["repo"], s["account"]) for s in props["suggestions"]] == [
        ("bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M", "no account needed"),
        ("bartowski/Llama-3.2-3B-Instruct-GGUF:Q4_K_M", "no account needed"),
        ("meta-llama/Llama-3.2-1B-Instruct", "needs a Hugging Face account that accepted Meta's license, and HF_TOKEN "
                                             "on the server"),
        ("meta-llama/Llama-3.2-3B-Instruct", "needs a Hugging Face account that accepted Meta's license, and HF_TOKEN "
                                             "on the server")]
    assert all(s["size"].endswith(("MB", "GB")) and "memory" in s["memory"] for s in props["suggestions"])
    assert starters[0].message == "/models" and "tiny" in starters[0].label
    assert chat.conversation().messages == []  # the command is not a turn of the chat


def test_a_pull_shows_its_progress_can_be_cancelled_goes_on_and_its_model_is_used(main, hub):
    chat = Chat(main)
    hub.held = threading.Event()  # the weights' second half waits: the small files come whole
    hub.held_files = {"model.safetensors"}

    async def scenario():
        await chat.start()
        await chat.send("/models")
        props = await click(chat, do="pull", source=PULLED)
        assert props["said"] == f"Pulling {PULLED}…"
        partial = main.SETTINGS.weights_dir / ".Tiny-Pulled.download"
        moving = await until(chat, lambda p: p["pulls"] and p["pulls"][0]["done"] > 0 and p["pulls"][0]["total"]
                             and hub.gets("model.safetensors") and (partial / "config.json").is_file())
        cancelled = await click(chat, do="cancel", source=PULLED)
        ended = await until(chat, lambda p: not p["pulls"])
        kept = sum(f.stat().st_size for f in partial.rglob("*") if f.is_file())
        hub.held.set()
        await click(chat, do="pull", source=PULLED)
        done = await until(chat, lambda p: not p["pulls"] and "Tiny-Pulled" in [m["name"] for m in p["models"]])
        used = await click(chat, do="use", name="Tiny-Pulled")
        await chat.send("Hello")
        return moving, cancelled, ended, kept, done, used

    try:
        moving, cancelled, ended, kept, done, used = run(scenario(), 240)
    finally:
        hub.held = hub.held_files = None
    pull = moving["pulls"][0]
    assert pull["source"] == PULLED and 0 < pull["done"] < pull["total"] and pull["total_text"].endswith("MB")
    assert cancelled["said"] == f"Cancelled pulling {PULLED}."
    assert ended["said"].startswith(f"cancelled: pulling {PULLED} again goes on from the")
    assert kept > 0  # what came before the cancel stays, for the next pull
    assert [i["source"] for i in ended["interrupted"]] == [PULLED]  # offered again, after a restart too
    assert ended["interrupted"][0]["here"] == models_panel.size_text(kept)  # what the cancel said goes on from
    assert done["interrupted"] == [] and moving["interrupted"] == []
    assert done["said"] == "Tiny-Pulled is here: choose Use to chat with it."
    assert len(done["suggestions"]) == 4  # a model pulled that is none of them leaves them all
    assert used["said"].startswith("This chat now uses Tiny-Pulled")
    assert chat.conversation().model == "Tiny-Pulled" and chat.stats()  # it answered
    assert [m["name"] for m in used["models"] if m["current"]] == ["Tiny-Pulled"]
    assert len(hub.gets("model.safetensors")) == 2
    assert len(hub.gets("config.json")) == 1  # here whole before the cancel: not fetched again


def test_a_pull_that_cannot_be_says_why_in_one_line(main):
    chat = Chat(main)

    async def ended(source: str) -> str:
        await click(chat, do="pull", source=source)
        return (await until(chat, lambda p: not p["pulls"] and source in p["said"] and "…" not in p["said"]))["said"]

    async def scenario():
        await chat.start()
        await chat.send("/models")
        refused = await click(chat, do="pull", source="not a model")
        return refused["said"], await ended("acme/No-Such-Model"), await ended(GATED)

    refused, missing, gated = run(scenario())
    assert refused.startswith("Not pulled: 'not a model' is not a Hugging Face model id")
    assert all("\n" not in line for line in (missing, gated))
    assert missing.startswith("Not pulled: acme/No-Such-Model: no such model on http"), missing
    assert gated.startswith(f"Not pulled: {GATED} is gated: accept its terms") and "HF_TOKEN" in gated, gated


def test_a_folder_of_gguf_files_on_this_machine_is_imported(main, tmp_path):
    chat = Chat(main)
    write_llama3_gguf(hf_model(seed=3), tmp_path / "Tiny-Llama-3-q8_0.gguf", "q8_0")

    async def scenario():
        await chat.start()
        await chat.send("/models")
        await click(chat, do="pull", source=str(tmp_path))
        return await until(chat, lambda p: not p["pulls"] and "is here" in p["said"], timeout=120)

    props = run(scenario(), 180)
    assert props["said"] == "Tiny-Llama-3-q8_0 is here: choose Use to chat with it."
    (imported,) = [m for m in props["models"] if m["name"] == "Tiny-Llama-3-q8_0"]
    assert "GGUF import" in imported["details"] and "int8" in imported["details"]


def test_pulls_that_end_together_each_say_how_they_ended(main, tmp_path):
    """Two imports started one after the other end while the panel refreshes for both: each one's line stays."""
    chat = Chat(main)
    for name, seed in (("Tiny-First-q8_0", 4), ("Tiny-Second-q8_0", 5)):
        (tmp_path / name).mkdir()
        write_llama3_gguf(hf_model(seed=seed), tmp_path / name / f"{name}.gguf", "q8_0")

    async def scenario():
        await chat.start()
        await chat.send("/models")
        await click(chat, do="pull", source=str(tmp_path / "Tiny-First-q8_0"))
        await click(chat, do="pull", source=str(tmp_path / "Tiny-Second-q8_0"))
        ended = await until(chat, lambda p: not p["pulls"] and p["said"].count("is here") == 2, timeout=120)
        await click(chat, do="use", name="Tiny-First-q8_0")
        return ended, panel(chat)

    ended, used = run(scenario(), 180)
    assert sorted(ended["said"].split("\n")) == [f"{name} is here: choose Use to chat with it."
                                                  for name in ("Tiny-First-q8_0", "Tiny-Second-q8_0")]
    assert used["said"].startswith("This chat now uses Tiny-First-q8_0") and "is here" not in used["said"]


def test_a_gguf_address_is_downloaded_cut_then_resumed_and_imported(main, hub, tmp_path):
    gguf = write_llama3_gguf(hf_model(seed=4), tmp_path / "Tiny-Llama-3-f16.gguf", "f16")
    (tmp_path / "page.gguf").write_text("<!doctype html><title>A model's page</title>")  # no GGUF at that address
    hub.add_folder("acme/GGUFs", tmp_path)
    url = f"{hub.url}/acme/GGUFs/resolve/main/{gguf.name}"
    hub.drop_after[gguf.name] = 20_000  # the first try is cut after 20 kB
    chat = Chat(main)

    async def ended(source: str) -> dict:
        await click(chat, do="pull", source=source)
        return await until(chat, lambda p: not p["pulls"] and "…" not in p["said"], timeout=120)

    async def scenario():
        await chat.start()
        await chat.send("/models")
        return (await ended(url), await ended(url), await ended(f"{hub.url}/acme/GGUFs/resolve/main/notes.txt"),
                await ended(f"{hub.url}/acme/GGUFs/resolve/main/page.gguf"))

    cut, done, refused, not_gguf = run(scenario(), 240)
    assert "bytes that are not a GGUF file" in not_gguf["said"], not_gguf["said"]
    assert not_gguf["interrupted"] == [] and not list(main.SETTINGS.weights_dir.glob(".page*"))  # nothing left
    assert cut["said"].startswith(f"Not pulled: {url}: the download was cut"), cut["said"]
    assert [i["source"] for i in cut["interrupted"]] == [url]
    assert done["said"] == "Tiny-Llama-3-f16 is here: choose Use to chat with it.", done["said"]
    assert hub.gets(gguf.name) == [None, "bytes=20000-"]  # the second try went on from the cut
    assert done["interrupted"] == [] and not list(main.SETTINGS.weights_dir.glob(".Tiny-Llama-3-f16*"))
    assert refused["said"].startswith("Not pulled: ") and "not the address of a .gguf file" in refused["said"]


def test_the_default_chosen_is_kept_in_the_data_folder_and_llama_checkpoint_comes_first(main):
    chat = Chat(main)
    unset = models_panel.ModelsPanel(main.BACKEND, main.MODELS.weights,
                                     dataclasses.replace(main.SETTINGS, checkpoint_set=False))
    weights = main.SETTINGS.weights_dir
    write_tiny_checkpoint(weights / "other")

    async def scenario():
        await chat.start()
        await main.BACKEND.find_models()
        await chat.send("/models")
        overridden = await click(chat, do="default", name="other")
        return overridden, await unset.act({"do": "default", "name": "other"}, chat.conversation(), None, busy=False)

    overridden, chosen = run(scenario())
    assert main.SETTINGS.checkpoint_set and overridden["said"].startswith("LLAMA_CHECKPOINT is set")
    assert chosen == "other is the default model from the next start of the server."
    env = {"LLAMA_WEIGHTS_DIR": str(weights), "LLAMA_HISTORY_DB": str(main.SETTINGS.history_db)}
    assert Settings.from_env(env).checkpoint == weights / "other"
    assert Settings.from_env(env | {"LLAMA_CHECKPOINT": str(weights / "tiny")}).checkpoint == weights / "tiny"
    (main.SETTINGS.data_dir / "default-model").write_text("../tiny\n")  # never a folder outside the weights
    assert Settings.from_env(env).checkpoint != weights / "tiny"


def test_only_model_admins_pull_remove_or_choose_and_removing_asks_nothing_of_others(main):
    chat = Chat(main)
    write_tiny_checkpoint(main.SETTINGS.weights_dir / "spare")
    signed_in = Settings(auth="password", password="x", api_key="k", model_admins=("ann",))
    guarded = models_panel.ModelsPanel(main.BACKEND, main.MODELS.weights, signed_in)

    async def scenario():
        await chat.start()
        await main.BACKEND.find_models()
        conversation = chat.conversation()
        said = [await guarded.act({"do": do, "name": "spare", "source": PULLED}, conversation, "bob", busy=False)
                for do in ("pull", "remove", "default", "cancel", "unload")]
        used = await guarded.act({"do": "use", "name": "spare"}, conversation, "bob", busy=False)
        props = await guarded.props("tiny", "bob")
        removed = await guarded.act({"do": "remove", "name": "spare"}, conversation, "ann", busy=False)
        default = await guarded.act({"do": "remove", "name": "tiny"}, conversation, "ann", busy=False)
        return said, used, props, removed, default

    said, used, props, removed, default = run(scenario())
    assert all(s.startswith("Only the users named in LLAMA_MODEL_ADMINS") for s in said)
    assert used.startswith("This chat now uses spare") and not props["admin"]
    assert removed == "Removed spare." and not (main.SETTINGS.weights_dir / "spare").exists()
    assert default.startswith("Not removed: tiny is the server's default model")
    assert Settings().may_manage_models(None) and not signed_in.may_manage_models(None)
    for source, seen in [("/home/ann/models/secret-project/x.Q4_0.gguf", "x.Q4_0.gguf"),
                         ("https://files.example/a/b/x.gguf?token=abc", "x.gguf"), (PULLED, PULLED)]:
        assert models_panel.public_source(source) == seen  # what bob sees of ann's pulls
    assert Settings(model_admins=()).may_manage_models(None) is False


def test_a_loaded_model_is_unloaded_by_its_button_and_removed_unloading_it_first(main):
    chat = Chat(main)
    write_tiny_checkpoint(main.SETTINGS.weights_dir / "spare")

    async def scenario():
        await chat.start()
        await main.BACKEND.find_models()
        await chat.send("/models")
        await click(chat, do="use", name="spare")
        await chat.send("Hello")  # spare loads to answer
        loaded = await click(chat, do="use", name="spare")
        unloaded = await click(chat, do="unload", name="spare")
        again = await click(chat, do="unload", name="spare")
        await chat.send("Hello again")  # and loads again
        before = main.BACKEND.in_memory("spare")
        removed = await click(chat, do="remove", name="spare")
        return loaded, unloaded, again, before, removed

    loaded, unloaded, again, before, removed = run(scenario(), 120)
    assert [m["loaded"] for m in loaded["models"] if m["name"] == "spare"] == [True]
    assert unloaded["said"] == "Unloaded spare: it loads again when a chat uses it."
    assert [m["loaded"] for m in unloaded["models"] if m["name"] == "spare"] == [False]
    assert again["said"] == "spare is not loaded."
    assert before and removed["said"] == "Removed spare." and not (main.SETTINGS.weights_dir / "spare").exists()
    assert "spare" not in [m["name"] for m in removed["models"]]


def test_a_pulls_progress_gives_a_time_left_once_its_speed_means_something_and_says_when_it_is_finishing(tmp_path):
    from app.weights import Pull

    partial = tmp_path / ".Model.download"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"x" * 800)
    pull = Pull("acme/Model", None, tmp_path / "Model", partial, sizes={"model.safetensors": 72_700_000})
    first = models_panel.pull_state(pull)  # a moment in, 800 bytes: no speed, no time left yet (not "88476 s left")
    assert first["speed"] is None and first["left"] is None and first["done_text"] == "800 bytes"
    pull.started -= 10
    (partial / "model.safetensors").write_bytes(b"x" * 36_350_000)
    half = models_panel.pull_state(pull)
    assert half["speed"] == "3.6 MB/s" and half["left"] == "10 s left"
    (partial / "model.safetensors").write_bytes(b"x" * 72_700_000)
    assert models_panel.pull_state(pull)["left"] == "finishing: the files are checked and moved into place"
    partial.rename(tmp_path / "Model")  # moved into place, not yet marked done: its bytes are still counted
    assert pull.completed() == 72_700_000
    assert [models_panel.time_text(s) for s in (12, 300, 4800, 9000)] == ["12 s", "5 min", "80 min", "2 h 30 min"]


def test_a_suggestion_being_pulled_is_not_offered_again(tmp_path):
    from types import SimpleNamespace

    from app.weights import Pull

    under_way = [Pull("bartowski/Llama-3.2-1B-Instruct-GGUF", "Q4_K_M", None, None)]
    weights = SimpleNamespace(folder=tmp_path, under_way=lambda: under_way)
    panel = models_panel.ModelsPanel(SimpleNamespace(profiles={"tiny": str(tmp_path / "tiny")}), weights, Settings())
    offered = [s["repo"] for s in panel.suggestions()]
    assert "bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M" not in offered and len(offered) == 3


def test_a_failures_terminal_words_are_the_pages():
    said = models_panel.page_words("cannot reach https://huggingface.co (ConnectError); check the network (or "
                                   "HF_ENDPOINT, HF_HUB_OFFLINE, the proxy settings) and run the same command again")
    assert said.endswith("the proxy settings) and pull it again") and "command" not in said
    assert models_panel.page_words("acme/x is gated: accept its terms, then set HF_TOKEN and run again").endswith(
        "and pull it again")


def test_a_downloads_bytes_are_counted_while_it_moves_its_files(tmp_path):
    """A pull's progress adds up its download folder while huggingface_hub makes, moves and removes files and folders
    in it: what goes meanwhile counts nothing, and the count never fails (a folder gone in the middle of the walk
    once ended a pull's progress stream with FileNotFoundError, and the client's pull with it)."""
    folder = tmp_path / "download"
    (folder / "kept").mkdir(parents=True)
    (folder / "kept" / "model.gguf").write_bytes(b"x" * 1000)
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            nested = folder / ".cache" / "huggingface" / "download" / "deep"
            nested.mkdir(parents=True, exist_ok=True)
            (nested / "model.gguf.incomplete").write_bytes(b"y" * 10)
            shutil.rmtree(folder / ".cache", ignore_errors=True)

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        counts = {bytes_here(folder) for _ in range(3000)}
    finally:
        stop.set()
        thread.join()
    assert counts <= {1000, 1010} and 1000 in counts
