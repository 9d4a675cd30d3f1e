"""Time to first token of a long conversation resumed after a restart: prefilled from its first token, or
read from the KV caches on disk (app/engine/kv_disk.py).

    python bench/kv_restart.py [--tokens 3000] [--shapes default,llama3.2-1b] [--threads N] [--out FILE]

For each model (the default model, real weights as served; the 1B shape, random bf16 weights, bench/common.py),
in this process, through the engine (app/engine/core.py, without sockets), greedy:

1. An engine over an empty folder answers a conversation of about `--tokens` tokens (a story told turn by
   turn), then computes its kept cache again while idle as the engine's loop does (Engine.refine); the
   cache's exact positions go to disk on the writer thread.
2. "restart, from disk": the file is synced and dropped from the page cache (posix_fadvise DONTNEED, checked
   with util-linux's fincore where it is installed), as after a reboot; a fresh engine over that folder
   (nothing in memory) gets the conversation resent with that answer and one more question, as a chat
   resumed from the history or an API client sends it.
3. "restart": the same again, the file now in the page cache, as after restarting the server alone.
4. "cold": a fresh engine keeping no cache on disk gets the same request: it prefills every token.

Reported: both times to first token and their ratio, the prompt tokens each computed, the step loop's time
handing a cache to the writer, the time reading it back (crc32 checked), disk bytes per position, and disk
bytes written in step 1 per token of the conversation (a cache is written when its reply ends and again
once refined). On a VM, "from disk" may still be served by the host's cache: it is the guest's disk read.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

from common import ROOT, machine, random_checkpoint  # noqa: E402

from model.options import DEFAULT_MODEL_NAME  # noqa: E402

STORY = (ROOT / "bench" / "perplexity.txt").read_text().split(". ")


def conversation(chat_format, tokens: int):
    """A story told turn by turn (the user asks for more, the assistant tells a few sentences of
    bench/perplexity.txt, again from its start when it runs out) until the prompt holds `tokens` tokens."""
    from app.backend.conversation import Conversation

    talk = Conversation(system_prompt="You are a storyteller. Tell the story a few sentences at a time.")
    part = 0
    while len(_prompt(chat_format, talk)) < tokens:
        talk.add("user", f"Go on with the story, part {part + 1}.")
        talk.add("assistant", ". ".join(STORY[(4 * part) % len(STORY):(4 * part) % len(STORY) + 4]) + ".")
        part += 1
    talk.add("user", "And what happened next?")
    return talk


def _prompt(chat_format, talk) -> list[int]:
    from app.engine.prompt import dialog
    return chat_format.encode_dialog(dialog(talk.chat_messages()))


def run_shape(name: str, folder: Path, checkpoint, tokens: int) -> dict:
    from support.engine import EngineHarness, last, request

    from app.messages import ReplySettings

    settings = ReplySettings(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    disk = Path(tempfile.mkdtemp(prefix="kv-restart-"))

    def engine(**config) -> EngineHarness:
        return EngineHarness(folder, loader=lambda profile, path: checkpoint, **config)

    talk = conversation(checkpoint.chat_format, tokens)
    first = engine(kv_disk_dir=str(disk), kv_disk_mb=16384)
    handovers = []
    save = first.engine.kv_disk.save

    def timed_save(*args):
        started = time.perf_counter()
        save(*args)
        handovers.append(time.perf_counter() - started)

    first.engine.kv_disk.save = timed_save
    answer = last(first.ask(r := request(talk, settings, model=folder.name))[r.id])
    assert first.engine.kv_disk.flush(600)
    written = first.engine.kv_disk.written_bytes
    [file] = disk.glob("*.kv")
    from app.engine.kv_disk import read_entry
    positions, file_bytes = read_entry(file)[0].shape[2], file.stat().st_size
    held = answer.stats.prompt_tokens + answer.stats.new_tokens

    talk.add("assistant", answer.text, ids=answer.token_ids)
    talk.add("user", "Tell me how it ends.")

    def restart():
        """A fresh engine over the folder answers the resumed conversation: its Done, and the read's seconds."""
        restarted = engine(kv_disk_dir=str(disk), kv_disk_mb=16384)
        take = restarted.engine.kv_disk.take
        reads = []

        def timed_take(*args, **kwargs):
            started = time.perf_counter()
            taken = take(*args, **kwargs)
            reads.append(time.perf_counter() - started)
            return taken

        restarted.engine.kv_disk.take = timed_take
        return last(restarted.ask(r := request(talk, settings, model=folder.name))[r.id]), reads[0]

    resident = evict(file)
    from_disk, disk_read = restart()
    again, read = restart()
    cold = last(engine(kv_disk_mb=0, kv_cache_mb=0).ask(r := request(talk, settings, model=folder.name))[r.id])
    assert again.token_ids == from_disk.token_ids == cold.token_ids, "a reply after a restart differs from a fresh engine's"
    shutil.rmtree(disk, ignore_errors=True)
    result = {
        "model": name, "prompt_tokens": cold.stats.prompt_tokens,
        "cold_ttft_s": cold.stats.time_to_first_token, "restart_ttft_s": again.stats.time_to_first_token,
        "ratio": again.stats.time_to_first_token / cold.stats.time_to_first_token,
        "restart_prefilled": again.stats.prompt_tokens - again.stats.reused_tokens,
        "restart_from_disk": again.stats.reused_tokens, "read_s": read,
        "evicted_resident": resident, "evicted_ttft_s": from_disk.stats.time_to_first_token,
        "evicted_ratio": from_disk.stats.time_to_first_token / cold.stats.time_to_first_token,
        "evicted_read_s": disk_read,
        "handover_ms": [1000 * s for s in handovers], "bytes_per_position": file_bytes / positions,
        "written_bytes_per_token": written / held, "kv_dtype": str(checkpoint.dtype),
    }
    print(f"  {name}: {result['prompt_tokens']} prompt tokens; first token cold {result['cold_ttft_s']:.2f} s, "
          f"after a restart {result['restart_ttft_s']:.3f} s ({result['ratio']:.3f}x: {result['restart_from_disk']} "
          f"positions read in {result['read_s']:.3f} s, {result['restart_prefilled']} prefilled); file out of the "
          f"page cache ({resident or 'residency unknown'}): {result['evicted_ttft_s']:.3f} s "
          f"({result['evicted_ratio']:.3f}x, read in {result['evicted_read_s']:.3f} s); handover "
          f"{', '.join(f'{ms:.2f}' for ms in result['handover_ms'])} ms; {result['bytes_per_position'] / 1024:.1f} "
          f"KiB a position on disk, {result['written_bytes_per_token'] / 1024:.1f} KiB written per token", flush=True)
    return result


def evict(file: Path) -> str | None:
    """Sync the file and drop its pages from the page cache; what fincore says is left of it in memory
    ("0B" when all went), or None without fincore."""
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if not shutil.which("fincore"):
        return None
    out = subprocess.run(["fincore", "--noheadings", "--output", "RES", str(file)], capture_output=True, text=True)
    return out.stdout.strip() or None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=3000)
    p.add_argument("--shapes", default="default,llama3.2-1b")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    from model.checkpoint import load_checkpoint

    results = {"machine": machine(), "threads": torch.get_num_threads(), "tokens": args.tokens, "rows": []}
    print(f"[bench] {results['machine']['cpu']}, {results['threads']} threads", flush=True)
    for shape in args.shapes.split(","):
        if shape == "default":  # as the app serves it: its Q4_1 blocks where the decode kernel runs
            folder = ROOT / "weights" / DEFAULT_MODEL_NAME
            checkpoint = load_checkpoint(folder, device="auto", dtype="auto", widen="auto")
        else:
            folder = random_checkpoint(shape)
            checkpoint = load_checkpoint(folder, device="auto", dtype="auto")
        results["rows"].append(run_shape(shape, folder, checkpoint, args.tokens))
        del checkpoint
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
