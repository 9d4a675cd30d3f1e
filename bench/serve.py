"""Many streams at once through the OpenAI-compatible API, against the engine alone and transformers.

    python bench/serve.py [--shape llama3.2-1b | default] [--streams 1,2,4,8] [--new-tokens 128] [--threads 2]

On the random checkpoint of a preset's shape (bench/common.py), or on the default model's own weights
(`--shape default`: a random 135M model's ids mostly fall outside the byte tokenizer it gets, so its
streams would show no text), in one run, every request with a prompt of its own (about 100 tokens;
none is found in the prefix cache), greedy, `--new-tokens` new tokens:
- `--rounds` single streams through the API server (`python -m app.api`, engine process and all),
  each between two runs of `model.generate` alone on the same prompt, in a process of its own loaded
  once, asked right before and right after: the machine's memory moves between a slow and a fast
  state over minutes, so each round is a ratio of its own (served / the mean of the two alone), taken
  seconds apart, and where the two runs alone differ by more than 5% the state changed within the
  round: the median is reported over all rounds and over the steady ones;
- 1, 2, 4 and 8 concurrent streams, `--stream-rounds` times in turn (medians; 8 streams / one stream
  is taken within each round): per stream the time to first token and the decode rate (tokens
  after the first / time from the first to the last piece, as the client sees them), and the
  aggregate (the streams' decode rates added up);
- a request arriving while 7 streams decode: its time to first token against that of a prompt of
  as many words on the idle server, plus two decode steps of the batch (the target); both count
  the first token, visible text or not (logprobs on);
- /health asked every 25 ms from a process of its own throughout the stream counts and the late
  arrival (not during the single-stream rounds: 40 requests a second are a load of their own, which
  took the default model's ratio from 0.97x to 0.93x in a test): its slowest answers;
- the peak resident memory of the web process and of the engine process;
- transformers' `generate` on the 8-stream run's prompts' ids, batch 1 and batch 8 (left padding),
  bf16: decode = new tokens after the first / (time for N tokens - time for 1), times the batch.
Writes bench/results/serve-<shape>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from common import RESULTS, ROOT, engine_pid, machine, random_checkpoint, run_worker, vm_hwm_mb, write_result

sys.path.insert(0, str(ROOT / "tests"))  # the test suite's server helpers

from support.servers import DEFAULT_MODEL, ApiServer, server_env  # noqa: E402

WORDS = ("river mountain quiet garden lantern copper meadow harbor violet engine orchard winter signal "
         "marble thunder canyon pepper willow shadow crystal falcon velvet ember glacier saddle compass "
         "thistle beacon cobalt juniper tundra pebble ribbon walnut canvas").split()
HEALTH_EVERY_S = 0.025
PROBE_START_S = 3.0  # the /health probe's process imports httpx before it asks
# A round's two runs alone agree within this when the machine's memory kept its state through the round.
STEADY = 0.05


def prompts(n: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"Prompt {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(n)]


# ---- workers (fresh processes) ----------------------------------------------------------------------

def worker_generate(spec: dict) -> dict:
    """model.generate alone on the `timed` prompt: the engine's single-stream speed; and the ids of
    `prompts` (for transformers)."""
    import torch

    from model.checkpoint import load_checkpoint
    from model.generation import generate

    torch.set_num_threads(spec["threads"])
    ckpt = load_checkpoint(spec["folder"])
    ids = [ckpt.chat_format.encode_dialog([{"role": "user", "content": p}]) for p in spec["prompts"]]
    timed = ckpt.chat_format.encode_dialog([{"role": "user", "content": spec["timed"]}])
    runs = []
    for attempt in range(2):  # the first also reads the mapped file
        reply = generate(ckpt, timed, max_new_tokens=spec["new_tokens"], temperature=0.0, stop_ids=set())
        list(reply)
        runs.append({"ttft_s": reply.stats.time_to_first_token, "decode_tps": reply.stats.tokens_per_second,
                     "new_tokens": reply.stats.new_tokens})
    return {"runs": runs, "ttft_s": runs[-1]["ttft_s"], "decode_tps": runs[-1]["decode_tps"], "prompt_ids": ids,
            "dtype": str(ckpt.dtype)}


def worker_transformers(spec: dict) -> dict:
    """transformers' batched generate (left padding), bf16: decode rate of batch 1 and of batch len(ids)."""
    import torch
    import transformers

    torch.set_num_threads(spec["threads"])
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["folder"], dtype=torch.bfloat16).eval()
    pad = 0
    results = {}
    for batch in spec["batches"]:
        rows = spec["prompt_ids"][:batch]
        width = max(map(len, rows))
        input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])

        def timed(n: int) -> float:
            started = time.perf_counter()
            with torch.inference_mode():
                model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=pad)
            return time.perf_counter() - started

        timed(2)  # warm up
        t1 = statistics.median(timed(1) for _ in range(2))
        tn = timed(spec["new_tokens"])
        results[str(batch)] = {"ttft_s": t1, "decode_tps": batch * (spec["new_tokens"] - 1) / (tn - t1)}
    return results


