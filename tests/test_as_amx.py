"""The tests whose numbers follow the CPU's rules, run again as on a CPU with AMX (a Sapphire Rapids host):
there the prefill chunk is 512 tokens, not 256, and activations are bf16 (model/cpu.py, model/kv_cache.py).
A test written for one chunk size (a prompt "longer than a chunk" of 463 tokens) passes on the machine that
wrote it and fails on such a host; this runs them here with tests/conftest.py's LLAMA_TEST_AS_AMX.

Which tests: those of CHUNK_SIZED's files marked `cpu_rules` (pytest.ini): a prompt or reply that crosses a
prefill chunk, caches reused or kept in whole chunks, a context or prompt sized in chunks, or a checkpoint loaded
in the default dtype (activations in bf16, or fp32 where the CPU has no bf16 arithmetic). The files' other tests
(explicit fp32 checkpoints, prompts and replies within a chunk) run the same either way and are not run again; a
test that comes to depend on either rule takes the mark."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHUNK_SIZED = ["tests/engine/test_engine.py", "tests/engine/test_engine_slots.py", "tests/engine/test_sequence.py",
               "tests/engine/test_keep_alive.py", "tests/engine/test_files_prompt.py", "tests/model/test_model.py",
               "tests/model/test_static_decode.py"]


@pytest.mark.timeout(900)
def test_the_chunk_sized_tests_pass_as_on_a_cpu_with_amx():
    """Over 30 s (35 s alone, 57 s beside the suite's two other workers, on a Zen 4 of 2 cores): the marked tests of seven files run again in a process of their
    own, since the switch must be read before anything imports model.kv_cache."""
    env = {**os.environ, "LLAMA_TEST_AS_AMX": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-n", "0",
                          "-m", "cpu_rules", *CHUNK_SIZED],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]


def test_the_switch_makes_the_rules_say_amx():
    code = "from model.kv_cache import PREFILL_CHUNK; from model.cpu import has_native_bf16; " \
           "print(PREFILL_CHUNK, has_native_bf16())"
    conftest = "import sys; sys.path.insert(0, 'tests'); import conftest; "
    out = subprocess.run([sys.executable, "-c", conftest + code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "LLAMA_TEST_AS_AMX": "1"})
    assert out.stdout.split() == ["512", "True"], out.stderr
