"""Request bodies read from many threads at once by a fresh server: msgspec builds a type's decoding information on
its first use, and two threads doing that at once crashed the web process (a segfault, in about half of fresh
processes given 16 threads at once). Each try is a fresh interpreter, since a type is built once per process."""

from __future__ import annotations

import json
import subprocess
import sys

from support.servers import ROOT
from support.tool_calls import body

TRIES = 10

PROGRAM = """
import json, sys, threading
from app.api.openai import ChatBody
from app.api.parse import read_body

chat = json.loads(sys.argv[1])  # (given whole: the OpenAI client that writes it took 0.6 s a process to import)
start = threading.Barrier(16)
read = []

def reader():
    start.wait()
    read.append(read_body(chat, ChatBody))

threads = [threading.Thread(target=reader) for _ in range(16)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(len(read), len(read[0].tools))
"""


def test_the_first_bodies_of_a_fresh_process_are_read_from_sixteen_threads_at_once():
    chat = {name: value for name, value in body(1, "required", True).items() if name != "extra_body"}
    for _ in range(TRIES):
        done = subprocess.run([sys.executable, "-X", "faulthandler", "-c", PROGRAM, json.dumps(chat)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120,
                              env={"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "PATH": ""})
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split() == ["16", "3"]
