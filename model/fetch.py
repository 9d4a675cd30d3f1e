"""Bring a model into weights/ in one command.

    python -m model.fetch meta-llama/Llama-3.2-1B-Instruct  # download from Hugging Face
    python -m model.fetch path/to/model.gguf                # import a GGUF (llama.cpp, Ollama, LM Studio)
    python -m model.fetch ~/.lmstudio/models                # import every Llama GGUF in a folder
    python -m model.fetch https://host/path/model.gguf     # download a GGUF, then import it

Prints each model folder it wrote. A failure prints one line saying what to do, exits with status 2
and leaves weights/ as it was (an interrupted download keeps a hidden folder to resume from).
With --report, stdout is JSON lines for a program that watches (the server's pulls, app/weights.py):
{"files": {name: bytes}} once the hub has listed a download's files, then {"folder": path} per model.
The work is done in model/convert/ (hub.py, gguf.py).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
from pathlib import Path

from .convert.folder import ConversionError
from .convert.gguf import import_ggufs
from .convert.hub import download, is_repo_id
from .convert.url import fetch_gguf_url, is_url
from .options import Environment


def end_with_parent() -> None:
    """SIGTERM to this process when its parent ends (Linux's PR_SET_PDEATHSIG; elsewhere nothing), and an end now if
    the parent has ended already (this process was adopted before the request took effect)."""
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux
        return
    if os.getppid() != parent:
        sys.exit(130)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m model.fetch", description=__doc__.split("\n")[0])
    parser.add_argument("source", help="a Hugging Face model id (owner/name), a .gguf file, a folder of them, or the "
                                       "http(s) address of a .gguf file")
    parser.add_argument("--weights-dir", default="weights", help="where the model folder goes (default: weights)")
    parser.add_argument("--name", help="the model folder's name (default: the repo's or the file's name)")
    parser.add_argument("--revision", help="a branch, tag or commit of the Hugging Face repo (default: main)")
    parser.add_argument("--force", action="store_true", help="replace a model folder of the same name")
    parser.add_argument("--report", action="store_true", help="JSON lines on stdout: the files, then the folders")
    args = parser.parse_args(argv)

    def report(what: dict) -> None:
        print(json.dumps(what), flush=True)

    if args.report:  # run by a server (app.weights): it ends when that server's process ends, however it ends
        end_with_parent()

    source, weights_dir = Path(args.source).expanduser(), Path(args.weights_dir)
    try:
        if source.exists():
            folders = import_ggufs(source, weights_dir, args.name, args.force)
        elif is_url(args.source):
            folders = fetch_gguf_url(args.source, weights_dir, args.name, args.force,
                                     on_files=(lambda sizes: report({"files": sizes})) if args.report else None)
        elif not is_repo_id(args.source):
            raise ConversionError(f"{args.source}: no such file or folder, and not a Hugging Face model id "
                                  "(owner/name, e.g. meta-llama/Llama-3.2-1B-Instruct)")
        else:
            endpoint = Environment().text("HF_ENDPOINT")  # read here: huggingface_hub reads it once, at import
            folders = [download(args.source, weights_dir, name=args.name, revision=args.revision, force=args.force,
                                endpoint=endpoint, on_files=(lambda sizes: report({"files": sizes})) if args.report
                                else None)]
    except ConversionError as e:
        if args.report:  # the status a server answers its client with (app.weights)
            report({"status": e.status})
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted; run the same command again to go on", file=sys.stderr)
        sys.exit(130)
    for folder in folders:
        if args.report:
            report({"folder": str(folder)})
        else:
            print(folder)


if __name__ == "__main__":
    main()
