"""KV caches on disk (app/engine/kv_disk.py): read back, a cache gives the logits of a prefill exactly; an engine
started again over the same folder prefills only what is new; files not whole, not ours, changed or of another
model are not used and are removed; the bound; users; owner-only files."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

import pytest
import torch
from support.checkpoints import write_tiny_checkpoint
from support.engine import EngineHarness, last, request

from app.backend.conversation import Conversation
from app.engine.kv_disk import MAGIC, PREAMBLE, VERSION, KVDisk, model_identity, read_entry
from app.messages import ReplySettings
from model.checkpoint import load_checkpoint
from model.kv_cache import PREFILL_CHUNK, KVCache

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]

GREEDY = ReplySettings(max_new_tokens=24, temperature=0.0)
LONG_SYSTEM = "You are a helpful assistant who answers briefly and kindly. " * 40  # more than a prefill chunk


def harness(tiny, checkpoint, folder: Path | None, **config) -> EngineHarness:
    """An engine over the checkpoint; its KV caches kept on disk in `folder` (None: not on disk, no cache at all)."""
    disk = dict(kv_disk_dir=str(folder), kv_disk_mb=64) if folder else dict(kv_disk_mb=0, kv_cache_mb=0)
    return EngineHarness(tiny, loader=lambda name, path: checkpoint, **(disk | config))


def chat(*texts: str) -> Conversation:
    conversation = Conversation(system_prompt=LONG_SYSTEM)
    for i, text in enumerate(texts):
        conversation.add("user" if i % 2 == 0 else "assistant", text)
    return conversation


def ask(h: EngineHarness, conversation: Conversation, settings: ReplySettings = GREEDY, **fields):
    done = last(h.ask(r := request(conversation, settings, **fields))[r.id])
    if h.engine.kv_disk is not None:
        assert h.engine.kv_disk.flush(60)
    return done


def files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.kv"))


def new_cache(checkpoint):
    return lambda max_len: KVCache(checkpoint.config, max_len, device=checkpoint.device, dtype=checkpoint.dtype)


def prefill(checkpoint, cache: KVCache, ids: list[int]) -> torch.Tensor:
    """ids from the cache's length on, in the engine's chunks; the last chunk's logits (positions, vocab)."""
    while cache.length < len(ids):
        chunk = ids[cache.length:cache.chunk_end(len(ids))]
        logits = checkpoint.model(torch.tensor([chunk], device=checkpoint.device), start_pos=cache.length,
                                  kv_cache=cache)[0]
        cache.extend(chunk)
    return logits


