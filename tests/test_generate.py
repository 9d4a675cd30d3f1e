"""Streaming text, and the terminal chat (`python -m model.chat`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from model import TextStream, load_tokenizer

from checkpoints import hf_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def llama3_tokenizer(tmp_path_factory):
    return load_tokenizer(tmp_path_factory.mktemp("empty"))  # falls back to the llama-models copy


def test_text_stream_never_emits_half_characters(llama3_tokenizer):
    text = "Llamas 🦙🦙 like 你好世界 and naïve café ☕️ — ok 👩‍👩‍👧"
    ids = llama3_tokenizer.encode(text)
    # The test is only meaningful if some tokens are pieces of one character.
    assert any("\ufffd" in llama3_tokenizer.decode([i]) for i in ids)
    stream = TextStream(llama3_tokenizer)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == text


def test_text_stream_keeps_leading_spaces_and_newlines(llama3_tokenizer):
    text = "  def f(x):\n\treturn x  \n\n"
    stream = TextStream(llama3_tokenizer)
    assert "".join([stream.push(i) for i in llama3_tokenizer.encode(text)] + [stream.flush()]) == text


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    hf_model(seed=3).save_pretrained(folder)
    return folder


def run_chat(*args, input_text=None):
    return subprocess.run([sys.executable, "-m", "model.chat", *args], cwd=ROOT, input=input_text,
                          capture_output=True, text=True, timeout=120)


def test_cli_answers_one_prompt_and_reports_stats(tiny_folder):
    r = run_chat("--checkpoint", str(tiny_folder), "--temperature", "0", "--max-new-tokens", "5",
                 "--dtype", "fp32", "Hello there")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()  # random weights: some text, five tokens of it
    assert "prompt tokens" in r.stderr and "5 new" in r.stderr and "tokens/s" in r.stderr


def test_cli_interactive_multi_turn(tiny_folder):
    r = run_chat("--checkpoint", str(tiny_folder), "--temperature", "0", "--max-new-tokens", "3",
                 "--system", "Be brief.", input_text="hi\nsecond turn\n/exit\n")
    assert r.returncode == 0, r.stderr
    stats = [line for line in r.stderr.splitlines() if "prompt tokens" in line]
    assert len(stats) == 2
    assert "(0 cached)" in stats[0] and "(0 cached)" not in stats[1]  # the second turn reuses the cache


def test_cli_bad_checkpoint_exits_2_with_one_clear_line(tmp_path):
    r = run_chat("--checkpoint", str(tmp_path / "missing"), "hi")
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: {tmp_path / 'missing'}: no such file or folder"
    assert "Traceback" not in r.stderr


def test_cli_prompt_too_long_exits_2(tiny_folder):
    r = run_chat("--checkpoint", str(tiny_folder), "--max-context", "16", "word " * 50)
    assert r.returncode == 2 and "context limit is 16" in r.stderr and "Traceback" not in r.stderr
