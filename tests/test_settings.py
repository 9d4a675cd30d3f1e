"""The app's configuration (app/settings.py): every LLAMA_* variable, its default and its errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from app.settings import Settings, SettingsError
from model.options import DEFAULT_MAX_NEW_TOKENS


def test_settings_defaults():
    settings = Settings.from_env({})
    assert settings.checkpoint.name == "SmolLM2-135M-Instruct" and settings.is_default_checkpoint
    assert settings.weights_dir.name == "weights"
    assert (settings.device, settings.dtype, settings.max_context) == ("auto", "auto", None)  # None: the model's own
    assert settings.kv_type == "bf16"
    assert settings.max_new_tokens == DEFAULT_MAX_NEW_TOKENS
    assert (settings.temperature, settings.top_k, settings.top_p, settings.threads) == (None, None, None, None)
    assert settings.system_prompt is None


def test_settings_from_values():
    settings = Settings.from_env({
        "LLAMA_CHECKPOINT": "/models/llama", "LLAMA_WEIGHTS_DIR": "/models", "LLAMA_TOKENIZER": "/t/tokenizer.model",
        "LLAMA_DEVICE": "CPU", "LLAMA_DTYPE": "bf16", "LLAMA_MAX_CONTEXT": "2048", "LLAMA_KV_TYPE": "Q8",
        "LLAMA_SYSTEM_PROMPT": "Be brief.", "LLAMA_MAX_NEW_TOKENS": "64", "LLAMA_TEMPERATURE": "0",
        "LLAMA_TOP_K": "40", "LLAMA_TOP_P": "0.95", "LLAMA_THREADS": "2", "LLAMA_SEED_UNUSED": "x",
    })
    assert settings == Settings(checkpoint=Path("/models/llama"), weights_dir=Path("/models"),
                                tokenizer=Path("/t/tokenizer.model"), device="cpu", dtype="bf16", max_context=2048, kv_type="q8",
                                system_prompt="Be brief.", max_new_tokens=64, temperature=0.0, top_k=40,
                                top_p=0.95, threads=2, checkpoint_set=True)
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
    ("LLAMA_KV_TYPE", "q4", "LLAMA_KV_TYPE=q4: expected one of bf16, q8"),
])
def test_bad_settings_name_the_variable(name, value, message):
    with pytest.raises(SettingsError) as error:
        Settings.from_env({name: value})
    assert str(error.value) == message


def test_every_setting_is_documented():
    root = Path(__file__).resolve().parents[1]
    read = {name for reader in ("model/options.py", "app/settings.py")
            for name in re.findall(r'"(LLAMA_[A-Z_0-9]+)"', (root / reader).read_text())}
    table = set(re.findall(r"^\| `(LLAMA_[A-Z_0-9]+)`", (root / "chainlit.md").read_text(), re.MULTILINE))
    example = set(re.findall(r"^(LLAMA_[A-Z_0-9]+)=", (root / ".env.example").read_text(), re.MULTILINE))
    assert len(read) == 52 and read == table == example


def test_kv_cache_budget_setting():
    assert Settings.from_env({}).kv_cache_mb == 1024
    assert Settings.from_env({"LLAMA_KV_CACHE_MB": "0"}).kv_cache_mb == 0  # only the newest chat keeps its cache
    assert Settings.from_env({"LLAMA_KV_CACHE_MB": " 300 "}).kv_cache_mb == 300
    with pytest.raises(SettingsError, match="LLAMA_KV_CACHE_MB=-1: expected a whole number of at least 0"):
        Settings.from_env({"LLAMA_KV_CACHE_MB": "-1"})


def test_kv_disk_settings():
    settings = Settings.from_env({})
    assert settings.kv_disk_mb == 4096 and settings.kv_disk_dir == settings.cache_dir / "kv"
    assert Settings.from_env({"LLAMA_CACHE_DIR": "/srv/cache"}).kv_disk_dir == Path("/srv/cache/kv")
    settings = Settings.from_env({"LLAMA_KV_DISK_DIR": "/srv/kv", "LLAMA_KV_DISK_MB": "0"})
    assert (settings.kv_disk_dir, settings.kv_disk_mb) == (Path("/srv/kv"), 0)  # 0: no caches on disk
    with pytest.raises(SettingsError, match="LLAMA_KV_DISK_MB=lots: expected a whole number of at least 0"):
        Settings.from_env({"LLAMA_KV_DISK_MB": "lots"})
    from app.backend.protocol import engine_config
    from app.messages import EngineConfig
    config = engine_config(Settings.from_env({"LLAMA_CACHE_DIR": "/srv/cache"}))
    assert (config.kv_disk_dir, config.kv_disk_mb) == ("/srv/cache/kv", 4096)
    assert EngineConfig(checkpoint="x").kv_disk_mb == Settings().kv_disk_mb  # one default


def test_llama_quantize_setting():
    from app.settings import Settings, SettingsError
    settings = Settings.from_env({"LLAMA_QUANTIZE": "INT8"})
    assert settings.quantize == "int8"
    assert Settings.from_env({}).quantize == "off"
    assert Settings.from_env({"LLAMA_QUANTIZE": "int4"}).quantize == "int4"
    with pytest.raises(SettingsError, match="LLAMA_QUANTIZE=int2: expected one of off, int8, int4"):
        Settings.from_env({"LLAMA_QUANTIZE": "int2"})


def test_batch_and_queue_settings():
    assert (Settings.from_env({}).max_batch, Settings.from_env({}).max_waiting) == (8, 32)
    settings = Settings.from_env({"LLAMA_MAX_BATCH": "4", "LLAMA_MAX_WAITING": "0"})
    assert (settings.max_batch, settings.max_waiting) == (4, 0)
    with pytest.raises(SettingsError, match="LLAMA_MAX_BATCH=0: expected a whole number of at least 1"):
        Settings.from_env({"LLAMA_MAX_BATCH": "0"})


def test_min_p_and_repetition_penalty_settings():
    settings = Settings.from_env({"LLAMA_MIN_P": "0.05", "LLAMA_REPETITION_PENALTY": "1.15"})
    assert (settings.min_p, settings.repetition_penalty) == (0.05, 1.15)
    assert Settings.from_env({}).repetition_penalty is None  # the checkpoint's
    with pytest.raises(SettingsError, match="LLAMA_REPETITION_PENALTY=0: expected a number between 0 and 10"):
        Settings.from_env({"LLAMA_REPETITION_PENALTY": "0"})


@pytest.mark.parametrize("value, seconds", [("300", 300.0), ("2.5", 2.5), ("30s", 30.0), ("5m", 300.0), ("1h", 3600.0),
                                            ("1h30m", 5400.0), ("1.5h", 5400.0), ("250ms", 0.25), (" 5M ", 300.0),
                                            ("0", 0.0), ("-1", -1.0), ("-5m", -300.0)])
def test_keep_alive_takes_seconds_or_durations_as_ollama_does(value, seconds):
    assert Settings.from_env({"LLAMA_KEEP_ALIVE": value}).keep_alive == seconds


def test_keep_alive_unset_is_none_so_the_default_model_stays():
    assert Settings.from_env({}).keep_alive is None and Settings.from_env({"LLAMA_KEEP_ALIVE": " "}).keep_alive is None


@pytest.mark.parametrize("value", ["soon", "5 m", "5x", "m", "1h-30m", "--1", "inf", "nan", "5m3"])
def test_a_bad_keep_alive_names_the_variable_and_the_value(value):
    with pytest.raises(SettingsError) as error:
        Settings.from_env({"LLAMA_KEEP_ALIVE": value})
    assert str(error.value) == (f"LLAMA_KEEP_ALIVE={value}: expected a number of seconds or a duration such as 30s, "
                                "5m or 1h (negative: forever)")