def random_ids(checkpoint, n: int, seed: int) -> list[int]:
    return torch.randint(0, checkpoint.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- read back: the same numbers -----------------------------------------------------------------

def test_a_cache_read_from_disk_gives_the_logits_of_a_prefill_exactly(checkpoint, tmp_path):
    ids = random_ids(checkpoint, 2 * PREFILL_CHUNK + 50, seed=1)
    whole = KVCache(checkpoint.config, len(ids), device=checkpoint.device, dtype=checkpoint.dtype)
    logits = prefill(checkpoint, whole, ids)
    written = KVDisk(tmp_path / "kv", 2**30)
    written.save(checkpoint, "", whole)
    assert written.flush(60) and len(written) == 1 and whole.exact == 2 * PREFILL_CHUNK

    restarted = KVDisk(tmp_path / "kv", 2**30)  # reads the headers only
    cache, reused = restarted.take(checkpoint, "", ids, len(ids), new_cache(checkpoint))
    assert reused == 2 * PREFILL_CHUNK and cache.tokens == ids[:reused] and cache.exact == reused
    assert torch.equal(cache.k[:, :, :, :reused], whole.k[:, :, :, :reused])
    again = prefill(checkpoint, cache, ids)  # the last 50 positions
    assert checkpoint.dtype == torch.float32 and torch.equal(again, logits)
    assert torch.equal(cache.k, whole.k) and torch.equal(cache.v, whole.v)
    # a prompt that parts from the file inside its second chunk reuses the first; none of another start
    assert restarted.take(checkpoint, "", ids[:300] + [1, 2, 3], 400, new_cache(checkpoint))[1] == PREFILL_CHUNK
    assert restarted.take(checkpoint, "", [ids[0] + 1] + ids[1:], 600, new_cache(checkpoint)) is None
    assert restarted.take(checkpoint, "", ids, 600, new_cache(checkpoint), more_than=2 * PREFILL_CHUNK) is None


def test_a_restarted_engine_prefills_only_what_is_new_with_the_reply_of_a_fresh_one(tiny, checkpoint, tmp_path):
    folder = tmp_path / "kv"
    long_reply = ReplySettings(max_new_tokens=300, temperature=0.0, ignore_eos=True)
    conversation = chat("Tell me a long story.")
    first = ask(harness(tiny, checkpoint, folder), conversation, long_reply)
    # written at its end, then again once computed as a prefill (Engine.refine): the longer file replaces it
    held = first.stats.prompt_tokens + first.stats.new_tokens - 1  # (the last token was sampled, never fed)
    [file] = files(folder)
    assert len(read_entry(file)[0].ids) == held // PREFILL_CHUNK * PREFILL_CHUNK

    conversation.add("assistant", first.text, ids=first.token_ids)
    conversation.add("user", "And then?")
    restarted = harness(tiny, checkpoint, folder)
    assert len(restarted.engine.prefix_cache) == 0 and len(restarted.engine.kv_disk) == 1
    second = ask(restarted, conversation)
    assert second.stats.reused_tokens == held // PREFILL_CHUNK * PREFILL_CHUNK > first.stats.prompt_tokens
    prefilled = second.stats.prompt_tokens - second.stats.reused_tokens
    assert prefilled < PREFILL_CHUNK + 20
    fresh = ask(harness(tiny, checkpoint, None), conversation)
    assert fresh.stats.reused_tokens == 0 and second.token_ids == fresh.token_ids


def test_the_cache_in_memory_is_taken_where_the_disk_offers_no_more(tiny, checkpoint, tmp_path, caplog):
    h = harness(tiny, checkpoint, tmp_path / "kv", refine=False)
    conversation = chat("What is the capital of France?")
    first = ask(h, conversation)
    conversation.add("assistant", first.text, ids=first.token_ids)
    conversation.add("user", "And its river?")
    with caplog.at_level(logging.INFO, logger="app.engine"):
        second = ask(h, conversation)
    assert second.stats.reused_tokens == first.stats.prompt_tokens // PREFILL_CHUNK * PREFILL_CHUNK > 0
    assert not any("positions read from" in r.getMessage() for r in caplog.records)


# ---- files that cannot be used -------------------------------------------------------------------

def test_files_not_whole_or_not_ours_are_removed_at_start_and_others_left_alone(tiny, checkpoint, tmp_path, caplog):
    folder = tmp_path / "kv"
    ask(harness(tiny, checkpoint, folder, refine=False), chat("Hello"))
    [good] = files(folder)
    data = good.read_bytes()
    (folder / "truncated.kv").write_bytes(data[:-10])
    (folder / "foreign.kv").write_bytes(b"GGUF" + os.urandom(3000))
    (folder / "empty.kv").write_bytes(b"")
    lying = json.dumps({"model": "m", "identity": {}, "user": "u", "chunk": PREFILL_CHUNK, "ids": [1],
                        "dtype": "float32", "shape": [100000, 8, 1, 64]}).encode()
    (folder / "lying.kv").write_bytes(PREAMBLE.pack(MAGIC, VERSION, len(lying)) + lying + bytes(100))
    (folder / "long-header.kv").write_bytes(PREAMBLE.pack(MAGIC, VERSION, 2**31) + bytes(100))
    (folder / "next-version.kv").write_bytes(PREAMBLE.pack(MAGIC, VERSION + 1, 0) + data[PREAMBLE.size:])
    (folder / f"{good.name}.4194305.tmp").write_bytes(data[:100])  # a pid above Linux's largest: gone
    (folder / f"{good.name}.{os.getpid()}.tmp").write_bytes(data[:100])  # this pid's, before it wrote: gone too
    (folder / f"{good.name}.{os.getppid()}.tmp").write_bytes(data[:100])  # a running process's: being written
    (folder / "notes.txt").write_text("not a cache")

    with caplog.at_level(logging.WARNING, logger="app.engine"):
        restarted = harness(tiny, checkpoint, folder)
    assert sorted(p.name for p in folder.iterdir()) == sorted([good.name, f"{good.name}.{os.getppid()}.tmp",
                                                               "notes.txt"])
    removed = [r.getMessage() for r in caplog.records if "removed" in r.getMessage()]
    assert len(removed) == 8, removed
    assert any("truncated.kv removed" in m and "where its header says" in m for m in removed)
    assert any("lying.kv removed" in m and "where its header says" in m for m in removed)
    assert any("long-header.kv removed" in m and "runs past its end" in m for m in removed)
    assert any("foreign.kv removed" in m and "not a KV cache file" in m for m in removed)
    assert any(".4194305.tmp removed: left half written" in m for m in removed)
    assert ask(restarted, chat("Hello")).stats.reused_tokens > 0


def test_a_corrupted_file_is_not_used_and_is_removed(tiny, checkpoint, tmp_path, caplog):
    folder = tmp_path / "kv"
    conversation = chat("Hello")
    ask(harness(tiny, checkpoint, folder, refine=False), conversation)
    [file] = files(folder)
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x40  # one bit of a key, the length as it was
    file.write_bytes(bytes(data))

    restarted = harness(tiny, checkpoint, folder, refine=False)
    assert len(restarted.engine.kv_disk) == 1  # its header is whole: found when read
    with caplog.at_level(logging.WARNING, logger="app.engine"):
        reply = last(restarted.ask(r := request(conversation, GREEDY))[r.id])
    assert reply.stats.reused_tokens == 0
    assert any("removed: its crc32 differs" in r.getMessage() for r in caplog.records)
    fresh = ask(harness(tiny, checkpoint, None), conversation)
    assert reply.token_ids == fresh.token_ids
    assert restarted.engine.kv_disk.flush(60)  # the reply's cache, written again whole
    assert ask(harness(tiny, checkpoint, folder, refine=False), conversation).stats.reused_tokens > 0


def test_a_changed_model_file_matches_no_earlier_cache(tmp_path, device, caplog):
    folder, own = tmp_path / "kv", write_tiny_checkpoint(tmp_path / "weights" / "tiny", seed=3)
    checkpoint = load_checkpoint(own, dtype=torch.float32, device=device)
    before = model_identity(checkpoint)
    ask(harness(own, checkpoint, folder, refine=False), chat("Hello"))
    assert len(files(folder)) == 1
    weights = own / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # as `touch` does

    assert model_identity(checkpoint).digest != before.digest
    with caplog.at_level(logging.WARNING, logger="app.engine"):
        restarted = harness(own, checkpoint, folder, refine=False)
    assert files(folder) == [] and any("model's files changed" in r.getMessage() for r in caplog.records)
    assert ask(restarted, chat("Hello")).stats.reused_tokens == 0


# ---- the bound, users, the files' modes ----------------------------------------------------------

def test_the_files_stay_within_the_bound_and_the_least_recently_used_go_first(checkpoint, tmp_path):
    caches = []
    for seed in range(4):
        cache = KVCache(checkpoint.config, PREFILL_CHUNK + 10, device=checkpoint.device, dtype=checkpoint.dtype)
        prefill(checkpoint, cache, random_ids(checkpoint, PREFILL_CHUNK + 10, seed=10 + seed))
        caches.append(cache)
    sizes = []  # each cache's file: one chunk's positions, and a header whose JSON (the ids) varies in length
    for i, cache in enumerate(caches):
        probe = KVDisk(tmp_path / f"probe{i}", 2**30)
        probe.save(checkpoint, "", cache)
        assert probe.flush(60)
        sizes.append(probe.nbytes)
    size = max(sizes)
    assert 3 * min(sizes) > 2.5 * size  # so the bound below holds any two files and never three
    disk = KVDisk(tmp_path / "kv", int(2.5 * size))

    def held() -> list[list[int]]:
        return [cache.tokens[:PREFILL_CHUNK] for cache in caches
                if disk.take(checkpoint, "", cache.tokens + [0], PREFILL_CHUNK + 20, new_cache(checkpoint))]

    for cache in caches[:3]:
        disk.save(checkpoint, "", cache)
        assert disk.flush(60)
    assert disk.nbytes == sizes[1] + sizes[2] <= disk.max_bytes and len(files(tmp_path / "kv")) == 2
    assert held() == [caches[1].tokens[:PREFILL_CHUNK], caches[2].tokens[:PREFILL_CHUNK]]  # the oldest went
    disk.take(checkpoint, "", caches[1].tokens + [0], PREFILL_CHUNK + 20, new_cache(checkpoint))  # read: recent
    disk.save(checkpoint, "", caches[3])
    assert disk.flush(60)
    assert held() == [caches[1].tokens[:PREFILL_CHUNK], caches[3].tokens[:PREFILL_CHUNK]]
    assert KVDisk(tmp_path / "kv", size).nbytes == sizes[3]  # a smaller bound at start: trimmed to the newest
    small = KVDisk(tmp_path / "small", sizes[0] - 1)  # a cache longer than the bound is not written
    small.save(checkpoint, "", caches[0])
    assert small.flush(60) and files(tmp_path / "small") == []


def test_another_users_cache_is_not_used_and_no_file_names_a_user(tiny, checkpoint, tmp_path):
    folder = tmp_path / "kv"
    conversation = chat("What is the capital of France?")
    ask(harness(tiny, checkpoint, folder, refine=False), conversation, user="alice")
    assert all(b"alice" not in file.read_bytes() for file in files(folder))
    restarted = harness(tiny, checkpoint, folder, refine=False)
    assert ask(restarted, conversation, user="bob").stats.reused_tokens == 0
    assert ask(restarted, conversation, user="").stats.reused_tokens == 0  # (no sign-in: a user of its own)
    restarted = harness(tiny, checkpoint, folder, refine=False)
    assert ask(restarted, conversation, user="alice").stats.reused_tokens > 0


def test_the_folder_and_the_files_are_the_accounts_only(checkpoint, tmp_path):
    folder = tmp_path / "kv"
    folder.mkdir(mode=0o755)
    umask = os.umask(0)
    try:
        os.chmod(folder, 0o755)
        disk = KVDisk(folder, 2**30)
        cache = KVCache(checkpoint.config, PREFILL_CHUNK + 1, device=checkpoint.device, dtype=checkpoint.dtype)
        prefill(checkpoint, cache, random_ids(checkpoint, PREFILL_CHUNK + 1, seed=5))
        disk.save(checkpoint, "", cache)
        assert disk.flush(60)
    finally:
        os.umask(umask)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    [file] = files(folder)
    assert stat.S_IMODE(file.stat().st_mode) == 0o600


def test_with_no_disk_bound_nothing_is_written(tiny, checkpoint, tmp_path):
    h = harness(tiny, checkpoint, tmp_path / "kv", kv_disk_mb=0)
    ask(h, chat("Hello"))
    assert h.engine.kv_disk is None and not (tmp_path / "kv").exists()


# ---- q8 caches -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory):
    """A tiny checkpoint whose head_dim (32) q8 blocks take."""
    from support.checkpoints import hf_model
    folder = tmp_path_factory.mktemp("weights") / "wide"
    hf_model(num_hidden_layers=2, hidden_size=128).save_pretrained(folder)
    return folder


def test_a_q8_cache_is_written_and_read_back_exactly_and_a_file_of_the_other_type_is_not_used(wide_heads, tmp_path):
    plain = load_checkpoint(wide_heads, dtype=torch.float32)
    q8 = load_checkpoint(wide_heads, dtype=torch.float32, kv_type="q8")
    ids = random_ids(q8, PREFILL_CHUNK + 40, seed=3)
    whole = KVCache(q8.config, len(ids), dtype=q8.dtype, kv_type="q8")
    logits = prefill(q8, whole, ids)
    written = KVDisk(tmp_path / "kv", 2**30)
    written.save(q8, "", whole)
    assert written.flush(60) and len(written) == 1
    [file] = files(tmp_path / "kv")
    entry = read_entry(file)[0]
    assert entry.dtype == "uint8" and entry.shape[-1] == 34  # head_dim 32: one block a row
    # the file is 0.53x what the same positions take in bf16 (0.27x fp32's), less the header
    assert file.stat().st_size - entry.offset < 0.54 * 2 * whole.k[:, 0, :, :PREFILL_CHUNK].numel() / 34 * 32 * 2

    restarted = KVDisk(tmp_path / "kv", 2**30)
    assert restarted.take(plain, "", ids, len(ids), new_cache(plain)) is None  # a bf16 model does not use it

    def q8_cache(max_len):
        return KVCache(q8.config, max_len, dtype=q8.dtype, kv_type="q8")

    cache, reused = restarted.take(q8, "", ids, len(ids), q8_cache)
    assert reused == PREFILL_CHUNK and torch.equal(cache.k[:, :, :, :reused], whole.k[:, :, :, :reused])
    assert torch.equal(prefill(q8, cache, ids), logits)
    assert file.exists()  # not removed: it serves the q8 model

    plain_whole = KVCache(plain.config, len(ids), dtype=plain.dtype)
    prefill(plain, plain_whole, ids)
    restarted.save(plain, "", plain_whole)
    assert restarted.flush(60) and len(restarted) == 2  # each type its own file
    again = KVDisk(tmp_path / "kv", 2**30)
    assert again.take(q8, "", ids, len(ids), q8_cache)[0].k.dtype == torch.uint8
    assert again.take(plain, "", ids, len(ids), new_cache(plain))[0].k.dtype == torch.float32


def test_files_used_one_after_the_other_are_told_apart_after_a_restart_whatever_the_clock(tmp_path, monkeypatch):
    """The order of use survives a restart in the files' mtimes, each later than the one before even where the
    clock gives the same time twice (a file system's times tick every few milliseconds: two files written within
    one tick tied, and which one a smaller bound kept at the next start was left to chance)."""
    import time as time_module

    from app.engine.kv_disk import KVDisk

    disk = KVDisk(tmp_path / "kv", 2**20)
    files = [tmp_path / f"f{i}" for i in range(4)]
    for f in files:
        f.write_bytes(b"x")
    monkeypatch.setattr(time_module, "time_ns", lambda: 1_700_000_000_000_000_000)  # a clock that does not move
    stamps = [disk.stamp(f) for f in files]
    assert stamps == sorted(set(stamps)) and [f.stat().st_mtime_ns for f in files] == stamps
