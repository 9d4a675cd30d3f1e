"""A run of the suite writes its temporary files in one folder of its own, and removes it when it ends
(tests/conftest.py): a run writes a few GB there, and a machine's /tmp outlives its runs."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_run_writes_in_a_folder_of_its_own_and_removes_it_and_a_killed_runs_folder(tmp_path):
    """A pytest run (one quick test) with TMPDIR here and no folder of a parent run: its header names the folder
    it writes in, inside TMPDIR; after it, that folder is gone, and so is the folder a killed run left (its process
    gone), while one of a process that runs stays."""
    killed = tmp_path / "llama-tests-999999999-abcd"  # (above any pid Linux gives: pid_max is at most 2^22)
    (killed / "pytest-of-someone").mkdir(parents=True)
    running = tmp_path / f"llama-tests-{os.getpid()}-abcd"
    running.mkdir()
    env = {name: value for name, value in os.environ.items() if name not in ("LLAMA_TEST_SCRATCH", "TMPDIR")}
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0",
                          "tests/model/test_tokenizer.py::test_hf_errors"],
                         cwd=ROOT, env=env | {"TMPDIR": str(tmp_path)}, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    header = re.search(r"temporary folder: (\S+),", run.stdout)
    assert header, run.stdout[:2000]
    folder = Path(header[1])
    assert folder.parent == tmp_path and folder.name.startswith("llama-tests-")
    assert not folder.exists()
    assert not killed.exists() and running.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == [running.name]
