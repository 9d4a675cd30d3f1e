"""Password sign-in (app.web.users): the users file holds argon2 hashes, written by `python -m app.web.users add`;
a plain-text line stops the start with the command that converts it; failed sign-ins are answered
later and later, per name and per address, one at a time.

Delays are checked with a recording sleep and a settable clock, never by timing.
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys

import pytest
from support.servers import ROOT

from app.web import users
from app.settings import SettingsError

pytestmark = pytest.mark.timeout(120)


def run_users(*args: str, password: str = "", env: dict | None = None,
              umask: int = 0o022) -> subprocess.CompletedProcess:
    """`python -m app.web.users ...` with the password on standard input (not a terminal: read as one line)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_")} | (env or {})
    return subprocess.run([sys.executable, "-m", "app.web.users", *args], cwd=ROOT, input=password + "\n",
                          capture_output=True, text=True, env=environ, timeout=60, umask=umask)


# ---- the users file -----------------------------------------------------------------------------

def test_add_writes_an_argon2_hash_readable_by_its_owner_only(tmp_path):
    path = tmp_path / "users"
    done = run_users("add", "ada", "--file", str(path), password="lovelace", umask=0)  # whatever the umask
    assert done.returncode == 0, done.stderr
    assert "ada's password is stored as an argon2 hash" in done.stdout
    name, hash = path.read_text().strip().split(":", 1)
    assert name == "ada" and hash.startswith("$argon2id$") and "lovelace" not in path.read_text()
    assert users.HASHER.verify(hash, "lovelace")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert users.Passwords(users.read_users(path)).check("ada", "lovelace") == "ada"


def test_add_replaces_the_users_line_and_keeps_the_others(tmp_path):
    path = tmp_path / "users"
    run_users("add", "ada", "--file", str(path), password="first")
    path.write_text("# our household\n" + path.read_text() + "\ngrace:" + users.HASHER.hash("hopper") + "\n")
    done = run_users("add", "ada", password="second", env={"LLAMA_USERS": str(path)})  # the file from LLAMA_USERS
    # (alone: sign-in's other settings, such as LLAMA_API_KEY, are not needed to write the file)
    assert done.returncode == 0, done.stderr
    lines = path.read_text().splitlines()
    assert lines[0] == "# our household" and lines[2] == "" and len(lines) == 4
    passwords = users.Passwords(users.read_users(path))
    assert passwords.check("ada", "second") == "ada" and passwords.check("ada", "first") is None
    assert passwords.check("grace", "hopper") == "grace"


@pytest.mark.parametrize("name, password, message", [
    ("ada:x", "pw", "cannot be stored"), (" ada", "pw", "cannot be stored"), ("#ada", "pw", "cannot be stored"),
    ("ada", "", "the password is empty"),
])
def test_add_refuses_what_it_cannot_store_and_writes_nothing(tmp_path, name, password, message):
    path = tmp_path / "users"
    done = run_users("add", name, "--file", str(path), password=password)
    assert done.returncode == 2 and message in done.stderr and not path.exists()


def test_add_needs_a_file(tmp_path):
    done = run_users("add", "ada", password="pw")
    assert done.returncode == 2 and "expected --file FILE, or LLAMA_USERS" in done.stderr


def test_a_plain_text_line_is_refused_with_how_to_convert_and_convert_does_it(tmp_path):
    path = tmp_path / "users"
    path.write_text("# name:password\nada:lovelace\n\ngrace: hopper\n")
    with pytest.raises(SettingsError) as refused:
        users.read_users(path)
    message = str(refused.value)
    assert f"LLAMA_USERS={path}, line 2: the password of 'ada' is in plain text" in message
    assert f"python -m app.web.users convert --file {path}" in message and "python -m app.web.users add ada" in message

    done = run_users("convert", "--file", str(path))
    assert done.returncode == 0 and "hashed the passwords of ada, grace" in done.stdout, done.stderr
    assert "lovelace" not in path.read_text() and path.read_text().startswith("# name:password\n")
    passwords = users.Passwords(users.read_users(path))
    assert passwords.check("ada", "lovelace") == "ada"
    assert passwords.check("grace", " hopper") == "grace"  # the password exactly as it was written
    assert "no plain-text passwords" in run_users("convert", "--file", str(path)).stdout


