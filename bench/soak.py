"""Soak: many replies through the app's engine client and engine process; fails on a leak in either.

    python bench/soak.py [--replies 300] [--max-new-tokens 32] [--checkpoint weights/SmolLM2-135M-Instruct]

Chats of --turns replies each, one after the other, as the app serves them: every 10th reply is
stopped after its first piece (Stop), every 25th message is too long for the context (a polite
refusal). The engine keeps finished chats' KV caches for reuse up to --kv-cache-mb (growth up to that
is by design). After --warmup replies, resident memory (VmRSS), open file descriptors and threads of this
(the web) process and of the engine process are read (/proc); then again every 10 replies and at the
end. It is a leak when either process's memory grows by more than --max-growth-mb above the warm-up
reading, or when descriptors or threads are more at the end than after the warm-up (or this process
has more threads after the client closed than before it started). Prints a summary (and --json
writes it); exits 1 on a leak or a failed reply.
Linux only (/proc).
Too slow for the test suite: 300 replies of 32 tokens take 10-15 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/soak.py` from anywhere
    sys.path.insert(0, str(ROOT))

from app.backend.protocol import open_backend  # noqa: E402
from app.backend.engine_client import EngineClient  # noqa: E402
from app.backend.conversation import Conversation  # noqa: E402
from app.messages import Done, Failed, ReplySettings, Text  # noqa: E402
from app.settings import Settings  # noqa: E402
from model.options import DEFAULT_MODEL_NAME, DEFAULT_WEIGHTS_DIR  # noqa: E402

MB = 1 << 20
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain recursion to a child.",
    "Give me three tips for sleeping better.", "What is 17 times 23?", "Name a few uses of a paperclip.",
    "Translate 'good morning' into Spanish and German.", "Why is the sky blue?",
    "Write a Python function that reverses a string.", "Summarize the plot of Cinderella in two sentences.",
]
FOLLOW_UPS = ["Tell me more.", "Can you say that more briefly?", "And why is that?", "Give an example."]
TOO_LONG = "word " * 20_000  # more tokens than any context this app serves


def status(pid: int | str, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def reading(engine_pid: int) -> dict:
    """This process's and the engine's resident memory, descriptors and threads."""
    gc.collect()
    return {"rss_mb": status("self", "VmRSS") / 1024, "fds": len(os.listdir("/proc/self/fd")),
            "threads": threading.active_count(), "engine_rss_mb": status(engine_pid, "VmRSS") / 1024,
            "engine_fds": len(os.listdir(f"/proc/{engine_pid}/fd")), "engine_threads": status(engine_pid, "Threads")}


async def one_reply(service: EngineClient, conversation: Conversation, settings: ReplySettings,
                    stop_early: bool) -> tuple[str, int]:
    """Ask for a reply; returns ("done" | "stopped" | "refused" | "failed", new tokens)."""
    request = service.stream(conversation, settings)
    last = None
    async for event in request:
        if isinstance(event, Text) and stop_early:
            request.cancel()
        last = event
    if isinstance(last, Done):
        conversation.add("assistant", last.text, ids=last.token_ids)
        return ("stopped" if last.finish_reason == "cancelled" else "done"), last.stats.new_tokens
    conversation.messages.pop()  # not answered: out of the history, as the app does
    return ("refused" if isinstance(last, Failed) and last.reason == "prompt_too_long" else "failed"), 0


async def soak(service: EngineClient, args) -> dict:
    counts = {"done": 0, "stopped": 0, "refused": 0, "failed": 0}
    tokens, samples, after_warmup = 0, [], None
    conversation = None
    started = time.perf_counter()
    for i in range(args.replies):
        if i % args.turns == 0:  # a new chat
            conversation = Conversation()
        if (i + 1) % 25 == 0:
            conversation.add("user", TOO_LONG)
        elif not conversation.messages:
            conversation.add("user", QUESTIONS[(i // args.turns) % len(QUESTIONS)])
        else:
            conversation.add("user", FOLLOW_UPS[i % len(FOLLOW_UPS)])
        settings = ReplySettings(max_new_tokens=args.max_new_tokens, seed=i)
        outcome, new_tokens = await one_reply(service, conversation, settings, stop_early=(i + 1) % 10 == 0)
        counts[outcome] += 1
        tokens += new_tokens
        if i + 1 == args.warmup:
            after_warmup = reading(service.pid)
        if after_warmup and (i + 1) % 10 == 0:
            r = reading(service.pid)
            samples.append({"reply": i + 1, **r})
            print(f"  {i + 1:4d} replies  web: rss {r['rss_mb']:7.1f} MB fds {r['fds']:3d} threads {r['threads']:2d}"
                  f"  engine: rss {r['engine_rss_mb']:7.1f} MB fds {r['engine_fds']:3d} threads "
                  f"{r['engine_threads']:2d}", flush=True)
    del conversation
    return {"counts": counts, "new_tokens": tokens, "seconds": time.perf_counter() - started,
            "after_warmup": after_warmup, "samples": samples, "at_end": reading(service.pid)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--replies", type=int, default=300, help="replies in all (default 300)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="the longest reply (default 32)")
    parser.add_argument("--turns", type=int, default=4, help="replies per chat (default 4)")
    parser.add_argument("--warmup", type=int, default=20, help="replies before the first reading (default 20)")
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_WEIGHTS_DIR / DEFAULT_MODEL_NAME,
                        help="checkpoint folder (default: the default model, prepared if missing)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--kv-cache-mb", type=int, default=16,
                        help="LLAMA_KV_CACHE_MB: the engine keeps finished chats' caches up to this, by design "
                             "(default 16, so that what it keeps is small beside the leak limit)")
    parser.add_argument("--max-growth-mb", type=float, default=100.0,
                        help="resident memory growth after the warm-up that counts as a leak (default 100)")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.replies <= args.warmup:
        parser.error(f"--replies ({args.replies}) must be more than --warmup ({args.warmup})")

    threads_before = threading.active_count()
    settings = Settings.from_env(os.environ | {  # the app's settings (LLAMA_KERNELS, ...), these as asked
        "LLAMA_CHECKPOINT": str(args.checkpoint), "LLAMA_THREADS": str(args.threads),
        "LLAMA_WEIGHTS_DIR": str(args.checkpoint.parent), "LLAMA_KV_CACHE_MB": str(args.kv_cache_mb)})
    service = open_backend(settings)
    loaded = time.perf_counter()

    async def run() -> dict:
        await service.load()
        print(f"soak: {args.replies} replies of at most {args.max_new_tokens} tokens on {service.default} "
              f"({time.perf_counter() - loaded:.1f} s to start and load), {args.threads} thread(s)", flush=True)
        return await soak(service, args)

    try:
        result = asyncio.run(run())
    finally:
        service.close()
    threads_after_close = threading.active_count()

    base, end = result["after_warmup"], result["at_end"]
    leaks, peaks = [], {}
    for process, prefix in (("web", ""), ("engine", "engine_")):
        peak = peaks[process] = max(s[f"{prefix}rss_mb"] for s in result["samples"] + [end])
        if peak - base[f"{prefix}rss_mb"] > args.max_growth_mb:
            leaks.append(f"{process} process: resident memory grew by {peak - base[f'{prefix}rss_mb']:.1f} MB "
                         f"(limit {args.max_growth_mb:g})")
        for what in ("fds", "threads"):
            if end[f"{prefix}{what}"] > base[f"{prefix}{what}"]:
                leaks.append(f"{process} process: {what} {base[f'{prefix}{what}']} after the warm-up, "
                             f"{end[f'{prefix}{what}']} at the end")
    if threads_after_close > threads_before:
        leaks.append(f"threads: {threads_before} before the client, {threads_after_close} after it closed")
    counts = result["counts"]
    summary = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
        "python": platform.python_version(), "model": service.default, "replies": args.replies,
        "max_new_tokens": args.max_new_tokens, "threads_option": args.threads, **counts,
        "new_tokens": result["new_tokens"], "minutes": round(result["seconds"] / 60, 1),
        **{f"{key}_after_warmup": round(value, 1) for key, value in base.items()},
        **{f"{key}_at_end": round(value, 1) for key, value in end.items()},
        "web_rss_mb_peak_after_warmup": round(peaks["web"], 1),
        "engine_rss_mb_peak_after_warmup": round(peaks["engine"], 1),
        "threads_before_client": threads_before, "threads_after_close": threads_after_close,
        "leaks": leaks,
    }
    print("\n".join(f"{key:>26}: {value}" for key, value in summary.items() if key != "leaks"))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**summary, "samples": result["samples"]}, indent=1))
    print("LEAK: " + "; ".join(leaks) if leaks else "no leak", flush=True)
    if counts["failed"]:
        print(f"FAILED: {counts['failed']} replies failed", flush=True)
    return 1 if leaks or counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
