"""`python -m model.fetch <owner/name>` against a local stand-in for the Hugging Face Hub (fake_hub.py):
the files the engine needs and nothing else, a folder that loads with the source's logits, resuming,
and one line with exit status 2 for a gated or missing repo, a server that is gone, a full disk."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support.checkpoints import hf_model, prompt_ids
from support.fake_hub import FakeHub
from support.gguf_checkpoints import write_llama3_gguf

from model import load_checkpoint
from model.convert.folder import SOURCE_FILE, source_of
from model.fetch import main
from model.tokenizer import meta_tokenizer_model

ROOT = Path(__file__).resolve().parents[2]
REPO = "acme/Tiny-Llama-3"
ENGINE_FILES = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors", "model.safetensors.index.json", "original/tokenizer.model"]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A Llama 3 repo as Meta publishes one: sharded safetensors, plus files the engine does not need."""
    folder = tmp_path_factory.mktemp("hub") / "Tiny-Llama-3"
    hf_model(seed=3).to(torch.bfloat16).save_pretrained(folder, max_shard_size="12MB")
    (folder / "original").mkdir()
    shutil.copyfile(meta_tokenizer_model(), folder / "original" / "tokenizer.model")
    (folder / "original" / "consolidated.00.pth").write_bytes(b"\0" * 3_000_000)
    (folder / "original" / "params.json").write_text("{}")
    (folder / "README.md").write_text("# Tiny Llama 3\n")
    (folder / "model.gguf").write_bytes(b"GGUF" + b"\0" * 1000)
    return folder


@pytest.fixture
def hub(source, monkeypatch):
    hub = FakeHub()
    hub.add_folder(REPO, source)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    yield hub
    hub.stop()


@pytest.fixture
def weights_dir(tmp_path) -> Path:
    """A weights folder that already holds something of the user's."""
    folder = tmp_path / "weights"
    (folder / "Other-Model").mkdir(parents=True)
    (folder / "Other-Model" / "config.json").write_text("{}\n")
    return folder


def snapshot(folder: Path) -> dict[str, int]:
    """Every path under `folder` with its mtime: equal snapshots mean nothing was touched."""
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*"))}


