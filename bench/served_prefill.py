"""Time to the first token of a long prompt through the OpenAI-compatible API: this tree against another checkout,
on the same Q4_K_M file (the 1B shape's random weights quantized by llama.cpp, with Llama 3's tokenizer), in turn.

    python bench/served_prefill.py --baseline PATH [--prompt-words 600] [--rounds 4]

Starts `python -m app.api` from each checkout (this tree's interpreter; each its own LLAMA_CACHE_DIR and weights
folder, the GGUF file as LLAMA_CHECKPOINT, used where it lies, no speculation), waits for /health, then each round
asks each server in turn for a chat completion of `--prompt-words` random words, a word of its own first each time
so that no prefix cache holds any of it, `max_tokens` 1, greedy: the time to the answer is the prompt's prefill (in
the engine's chunks) and one token. Prints the prompt's tokens, and per checkout the best and median seconds and
prompt tokens/s.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, machine
from first_answer import free_port, q4_k_m_file

WORDS = ("river stone garden window morning letter bridge market silver orange thunder pencil harbor meadow "
         "candle forest engine ladder velvet puzzle lantern compass blanket whistle canyon marble saddle feather "
         "glacier").split()


def start(checkout: Path, gguf: Path, folder: Path):
    """The API server of `checkout` on a free port, ready: (process, url)."""
    import httpx

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMA_", "CHAINLIT_"))}
    env |= {"LLAMA_CHECKPOINT": str(gguf), "LLAMA_CACHE_DIR": str(folder / "cache"), "LLAMA_SPECULATE": "off",
            "LLAMA_WEIGHTS_DIR": str(folder / "weights"), "LLAMA_HISTORY": "off"}
    log = open(folder / "server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "app.api", "--port", str(port)], cwd=checkout, env=env,
                              stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            raise RuntimeError(f"{checkout}'s server stopped: {(folder / 'server.log').read_text()[-2000:]}")
        time.sleep(0.5)


def ask(url: str, words: int, rng: random.Random) -> tuple[float, int]:
    """Seconds to a one-token answer to a prompt of `words` random words, and the prompt's tokens."""
    import httpx

    text = " ".join([f"{rng.randrange(10**9)}", *(rng.choice(WORDS) for _ in range(words))])
    model = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]  # the default model comes first
    started = time.perf_counter()
    answer = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
        "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1, "temperature": 0})
    seconds = time.perf_counter() - started
    assert answer.status_code == 200, answer.text
    return seconds, answer.json()["usage"]["prompt_tokens"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", type=Path, required=True, help="another checkout (a git worktree) to compare with")
    p.add_argument("--shape", default="llama3.2-1b")
    p.add_argument("--prompt-words", type=int, default=600)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    gguf = q4_k_m_file(args.shape)
    checkouts = {"this tree": ROOT, "baseline": args.baseline.resolve()}
    servers, times, tokens = {}, {name: [] for name in checkouts}, 0
    rng = random.Random(0)
    try:
        for name, checkout in checkouts.items():
            servers[name] = start(checkout, gguf, Path(tempfile.mkdtemp(prefix="served-prefill-")))
        for name, (_, url) in servers.items():  # a first request of each: the model's load, the kernels' first calls
            ask(url, 16, rng)
        for _ in range(args.rounds):
            for name, (_, url) in servers.items():
                seconds, tokens = ask(url, args.prompt_words, rng)
                times[name].append(seconds)
    finally:
        for server, _ in servers.values():
            server.terminate()
            server.wait(60)
    print(f"{args.shape} Q4_K_M, {machine()['cpu']}, prompts of {tokens} tokens, {args.rounds} rounds in turn\n")
    print("| checkout | seconds to the answer (best / median) | prompt tok/s (best) |\n|---|---|---|")
    for name, seconds in times.items():
        print(f"| {name} | {min(seconds):.2f} / {statistics.median(seconds):.2f} | {tokens / min(seconds):.1f} |")
    print(f"\nthis tree / baseline (best): {min(times['baseline']) / min(times['this tree']):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
