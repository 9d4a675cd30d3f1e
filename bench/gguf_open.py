"""Time to open a Llama 3 GGUF's header: the `gguf` library's reader against ours, side by side.

    python bench/gguf_open.py [--file PATH] [--rounds 3]

Every Llama 3 GGUF's header holds its vocabulary and merges (about 400,000 strings) and the token types
(128,256 numbers); a file is opened when it is imported or pulled, and every time a model in another app's store
is loaded (model/convert/gguf.py's in_place). Per round, in turn: gguf.GGUFReader; our Reader
(model/convert/gguf_reader.py) opening the file, then decoding every field's contents; and in_place, the whole
metadata step of loading a store's GGUF (its folder of config and tokenizer already made). Best and median
seconds of the rounds. The default file: the 1B shape's random weights with Llama 3's tokenizer in Q4_K_M
(bench/first_answer.py's, written once: llama-cpp-python's quantizer).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import machine  # (sets the import path)
from first_answer import q4_k_m_file

from model.convert.gguf import in_place  # noqa: E402
from model.convert.gguf_reader import open_gguf  # noqa: E402


def timed(f) -> float:
    start = time.perf_counter()
    f()
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--file", type=Path)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    args.file = args.file or q4_k_m_file("llama3.2-1b")
    import gguf

    cache = Path(tempfile.mkdtemp(prefix="gguf-open-"))
    in_place(args.file, cache)  # its folder made once, as after a store model's first load
    ways = {
        "gguf.GGUFReader": lambda: gguf.GGUFReader(args.file),
        "ours: open": lambda: open_gguf(args.file),
        "ours: open and every field's contents": lambda: [f.contents() for f in open_gguf(args.file).fields.values()],
        "in_place (a store model's metadata)": lambda: in_place(args.file, cache),
    }
    times = {name: [] for name in ways}
    try:
        for _ in range(args.rounds):
            for name, way in ways.items():
                times[name].append(timed(way))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    info = machine()
    print(f"{args.file.name} ({args.file.stat().st_size / 1e6:.0f} MB), {info['cpu']}, {args.rounds} rounds")
    print("| way | seconds (best / median) |\n|---|---|")
    for name, t in times.items():
        print(f"| {name} | {min(t):.3f} / {statistics.median(t):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