def files_under(folder: Path) -> list[str]:
    """The files of a model folder, but the note of where it came from (model/convert/folder.py's note_source)."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != SOURCE_FILE)


def fetch_fails(argv: list[str], capsys) -> str:
    """Run the command, expect exit status 2, return its one line of error."""
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and err.rstrip().endswith(errors[0]) and "Traceback" not in err, err
    return errors[0]


def same_logits(folder: Path, source: Path):
    ids = prompt_ids(n=24)
    ours, theirs = load_checkpoint(folder, dtype=torch.float32), load_checkpoint(source, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(ours.model(ids), theirs.model(ids))


# ---- success ---------------------------------------------------------------------------------------

def test_downloads_only_the_engine_files_into_weights_and_they_load(hub, source, weights_dir, capsys):
    main([REPO, "--weights-dir", str(weights_dir)])
    folder = weights_dir / "Tiny-Llama-3"
    assert capsys.readouterr().out.strip() == str(folder)
    assert files_under(folder) == ENGINE_FILES and source_of(folder) == (REPO, None)  # (and where it came from)
    assert sorted(p.name for p in weights_dir.iterdir()) == ["Other-Model", "Tiny-Llama-3"]  # no temp left
    assert all(filecmp.cmp(folder / f, source / f, shallow=False) for f in ENGINE_FILES)
    assert hub.gets("consolidated.00.pth") == [] and hub.gets("model.gguf") == []
    same_logits(folder, source)


def test_as_a_user_runs_it(hub, weights_dir):
    done = subprocess.run([sys.executable, "-m", "model.fetch", REPO, "--weights-dir", str(weights_dir),
                           "--name", "mine"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "0"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(weights_dir / "mine")
    assert files_under(weights_dir / "mine") == ENGINE_FILES


def test_a_dropped_connection_resumes_where_it_stopped(hub, source, weights_dir):
    shard = "model-00001-of-00002.safetensors"  # 16 MB; huggingface_hub writes it in 10 MB pieces
    hub.drop_after[shard] = 11_000_000
    main([REPO, "--weights-dir", str(weights_dir)])
    first, again = hub.gets(shard)
    assert first is None and again == "bytes=10485760-"  # the second request asks only for the rest
    assert filecmp.cmp(weights_dir / "Tiny-Llama-3" / shard, source / shard, shallow=False)


def test_a_run_cut_off_midway_is_resumed_by_the_next(hub, source, weights_dir, capsys, monkeypatch):
    import huggingface_hub.file_download
    monkeypatch.setattr(huggingface_hub.file_download.time, "sleep", lambda s: None)  # its retry pauses
    shard = "model-00001-of-00002.safetensors"
    hub.drop_after[shard] = 2_000_000
    hub.gone_after_drop = True
    before = snapshot(weights_dir)
    line = fetch_fails([REPO, "--weights-dir", str(weights_dir)], capsys)
    assert f"cannot reach {hub.url}" in line and "run the same command again" in line
    partial = weights_dir / ".Tiny-Llama-3.download"
    assert set(snapshot(weights_dir)) - set(before) <= {p for p in snapshot(weights_dir) if p.startswith(".")}
    assert not (weights_dir / "Tiny-Llama-3").exists() and (partial / "config.json").is_file()
    done_before = [f for f in ENGINE_FILES if (partial / f).is_file()]
    assert shard not in done_before and len(done_before) >= 2

    again = FakeHub()  # the network is back
    again.add_folder(REPO, source)
    monkeypatch.setenv("HF_ENDPOINT", again.url)
    try:
        main([REPO, "--weights-dir", str(weights_dir)])
    finally:
        again.stop()
    fetched_again = [f for f in ENGINE_FILES if again.gets(Path(f).name)]
    assert shard in fetched_again and not set(fetched_again) & set(done_before)
    assert files_under(weights_dir / "Tiny-Llama-3") == ENGINE_FILES and not partial.exists()
    same_logits(weights_dir / "Tiny-Llama-3", source)


# ---- failures: one line, exit status 2, weights/ as it was ------------------------------------------

def test_gated_repo_without_a_token(hub, weights_dir, capsys):
    hub.repos[REPO].gated = True
    before = snapshot(weights_dir)
    line = fetch_fails([REPO, "--weights-dir", str(weights_dir)], capsys)
    assert line == (f"error: {REPO} is gated: accept its terms at {hub.url}/{REPO}, then set HF_TOKEN "
                    "(or run `hf auth login`) and run again")
    assert snapshot(weights_dir) == before


def test_gated_repo_with_a_token_not_granted_then_granted(hub, weights_dir, capsys, monkeypatch):
    hub.repos[REPO].gated = True
    monkeypatch.setenv("HF_TOKEN", "hf_not_yet")
    before = snapshot(weights_dir)
    line = fetch_fails([REPO, "--weights-dir", str(weights_dir)], capsys)
    assert line.startswith(f"error: {REPO} is gated and your token has no access yet: accept its terms at "
                           f"{hub.url}/{REPO}")
    assert snapshot(weights_dir) == before
    hub.repos[REPO].granted_tokens.add("hf_not_yet")
    main([REPO, "--weights-dir", str(weights_dir)])
    assert files_under(weights_dir / "Tiny-Llama-3") == ENGINE_FILES


def test_missing_repo(hub, weights_dir, capsys):
    before = snapshot(weights_dir)
    line = fetch_fails(["acme/No-Such-Model", "--weights-dir", str(weights_dir)], capsys)
    assert line == (f"error: acme/No-Such-Model: no such model on {hub.url}; check the id (owner/name), and "
                    "for a private model set HF_TOKEN (or run `hf auth login`)")
    assert snapshot(weights_dir) == before


def test_server_gone(hub, weights_dir, capsys):
    hub.stop()
    before = snapshot(weights_dir)
    line = fetch_fails([REPO, "--weights-dir", str(weights_dir)], capsys)
    assert line.startswith(f"error: cannot reach {hub.url} (ConnectError); check the network")
    assert snapshot(weights_dir) == before


def test_too_little_free_space_is_refused_up_front(hub, weights_dir, capsys, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=5_000_000))
    before = snapshot(weights_dir)
    line = fetch_fails([REPO, "--weights-dir", str(weights_dir)], capsys)
    assert line.startswith(f"error: {weights_dir}: not enough disk space for the model: need ")
    assert line.endswith("5 MB free; free some space and run again")
    assert snapshot(weights_dir) == before and hub.gets("config.json") == []


def test_disk_full_midway_says_so(hub, weights_dir, capsys, monkeypatch):
    import errno

    import huggingface_hub.file_download

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(huggingface_hub.file_download, "http_get", full)
    before = snapshot(weights_dir)
    line = fetch_fails([REPO, "--weights-dir", str(weights_dir)], capsys)
    assert line == (f"error: {weights_dir}: no space left on device while downloading {REPO}; free some space "
                    "and run the same command again")
    assert snapshot(weights_dir) == before


def test_a_repo_of_another_architecture_is_refused(hub, source, weights_dir, capsys, tmp_path):
    other = tmp_path / "qwen"
    shutil.copytree(source, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"model_type": "qwen2"}))
    hub.add_folder("acme/Qwen", other)
    before = snapshot(weights_dir)
    line = fetch_fails(["acme/Qwen", "--weights-dir", str(weights_dir)], capsys)
    assert line == ("error: acme/Qwen: config.json: model_type='qwen2', expected 'llama'; this engine runs "
                    "Llama-architecture models")
    assert snapshot(weights_dir) == before and hub.gets("model-00001-of-00002.safetensors") == []


def test_a_repo_without_safetensors_is_refused(hub, weights_dir, capsys):
    hub.repos["acme/Nothing"] = type(hub.repos[REPO])({"README.md": b"hi", "notes.txt": b"none"})
    line = fetch_fails(["acme/Nothing", "--weights-dir", str(weights_dir)], capsys)
    assert line == ("error: acme/Nothing: expected a transformers checkpoint (config.json and "
                    "model.safetensors) or .gguf files, found README.md, notes.txt")


# ---- a repo of .gguf files (as llama.cpp's users publish them) -----------------------------------------

@pytest.fixture(scope="module")
def gguf_repo(tmp_path_factory) -> dict[str, bytes]:
    """The files of a repo of one model in several quantizations, and one split in parts."""
    folder = tmp_path_factory.mktemp("gguf-repo")
    model = hf_model(seed=3)
    files = {f"Tiny-Llama-3-{tag}.gguf": write_llama3_gguf(model, folder / f"{tag}.gguf", tag.lower()).read_bytes()
             for tag in ("Q8_0", "Q4_0")}
    return files | {"Tiny-Llama-3-Q5_K_M-00001-of-00002.gguf": b"GGUF part", "README.md": b"# GGUF"}


def test_a_gguf_repo_by_its_quantization_fetches_that_file_only(hub, gguf_repo, weights_dir, capsys):
    """Ollama's hf.co/owner/name:Q4_0 (any case): that file alone, imported into NAME-Q4_0, the download gone."""
    hub.repos["acme/Tiny-Llama-3-GGUF"] = type(hub.repos[REPO])(dict(gguf_repo))
    main(["acme/Tiny-Llama-3-GGUF", "--revision", "q4_0", "--weights-dir", str(weights_dir)])
    folder = weights_dir / "Tiny-Llama-3-GGUF-Q4_0"
    assert capsys.readouterr().out.split() == [str(folder)]
    assert hub.gets("Tiny-Llama-3-Q4_0.gguf") and not hub.gets("Tiny-Llama-3-Q8_0.gguf")
    assert not hub.gets("Tiny-Llama-3-Q5_K_M-00001-of-00002.gguf")
    assert sorted(p.name for p in weights_dir.iterdir()) == ["Other-Model", "Tiny-Llama-3-GGUF-Q4_0"]
    assert json.loads((folder / "config.json").read_text())["quantization"]["method"] == "int4"
    assert source_of(folder) == ("acme/Tiny-Llama-3-GGUF", "q4_0")  # (Ollama's routes name it by that)
    assert load_checkpoint(folder).config.dim == 64