def test_other_bad_files_are_named(tmp_path):
    path = tmp_path / "users"
    for text, message in [("ada\n", "line 1: expected name:hash"),
                          ("ada:$argon2id$broken\n", "line 1: the hash of 'ada' is not a valid argon2 hash"),
                          ("# nobody\n", "no name:hash line")]:
        path.write_text(text)
        with pytest.raises(SettingsError, match=message):
            users.read_users(path)
    with pytest.raises(SettingsError, match="cannot read"):
        users.read_users(tmp_path / "missing")


def test_named_users_and_a_shared_password():
    passwords = users.Passwords({"ada": users.HASHER.hash("lovelace")}, shared="household")
    assert passwords.check("ada", "lovelace") == "ada"
    assert passwords.check("ada", "household") is None  # a named user needs their own password
    assert passwords.check(" guest ", "household") == "guest"
    assert passwords.check("guest", "wrong") is None and passwords.check(" ", "household") is None
    assert users.Passwords({"ada": users.HASHER.hash("lovelace")}).check("guest", "household") is None


def test_the_worst_names_and_passwords_are_refused_without_an_error():
    passwords = users.Passwords({"ada": users.HASHER.hash("lovelace")}, shared="household")
    for name, password in [("ada", "\ud800"), ("\udfff", "household\ud800"), ("ada\x00", "lovelace"),
                           ("a" * (users.MAX_NAME + 1), "household"), ("ada", "lovelace" * 100_000)]:
        assert passwords.check(name, password) is None
    assert passwords.check("\u00e9\U0001f600", "household") == "\u00e9\U0001f600"
    assert passwords.stamp("\ud800") is not None and passwords.stamp(" ada") is None and passwords.stamp("") is None


# ---- a changed file, and the stamp a session carries --------------------------------------------

def test_a_changed_file_counts_at_once_and_changes_the_users_stamp(tmp_path):
    path = tmp_path / "users"
    users.add(path, "ada", "lovelace")
    users.add(path, "grace", "hopper")
    passwords = users.Passwords(users.UsersFile(path), shared="household", key=b"k" * 32)
    ada, grace, guest = passwords.stamp("ada"), passwords.stamp("grace"), passwords.stamp("guest")
    assert len({ada, grace, guest}) == 3 and None not in (ada, grace, guest)
    again = users.Passwords(users.UsersFile(path), shared="household", key=b"k" * 32)
    assert again.stamp("ada") == ada  # the next start, with the same secret: sessions go on
    assert users.Passwords(users.UsersFile(path), key=b"other" * 8).stamp("ada") != ada  # another secret: they end

    users.add(path, "ada", "analytical engine")
    assert passwords.check("ada", "analytical engine") == "ada" and passwords.check("ada", "lovelace") is None
    assert passwords.stamp("ada") not in (ada, None) and passwords.stamp("grace") == grace
    users.write_lines(path, [line for line in path.read_text().splitlines() if not line.startswith("grace:")])
    assert passwords.stamp("grace") not in (grace, None)  # a name of LLAMA_PASSWORD's now, not the user grace
    assert users.Passwords(users.UsersFile(path), key=b"k" * 32).stamp("grace") is None  # no LLAMA_PASSWORD
    assert users.Passwords({}, shared="household", key=b"k" * 32).stamp("guest") == guest
    assert users.Passwords({}, shared="another", key=b"k" * 32).stamp("guest") != guest


