"""What choosing a token costs on the CPU: the host's sampler against the tensor ops a GPU runs, and a chat's
replies through the API against another commit's server.

    python bench/sampling.py [--rounds 30]                              # the sampler alone
    python bench/sampling.py --served --baseline COMMIT [--rounds 3]    # two API servers, asked in turn

The sampler alone: next-token logits of the default model (real weights) at every position of its greedy
replies to a few questions; for each sampling preset a chat app sends (the default model's own
generation_config, Llama 3.2's, Ollama's defaults, plain temperature, greedy), the time per token of
model/sampling.py's `host_sample` (what the CPU runs) against `tensor_sample` (the GPU's way, which the CPU ran
before), in turn, best of `--rounds`.

`--served`: the working tree's API server (`python -m app.api`) beside one started from a git worktree of
`--baseline`, the default model as the app serves it, asked in turn through `/v1/chat/completions` with the
model's own sampling (the request names only a seed) and, as a control, greedily (temperature 0: the same
replies from both). Per ask the median over rounds of completion tokens per second as the client sees them.
The questions were not used to tune the sampler.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

import torch  # noqa: E402
from common import ROOT, machine  # noqa: E402

from model.sampling import host_sample, tensor_sample  # noqa: E402

PRESETS = {  # name: (temperature, top_k, top_p, min_p)
    "default model (0.2, top-p 0.9, min-p 0.05)": (0.2, 0, 0.9, 0.05),
    "Llama 3.2 (0.6, top-p 0.9)": (0.6, 0, 0.9, 0.0),
    "Ollama (0.8, top-k 40, top-p 0.9)": (0.8, 40, 0.9, 0.0),
    "temperature 1 alone": (1.0, 0, 1.0, 0.0),
    "greedy": (0.0, 0, 1.0, 0.0),
}
QUESTIONS = [  # for the logits, and the served asks
    "Why is the sky blue?",
    "Write a short poem about autumn leaves.",
    "Give me three tips for learning to cook.",
    "Explain what a hash table is to a beginner.",
    "What should I pack for a weekend hiking trip?",
    "Summarize the plot of Romeo and Juliet in a paragraph.",
]


def model_logits(tokens: int) -> list[torch.Tensor]:
    from model.checkpoint import load_checkpoint
    from model.generation import Generation
    from model.options import DEFAULT_MODEL_NAME, DEFAULT_WEIGHTS_DIR

    checkpoint = load_checkpoint(DEFAULT_WEIGHTS_DIR / DEFAULT_MODEL_NAME)
    found = []
    for question in QUESTIONS:
        prompt = checkpoint.chat_format.encode_dialog([{"role": "user", "content": question}])
        reply = Generation(checkpoint, prompt, max_new_tokens=tokens, temperature=0.0, speculate="off")
        original = reply.decoding.sample
        reply.decoding.sample = lambda logits: found.append(logits.clone()) or original(logits)
        for _ in reply:
            pass
    return found


def alone(rounds: int, tokens: int) -> list[dict]:
    logits = model_logits(tokens)
    print(f"[bench] {machine()['cpu']}, {torch.get_num_threads()} threads, {len(logits)} positions' logits "
          f"({logits[0].shape[0]} tokens each)", flush=True)
    rows = []
    for name, (temperature, top_k, top_p, min_p) in PRESETS.items():
        best = {"tensor ops": float("inf"), "host": float("inf")}
        for r in range(rounds):
            for way in (("tensor ops", "host") if r % 2 == 0 else ("host", "tensor ops")):
                generator = torch.Generator().manual_seed(r)
                started = time.perf_counter()
                for x in logits:
                    if way == "host":
                        host_sample(x, temperature, top_k, top_p, generator, min_p)
                    else:
                        tensor_sample(x, temperature, top_k, top_p, generator, min_p)
                best[way] = min(best[way], (time.perf_counter() - started) / len(logits))
        rows.append({"preset": name, "tensor_ms": best["tensor ops"] * 1e3, "host_ms": best["host"] * 1e3,
                     "ratio": best["tensor ops"] / best["host"]})
        print(f"  {name:45s} tensor ops {rows[-1]['tensor_ms']:7.3f} ms  host {rows[-1]['host_ms']:6.3f} ms  "
              f"{rows[-1]['ratio']:5.1f}x", flush=True)
    return rows


def served(baseline: str, rounds: int, tokens: int) -> dict:
    import httpx
    from support.servers import DEFAULT_MODEL, ApiServer, server_env
    from support.special_checkpoints import default_model

    default_model()
    logs = Path(tempfile.mkdtemp(prefix="sampling-served-"))
    tree = logs / "baseline"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), baseline], check=True,
                   capture_output=True)
    def env() -> dict[str, str]:  # each server its own history and KV folders (server_env makes new ones)
        return server_env(checkpoint=DEFAULT_MODEL, weights_dir=DEFAULT_MODEL.parent, kv_cache_mb=0, kv_disk_mb=0)

    servers = {"baseline": ApiServer(env(), logs / "baseline.log", root=tree),
               "this tree": ApiServer(env(), logs / "this-tree.log")}
    results: dict[str, list[dict]] = {}
    try:
        for server in servers.values():
            server.wait_ready(timeout=300)
        with httpx.Client(timeout=600) as client:
            def ask(name: str, question: str, sampling: dict) -> tuple[float, str]:
                started = time.perf_counter()
                r = client.post(f"{servers[name].url}/v1/chat/completions", json={
                    "model": DEFAULT_MODEL.name, "messages": [{"role": "user", "content": question}],
                    "max_tokens": tokens, **sampling})
                seconds = time.perf_counter() - started
                r.raise_for_status()
                body = r.json()
                return body["usage"]["completion_tokens"] / seconds, body["choices"][0]["message"]["content"]

            for kind, sampling in (("model's sampling", {"seed": 7}), ("greedy", {"temperature": 0})):
                print(f"Served, {kind}:", flush=True)
                rows = []
                for question in QUESTIONS:
                    speeds: dict[str, list[float]] = {name: [] for name in servers}
                    texts = {}
                    for name in servers:  # once unmeasured: both warm alike
                        ask(name, question, sampling)
                    for r in range(rounds):
                        for name in (list(servers) if r % 2 == 0 else list(servers)[::-1]):
                            speed, texts[name] = ask(name, question, sampling)
                            speeds[name].append(speed)
                    base, ours = (statistics.median(speeds[name]) for name in servers)
                    rows.append({"ask": question, "baseline_tok_s": base, "this_tree_tok_s": ours, "ratio": ours / base,
                                 "same_text": texts["baseline"] == texts["this tree"]})
                    print(f"  {question[:40]:40s} baseline {base:6.1f} tok/s  this tree {ours:6.1f} tok/s  "
                          f"{ours / base:.2f}x  same text: {rows[-1]['same_text']}", flush=True)
                results[kind] = rows
                ratios = [row["ratio"] for row in rows]
                print(f"  {kind}: geometric mean {statistics.geometric_mean(ratios):.2f}x, "
                      f"{min(ratios):.2f}x-{max(ratios):.2f}x", flush=True)
    finally:
        for server in servers.values():
            server.stop()
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=None, help="alone: 30; served: 3")
    p.add_argument("--tokens", type=int, default=None, help="tokens a reply: alone 48, served 200")
    p.add_argument("--served", action="store_true")
    p.add_argument("--baseline", help="the commit the served mode measures against")
    p.add_argument("--out", default="bench/results/sampling.json")
    args = p.parse_args()
    if args.served:
        if not args.baseline:
            p.error("--served needs --baseline COMMIT")
        result = served(args.baseline, args.rounds or 3, args.tokens or 200)
    else:
        result = alone(args.rounds or 30, args.tokens or 48)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine(), "args": vars(args), "results": result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