class Alone:
    """model.generate in a process of its own, loaded once, generating when asked: each round's runs
    alone come seconds before and after its served run (the machine's memory moves between a slow
    and a fast state over minutes: see docs/benchmarks.md, "A long-lived process")."""

    def __init__(self, spec: dict):
        self.process = subprocess.Popen([sys.executable, __file__, "--alone", json.dumps(spec)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def generate(self, text: str) -> dict:
        self.process.stdin.write(json.dumps(text) + "\n")
        self.process.stdin.flush()
        for line in self.process.stdout:
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT):])
        raise RuntimeError(f"the model.generate process exited with {self.process.wait()}")

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


RESULT = "result: "


def serve_alone(spec: dict) -> None:
    """Alone's process: a prompt as a JSON line on stdin -> its greedy reply's figures on stdout."""
    import torch

    from model.checkpoint import load_checkpoint
    from model.generation import generate

    torch.set_num_threads(spec["threads"])
    ckpt = load_checkpoint(spec["folder"])
    list(generate(ckpt, ckpt.chat_format.encode_dialog([{"role": "user", "content": "Hello"}]),
                  max_new_tokens=8, temperature=0.0))  # reads the mapped file once
    for line in sys.stdin:
        ids = ckpt.chat_format.encode_dialog([{"role": "user", "content": json.loads(line)}])
        reply = generate(ckpt, ids, max_new_tokens=spec["new_tokens"], temperature=0.0, stop_ids=set())
        list(reply)
        print(RESULT + json.dumps({"ttft_s": reply.stats.time_to_first_token,
                                   "decode_tps": reply.stats.tokens_per_second}), flush=True)


# ---- the server ------------------------------------------------------------------------------------------

def stream(url: str, prompt: str, new_tokens: int, out: dict, logprobs: bool = False) -> None:
    """One streamed greedy reply; fills out with sent/first/last times (monotonic) and token count.
    `first` is the first piece of text, or with `logprobs` the first token, text or not (a random
    model's first tokens may be ids its byte tokenizer shows as nothing)."""
    body = {"model": "", "messages": [{"role": "user", "content": prompt}], "max_tokens": new_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            **({"logprobs": True} if logprobs else {})}
    out["sent"] = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                out["tokens"] = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content") or (choice.get("logprobs") or {}).get("content"):
                    out.setdefault("first", time.monotonic())
                    out["last"] = time.monotonic()


