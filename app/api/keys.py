"""Who sends an API request: the key it carries names a user.

Two ways to give keys, which can be used together:

    LLAMA_API_KEY=KEY     one key for whoever holds it: they are one user, named `api-key` (KEY_USER)
    LLAMA_API_KEYS=FILE   a key per person: `name:sha256:HEX` lines (blank lines and # comments skipped), written by
                              python -m app.api.keys add NAME      a new key for NAME, printed once
                              python -m app.api.keys remove NAME   NAME's keys no longer work
                          (on the file named by --file, else by LLAMA_API_KEYS)

A key acts as its user everywhere the API reaches: the stored responses of /v1/responses are that user's (another
user's id is a 404), the engine reuses only that user's KV caches, and only the users named in LLAMA_MODEL_ADMINS
pull, delete or unload models (app.settings `may_manage_models`; a 403 names the rule). The same name as a sign-in
account of the chat is the same user. The file keeps a SHA-256 of each key, never the key: a key is 32 random
bytes, which no hash needs to slow down, and a request's check is then one dictionary lookup. The file is read
again when it changes: a new or removed key takes effect at the next request; while the file cannot be used
(a line broken by hand), none of its keys is taken, and the log says why.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import logging
import re
import secrets
import sys
from pathlib import Path

from model.options import Environment

from app.api.openai import ApiError
from app.settings import SettingsError
from app.web.users import file_version, parse_lines, read_text, storable_name, utf8, write_lines

log = logging.getLogger(__name__)

KEY_USER = "api-key"  # the user of LLAMA_API_KEY's single key (a name LLAMA_MODEL_ADMINS can give)
VARIABLE = "LLAMA_API_KEYS"
_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")


def digest(key: str) -> str:
    """What the keys file keeps of a key: its SHA-256 (the header's bytes as sent)."""
    return hashlib.sha256(key.encode("latin-1", "replace")).hexdigest()


def read_keys(path: Path) -> dict[str, str]:
    """`name:sha256:HEX` lines -> {hex digest: name}; SettingsError names the file, the line and the fix."""
    users = {}
    for number, line, name, secret in parse_lines(read_text(path, VARIABLE)):
        if name is None:
            if line.strip() and not line.lstrip().startswith("#"):
                raise SettingsError(f"{VARIABLE}={path}, line {number}: expected name:sha256:HEX "
                                    f"(write it with: python -m app.api.keys add NAME --file {path})")
            continue
        found = _DIGEST.fullmatch(secret.strip())
        if found is None:
            raise SettingsError(f"{VARIABLE}={path}, line {number}: {name!r}'s key is not a sha256:HEX digest "
                                f"(64 lowercase hex digits); the file never holds a key itself. Make a new key with: "
                                f"python -m app.api.keys add {name} --file {path}")
        users[found[1]] = name
    return users


class KeysFile:
    """LLAMA_API_KEYS as it is now: read again whenever it changes on disk."""

    def __init__(self, path: Path):
        self.path = path
        self.version = file_version(path)
        self.users: dict[str, str] = read_keys(path)  # at start, a file that cannot be used stops the app

    def read(self) -> dict[str, str]:
        """{digest: name}; empty while the file cannot be used (a broken file must not keep a removed key working)."""
        version = file_version(self.path)
        if version != self.version:
            self.version = version
            try:
                self.users = read_keys(self.path)
                log.info("%s=%s changed: %d keys", VARIABLE, self.path, len(self.users))
            except SettingsError as e:
                self.users = {}
                log.error("%s; none of its keys is taken until it is fixed", e)
        return self.users


class ApiKeys:
    """The keys the API takes: `user(token)` is the key's user, or None for a key that is none of them."""

    def __init__(self, key: str | None = None, file: Path | KeysFile | None = None):
        self.key = key
        self.file = KeysFile(file) if isinstance(file, Path) else file

    @classmethod
    def from_settings(cls, settings) -> ApiKeys:
        return cls(settings.api_key, settings.api_keys_file)

    @property
    def required(self) -> bool:
        """Whether a request must carry a key (else every request is the local user's)."""
        return bool(self.key) or self.file is not None

    def user(self, token: str) -> str | None:
        if self.key and hmac.compare_digest(token.encode("latin-1", "replace"), utf8(self.key)):
            return KEY_USER
        return self.file.read().get(digest(token)) if self.file is not None else None


def check_may_manage(http_request, what: str) -> None:
    """A 403 naming the rule, unless the request's user manages models (routes.check_key noted whether)."""
    if not getattr(http_request.state, "may_manage_models", True):
        raise ApiError(403, f"Only the users named in LLAMA_MODEL_ADMINS may {what} (with sign-in on and "
                       f"LLAMA_MODEL_ADMINS unset, nobody may); this key's user is {http_request.state.user!r}.",
                       type="permission_error", code="model_admins_only")


# ---- python -m app.api.keys ---------------------------------------------------------------------

def add(path: Path, name: str) -> str:
    """A new key for name, its digest appended to the file (created if missing); returns the key."""
    key = "llama-" + secrets.token_urlsafe(32)
    lines = [text for _, text, _, _ in parse_lines(read_text(path, VARIABLE))] if path.exists() else []
    write_lines(path, [*lines, f"{name}:sha256:{digest(key)}"])
    return key


def remove(path: Path, name: str) -> int:
    """Take name's keys out of the file; returns how many there were."""
    kept = [(text, other) for _, text, other, _ in parse_lines(read_text(path, VARIABLE))]
    write_lines(path, [text for text, other in kept if other != name])
    return sum(other == name for _, other in kept)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.api.keys", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for command, help in (("add", "make a new key for NAME (printed once; the file keeps its SHA-256)"),
                          ("remove", "take NAME's keys out of the file")):
        sub = commands.add_parser(command, help=help)
        sub.add_argument("name")
        sub.add_argument("--file", type=Path, help=f"the keys file (default: {VARIABLE})")
    args = parser.parse_args(argv)
    try:
        path = args.file or Environment().path(VARIABLE)
        if path is None:
            raise SettingsError(f"expected --file FILE, or {VARIABLE} naming the keys file")
        name = storable_name(args.name)
        if args.command == "add":
            key = add(path, name)
            print(f"{path}: a new key for {name} (shown once; send it as 'Authorization: Bearer KEY'):\n{key}")
        else:
            if not path.exists():
                raise SettingsError(f"{path}: no such file")
            print(f"{path}: removed {remove(path, name)} keys of {name}")
    except (SettingsError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