def test_a_gguf_repo_without_a_tag_gets_the_preferred_quantization(hub, gguf_repo, weights_dir):
    hub.repos["acme/Tiny-Llama-3-GGUF"] = type(hub.repos[REPO])(dict(gguf_repo))
    main(["acme/Tiny-Llama-3-GGUF", "--weights-dir", str(weights_dir)])  # no Q4_K_M, Q4_K_S, Q5_K_M, Q6_K: Q8_0
    assert hub.gets("Tiny-Llama-3-Q8_0.gguf") and not hub.gets("Tiny-Llama-3-Q4_0.gguf")
    assert json.loads((weights_dir / "Tiny-Llama-3-GGUF" / "config.json").read_text())["quantization"] == {
        "method": "int8", "group_size": 32}


def test_a_quantization_the_repo_has_not_is_named_with_those_it_has(hub, gguf_repo, weights_dir, capsys):
    hub.repos["acme/Tiny-Llama-3-GGUF"] = type(hub.repos[REPO])(dict(gguf_repo))
    before = snapshot(weights_dir)
    line = fetch_fails(["acme/Tiny-Llama-3-GGUF", "--revision", "Q6_K", "--weights-dir", str(weights_dir)], capsys)
    assert line == "error: acme/Tiny-Llama-3-GGUF: no Q6_K .gguf file; its quantizations: Q4_0, Q8_0"
    assert snapshot(weights_dir) == before and not [r for r in hub.requests if "/resolve/" in r[1]]


