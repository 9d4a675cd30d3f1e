"""The engine's socket folder (app/backend/socket_folder.py): named after its web process, and at start the
folders of web processes that no longer run are removed while those of running ones stay."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

from app.backend import socket_folder
from app.processes import alive


def ended_pid() -> int:
    """The pid of a process that ran and has ended (and was reaped)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_process_that_ended_is_not_alive_and_a_running_one_is():
    assert alive(os.getpid())
    assert not alive(ended_pid())
    assert not alive(2**70)  # past any pid
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # ended, not yet reaped
    try:
        os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # it has exited; it stays a zombie
        assert not alive(zombie.pid)
    finally:
        zombie.wait()


def test_the_folder_is_private_and_named_after_this_process(tmp_path, monkeypatch):
    monkeypatch.setattr(socket_folder.tempfile, "tempdir", str(tmp_path))
    folder = socket_folder.make()
    name = os.path.basename(folder)
    assert socket_folder.NAME.fullmatch(name) and name.startswith(f"llama-engine-{os.getpid()}-")
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    socket_folder.remove(folder)
    assert not os.path.exists(folder)


def test_at_start_the_folders_of_ended_web_processes_go_and_the_others_stay(tmp_path):
    dead, running = ended_pid(), os.getpid()
    folders = {name: tmp_path / name for name in (
        f"llama-engine-{dead}-abc_12", f"llama-engine-{running}-def34",  # left by a killed server; a running one's
        "llama-engine-k2x9q7ab",  # an older name that says no pid: not known to be stale
        f"llama-engine-{dead}",  # not a name make() gives
        "llama-engine-99999999999999999999999-x1")}  # (a pid past 64 bits: not ours)
    for name, path in folders.items():
        path.mkdir()
        (path / "events").write_text("")
    (tmp_path / f"llama-engine-{dead}-file1").write_text("")  # a file of that name is no folder of ours
    removed = socket_folder.remove_stale(tmp_path)
    assert removed == [folders[f"llama-engine-{dead}-abc_12"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"llama-engine-{dead}-file1", *(n for n in folders if n != f"llama-engine-{dead}-abc_12")])