def test_a_file_that_cannot_be_used_any_more_lets_nobody_in(tmp_path, caplog):
    path = tmp_path / "users"
    users.add(path, "ada", "lovelace")
    passwords = users.Passwords(users.UsersFile(path), shared="household")
    users.write_lines(path, ["ada:lovelace"])  # edited by hand: a plain-text password
    assert passwords.check("ada", "lovelace") is None and passwords.stamp("ada") is None
    assert passwords.check("guest", "household") is None  # nor does LLAMA_PASSWORD take ada's name meanwhile
    assert "the password of 'ada' is in plain text" in caplog.text and "nobody can sign in" in caplog.text
    path.unlink()
    assert passwords.check("guest", "household") is None
    users.add(path, "ada", "lovelace")
    good = path.read_bytes()
    path.write_bytes(good + b"grace:\xff\n")
    assert passwords.users is None and "expected UTF-8 text, found byte 0xff at offset" in caplog.text
    with pytest.raises(SettingsError, match="expected UTF-8 text"):  # nor is it written over
        users.add(path, "grace", "hopper")
    path.write_bytes(good)
    assert passwords.check("ada", "lovelace") == "ada" and passwords.check("guest", "household") == "guest"


# ---- failed sign-ins are slowed -----------------------------------------------------------------

class Recorder:
    """A sleep that returns at once and remembers how long it was asked to wait, and a settable clock."""

    def __init__(self):
        self.slept: list[float] = []
        self.now = 1000.0

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)

    def clock(self) -> float:
        return self.now


def sign_in_with(recorder: Recorder, **throttle) -> users.SignIn:
    passwords = users.Passwords({"ada": users.HASHER.hash("lovelace"), "grace": users.HASHER.hash("hopper")})
    return users.SignIn(passwords, users.Throttle(sleep=recorder.sleep, clock=recorder.clock, **throttle))


def test_each_failure_waits_longer_per_name_and_address_and_per_address():
    recorder = Recorder()
    sign_in = sign_in_with(recorder)

    async def attempts():
        assert await sign_in("ada", "guess", "10.0.0.1") is None
        assert await sign_in("ada", "guess", "10.0.0.1") is None
        assert await sign_in("ada", "guess", "10.0.0.2") is None  # the name from elsewhere: counted apart
        assert await sign_in("grace", "guess", "10.0.0.1") is None  # another name: the address's count goes on
        assert await sign_in("grace", "guess", "10.0.0.3") is None
        assert await sign_in("ada", "lovelace", "10.0.0.1") == "ada"  # right: answered at once
        assert await sign_in("ada", "guess", "10.0.0.4") is None
        recorder.now += users.FORGET_AFTER_S + 1
        assert await sign_in("grace", "guess", "10.0.0.1") is None  # old failures are forgotten
        for _ in range(8):
            await sign_in("grace", "guess", "10.0.0.5")

    asyncio.run(attempts())
    assert recorder.slept[:7] == [1, 2, 1, 4, 1, 1, 1]
    assert recorder.slept[7:] == [1, 2, 4, 8, 16, 30, 30, 30]  # doubled up to MAX_DELAY_S


def test_an_ipv6_address_counts_as_its_64():
    recorder = Recorder()
    sign_in = sign_in_with(recorder)

    async def attempts():
        for address in ("2001:db8:0:1::1", "2001:db8:0:1::2", "2001:db8:0:1:ffff::9", "2001:db8:0:2::1",
                        "::ffff:10.0.0.1", "10.0.0.1"):
            assert await sign_in("ada", "guess", address) is None

    asyncio.run(attempts())
    assert recorder.slept == [1, 2, 4, 1, 1, 2]  # one /64 is one guesser; a mapped IPv4 address is that address
    assert users.address_key("2001:DB8:0:1:2:3:4:5") == "2001:db8:0:1::/64"
    assert users.address_key("unknown") == "unknown"


class Counting(users.Passwords):
    """Remembers the password of every check."""

    def __init__(self, users_: dict[str, str]):
        super().__init__(users_)
        self.checked: list[str] = []

    def check(self, name: str, password: str) -> str | None:
        self.checked.append(password)
        return super().check(name, password)


class HeldSleep:
    """A sleep that says it began and lasts until released."""

    def __init__(self):
        self.began, self.released = asyncio.Event(), asyncio.Event()

    async def __call__(self, seconds: float) -> None:
        self.began.set()
        await self.released.wait()