def test_a_gated_gguf_repo_without_a_token_is_refused_before_any_byte(hub, gguf_repo, weights_dir, capsys):
    hub.repos["acme/Tiny-Llama-3-GGUF"] = type(hub.repos[REPO])(dict(gguf_repo), gated=True)
    line = fetch_fails(["acme/Tiny-Llama-3-GGUF", "--revision", "Q4_0", "--weights-dir", str(weights_dir)], capsys)
    assert line.startswith("error: acme/Tiny-Llama-3-GGUF is gated: accept its terms at ")
    assert not [r for r in hub.requests if "/resolve/" in r[1]]


def test_an_existing_folder_is_kept_unless_forced(hub, source, weights_dir, capsys):
    (weights_dir / "Tiny-Llama-3").mkdir()
    (weights_dir / "Tiny-Llama-3" / "mine.txt").write_text("keep")
    line = fetch_fails([REPO, "--weights-dir", str(weights_dir)], capsys)
    assert line == (f"error: {weights_dir / 'Tiny-Llama-3'} already exists; pass --force to download it again, "
                    "or --name to choose another folder")
    main([REPO, "--weights-dir", str(weights_dir), "--force"])
    assert files_under(weights_dir / "Tiny-Llama-3") == ENGINE_FILES


def test_neither_a_path_nor_an_id(weights_dir, capsys):
    line = fetch_fails(["no/such/place.gguf", "--weights-dir", str(weights_dir)], capsys)
    assert line == ("error: no/such/place.gguf: no such file or folder, and not a Hugging Face model id "
                    "(owner/name, e.g. meta-llama/Llama-3.2-1B-Instruct)")


def test_a_fetch_run_by_a_server_ends_when_that_server_is_killed(tmp_path):
    """`--report` (a server runs it: app.weights): killed -9, the server leaves no fetch running to its end."""
    import signal
    import socket
    import time

    hanging = socket.socket()  # accepts, never answers: the download waits
    hanging.bind(("127.0.0.1", 0))
    hanging.listen()
    url = f"http://127.0.0.1:{hanging.getsockname()[1]}/model.gguf"
    server = subprocess.Popen([sys.executable, "-c", f"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-m", "model.fetch", {url!r}, "--weights-dir", {str(tmp_path)!r}, "--report"])
print(child.pid, flush=True)
time.sleep(600)
"""], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        fetch = int(server.stdout.readline())
        hanging.settimeout(60)
        connection, _ = hanging.accept()  # the fetch has connected: under way, waiting for an answer (kept open)
        os.kill(server.pid, signal.SIGKILL)
        server.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and os.path.exists(f"/proc/{fetch}") and \
                open(f"/proc/{fetch}/stat").read().split()[2] != "Z":
            time.sleep(0.1)
        gone = not os.path.exists(f"/proc/{fetch}") or open(f"/proc/{fetch}/stat").read().split()[2] == "Z"
        assert gone, "the fetch went on after its server was killed"
        connection.close()
    finally:
        server.kill()
        hanging.close()
