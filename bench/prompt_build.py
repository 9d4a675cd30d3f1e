"""How long a running stream pauses while another request's prompt is built: on the engine's prompt thread
(as it runs), or on its step loop (as it ran before: the loop waits for the build).

    python bench/prompt_build.py [--chars 4000000] [--rounds 3] [--threads N] [--switch-interval S]

The default model, as the app serves it, through the engine in this process (app/engine/core.py, without
sockets). Stream A answers greedily (ignore_eos); after its 20th token request B arrives with one file of
`--chars` characters (made-up harbor records), which the engine cuts into chunks and ranks against B's
question (app/files/chunks.py, BM25) before B can start. Per round and way: the longest time between two of
A's steps while B is built, A's tokens in that time, and B's wait from arriving to starting (its prompt
taken). The two ways alternate within each round. The interpreter's switch interval is the engine process's
(app/engine/core.py SWITCH_INTERVAL_S), or --switch-interval (Python's default: 0.005).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

from common import ROOT, machine  # noqa: E402

from model.options import DEFAULT_MODEL_NAME  # noqa: E402


def records(chars: int) -> str:
    """Made-up harbor records, one line a berth, until `chars` characters."""
    lines, i = [], 0
    while sum(map(len, lines)) < chars:
        lines.append(f"Berth {i} of district {i % 97}: fee {(i * 37) % 500} crowns, depth {(i * 13) % 40} m, "
                     f"keeper {['Ada', 'Bo', 'Cy', 'Di', 'Ed'][i % 5]} {i % 311}.\n")
        i += 1
    return "".join(lines)[:chars]


def one_round(harness, folder: Path, text: str, on_loop: bool) -> dict:
    from support.engine import request

    from app.backend.conversation import Conversation
    from app.engine.sequence import State
    from app.messages import Attachment, Cancel, ReplySettings

    engine = harness.engine
    a = request("Tell me a long story about a harbor.", ReplySettings(max_new_tokens=400, temperature=0.0,
                                                                        ignore_eos=True), model=folder.name)
    harness.run(a, max_steps=20)
    talk = Conversation()
    talk.add("user", "What is the fee at berth 4242?", files=[Attachment(name="records.txt", text=text)])
    b = request(talk, ReplySettings(max_new_tokens=8, temperature=0.0), model=folder.name)
    stream = engine.requests[a.id][0]
    before, arrived = len(stream.tokens), time.perf_counter()
    engine.handle(b)
    if on_loop:  # as before: the loop builds the prompt before its next step
        engine.wait_for_prompts()
    gaps, last_step = [], arrived
    while engine.requests[b.id][0].state is State.NEW:
        engine.step()
        now = time.perf_counter()
        gaps.append(now - last_step)
        last_step = now
    started = time.perf_counter() - arrived
    tokens = len(stream.tokens) - before
    harness.run(Cancel(a.id))
    return {"longest_pause_s": max(gaps), "a_tokens": tokens, "b_waited_s": started}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chars", type=int, default=4_000_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval for the run (default: the engine process's, SWITCH_INTERVAL_S)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    from support.engine import EngineHarness

    from app.engine.core import SWITCH_INTERVAL_S
    from model.checkpoint import load_checkpoint

    sys.setswitchinterval(args.switch_interval or SWITCH_INTERVAL_S)  # as the engine process sets it
    folder = ROOT / "weights" / DEFAULT_MODEL_NAME
    checkpoint = load_checkpoint(folder, device="auto", dtype="auto", widen="auto")
    harness = EngineHarness(folder, loader=lambda profile, path: checkpoint, kv_cache_mb=0)
    text = records(args.chars)
    print(f"[bench] {machine()['cpu']}, {torch.get_num_threads()} threads; a file of {len(text):,} characters",
          flush=True)
    rows = {"prompt thread": [], "on the loop": []}
    for _ in range(args.rounds):
        for way in rows:
            rows[way].append(one_round(harness, folder, text, on_loop=way == "on the loop"))
            r = rows[way][-1]
            print(f"  {way}: A paused at most {1000 * r['longest_pause_s']:.0f} ms, {r['a_tokens']} tokens of A "
                  f"while B was built; B started after {r['b_waited_s']:.2f} s", flush=True)
    for way, results in rows.items():
        print(f"{way}: median longest pause {1000 * statistics.median(r['longest_pause_s'] for r in results):.0f} ms, "
              f"A's tokens meanwhile {statistics.median(r['a_tokens'] for r in results):.0f}, B started after "
              f"{statistics.median(r['b_waited_s'] for r in results):.2f} s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine(), "chars": len(text), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
