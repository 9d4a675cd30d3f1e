"""Real servers for the tests to drive: the chat app (`chainlit run app/main.py`) and the API alone
(`python -m app.api`), each in a process group of its own (with the engine process it starts),
always stopped by stop()."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from model.options import DEFAULT_MODEL_NAME, DEFAULT_WEIGHTS_DIR

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = DEFAULT_WEIGHTS_DIR / DEFAULT_MODEL_NAME
# Chainlit reads these bare names itself (CI=true switches on its CI mode): never pass them on.
CHAINLIT_OWN_ENV = ("CI", "HEADLESS", "DEBUG", "WATCH", "DATABASE_URL", "NO_CACHE", "RUN_TARGET")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(**llama) -> dict[str, str]:
    """This process's environment, minus what Chainlit would misread, plus LLAMA_* values."""
    env = {k: v for k, v in os.environ.items() if k not in CHAINLIT_OWN_ENV and not k.startswith("LLAMA_")}
    env.update({f"LLAMA_{k.upper()}": str(v) for k, v in llama.items()})
    if "history_db" not in llama:  # never the developer's own chats in data/history.db
        env["LLAMA_HISTORY_DB"] = str(Path(tempfile.mkdtemp(prefix="llama-history-")) / "history.db")
    if "kv_disk_dir" not in llama:  # nor KV caches of the developer's (or of an earlier run's) chats
        env["LLAMA_KV_DISK_DIR"] = tempfile.mkdtemp(prefix="llama-kv-")
    # The tiny test models say 131,072 positions: their own context would let a test's hostile megabyte
    # through as a prompt of hours. The servers' tests were written for 8,192 (the default model's own);
    # the engine's tests take the models' own context (tests/engine/test_models.py, test_files_prompt.py).
    env.setdefault("LLAMA_MAX_CONTEXT", "8192")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a crash in native code leaves its threads' stacks in the log
    env["CHAINLIT_ENV_FILE"] = os.devnull  # a developer's .env must not change what is tested
    return env


class ChainlitServer:
    """`chainlit run app/main.py -h --host H --port N` from the project root.
    host=None leaves --host out, to start it as the README says."""

    def __init__(self, env: dict[str, str], log: Path, port: int | None = None, host: str | None = "127.0.0.1"):
        self.start([sys.executable, "-m", "chainlit", "run", "app/main.py", "-h",
                    *(["--host", host] if host else [])], env, log, port)

    def start(self, command: list[str], env: dict[str, str], log: Path, port: int | None, root: Path = ROOT) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log, "wb")
        self.process = subprocess.Popen([*command, "--port", str(self.port)], cwd=root, env=env, stdout=self._log,
                                        stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"chainlit exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"chainlit did not answer /health within {timeout:.0f} s:\n{self.log()}")

    def running(self):
        """For a fixture (`yield from server.running()`): the server once it answers, stopped after; then it must
        not have ended on its own meanwhile, and its log must hold no traceback."""
        ended = None
        try:
            self.wait_ready()
            yield self
        finally:
            ended = self.process.poll()  # None: still running, as it should be
            self.stop()
        log = self.log_path.read_text(errors="replace")
        assert ended is None, f"the server ended by itself (exit code {ended}) while its tests ran: {log[-3000:]}"
        assert "Traceback" not in log

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-5000:]

    def stop(self) -> None:
        """Stop the server and everything it started (its process group), waiting for them to end."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
            except ProcessLookupError:
                pass
        self._log.close()


class ApiServer(ChainlitServer):
    """`python -m app.api --port N`: the API alone (root: the checkout it runs from, this one unless given)."""

    def __init__(self, env: dict[str, str], log: Path, port: int | None = None, root: Path = ROOT):
        self.start([sys.executable, "-m", "app.api"], env, log, port, root)
