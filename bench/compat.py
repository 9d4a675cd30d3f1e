"""Other people's clients and test suites against our API server, one table of what passes:

- llama.cpp's own server tests (`tools/server/tests` of the llama.cpp that the llama-cpp-python source
  distribution vendors), run by their pytest harness with `bench/llamacpp_shim.py` pointing each test at
  `python -m app.api` on a random Llama 3 checkpoint instead of a `llama-server` binary;
- the Python clients of `tests/api/test_clients.py` (the `ollama` package, the OpenAI Agents SDK,
  langchain-openai on the Responses API, langchain-ollama), each test a row.

    python bench/compat.py [--sdist llama_cpp_python-X.tar.gz] [--files test_chat_completion.py ...]

Without --sdist it runs `pip download --no-deps --no-binary :all: llama-cpp-python` into bench/.cache/compat.
Failures are listed with the first line of their message; docs/compatibility.md says why each differs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "bench" / ".cache" / "compat"
SUITE = "vendor/llama.cpp/tools/server/tests"
# Their files about the OpenAI-shaped routes and what every server answers; the others test llama.cpp's own
# features (slots, LoRA, embeddings, rerank, infill, router, MCP, vision, speculative, sleep).
FILES = ["test_basic.py", "test_chat_completion.py", "test_completion.py", "test_compat_oai_responses.py",
         "test_security.py", "test_tool_call.py", "test_stream.py", "test_ctx_shift.py"]
CLIENTS = {"ollama": "ollama", "agents": "openai-agents", "langchain_openai": "langchain-openai",
           "langchain_ollama": "langchain-ollama"}


def sdist(given: Path | None) -> Path:
    if given:
        return given
    found = sorted(CACHE.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(CACHE),
                        "llama-cpp-python"], check=True)
        found = sorted(CACHE.glob("llama_cpp_python-*.tar.gz"))
    return found[-1]


def their_tests(archive: Path) -> Path:
    """The server tests' folder, unpacked from the source distribution once."""
    top = archive.name.removesuffix(".tar.gz")
    folder = CACHE / top / SUITE
    if not folder.is_dir():
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(f"{top}/{SUITE}/") and m.isfile()]
            tar.extractall(CACHE, members=members, filter="data")
    return folder


def run_pytest(args: list[str], cwd: Path, env: dict[str, str]) -> list[tuple[str, str, str]]:
    """(test, "pass" | "fail" | "skip", first line of the reason) for each test pytest ran."""
    report = Path(tempfile.mkdtemp(prefix="compat-")) / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *args],
                   cwd=cwd, env=env, stdout=subprocess.DEVNULL)
    rows = []
    for case in ET.parse(report).iter("testcase"):
        outcome, reason = "pass", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "skip" if child.tag == "skipped" else "fail"
                reason = (child.get("message") or "").strip().splitlines()[0][:110] if child.get("message") else ""
        rows.append((f"{case.get('classname').split('.')[-1]}::{case.get('name')}", outcome, reason))
    return rows


def llamacpp_rows(archive: Path, files: list[str]) -> list[tuple[str, str, str, str]]:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from support.checkpoints import write_tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix="compat-llamacpp-"))
    write_tiny_checkpoint(work / "weights" / "tinyllama-2")  # named as their preset's alias
    (work / "stubs").mkdir()
    (work / "stubs" / "wget.py").write_text("def download(url, out=None):\n    raise RuntimeError('no downloads')\n")
    env = os.environ | {"COMPAT_WEIGHTS": str(work / "weights"), "COMPAT_LOGS": str(work),
                        "PYTHONPATH": os.pathsep.join([str(ROOT / "bench"), str(ROOT), str(ROOT / "tests"),
                                                       str(work / "stubs")])}
    rows = run_pytest(["-p", "llamacpp_shim", "-m", "not slow", *[f"unit/{name}" for name in files]],
                      their_tests(archive), env)
    print(f"(our server's logs: {work})", file=sys.stderr)
    return [("llama.cpp server tests", *row) for row in rows]


def client_rows() -> list[tuple[str, str, str, str]]:
    rows = []
    for test, outcome, reason in run_pytest(["tests/api/test_clients.py"], ROOT, dict(os.environ)):
        name = test.split("::")[1].removeprefix("test_")
        prefix = next((p for p in CLIENTS if name.startswith(p + "_")), "")
        rows.append((CLIENTS.get(prefix, "?"), name.removeprefix(prefix + "_"), outcome, reason))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sdist", type=Path, help="llama-cpp-python's source distribution (.tar.gz)")
    parser.add_argument("--files", nargs="+", default=FILES, help="which of its tests/unit files to run")
    parser.add_argument("--skip-clients", action="store_true", help="only llama.cpp's tests")
    args = parser.parse_args()
    CACHE.mkdir(parents=True, exist_ok=True)
    archive = sdist(args.sdist)
    rows = llamacpp_rows(archive, args.files) + ([] if args.skip_clients else client_rows())
    print(f"llama.cpp tests from {archive.name}\n")
    print("| client | check | result | reason |\n|---|---|---|---|")
    for client, check, outcome, reason in rows:
        print(f"| {client} | {check.replace('|', '&#124;')} | {outcome} | {reason.replace('|', '&#124;')} |")
    counts = {o: sum(1 for r in rows if r[2] == o) for o in ("pass", "fail", "skip")}
    print(f"\n{counts['pass']} pass, {counts['fail']} fail, {counts['skip']} skip")


if __name__ == "__main__":
    main()
