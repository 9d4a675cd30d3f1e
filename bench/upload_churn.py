"""Uploads never sent: does the disk come back to where it started within the cleanup period?

    python bench/upload_churn.py [--uploads 1000] [--size 1024] [--sessions 50]

Starts the chat app (`chainlit run app/main.py -h`) on loopback over a remote backend that is never asked
(no model loads: nothing is sent), with history off; opens --sessions socket.io sessions as browser tabs do,
and uploads --uploads small text files through Chainlit's upload route (POST /project/file), spread over the
sessions, as the page uploads an attached file; no message takes them. Then it reads, every 5 s, the bytes
under Chainlit's upload folder (.files/ of this checkout) and the `llama_stored_bytes{part="uploads"}` gauge of
/metrics, until the folder is back to its size before the uploads, or the cleanup period (app.web.uploads:
KEEP_SECONDS + 2 sweeps) and a minute more have passed (exit 1). Prints the uploads' statuses and time, the
peak, and when the disk came back.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the test suite's server and socket.io tab
from app.web.uploads import KEEP_SECONDS, SWEEP_SECONDS, folder_bytes  # noqa: E402
from support.live_chat import LiveChat  # noqa: E402
from support.servers import ChainlitServer, server_env  # noqa: E402

FOLDER = ROOT / ".files"  # Chainlit's, for `chainlit run` in this checkout
GAUGE = re.compile(r'^llama_stored_bytes\{part="uploads"\} (\S+)$', re.M)


async def upload_all(url: str, uploads: int, size: int, sessions: int) -> tuple[Counter, float]:
    """The uploads, spread over the sessions (each one's in turn, the sessions at once); then the tabs close."""
    tabs = [await LiveChat(url).open() for _ in range(sessions)]
    statuses: Counter = Counter()
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=60) as client:
        async def tab_uploads(tab: LiveChat, count: int) -> None:
            for k in range(count):
                answer = await client.post(f"{url}/project/file", params={"session_id": tab.session_id},
                                           files={"file": (f"note-{k}.txt", b"x" * size, "text/plain")})
                statuses[answer.status_code] += 1

        share = [uploads // sessions + (k < uploads % sessions) for k in range(sessions)]
        await asyncio.gather(*(tab_uploads(tab, n) for tab, n in zip(tabs, share)))
    took = time.monotonic() - started
    for tab in tabs:
        await tab.close()
    return statuses, took


def gauge(url: str) -> float | None:
    found = GAUGE.search(httpx.get(f"{url}/metrics", timeout=10).text)
    return float(found.group(1)) if found else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--uploads", type=int, default=1000)
    p.add_argument("--size", type=int, default=1024, help="bytes of each upload")
    p.add_argument("--sessions", type=int, default=50, help="tabs the uploads are spread over")
    args = p.parse_args()
    env = server_env(backend_url="http://127.0.0.1:9/v1", backend_model="remote", history="off")
    server = ChainlitServer(env, Path(tempfile.mkdtemp(prefix="upload-churn-")) / "server.log")
    try:
        server.wait_ready()
        before = folder_bytes(FOLDER)
        statuses, took = asyncio.run(upload_all(server.url, args.uploads, args.size, args.sessions))
        after = folder_bytes(FOLDER)
        print(f"{args.uploads} uploads of {args.size} B over {args.sessions} sessions in {took:.1f} s: "
              f"{dict(sorted(statuses.items()))}")
        print(f".files/: {before:,} B before, {after:,} B after the uploads")
        started, period = time.monotonic(), KEEP_SECONDS + 2 * SWEEP_SECONDS
        while True:
            time.sleep(5)
            now, waited = folder_bytes(FOLDER), time.monotonic() - started
            print(f"  {waited:5.0f} s: .files/ {now:,} B; /metrics uploads {gauge(server.url)}")
            if now <= before:
                print(f"back to {now:,} B {waited:.0f} s after the last upload (cleanup period: {period:.0f} s)")
                return 0
            if waited > period + 60:
                print(f"still {now - before:,} B more than before after {waited:.0f} s")
                return 1
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
