"""The folder of the sockets between the web process and its engine: private (mode 0700, only this account
connects), in the temporary directory, named after the web process (`llama-engine-<pid>-<random>`).

The web process removes its folder when it stops; one that was killed (kill -9, out of memory, a power cut of
the process) cannot. So at start the folders of web processes that no longer run are removed, and those of
running ones (another server on the same machine) are kept.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

from app.processes import alive

log = logging.getLogger(__name__)

PREFIX = "llama-engine-"
NAME = re.compile(re.escape(PREFIX) + r"(\d{1,20})-[a-z0-9_]+")  # (tempfile's random part has no "-")


def make() -> str:
    """A new folder for this process's sockets."""
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")


def remove(folder: str) -> None:
    """This process's folder, when its engine has stopped (its sockets closed)."""
    shutil.rmtree(folder, ignore_errors=True)


def remove_stale(parent: Path | None = None) -> list[Path]:
    """Remove the socket folders (in `parent`, by default the temporary directory) that this account's web
    processes left when they were killed; returns them. Folders of running processes, of other accounts,
    and names not made by make() stay."""
    removed = []
    for path in Path(parent or tempfile.gettempdir()).glob(f"{PREFIX}*"):
        found = NAME.fullmatch(path.name)
        if found is None or alive(int(found[1])):
            continue
        try:
            info = path.lstat()
        except FileNotFoundError:  # another server starting removed it first
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
            log.info("removed %s: the socket folder of web process %s, which no longer runs", path, found[1])
    return removed
