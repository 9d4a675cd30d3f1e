"""The web process's resident memory: the chat app started as the README says, once it is ready.

    python bench/web_memory.py [--root CHECKOUT] [--settle S]

Starts `chainlit run app/main.py -h --port N` in the checkout (default: this one) on its default
model, with its history in a scratch folder, waits until /health answers 200 (the engine process has
loaded the model), waits --settle seconds more, then reads VmRSS, RssAnon and RssFile of the chainlit
process (not of the engine process it started) from /proc, and whether libtorch is mapped into it.
Run it on two checkouts to compare them.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
CHAINLIT_OWN_ENV = ("CI", "HEADLESS", "DEBUG", "WATCH", "DATABASE_URL", "NO_CACHE", "RUN_TARGET")  # it reads these


def status_mb(pid: int) -> dict[str, float]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {key: int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "RssAnon", "RssFile")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout to start (default: this one)")
    p.add_argument("--settle", type=float, default=5.0, help="seconds to wait after /health says ready")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in CHAINLIT_OWN_ENV and not k.startswith("LLAMA_")}
    env |= {"LLAMA_HISTORY_DB": str(Path(tempfile.mkdtemp(prefix="web-memory-")) / "history.db"),
            "CHAINLIT_ENV_FILE": os.devnull}
    server = subprocess.Popen([sys.executable, "-m", "chainlit", "run", "app/main.py", "-h", "--port", str(port)],
                              cwd=args.root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        started = time.monotonic()
        while True:
            if server.poll() is not None or time.monotonic() - started > 600:
                raise SystemExit(f"the app in {args.root} did not become ready")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        time.sleep(args.settle)
        memory = status_mb(server.pid)
        torch_mapped = "libtorch" in Path(f"/proc/{server.pid}/maps").read_text()
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    print(f"{args.root}: web process VmRSS {memory['VmRSS']:.0f} MiB (anon {memory['RssAnon']:.0f}, "
          f"file {memory['RssFile']:.0f}); libtorch mapped: {'yes' if torch_mapped else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
