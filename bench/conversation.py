"""The chat app serving one long conversation: time to first token per turn, and the server's peak memory.

    python bench/conversation.py [--shape llama3.2-1b] [--turns 10] [--words 55] [--reply-tokens 75] [--threads N]
                                 [--pause S]

Starts the real app (`chainlit run app/main.py`) on the random checkpoint of the shape, connects as a
browser tab does (socket.io), and holds a conversation of `--turns` turns: each a user message of
`--words` random words (about 75 tokens) and a greedy reply of `--reply-tokens` tokens, so each turn
adds about 150 tokens. A first chat says "Hello" to warm the server up. Per turn it reads the time to
first token that the app shows under the reply (measured by the engine: prompt to first sampled token)
and, from the server's log, the prompt's length and how much of it came from the KV cache. A follow-up
prefills what is new since the last whole prefill chunk (model/kv_cache.py; with `--pause`, the engine
computes the kept reply again meanwhile, a chunk at a time, and the follow-up reuses it too), so later
turns should start about as fast as the first; without reuse,
a turn's TTFT would grow with its whole prompt, estimated here as prompt tokens / the first turn's
prefill rate (the first turn has nothing to reuse).

The chat keeps each reply as the token ids it was generated as, so the next prompt matches the
engine's cache up to the new message even for random weights (whose text would not encode back to
the same ids).

At the end it reads the peak resident memory (VmHWM) of the web process and of the engine process
and compares their sum with the weight bytes + the conversation's KV cache + 600 MB. Writes bench/results/conversation-<shape>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time

from common import RESULTS, ROOT, engine_pid, machine, random_checkpoint, vm_hwm_mb

sys.path.insert(0, str(ROOT / "tests"))  # the test suite's server and socket.io client

from support.live_chat import LiveChat  # noqa: E402
from support.servers import ChainlitServer, server_env  # noqa: E402

from model.config import LlamaConfig  # noqa: E402

WORDS = ("river mountain quiet garden lantern copper meadow harbor violet engine orchard winter signal "
         "marble thunder canyon pepper willow shadow crystal falcon velvet ember glacier saddle compass "
         "thistle beacon cobalt juniper tundra pebble ribbon walnut canvas").split()


def kv_bytes_per_token(config: LlamaConfig, dtype_bytes: int = 2) -> int:
    return config.n_layers * 2 * config.n_kv_heads * config.head_dim * dtype_bytes


async def converse(url: str, turns: int, words: int, seed: int, pause: float) -> list[dict]:
    rng = random.Random(seed)
    warm_up = await LiveChat(url).open(timeout=300)  # the first reply after start reads the mapped weights
    try:
        await warm_up.ask("Hello", timeout=600)
    finally:
        await warm_up.close()
    chat = await LiveChat(url).open(timeout=300)
    rows = []
    try:
        for turn in range(1, turns + 1):
            if turn > 1:
                await asyncio.sleep(pause)  # a person reads the reply and types the next message
            text = " ".join(rng.choice(WORDS) for _ in range(words))
            sent = time.monotonic()
            reply = await chat.ask(text, timeout=600)
            stats = " ".join(reply.stats)
            found = re.search(r"first token ([\d.]+) s", stats)
            tokens = re.search(r"(\d+) tokens", stats)
            if reply.errors or not found:
                raise RuntimeError(f"turn {turn}: no reply ({reply.errors or stats or reply.notes})")
            rows.append({"turn": turn, "ttft_s": float(found.group(1)), "reply_tokens": int(tokens.group(1)),
                         "user": text, "reply": reply.text,
                         "client_first_piece_s": (reply.first_token_at or sent) - sent, "stats": stats})
            print(f"  turn {turn}: {stats}", flush=True)
    finally:
        await chat.close()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.split("\n")[2:]))
    p.add_argument("--shape", default="llama3.2-1b")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--words", type=int, default=55, help="random words per user message (about 75 tokens)")
    p.add_argument("--reply-tokens", type=int, default=75)
    p.add_argument("--threads", type=int, default=None, help="LLAMA_THREADS for the server (default: all cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pause", type=float, default=0.0,
                   help="seconds between a reply and the next message (the engine computes the kept reply "
                        "again as a prefill meanwhile, so the next turn reuses it; default: none)")
    args = p.parse_args()

    config = LlamaConfig.preset(args.shape)
    folder = random_checkpoint(args.shape)
    weight_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    options = {"threads": args.threads} if args.threads else {}
    env = server_env(checkpoint=folder, weights_dir=folder.parent, history="off", temperature=0,
                     max_new_tokens=args.reply_tokens, **options)
    log = RESULTS / f"conversation-{args.shape}.log"
    RESULTS.mkdir(parents=True, exist_ok=True)
    print(f"{args.shape}: starting the app on {folder.relative_to(ROOT)} (log: {log.relative_to(ROOT)})", flush=True)
    server = ChainlitServer(env, log=log)
    try:
        started = time.monotonic()
        server.wait_ready(timeout=600)
        ready_s = time.monotonic() - started
        engine = engine_pid(server.process.pid)
        rss_ready = vm_hwm_mb(server.process.pid) + vm_hwm_mb(engine)
        rows = asyncio.run(converse(server.url, args.turns, args.words, args.seed, args.pause))
        web_peak, engine_peak = vm_hwm_mb(server.process.pid), vm_hwm_mb(engine)
        peak = web_peak + engine_peak
    finally:
        server.stop()

    # Prompt and reused tokens of each reply, from the service's log (the last `turns` replies are ours).
    logged = re.findall(r"reply: prompt (\d+) tokens \((\d+) from the cache\)", log.read_text(errors="replace"))
    for row, (prompt, reused) in zip(rows, logged[-len(rows):]):
        row["prompt_tokens"], row["reused_tokens"] = int(prompt), int(reused)
    first = rows[0]
    prefill_tps = (first["prompt_tokens"] - first["reused_tokens"]) / first["ttft_s"]
    kv_bytes = kv_bytes_per_token(config) * (rows[-1]["prompt_tokens"] + args.reply_tokens)
    limit_mb = (weight_bytes + kv_bytes) / 2**20 + 600

    print("\n| turn | prompt tokens | from the cache | prefilled | TTFT s | TTFT / turn 1 "
          "| re-prefilling it all, estimated s |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        row["full_prefill_estimate_s"] = row["prompt_tokens"] / prefill_tps
        print(f"| {row['turn']} | {row['prompt_tokens']} | {row['reused_tokens']} | "
              f"{row['prompt_tokens'] - row['reused_tokens']} | {row['ttft_s']:.2f} | "
              f"{row['ttft_s'] / first['ttft_s']:.2f}x | {row['full_prefill_estimate_s']:.2f} |")
    last = rows[-1]
    print(f"\nturn {last['turn']} TTFT = {last['ttft_s'] / first['ttft_s']:.2f}x turn 1 (target <= 1.5x); "
          f"re-prefilling would be about {last['full_prefill_estimate_s'] / first['ttft_s']:.1f}x")
    print(f"peak RSS {peak:.0f} MB (web process {web_peak:.0f}, engine {engine_peak:.0f}; after start "
          f"{rss_ready:.0f} MB); weights {weight_bytes / 2**20:.0f} MB "
          f"+ KV cache {kv_bytes / 2**20:.0f} MB + 600 MB = {limit_mb:.0f} MB: "
          f"{'within' if peak <= limit_mb else 'OVER'}")
    out = RESULTS / f"conversation-{args.shape}.json"
    out.write_text(json.dumps({"shape": args.shape, "machine": machine(), "settings": vars(args),
                               "ready_s": ready_s, "rss_after_start_mb": rss_ready, "peak_rss_mb": peak,
                               "web_peak_rss_mb": web_peak, "engine_peak_rss_mb": engine_peak,
                               "weight_bytes": weight_bytes, "kv_cache_bytes": kv_bytes, "limit_mb": limit_mb,
                               "turns": rows}, indent=2))
    print(f"results: {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
