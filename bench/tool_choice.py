"""tool_choice "required" and a named function through the API, on a Llama 3 checkpoint: how many replies are
valid calls of an allowed tool.

    python bench/tool_choice.py [--shape llama3.2-1b | tiny] [--replies 50] [--threads 2] [--out FILE]

Starts `python -m app.api` on random weights of a preset's shape (bench/common.py; Llama 3's vocabulary, so
Llama 3's tokenizer and tool-call format) or on the tests' tiny random checkpoint, and asks `--replies`
requests per case (required / named, whole / streamed; half of them with parallel_tool_calls false),
temperature 1 over the whole vocabulary, 16 at a time, with the official `openai` client. Random weights
write garbage unconstrained: only the constraint (model/tool_choice.py) makes a reply a valid call. Counts
replies whose calls name an allowed tool with arguments valid against its schema (tests/support/tool_calls.py,
the same check the tests assert), and prints what is wrong with any other.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

from common import machine, random_checkpoint  # noqa: E402
from support.servers import ApiServer, server_env  # noqa: E402
from support.tool_calls import ask_all, body, problems  # noqa: E402

KEY = "bench-tool-choice"
CASES = {"required": "required", "named": {"type": "function", "function": {"name": "send_letter"}}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3.2-1b", help="a preset's shape (random weights), or tiny")
    p.add_argument("--replies", type=int, default=50)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.shape == "tiny":
        from support.checkpoints import write_tiny_checkpoint
        folder = write_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="tool-choice-")) / "tiny")
    else:
        folder = random_checkpoint(args.shape)
    log = Path(tempfile.mkdtemp(prefix="tool-choice-log-")) / "api.log"
    server = ApiServer(server_env(checkpoint=folder, weights_dir=folder.parent, threads=args.threads, api_key=KEY,
                                  max_batch=16), log=log)
    results = {"machine": machine(), "shape": args.shape, "replies": args.replies, "cases": {}}
    print(f"[bench] {results['machine']['cpu']}, {args.shape}, {args.replies} replies a case", flush=True)
    try:
        server.wait_ready(timeout=600)
        for case, tool_choice in CASES.items():
            for stream in (False, True):
                parallel = [i % 2 == 1 for i in range(args.replies)]
                started = time.perf_counter()
                replies = ask_all(server.url, KEY, [body(i, tool_choice, parallel[i], model=folder.name)
                                                    for i in range(args.replies)], stream, timeout=3600)
                seconds = time.perf_counter() - started
                wrong = problems(replies, tool_choice, parallel)
                bad = len({w.split(":")[0] for w in wrong})
                name = f"{case}, {'streamed' if stream else 'whole'}"
                calls = sum(len(calls) for _, calls, _ in replies)
                results["cases"][name] = {"valid": args.replies - bad, "replies": args.replies, "calls": calls,
                                          "seconds": seconds, "problems": wrong[:10]}
                print(f"  {name:20} {args.replies - bad}/{args.replies} valid ({calls} calls, {seconds:.0f} s)",
                      flush=True)
                for w in wrong[:10]:
                    print(f"    {w}", flush=True)
    finally:
        server.stop()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
