"""Files that hold users' data (the history database, the sign-in secret, the users file, exported
chats, the engine's KV caches on disk) are readable by the account that runs the app only: folders
0700, files 0600, whatever the umask, and also when they were made otherwise before. No web framework
here: the engine process writes such files too.

SQLite creates its -wal, -shm and -journal files with the database file's mode, so a database created
here (0600) keeps them private too.
"""

from __future__ import annotations

import os
from pathlib import Path

FOLDER_MODE = 0o700
FILE_MODE = 0o600


def private_folder(folder: Path) -> Path:
    """The folder, created if missing (with its parents), made readable by this account only."""
    folder.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
    os.chmod(folder, FOLDER_MODE)  # mkdir's mode passes through the umask, and the folder may be older
    return folder


def private_file(path: Path) -> Path:
    """The file, created empty if missing, made readable by this account only. An existing file is not
    opened: closing any descriptor of a file drops the process's POSIX locks on it, SQLite's among them."""
    try:
        os.close(open_private(path, os.O_EXCL))
    except FileExistsError:
        os.chmod(path, FILE_MODE)
    return path


def open_private(path: Path, flags: int = 0) -> int:
    """A descriptor of path for writing, the file created if missing and made readable by this account
    only; flags: more os.O_* flags (O_EXCL, O_TRUNC)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except OSError:
        os.close(fd)
        raise
    return fd