def concurrent(url: str, texts: list[str], new_tokens: int, logprobs: bool = False) -> list[dict]:
    outs = [{} for _ in texts]
    threads = [threading.Thread(target=stream, args=(url, t, new_tokens, o, logprobs)) for t, o in zip(texts, outs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for o in outs:
        o["ttft_s"] = o["first"] - o["sent"]
        o["decode_tps"] = (o["tokens"] - 1) / (o["last"] - o["first"])
    return outs


class HealthProbe:
    """GET /health every 25 ms from a process of its own (in this one, the streams' threads would hold
    the probe back), until stop(); the slowest answers."""

    def __init__(self, url: str):
        self._stop_file = RESULTS / f".health-stop-{os.getpid()}"
        self._out = RESULTS / f".health-{os.getpid()}.json"
        self._stop_file.unlink(missing_ok=True)
        self._process = subprocess.Popen([sys.executable, __file__, "--health-probe", url, str(self._stop_file),
                                          str(self._out)])

    def stop(self) -> dict:
        self._stop_file.touch()
        self._process.wait(30)
        times = sorted(json.loads(self._out.read_text()))
        self._stop_file.unlink()
        self._out.unlink()
        return {"requests": len(times), "max_ms": 1000 * times[-1], "p99_ms": 1000 * times[int(0.99 * (len(times) - 1))]}


def probe_health(url: str, stop_file: Path, out: Path) -> None:
    times = []
    with httpx.Client(timeout=10) as client:
        while not stop_file.exists():
            started = time.monotonic()
            client.get(f"{url}/health")
            times.append(time.monotonic() - started)
            time.sleep(HEALTH_EVERY_S)
    out.write_text(json.dumps(times))


def serve_runs(args, folder: Path, spec: dict) -> dict:
    """The server's runs; each with prompts of its own, so that none is found in the prefix cache.
    Single streams alternate with model.generate alone in a fresh process (the bandwidth drifts)."""
    env = server_env(checkpoint=folder, weights_dir=folder.parent, threads=args.threads, max_batch=8)
    log = RESULTS / f"serve-{args.shape}.log"
    server = ApiServer(env, log)
    try:
        started = time.monotonic()
        server.wait_ready(timeout=900)
        ready_s = time.monotonic() - started
        engine = engine_pid(server.process.pid)
        concurrent(server.url, prompts(1, args.prompt_words, seed=999), 8)  # warm up: the mapped weights are read
        pairs = []
        alone_process = Alone(spec)
        for round in range(args.rounds):  # alone, served, alone: the served stream between two runs alone
            text = prompts(1, args.prompt_words, seed=100 + round)
            before = alone_process.generate(text[0])
            served = concurrent(server.url, text, args.new_tokens)[0]
            after = alone_process.generate(text[0])
            runs = [before, after]
            alone = {k: statistics.mean(run[k] for run in runs) for k in ("ttft_s", "decode_tps")}
            steady = abs(before["decode_tps"] / after["decode_tps"] - 1) <= STEADY
            pairs.append({"alone": alone, "alone_runs": [run["decode_tps"] for run in runs], "steady": steady,
                          "served": {k: served[k] for k in ("ttft_s", "decode_tps")}})
            print(f"  round {round + 1}: alone {before['decode_tps']:.2f} and {after['decode_tps']:.2f} tok/s, served "
                  f"{served['decode_tps']:.2f} tok/s ({served['decode_tps'] / alone['decode_tps']:.3f}x"
                  f"{'' if steady else ', memory state changed'})", flush=True)
        alone_process.close()
        probe = HealthProbe(server.url)  # from here on: the probe's 40 requests a second are a load of their own
        time.sleep(PROBE_START_S)  # its interpreter starting up took a core from the first stream count's run
        runs: dict[str, list[dict]] = {str(n): [] for n in args.streams}
        for round in range(args.stream_rounds):  # 1, 2, 4, 8 streams in turn, again: drift touches each alike
            for n in args.streams:
                outs = concurrent(server.url, prompts(n, args.prompt_words, seed=200 + n + 1000 * round),
                                  args.new_tokens)
                runs[str(n)].append({"streams": outs, "aggregate_tps": sum(o["decode_tps"] for o in outs),
                                     "per_stream_tps": statistics.mean(o["decode_tps"] for o in outs),
                                     "ttft_s": statistics.mean(o["ttft_s"] for o in outs)})
                run = runs[str(n)][-1]
                print(f"  {n} streams: aggregate {run['aggregate_tps']:.1f} tok/s, per stream "
                      f"{run['per_stream_tps']:.2f}, TTFT {run['ttft_s']:.2f} s", flush=True)
        rows = {n: {key: statistics.median(r[key] for r in rs) for key in ("aggregate_tps", "per_stream_tps", "ttft_s")}
                | {"rounds": rs} for n, rs in runs.items()}
        late = late_arrival(server.url, prompts(9, args.prompt_words, seed=300), args.new_tokens)
        print(f"  late arrival: TTFT {late['ttft_s']:.2f} s (idle {late['idle_ttft_s']:.2f} s)", flush=True)
        health = probe.stop()
        memory = {"web_peak_mb": vm_hwm_mb(server.process.pid), "engine_peak_mb": vm_hwm_mb(engine)}
    finally:
        server.stop()
    return {"ready_s": ready_s, "single": pairs, "rows": rows, "late": late, "health": health, "memory": memory}


def late_arrival(url: str, texts: list[str], new_tokens: int) -> dict:
    """A request on the idle server; then 7 streams decode (long replies) and, once all have their
    first tokens, an 8th request arrives. The two requests' prompts differ (neither is found in the
    prefix cache) but have as many words; both count their first token, text or not."""
    idle = concurrent(url, texts[8:9], 16, logprobs=True)[0]
    outs = [{} for _ in range(7)]
    threads = [threading.Thread(target=stream, args=(url, t, 4 * new_tokens, o)) for t, o in zip(texts[:7], outs)]
    for t in threads:
        t.start()
    while not all("first" in o for o in outs):
        time.sleep(0.01)
    time.sleep(1.0)
    late = concurrent(url, texts[7:8], 16, logprobs=True)[0]
    for t in threads:
        t.join()
    step_s = statistics.mean((o["last"] - o["first"]) / (o["tokens"] - 1) for o in outs)
    return {"ttft_s": late["ttft_s"], "idle_ttft_s": idle["ttft_s"], "batch7_step_s": step_s}


# ---- main ------------------------------------------------------------------------------------------------

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.split("\n")[2:]))
    p.add_argument("--shape", default="llama3.2-1b")
    p.add_argument("--streams", default="1,2,4,8", type=lambda s: [int(n) for n in s.split(",")])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-words", type=int, default=60, help="random words per prompt (about 100 tokens)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--rounds", type=int, default=3, help="single served streams, each beside model.generate alone")
    p.add_argument("--stream-rounds", type=int, default=2, help="runs of 1, 2, 4, 8 streams, taken in turn")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--worker")
    p.add_argument("--out")
    p.add_argument("--alone", help=argparse.SUPPRESS)
    p.add_argument("--health-probe", nargs=3, metavar=("URL", "STOP_FILE", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.health_probe:
        probe_health(args.health_probe[0], Path(args.health_probe[1]), Path(args.health_probe[2]))
        return 0
    if args.alone:
        serve_alone(json.loads(args.alone))
        return 0
    if args.worker:
        spec = json.loads(args.worker)
        write_result(args.out, {"generate": worker_generate, "transformers": worker_transformers}[spec["kind"]](spec))
        return 0

    folder = DEFAULT_MODEL if args.shape == "default" else random_checkpoint(args.shape)
    spec = {"folder": str(folder), "new_tokens": args.new_tokens, "threads": args.threads}
    script = Path(__file__)
    RESULTS.mkdir(parents=True, exist_ok=True)
    print(f"{args.shape}: the API server, single streams beside model.generate alone", flush=True)
    served = serve_runs(args, folder, spec)
    hf = {}
    if not args.skip_transformers:
        print(f"{args.shape}: transformers batched generate", flush=True)
        eight = prompts(8, args.prompt_words, seed=208)  # the 8-stream run's prompts, as ids
        ids = run_worker(script, {"kind": "generate", **spec, "timed": eight[0], "prompts": eight})["prompt_ids"]
        hf = run_worker(script, {"kind": "transformers", "batches": [1, 8], **spec, "prompt_ids": ids})
        for batch, row in hf.items():
            if isinstance(row, dict):
                print(f"  batch {batch}: decode {row['decode_tps']:.1f} tok/s in all", flush=True)

    report(served, hf)
    print(chart(args.shape, served, hf))
    out = RESULTS / f"serve-{args.shape}.json"
    out.write_text(json.dumps({"shape": args.shape, "machine": machine(), "settings": vars(args), "served": served,
                               "transformers": hf}, indent=2))
    print(f"results: {out.relative_to(ROOT)}")
    return 0


def chart(shape: str, served: dict, hf: dict) -> str:
    """docs/benchmarks-serve-<shape>.png: aggregate decode tokens/s against concurrent streams."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no chart: matplotlib is not installed (pip install matplotlib)"
    streams = [int(n) for n in served["rows"]]
    ours = [row["aggregate_tps"] for row in served["rows"].values()]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    ax.plot(streams, ours, "o-", label="this server (OpenAI API, engine process)")
    one = statistics.median(p["alone"]["decode_tps"] for p in served["single"])
    ax.plot(streams, [n * one for n in streams], ":", color="gray", label="n x model.generate alone")
    for batch, row in hf.items():
        if isinstance(row, dict):
            ax.plot([int(batch)], [row["decode_tps"]], "s", color="tab:orange",
                    label="transformers generate, batch" if batch == "1" else None)
    ax.set_xlabel("concurrent greedy streams")
    ax.set_ylabel("decode tokens/s, all streams together")
    ax.set_xticks(streams)
    ax.set_title(f"{shape}: serving many streams")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = ROOT / "docs" / f"benchmarks-serve-{shape}.png"
    fig.tight_layout()
    fig.savefig(path)
    return f"chart: {path.relative_to(ROOT)}"


def report(served: dict, hf: dict) -> None:
    rows, pairs = served["rows"], served["single"]
    ratios = [p["served"]["decode_tps"] / p["alone"]["decode_tps"] for p in pairs]
    print("\n| round | model.generate alone tok/s, before and after | one served stream tok/s | served / alone | "
          "memory state | TTFT alone s | TTFT served s |")
    print("|---|---|---|---|---|---|---|")
    for i, (p, r) in enumerate(zip(pairs, ratios), 1):
        print(f"| {i} | {' and '.join(f'{t:.2f}' for t in p['alone_runs'])} | {p['served']['decode_tps']:.2f} | "
              f"{r:.3f}x | {'steady' if p['steady'] else 'changed'} | {p['alone']['ttft_s']:.2f} | "
              f"{p['served']['ttft_s']:.2f} |")
    steady = [r for p, r in zip(pairs, ratios) if p["steady"]]
    print(f"one served stream / model.generate alone: median {statistics.median(ratios):.3f}x of all {len(ratios)} "
          f"rounds; " + (f"{statistics.median(steady):.3f}x of the {len(steady)} rounds whose runs alone agree within "
                         f"{STEADY:.0%}" if steady else "no round's runs alone agreed") + " (target >= 0.95)")
    print("\n| streams | aggregate tok/s | per-stream tok/s | TTFT s | aggregate / one stream |")
    print("|---|---|---|---|---|")
    one = rows.get("1", {}).get("aggregate_tps")
    for n, row in rows.items():
        print(f"| {n} | {row['aggregate_tps']:.1f} | {row['per_stream_tps']:.2f} | {row['ttft_s']:.2f} | "
              + (f"{row['aggregate_tps'] / one:.2f}x |" if one else "- |"))
    if "8" in rows and isinstance(hf.get("8"), dict):
        print(f"8 streams / transformers batch 8: {rows['8']['aggregate_tps'] / hf['8']['decode_tps']:.2f}x "
              f"({hf['8']['decode_tps']:.1f} tok/s; batch 1: {hf['1']['decode_tps']:.2f}); target >= 1")
    if one and "8" in rows:
        per_round = [e["aggregate_tps"] / o["aggregate_tps"] for e, o in zip(rows["8"]["rounds"], rows["1"]["rounds"])]
        print(f"8 streams / one stream: {statistics.median(per_round):.2f}x, median of the rounds' "
              f"{', '.join(f'{r:.2f}x' for r in per_round)} (target >= 4)")
    late = served["late"]
    idle = late["idle_ttft_s"]
    limit = idle + 2 * late["batch7_step_s"]
    print(f"late arrival TTFT {late['ttft_s']:.2f} s; idle TTFT {idle:.2f} s + 2 steps of "
          f"{late['batch7_step_s']:.3f} s = {limit:.2f} s: {'met' if late['ttft_s'] <= limit else 'MISSED'}")
    h, m = served["health"], served["memory"]
    print(f"/health: slowest {h['max_ms']:.1f} ms, p99 {h['p99_ms']:.1f} ms over {h['requests']} requests "
          f"(target < 50 ms)")
    print(f"peak RSS: web process {m['web_peak_mb']:.0f} MiB, engine process {m['engine_peak_mb']:.0f} MiB")


if __name__ == "__main__":
    sys.exit(main())