def test_sign_ins_from_one_address_take_turns():
    """Sent at once, the attempts are still checked one after the other, each after the previous delay."""

    async def attempts():
        passwords, sleep = Counting({"ada": users.HASHER.hash("lovelace")}), HeldSleep()
        sign_in = users.SignIn(passwords, users.Throttle(sleep=sleep))
        tries = [asyncio.create_task(sign_in(name, f"guess {i}", "10.0.0.1")) for i, name in enumerate(["ada"] * 2
                                                                                                      + ["grace"])]
        await sleep.began.wait()  # the first was checked (an argon2 verify) and waits out its delay
        await asyncio.sleep(0.1)
        assert passwords.checked == ["guess 0"]  # the others wait for their turn, unchecked
        sleep.released.set()
        assert await asyncio.gather(*tries) == [None, None, None]
        assert passwords.checked[0] == "guess 0" and sorted(passwords.checked[1:]) == ["guess 1", "guess 2"]

    asyncio.run(attempts())


def test_too_many_waiting_sign_ins_are_refused_unchecked():
    async def attempts():
        passwords, sleep = Counting({"ada": users.HASHER.hash("lovelace")}), HeldSleep()
        sign_in = users.SignIn(passwords, users.Throttle(sleep=sleep, max_waiting=2))
        first = asyncio.create_task(sign_in("ada", "guess", "10.0.0.1"))
        await sleep.began.wait()
        waiting = [asyncio.create_task(sign_in("ada", "guess", "10.0.0.1")) for _ in range(2)]
        await asyncio.sleep(0.05)  # both are in line
        assert await sign_in("grace", "hopper", "10.0.0.1") is None  # a third in line there: refused unchecked
        sleep.released.set()
        await asyncio.gather(first, *waiting)
        assert passwords.checked == ["guess"] * 3

    asyncio.run(attempts())


def test_a_burst_of_wrong_passwords_for_a_name_does_not_keep_its_owner_out():
    """Someone at another address sends many wrong passwords for ada at once: they wait their turns (or are
    refused unchecked), while ada, at her own address, signs in at once, and a typo of hers costs her 1 s."""

    async def attempts():
        passwords, sleep = Counting({"ada": users.HASHER.hash("lovelace")}), HeldSleep()
        recorded: list[float] = []

        async def sleep_unless_owner(seconds: float) -> None:  # the owner's delay is recorded, the others held
            if users.CLIENT_ADDRESS.get() == "192.0.2.1":
                recorded.append(seconds)
            else:
                await sleep(seconds)

        sign_in = users.SignIn(passwords, users.Throttle(sleep=sleep_unless_owner))
        burst = [asyncio.create_task(sign_in("ada", f"guess {i}", "203.0.113.66")) for i in range(30)]
        await sleep.began.wait()
        await asyncio.sleep(0.05)
        assert sum(task.done() for task in burst) == 30 - 1 - users.MAX_WAITING  # refused unchecked at once
        assert passwords.checked == ["guess 0"]  # the rest of the burst waits its turn

        async def as_owner(password: str) -> str | None:
            users.CLIENT_ADDRESS.set("192.0.2.1")
            return await sign_in("ada", password)

        assert await asyncio.create_task(as_owner("typo")) is None
        assert await asyncio.create_task(as_owner("lovelace")) == "ada"
        assert recorded == [1]  # her own first failure, not the burst's count
        assert not all(task.done() for task in burst)
        sleep.released.set()
        assert await asyncio.gather(*burst) == [None] * 30

    asyncio.run(attempts())


def test_the_client_address_reaches_the_sign_in():
    seen = []

    async def app(scope, receive, send):
        seen.append(users.CLIENT_ADDRESS.get())

    asyncio.run(users.ClientAddress(app)({"type": "http", "client": ("192.0.2.7", 51000)}, None, None))
    assert seen == ["192.0.2.7"] and users.CLIENT_ADDRESS.get() == "unknown"
