"""Password sign-in: the users file (LLAMA_USERS) with argon2 hashes, the check, and failed sign-ins
slowed down.

The file has one `name:hash` line per person (blank lines and # comments skipped), the hash an
argon2id string (argon2-cffi) written by

    python -m app.web.users add NAME      asks for NAME's password, adds or replaces NAME's line
    python -m app.web.users convert       hashes every plain-text password of the file in place

(both on the file named by --file, else by LLAMA_USERS). A line with a password in plain text stops
the app at start with a message naming these commands. LLAMA_PASSWORD is one password, kept in the
environment, with which any name that is not in the file signs in. The file is read again whenever it
changes: a new password or a removed line takes effect at once, and ends the sessions signed in before
(each carries a stamp of the password it was signed in with, `Passwords.stamp`, checked by app.web.sessions).

Each failed sign-in is answered later than the one before it, per name and client address together
and per address: 1 s, 2 s, 4 s, ... at most 30 s, counted again from 1 s after 15 minutes without a
failure. The sign-ins of one name from one address, and of one address, are checked one at a time, so
an address guesses at one try per delay however many requests it sends at once. A name alone is never
slowed: a burst of wrong passwords for it from elsewhere does not keep its owner out. An IPv6 address
counts as its /64 (one home has the whole /64).

Someone with many addresses still has each address's turn and delays: N addresses try about N
passwords per 30 s at one name, after each address's first few, and each try costs the server one
argon2 verify (as many at once as asyncio's thread pool has threads). They cannot lock the owner out,
go faster per address, or tell which names exist (an unknown name takes as long to refuse). What holds
against them is a password that N x 2,880 guesses a day do not find. The address is the connection's,
or the X-Forwarded-For of a peer in LLAMA_TRUSTED_PROXIES (app.web.http_server); people behind one NAT
share theirs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import getpass
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import sys
import time
from pathlib import Path

from argon2 import PasswordHasher, extract_parameters
from argon2.exceptions import InvalidHashError, VerificationError

from app.private_files import open_private
from app.settings import Settings, SettingsError, users_file

log = logging.getLogger(__name__)

LOCAL_USER = "local"  # everyone, when sign-in is off
HASHER = PasswordHasher()  # argon2id with argon2-cffi's defaults (RFC 9106's low-memory profile)
HASH_PREFIX = "$argon2"
FIRST_DELAY_S = 1.0
MAX_DELAY_S = 30.0
FORGET_AFTER_S = 900.0  # failures older than this no longer count
MAX_WAITING = 8  # sign-ins of one name and address, or of one address, waiting their turn; more are refused at once
MAX_NAME = 256  # characters of a name that can sign in (any name can, with LLAMA_PASSWORD)

CLIENT_ADDRESS: contextvars.ContextVar[str] = contextvars.ContextVar("client_address", default="unknown")


# ---- the users file -----------------------------------------------------------------------------

def parse_lines(text: str) -> list[tuple[int, str, str | None, str | None]]:
    """(line number, line, name, secret) for each line; name and secret are None for blank, comment and
    malformed lines."""
    parsed = []
    for number, line in enumerate(text.splitlines(), 1):
        name, colon, secret = line.partition(":")
        if not line.strip() or line.lstrip().startswith("#") or not colon or not name.strip() or not secret:
            parsed.append((number, line, None, None))
        else:
            parsed.append((number, line, name.strip(), secret))  # a plain-text password exactly as written
    return parsed


def is_hash(secret: str) -> bool:
    return secret.startswith(HASH_PREFIX)


def read_users(path: Path) -> dict[str, str]:
    """`name:hash` lines -> {name: argon2 hash}; SettingsError names the file, the line and the fix."""
    users = {}
    for number, line, name, secret in parse_lines(read_text(path)):
        if name is None:
            if line.strip() and not line.lstrip().startswith("#"):
                raise SettingsError(f"LLAMA_USERS={path}, line {number}: expected name:hash "
                                    f"(write it with: python -m app.web.users add NAME --file {path})")
            continue
        secret = secret.strip()
        if not is_hash(secret):
            raise SettingsError(
                f"LLAMA_USERS={path}, line {number}: the password of {name!r} is in plain text; the file holds "
                f"argon2 hashes. Convert it with: python -m app.web.users convert --file {path} (hashes every "
                f"plain-text password in place), or set a new password with: python -m app.web.users add {name} "
                f"--file {path}")
        try:
            extract_parameters(secret)
        except InvalidHashError:
            raise SettingsError(f"LLAMA_USERS={path}, line {number}: the hash of {name!r} is not a valid argon2 "
                                f"hash; write a new one with: python -m app.web.users add {name} --file {path}") from None
        users[name] = secret
    if not users:
        raise SettingsError(f"LLAMA_USERS={path}: no name:hash line in the file "
                            f"(add one with: python -m app.web.users add NAME --file {path})")
    return users


def read_text(path: Path, variable: str = "LLAMA_USERS") -> str:
    """The file's text; SettingsError names the variable, the file and what was wrong."""
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise SettingsError(f"{variable}={path}: cannot read the file: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise SettingsError(f"{variable}={path}: expected UTF-8 text, found byte {e.object[e.start]:#04x} at "
                            f"offset {e.start}") from None


def write_lines(path: Path, lines: list[str]) -> None:
    """Replace the file at once (a new file renamed over it), readable by its owner only."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with os.fdopen(open_private(temporary, os.O_TRUNC), "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))
    os.replace(temporary, path)


# ---- checking a sign-in -------------------------------------------------------------------------

class UsersFile:
    """LLAMA_USERS as it is now: read again whenever it changes on disk, so that a new password or a
    removed line takes effect at once, sessions included (app.web.sessions)."""

    def __init__(self, path: Path):
        self.path = path
        self.version = file_version(path)
        self.users: dict[str, str] | None = read_users(path)  # at start, a file that cannot be used stops the app

    def read(self) -> dict[str, str] | None:
        """{name: hash}, or None while the file cannot be used: then nobody signs in or stays signed in (a
        broken file must not let a removed user back in, nor give their name to LLAMA_PASSWORD)."""
        version = file_version(self.path)
        if version != self.version:
            self.version = version
            try:
                self.users = read_users(self.path)
                log.info("LLAMA_USERS=%s changed: %d users", self.path, len(self.users))
            except SettingsError as e:
                self.users = None
                log.error("%s; nobody can sign in until it is fixed", e)
        return self.users


def file_version(path: Path) -> tuple[int, ...] | None:
    """What changes when the file does (None: it cannot be read now)."""
    try:
        status = path.stat()
    except OSError:
        return None
    return status.st_ino, status.st_mtime_ns, status.st_ctime_ns, status.st_size  # renamed over it: a new inode


class Passwords:
    """A named user of LLAMA_USERS with their password, or any other name with LLAMA_PASSWORD."""

    def __init__(self, users: dict[str, str] | UsersFile, shared: str | None = None, key: bytes | None = None):
        self.file, self.fixed = (users, None) if isinstance(users, UsersFile) else (None, users)
        self.shared = shared
        self.key = key or secrets.token_bytes(32)  # keys the stamps: the sign-in secret, so they last across starts
        self.decoy: str | None = None  # verified for unknown names, so that they take as long as known ones

    @classmethod
    def from_settings(cls, settings: Settings, key: bytes) -> Passwords:
        return cls(UsersFile(settings.users_file) if settings.users_file else {}, settings.password, key)

    @property
    def users(self) -> dict[str, str] | None:
        return self.file.read() if self.file else self.fixed

    def check(self, name: str, password: str) -> str | None:
        """The user's identifier if the password is right, else None (an argon2 verify: a fraction of a second)."""
        name, users = name.strip(), self.users
        if not name or len(name) > MAX_NAME or users is None:
            return None
        secret = utf8(password)
        if name in users:
            return name if _verify(users[name], secret) else None
        if users:
            self.decoy = self.decoy or HASHER.hash(secrets.token_urlsafe(16))
            _verify(self.decoy, secret)
        if self.shared is not None and hmac.compare_digest(secret, utf8(self.shared)):
            return name
        return None

    def stamp(self, name: str) -> str | None:
        """What a session signed in as name carries, and must match on every request: a digest (keyed) of
        the user's password hash, or of LLAMA_PASSWORD for other names. A new password, a removed line or
        another LLAMA_PASSWORD changes it; None when the name cannot sign in now."""
        users = self.users
        if users is None or not name or name != name.strip():
            return None
        if name in users:
            what = b"hash\0" + users[name].encode()
        elif self.shared is not None:
            what = b"shared\0" + utf8(self.shared)
        else:
            return None
        return hmac.new(self.key, utf8(name) + b"\0" + what, hashlib.sha256).hexdigest()


def utf8(text: str) -> bytes:
    """UTF-8, lone surrogates included (they can only be wrong, never an error)."""
    return text.encode("utf-8", "surrogatepass")


def _verify(hash: str, password: bytes) -> bool:
    try:
        return HASHER.verify(hash, password)
    except (VerificationError, InvalidHashError):
        return False


def address_key(address: str) -> str:
    """Whose failures an address's sign-ins count with: an IPv6 address's /64 (a home or a rented server
    is given a whole /64, which would otherwise be 2^64 fresh addresses to guess from), any other address
    itself."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if ip.version == 6:
        if ip.ipv4_mapped:  # ::ffff:192.0.2.7, an IPv4 client of a dual-stack socket
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class Throttle:
    """Failures per key (a name from an address, an address): the attempts of a key take turns, and each
    failure is answered after a delay that doubles with the key's recent failures."""

    def __init__(self, first_delay_s: float = FIRST_DELAY_S, max_delay_s: float = MAX_DELAY_S,
                 forget_after_s: float = FORGET_AFTER_S, max_waiting: int = MAX_WAITING,
                 sleep=asyncio.sleep, clock=time.monotonic):
        self.first_delay_s, self.max_delay_s, self.forget_after_s = first_delay_s, max_delay_s, forget_after_s
        self.max_waiting, self.sleep, self.clock = max_waiting, sleep, clock
        self.failures: dict[str, tuple[int, float]] = {}  # key -> (failures in a row, clock() of the last)
        self.turns: dict[str, tuple[asyncio.Lock, int]] = {}  # key -> (its turn, attempts holding or awaiting it)

    @contextlib.asynccontextmanager
    async def turn(self, keys: tuple[str, ...]):
        """Yields True once it is these keys' turn, or False at once when too many attempts wait for one."""
        if any(self.turns.get(key, (None, 0))[1] > self.max_waiting for key in keys):
            yield False
            return
        for key in keys:
            lock, count = self.turns.get(key) or (asyncio.Lock(), 0)
            self.turns[key] = (lock, count + 1)
        async with contextlib.AsyncExitStack() as held:
            try:
                for key in keys:  # always in the same order (name and address, then address): no deadlock
                    await held.enter_async_context(self.turns[key][0])
                yield True
            finally:
                for key in keys:
                    lock, count = self.turns[key]
                    if count == 1:
                        del self.turns[key]
                    else:
                        self.turns[key] = (lock, count - 1)

    async def failed(self, keys: tuple[str, ...]) -> float:
        """Count a failure for each key and wait the longest of their delays; returns it."""
        now = self.clock()
        delay = 0.0
        for key in keys:
            count, last = self.failures.get(key, (0, now))
            count = 1 if now - last > self.forget_after_s else count + 1
            self.failures[key] = (count, now)
            delay = max(delay, min(self.first_delay_s * 2 ** (count - 1), self.max_delay_s))
        self.failures = {k: v for k, v in self.failures.items() if now - v[1] <= self.forget_after_s}
        await self.sleep(delay)
        return delay

    def succeeded(self, key: str) -> None:
        self.failures.pop(key, None)


class SignIn:
    """`await sign_in(name, password)`: the user's identifier, or None after the failure's delay."""

    def __init__(self, passwords: Passwords, throttle: Throttle | None = None):
        self.passwords, self.throttle = passwords, throttle or Throttle()

    @classmethod
    def from_settings(cls, settings: Settings, key: bytes) -> SignIn:
        return cls(Passwords.from_settings(settings, key))

    async def __call__(self, name: str, password: str, address: str | None = None) -> str | None:
        address = address or CLIENT_ADDRESS.get()
        where = address_key(address)
        named = hashlib.sha256(utf8(name.strip())).hexdigest()  # a name of any length takes 64 characters here
        keys = (f"name {named} from {where}", f"address {where}")  # never the name alone: see the top
        shown = repr(name[:64]) + ("..." if len(name) > 64 else "")
        async with self.throttle.turn(keys) as admitted:
            if not admitted:
                log.warning("sign-in as %s from %s refused unchecked: more than %d sign-ins of that name from "
                            "there, or from that address, wait their turn", shown, address, self.throttle.max_waiting)
                return None
            user = await asyncio.to_thread(self.passwords.check, name, password)  # argon2 keeps the CPU busy
            if user is not None:
                self.throttle.succeeded(keys[0])
                return user
            delay = await self.throttle.failed(keys)
            log.info("sign-in as %s from %s failed; answered after %.0f s", shown, address, delay)
            return None


class ClientAddress:
    """ASGI middleware that makes each request's client address known to SignIn (Chainlit's password
    callback is given only the name and the password)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        client = scope.get("client")
        token = CLIENT_ADDRESS.set(client[0] if client else "unknown")
        try:
            await self.app(scope, receive, send)
        finally:
            CLIENT_ADDRESS.reset(token)


# ---- python -m app.web.users ------------------------------------------------------------------------

def add(path: Path, name: str, password: str) -> None:
    """Give name this password in the file (created if missing): its line is replaced, else appended."""
    line, lines, placed = f"{name}:{HASHER.hash(password)}", [], False
    for _, text, other, _ in parse_lines(read_text(path)) if path.exists() else []:
        if other == name:
            if placed:
                continue  # a later line for the same name would count instead: drop it
            text, placed = line, True
        lines.append(text)
    write_lines(path, lines if placed else [*lines, line])


def convert(path: Path) -> list[str]:
    """Hash every plain-text password of the file in place; returns the names converted."""
    lines, converted = [], []
    for _, text, name, secret in parse_lines(read_text(path)):
        if name is not None and not is_hash(secret):
            text = f"{name}:{HASHER.hash(secret)}"
            converted.append(name)
        lines.append(text)
    if converted:
        write_lines(path, lines)
    return converted


def storable_name(name: str) -> str:
    """A name as a `name:secret` line can hold it (the users file's, the keys file's); SettingsError if not."""
    if not name.strip() or name != name.strip() or name.startswith("#") or any(c in name for c in ":\r\n"):
        raise SettingsError(f"the name {name!r} cannot be stored: expected no ':' or line break, no leading '#' "
                            "and no spaces around it")
    return name


def read_password(name: str) -> str:
    """Asked twice on a terminal; else the first line of standard input (for scripts)."""
    if not sys.stdin.isatty():
        return sys.stdin.readline().rstrip("\r\n")
    password = getpass.getpass(f"Password for {name}: ")
    if getpass.getpass("The same again: ") != password:
        raise SettingsError("the two passwords differ; nothing was written")
    return password


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.web.users", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    add_command = commands.add_parser("add", help="add a user or set a new password (asked for)")
    add_command.add_argument("name")
    convert_command = commands.add_parser("convert", help="hash every plain-text password in the file")
    for command in (add_command, convert_command):
        command.add_argument("--file", type=Path, help="the users file (default: LLAMA_USERS)")
    args = parser.parse_args(argv)
    try:
        path = args.file or users_file()
        if path is None:
            raise SettingsError("expected --file FILE, or LLAMA_USERS naming the users file")
        if args.command == "add":
            name = storable_name(args.name)
            password = read_password(name)
            if not password:
                raise SettingsError("the password is empty; nothing was written")
            add(path, name, password)
            print(f"{path}: {name}'s password is stored as an argon2 hash")
        else:
            if not path.exists():
                raise SettingsError(f"{path}: no such file")
            converted = convert(path)
            print(f"{path}: hashed the passwords of {', '.join(converted)}" if converted
                  else f"{path}: no plain-text passwords")
    except (SettingsError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
