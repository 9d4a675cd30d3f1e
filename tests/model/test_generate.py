"""Streaming text, sampling inside a reply, and the terminal chat (`python -m model.chat`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from support.checkpoints import hf_model, prompt_ids

from model import TextStream, generate, load_checkpoint, load_tokenizer
from model.generation import sampling_defaults
from model.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


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
def tiny_reference():
    return hf_model(seed=3)


@pytest.fixture(scope="module")
def tiny_folder(tiny_reference, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    tiny_reference.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny(tiny_folder, device):
    return load_checkpoint(tiny_folder, dtype=torch.float32, device=device)


@pytest.mark.parametrize("penalty", [0.5, 1.5])
def test_greedy_with_repetition_penalty_matches_transformers(tiny, tiny_reference, penalty):
    # transformers penalizes every earlier id (prompt included): our window of the whole history.
    prompt = prompt_ids(n=12, seed=5)[0].tolist()
    theirs = tiny_reference.generate(torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=40,
                                     do_sample=False, repetition_penalty=penalty, eos_token_id=None,
                                     pad_token_id=0)[0, len(prompt):].tolist()
    gen = generate(tiny, prompt, max_new_tokens=40, stop_ids=set(),
                   sampling=SamplingParams(repetition_penalty=penalty, penalty_last_n=-1))
    list(gen)
    assert gen.tokens == theirs
    if penalty < 1:  # random weights never repeat by themselves; a reward for repeating shows the effect
        plain = generate(tiny, prompt, max_new_tokens=40, stop_ids=set())
        list(plain)
        assert plain.tokens != theirs


def test_the_sampler_sees_the_prompt_and_every_generated_token(tiny):
    prompt = prompt_ids(n=30, seed=6)[0].tolist()
    gen = generate(tiny, prompt, max_new_tokens=25, stop_ids=set(),
                   sampling=SamplingParams(temperature=1.0, repetition_penalty=1.2, penalty_last_n=16,
                                           frequency_penalty=0.5, seed=3))
    list(gen)
    assert len(gen.tokens) == 25
    assert list(gen.sampler.recent) == (prompt + gen.tokens)[-16:]
    assert gen.sampler.generated == Counter(gen.tokens)


def test_shorthand_keywords_and_sampling_params_are_the_same_reply(tiny):
    prompt = prompt_ids(n=10, seed=7)[0].tolist()
    a = generate(tiny, prompt, max_new_tokens=20, stop_ids=set(), temperature=0.9, top_k=40, top_p=0.95, seed=4)
    b = generate(tiny, prompt, max_new_tokens=20, stop_ids=set(),
                 sampling=SamplingParams(temperature=0.9, top_k=40, top_p=0.95), seed=4)
    c = generate(tiny, prompt, max_new_tokens=20, stop_ids=set(), temperature=0.9, top_k=40, top_p=0.95, seed=5)
    for gen in (a, b, c):
        list(gen)
    assert a.tokens == b.tokens and a.tokens != c.tokens
    with pytest.raises(ValueError, match="either sampling= or temperature="):
        generate(tiny, prompt, sampling=SamplingParams(), temperature=0.5)


def with_generation_config(folder: Path, tmp_path: Path, generation: dict | None) -> Path:
    copy = Path(shutil.copytree(folder, tmp_path / "copy"))
    (copy / "generation_config.json").unlink(missing_ok=True)
    if generation is not None:
        (copy / "generation_config.json").write_text(json.dumps(generation))
    return copy


def test_sampling_defaults_read_the_generation_config(tiny_folder, tmp_path):
    folder = with_generation_config(tiny_folder, tmp_path, {
        "do_sample": True, "temperature": 0.3, "top_k": 20, "top_p": 0.8, "min_p": 0.07,
        "repetition_penalty": 1.15})
    assert sampling_defaults(load_checkpoint(folder)) == SamplingParams(
        temperature=0.3, top_k=20, top_p=0.8, min_p=0.07, repetition_penalty=1.15)


def test_sampling_defaults_fall_back_to_llama3s(tiny_folder, tmp_path):
    assert sampling_defaults(load_checkpoint(with_generation_config(tiny_folder, tmp_path, None))) == \
        SamplingParams(temperature=0.6, top_p=0.9)


def test_sampling_defaults_greedy_when_do_sample_is_false(tiny_folder, tmp_path):
    folder = with_generation_config(tiny_folder, tmp_path, {"do_sample": False, "temperature": 0.7,
                                                             "repetition_penalty": 1.2})
    assert sampling_defaults(load_checkpoint(folder)) == SamplingParams(temperature=0.0, repetition_penalty=1.2)


def test_sampling_defaults_name_the_file_and_the_bad_value(tiny_folder, tmp_path):
    folder = with_generation_config(tiny_folder, tmp_path, {"top_p": 7})
    with pytest.raises(ValueError, match=r"generation_config.json of .*top_p=7"):
        sampling_defaults(load_checkpoint(folder))
    folder = with_generation_config(folder, tmp_path / "again", {"min_p": "lots"})
    with pytest.raises(ValueError, match=r"generation_config.json of .*min_p='lots': expected a float"):
        sampling_defaults(load_checkpoint(folder))


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
                 "--system", "Be brief. " * 200, input_text="hi\nsecond turn\n/exit\n")  # more than a prefill chunk
    assert r.returncode == 0, r.stderr
    stats = [line for line in r.stderr.splitlines() if "prompt tokens" in line]
    assert len(stats) == 2
    assert "(0 cached)" in stats[0] and "(0 cached)" not in stats[1]  # the second turn reuses the cache


def test_cli_bad_checkpoint_exits_2_with_one_clear_line(tmp_path):
    r = run_chat("--checkpoint", str(tmp_path / "missing"), "hi")
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: {tmp_path / 'missing'}: no such file or folder"
    assert "Traceback" not in r.stderr


def test_cli_takes_min_p_and_repeat_penalty(tiny_folder):
    r = run_chat("--checkpoint", str(tiny_folder), "--temperature", "0.7", "--min-p", "0.1",
                 "--repeat-penalty", "1.2", "--seed", "1", "--max-new-tokens", "4", "--dtype", "fp32", "Hi")
    assert r.returncode == 0, r.stderr
    r = run_chat("--checkpoint", str(tiny_folder), "--repeat-penalty", "0", "Hi")
    assert r.returncode == 2 and "repetition_penalty=0.0: expected a number > 0" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_prompt_too_long_exits_2(tiny_folder):
    r = run_chat("--checkpoint", str(tiny_folder), "--max-context", "16", "word " * 50)
    assert r.returncode == 2 and "context limit is 16" in r.stderr and "Traceback" not in r.stderr
