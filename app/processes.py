"""Whether a process that left something behind (the engine's socket folder, a reply being written to the
history) still runs: what it left is stale only once it is gone. No web framework here: both sides use it."""

from __future__ import annotations

import os
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether process `pid` runs: one that exited but was not yet reaped (a zombie) does not; one of another
    account does. A pid the system has given to a new process since reads as alive: what it left is kept."""
    if pid <= 0:  # (0 and negative numbers name process groups, not a process)
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another account's
        return True
    except OverflowError:  # past the platform's pid_t: no such process
        return False
    try:  # Linux: "pid (name) state ...", the name may hold spaces and parentheses
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")
