"""bench/on_gpu.sh, the one GPU check, run here with --dry-run: the same steps on the CPU, small, so the
script cannot rot between the rare sessions that have a GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(400)
def test_the_gpu_check_runs_every_step_and_writes_one_summary(tmp_path):
    """Over 30 s (43-48 s beside the suite's two other workers, Zen 4): the script's whole dry run, a Python process
    for each of its steps, each kind of weights loaded and decoded one stream, several and served."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    run = subprocess.run(["bash", "bench/on_gpu.sh", "run", "--dry-run", str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=380)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["steps"]) == {"versions", "tests", "check-1b"}
    assert all(step["exit"] == 0 and step["seconds"] <= step["limit"] for step in summary["steps"].values()), \
        summary["steps"]
    assert summary["tests"]["passed"] > 0 and summary["tests"]["failed"] == []
    check = summary["check-1b"]
    assert check["versions"]["torch"] == __import__("torch").__version__ and check["copy_gb_s"] > 0
    # the layers' 14 matrices in Q4_K blocks, which the CPU's kernel reads as they are (a GPU repacks them: packed)
    assert check["q4_k"]["load"]["blocks"] == 14 and check["q4_k"]["load"]["packed"] == 0
    assert check["bf16"]["load"]["blocks"] == 0
    for kind in ("bf16", "int8", "int4", "q4_k"):
        found = check[kind]
        assert not [part for part in found.values() if isinstance(part, dict) and "error" in part], found
        assert found["load"]["step_ops"] == "torch"  # the CPU's step: the torch forms
        assert found["replays"]["kernels_per_step"] > 0 and found["replays"]["top"]
        for one in ("one_stream", "one_stream_chat_sampling"):
            assert found[one]["decode_tok_s"] > 0 and found[one]["in_slot"]
        assert found["eager"]["median_ms"] > 0
        assert found["streams"]["tok_s"] > 0 and found["streams"]["in_slots"] == found["streams"]["rows"]
        assert found["served"]["failed"] == [] and found["served"]["tok_s"] > 0
        assert len(found["served"]["decode_tok_s_each"]) == found["served"]["rows"]
        assert found["served"]["steps"] > 0 and 0 <= found["served"]["queued_ahead"] <= found["served"]["steps"]
    assert check["bf16"]["served_one"]["rows"] == 1 and check["bf16"]["served_one"]["failed"] == []
    assert "torch" in (tmp_path / "versions.log").read_text()


def test_the_gpu_check_and_its_wheels_step_parse():
    assert subprocess.run(["bash", "-n", "bench/on_gpu.sh"], cwd=ROOT).returncode == 0
    usage = subprocess.run(["bash", "bench/on_gpu.sh", "nonsense"], cwd=ROOT, capture_output=True, text=True)
    assert usage.returncode == 2 and "usage" in usage.stderr
