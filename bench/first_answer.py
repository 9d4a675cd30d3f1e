"""From a fresh clone to the first answer of a model pulled from a stand-in for an ungated Hub repo, each stage timed.

    python bench/first_answer.py [--shape llama3.2-1b] [--keep]

As a newcomer goes: (1) `git clone` of this checkout (its last commit) into a temporary folder; (2) the README's
set-up there, `python3 -m venv .venv` and `pip install -r requirements.txt` (pip's own cache as this machine has
it: the packages are not downloaded again); (3) `chainlit run app/main.py -h` until /health says ready, with an
empty LLAMA_CACHE_DIR, so the default model is prepared and the decode kernel built as on a first start; (4)
`POST /api/pull hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M` (as `ollama pull` would ask, and the models
panel does the same job) from a local stand-in for the Hub (tests/support/fake_hub.py) serving a Q4_K_M file that
llama.cpp's quantizer made from random weights of the shape, with Llama 3's tokenizer; (5) the first streamed
/api/chat answer of that model (its load included): time to its first piece, and to its end (32 tokens). The
stand-in is on this machine: the pull's time is the import's and the disk's, not a network's. Writes
`bench/results/first_answer.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, ROOT, machine, random_checkpoint

sys.path.insert(0, str(ROOT / "tests"))
from support.fake_hub import FakeHub, Repo  # noqa: E402
from support.gguf_checkpoints import add_llama3_vocab  # noqa: E402

from gguf_file import CACHE, llama_quantize, write_gguf  # noqa: E402

REPO = "bartowski/Llama-3.2-1B-Instruct-GGUF"
FILE = "Llama-3.2-1B-Instruct-Q4_K_M.gguf"


def q4_k_m_file(shape: str) -> Path:
    """The shape's random weights with Llama 3's tokenizer, quantized to Q4_K_M by llama.cpp (written once)."""
    path = CACHE / f"{shape}-q4_k_m-llama3-vocab.gguf"
    if not path.is_file():
        source = CACHE / f"{shape}-bf16-llama3-vocab.gguf"
        if not source.is_file():
            write_gguf(random_checkpoint(shape), source.with_suffix(".partial"), "bf16", add_vocab=add_llama3_vocab,
                       name="Llama 3.2 1B Instruct (random)").rename(source)
        llama_quantize(source, path.with_suffix(".partial"), "q4_k_m").rename(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(stages: dict, name: str, step):
    started = time.monotonic()
    result = step()
    stages[name] = round(time.monotonic() - started, 1)
    print(f"{name}: {stages[name]} s", flush=True)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama3.2-1b")
    p.add_argument("--keep", action="store_true", help="keep the clone's folder")
    args = p.parse_args()
    import httpx

    gguf = q4_k_m_file(args.shape)
    hub = FakeHub()
    hub.repos[REPO] = Repo({FILE: gguf.read_bytes()})
    folder = Path(tempfile.mkdtemp(prefix="first-answer-"))
    clone, stages = folder / "llama-chat", {}
    server = None
    try:
        timed(stages, "clone", lambda: subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True))
        timed(stages, "install", lambda: subprocess.run(
            "python3 -m venv .venv && .venv/bin/pip install -q -r requirements.txt", shell=True, cwd=clone,
            check=True))
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMA_", "CHAINLIT_"))}
        env |= {"LLAMA_CACHE_DIR": str(folder / "cache"), "HF_ENDPOINT": hub.url, "HF_HOME": str(folder / "hf")}
        url = f"http://127.0.0.1:{port}"
        log = open(folder / "chainlit.log", "w")

        def start():
            nonlocal server
            server = subprocess.Popen([".venv/bin/chainlit", "run", "app/main.py", "-h", "--port", str(port)],
                                      cwd=clone, env=env, stdout=log, stderr=subprocess.STDOUT)
            while True:
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if server.poll() is not None:
                    raise RuntimeError(f"the server stopped: {(folder / 'chainlit.log').read_text()[-2000:]}")
                time.sleep(0.3)
        timed(stages, "start (first start: default model prepared, kernel built)", start)

        def pull():
            answer = httpx.post(f"{url}/api/pull", json={"model": f"hf.co/{REPO}:Q4_K_M", "stream": False},
                                timeout=1800)
            assert answer.status_code == 200, answer.text
        timed(stages, f"pull {REPO}:Q4_K_M ({gguf.stat().st_size / 1e6:.0f} MB)", pull)
        model = next(m["name"] for m in httpx.get(f"{url}/api/tags").json()["models"] if "Q4_K_M" in m["name"])
        started, first = time.monotonic(), None
        with httpx.stream("POST", f"{url}/api/chat", timeout=600, json={
                "model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "options": {"num_predict": 32, "temperature": 0}}) as reply:
            for line in reply.iter_lines():
                if line and first is None and json.loads(line).get("message", {}).get("content"):
                    first = time.monotonic() - started
        stages["first answer: its first piece (the model's load included)"] = round(first, 1)
        stages["first answer: its end (32 tokens)"] = round(time.monotonic() - started, 1)
        for name in list(stages)[-2:]:
            print(f"{name}: {stages[name]} s")
        print(f"in all, to the first answer's first piece: "
              f"{sum(v for k, v in stages.items() if 'its end' not in k):.1f} s")
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)
        hub.stop()
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "first_answer.json").write_text(json.dumps({"machine": machine(), "stages_s": stages}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
