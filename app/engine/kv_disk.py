"""KV caches kept on disk, so that a conversation resumed after a restart prefills only what is new.

The prefix cache (app/engine/prefix_cache.py) keeps finished replies' caches in memory, and they go with
the engine process. Here each kept cache's exact positions (`KVCache.exact`: computed by whole prefill
chunks, as any request with these ids computes them) are written to a file too. A request whose prompt
starts like a file's ids, where the file offers more positions than the caches in memory, has them read
into its cache instead of computed: a chat resumed from the history, or an API client resending a long
conversation, after a restart prefills its new tokens only, with the reply it would get without the file.

- Off the step loop: the loop hands over views of the exact positions, no copy (`save`), and a thread
  writes them. Those positions are not written again with other values: a request that takes the cache
  over (PrefixCache.take) writes from the positions it reuses on, at most `exact`, and what it writes
  below `exact` is the same ids computed by the same chunks, the same bits. A cache that Engine.refine
  made exact further is saved again; the longer file replaces the shorter.
- Key: the model's identity (`model_identity`: its files' paths, sizes and modification times, the
  dtypes and shapes of its loaded tensors (its dtype, its quantization), the compute dtype, the device,
  the decode kernel, the CPU, torch and its threads: what changes the numbers; the KV type, so a file of
  the other type is never used, and stays for when that type comes back), the user, the prefill
  chunk and the ids. A user's files serve that user alone; they hold a hash of the user, never the name.
  A file whose model files changed or went is removed at start.
- File: MAGIC, the version and the header's length (u32 each), the header (JSON: the model's identity
  and its digest, the user's hash, the prefill chunk, the ids, dtype and shape), keys and values (n_layers, n_kv_heads,
  positions, head_dim; or q8 blocks: uint8 and head_dim / 32 * 34 bytes) each, and the crc32 of all that. Written under a temporary name, renamed when
  whole. A file that is not whole, not ours, whose length is not what its header says, or whose crc32
  differs is not used, and removed, with a log line.
- An index in memory, built at start from the headers, answers lookups without reading a file; a load
  maps the file once, checks its crc32 and copies the positions into the request's cache.
- The files stay within `max_bytes` together; past it the least recently used (written or read) go first.
  The folder and the files are the app's account's only (0700, 0600): they hold conversations.

Written by hand: the format is a header and two tensors; safetensors would want the ids and the
identity as strings in its metadata and has no checksum, and torch.save pickles.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import struct
import threading
import time
import weakref
import zlib
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from model import kernels
from model.checkpoint import Checkpoint
from model.checkpoint_files import CheckpointError, find_checkpoint
from model.cpu import cpu_tag
from model.kv_cache import PREFILL_CHUNK, KVCache, common_prefix
from model.options import DTYPES

from app.private_files import open_private, private_folder
from app.processes import alive

log = logging.getLogger("app.engine")

MAGIC = b"LLAMAKV\0"
VERSION = 1
PREAMBLE = struct.Struct("<8sII")  # magic, version, the header's length
CRC = struct.Struct("<I")  # the file's last 4 bytes: crc32 of all before them
ALIGN = 64  # the header is padded so that the tensors start at a multiple of this
SUFFIX = ".kv"
STORED = {*DTYPES.values(), "uint8"}  # torch's names of the dtypes a cache may hold (uint8: q8 blocks)


class BadFile(ValueError):
    """A file in the folder that cannot be used: the message says why."""


@dataclass(frozen=True)
class Identity:
    """What the numbers of a model's keys and values depend on (model_identity), and its digest."""

    digest: str
    fields: dict


@dataclass
class Entry:
    """One file, as its header describes it (checked against the file's length)."""

    path: Path
    model: str  # Identity.digest
    user: str  # user_hash
    chunk: int  # the prefill chunk its positions were computed by
    ids: list[int]
    dtype: str
    shape: tuple[int, int, int, int]  # n_layers, n_kv_heads, positions, head_dim
    offset: int  # where the keys start
    size: int
    used: int  # last written or read (ns, as `stamp` gives them, and the file's mtime says after a restart)


@dataclass
class _Job:
    model: Identity
    user: str
    chunk: int
    ids: list[int]
    keys: torch.Tensor  # (n_layers, n_kv_heads, positions, head_dim): views of the cache, no copy
    values: torch.Tensor


def user_hash(user: str) -> str:
    return hashlib.blake2b(user.encode("utf-8", "surrogatepass"), digest_size=16, person=b"llama-kv-user").hexdigest()


def model_identity(checkpoint: Checkpoint) -> Identity:
    """The loaded model's identity; raises CheckpointError or OSError where its files cannot be found."""
    files = find_checkpoint(checkpoint.path)
    stats = []
    for path in [files.config, *files.weights]:
        path = path.resolve()
        stat = path.stat()
        stats.append([str(path), stat.st_size, stat.st_mtime_ns])
    tensors = hashlib.blake2b(digest_size=16)
    for name, tensor in checkpoint.model.state_dict().items():
        tensors.update(f"{name} {tensor.dtype} {tuple(tensor.shape)};".encode())
    fields = {"files": stats, "tensors": tensors.hexdigest(), "compute": str(checkpoint.dtype),
              "kv": checkpoint.model.kv_type,
              "device": str(checkpoint.device), "kernel": [kernels.decode_path(), kernels.configured().deterministic],
              "cpu": cpu_tag(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    digest = hashlib.blake2b(json.dumps(fields, sort_keys=True).encode(), digest_size=16).hexdigest()
    return Identity(digest, fields)


def _files_unchanged(fields: dict) -> bool:
    """Whether the model files an identity names are still there as they were."""
    try:
        stats = [(os.stat(path), size, mtime) for path, size, mtime in fields["files"]]
    except (OSError, TypeError, ValueError, KeyError):
        return False
    return all(stat.st_size == size and stat.st_mtime_ns == mtime for stat, size, mtime in stats)


def read_entry(path: Path) -> tuple[Entry, dict]:
    """A file's entry and its model's identity fields, from its header; BadFile if it cannot be one of ours."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        preamble = f.read(PREAMBLE.size)
        if len(preamble) < PREAMBLE.size:
            raise BadFile(f"{size} bytes: shorter than a header")
        magic, version, length = PREAMBLE.unpack(preamble)
        if magic != MAGIC or version != VERSION:
            raise BadFile(f"not a KV cache file of version {VERSION} (starts {preamble[:8]!r}, version {version})")
        if PREAMBLE.size + length + CRC.size > size:
            raise BadFile(f"its header of {length} bytes runs past its end ({size} bytes)")
        try:
            header = json.loads(f.read(length))
            entry = Entry(path, header["model"], header["user"], header["chunk"], header["ids"], header["dtype"],
                          tuple(header["shape"]), PREAMBLE.size + length, size, path.stat().st_mtime_ns)
            fields = header["identity"]
        except (ValueError, KeyError, TypeError) as e:
            raise BadFile(f"its header is not what was written: {type(e).__name__}: {e}") from None
    if not (isinstance(entry.model, str) and isinstance(entry.user, str) and isinstance(fields, dict)
            and type(entry.chunk) is int and entry.chunk > 0
            and isinstance(entry.ids, list) and all(type(i) is int for i in entry.ids)
            and isinstance(entry.dtype, str) and entry.dtype in STORED and len(entry.shape) == 4
            and all(type(n) is int and n > 0 for n in entry.shape) and entry.shape[2] == len(entry.ids)):
        raise BadFile("its header does not describe a KV cache")
    expected = entry.offset + 2 * _numel(entry.shape) * getattr(torch, entry.dtype).itemsize + CRC.size
    if expected != size:
        raise BadFile(f"{size} bytes, where its header says {expected}")
    return entry, fields


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class KVDisk:
    """The files in `folder` (created 0700), at most max_bytes together: `take` one for a prompt, `save`
    a kept cache (written on a thread), `flush` to wait for the writes."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder = private_folder(Path(folder))
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._index: dict[Path, Entry] = {}
        self._last_used = 0  # the latest `stamp` given (ns)
        self._jobs: deque[_Job] = deque()  # the first one is being written
        self._writer: threading.Thread | None = None
        self._identities: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Llama -> Identity | None
        self.written_bytes = 0
        self._read_index()

    # -- the step loop's side

    def identity(self, checkpoint: Checkpoint) -> Identity | None:
        """The model's identity, found once per loaded model; None where its files cannot be found."""
        model = checkpoint.model
        if model not in self._identities:
            try:
                self._identities[model] = model_identity(checkpoint)
            except (CheckpointError, OSError) as e:
                log.warning("%s: its KV caches are not kept on disk: %s", checkpoint.name, e)
                self._identities[model] = None
        return self._identities[model]

    def take(self, checkpoint: Checkpoint, user: str, ids: list[int], max_len: int,
             new_cache: Callable[[int], KVCache], more_than: int = 0) -> tuple[KVCache, int] | None:
        """A cache of max_len positions (made by new_cache) whose leading positions a file holds for a prompt
        of `ids`, and how many; None unless a file offers more than `more_than` (what the kept caches in
        memory offer)."""
        model = self.identity(checkpoint)
        if model is None:
            return None
        entry, reused = self._best(model.digest, user_hash(user), PREFILL_CHUNK, ids)
        if entry is None or reused <= more_than:
            return None
        cache = new_cache(max_len)
        started = time.perf_counter()
        try:
            self._read(entry, cache, reused)
        except FileNotFoundError:  # removed meanwhile (by another process over the same folder)
            self._forget(entry, None)
            return None
        except (BadFile, OSError, ValueError, RuntimeError) as e:
            self._forget(entry, f"{e}")
            return None
        log.info("KV cache: %d positions read from %s in %.3f s", reused, entry.path.name,
                 time.perf_counter() - started)
        return cache, reused

    def save(self, checkpoint: Checkpoint, user: str, cache: KVCache) -> None:
        """Hand the cache's exact positions to the writer thread (views: no copy), unless a file, written
        or to be, holds them already."""
        n = cache.exact
        model = self.identity(checkpoint) if n >= cache.chunk else None
        if model is None:
            return
        ids, user = cache.tokens[:n], user_hash(user)
        with self._lock:
            if not self._holds(model.digest, user, cache.chunk, ids):
                self._jobs.append(_Job(model, user, cache.chunk, ids, cache.k[:, 0, :, :n], cache.v[:, 0, :, :n]))
                if self._writer is None:
                    self._writer = threading.Thread(target=self._write_all, name="kv disk", daemon=True)
                    self._writer.start()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every cache handed over is written; False if `timeout` came first."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._jobs, timeout)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(entry.size for entry in self._index.values())

    def __len__(self) -> int:
        return len(self._index)

    # -- the index

    def _read_index(self) -> None:
        """Every file's header; what cannot be used is removed (a file left half written by a process that is
        gone, one that is not ours, not whole, or whose model changed). Files of other names stay."""
        for path in sorted(self.folder.iterdir()):
            if path.suffix == ".tmp" and path.stem.rsplit(".", 1)[0].endswith(SUFFIX):
                pid = path.stem.rsplit(".", 1)[1]  # of the process writing it (this one writes nothing yet)
                if not (pid.isdigit() and int(pid) != os.getpid() and alive(int(pid))):
                    self._remove(path, "left half written")
                continue
            if path.suffix != SUFFIX or not path.is_file():
                continue
            try:
                entry, fields = read_entry(path)
            except (BadFile, OSError) as e:
                self._remove(path, str(e))
                continue
            if not _files_unchanged(fields):
                self._remove(path, "its model's files changed or are gone")
                continue
            self._index[path] = entry
        with self._lock:
            self._trim()
        if self._index:
            log.info("KV caches on disk: %d files, %.0f MB in %s", len(self._index), self.nbytes / 2**20, self.folder)

    def _best(self, model: str, user: str, chunk: int, ids: list[int]) -> tuple[Entry | None, int]:
        """The file that offers a prompt of `ids` the most leading positions (whole chunks, leaving the
        prompt's last token to run, as KVCache.reusable), and how many."""
        best, reused = None, 0
        with self._lock:
            entries = [e for e in self._index.values() if (e.model, e.user, e.chunk) == (model, user, chunk)]
        for entry in entries:
            shared = min(len(entry.ids), len(ids) - 1)
            n = min(shared, common_prefix(entry.ids, ids)) // chunk * chunk if shared > 0 else 0
            if n > reused:
                best, reused = entry, n
        return best, reused

    def _holds(self, model: str, user: str, chunk: int, ids: list[int]) -> bool:
        """Whether a file, or a cache waiting to be written, holds these ids (or more after them). Under the
        lock."""
        held = [(e.model, e.user, e.chunk, e.ids) for e in self._index.values()]
        held += [(job.model.digest, job.user, job.chunk, job.ids) for job in self._jobs]
        n = len(ids)
        return any(key == (model, user, chunk) and len(them) >= n and them[:n] == ids
                   for *key, them in held)

    def _read(self, entry: Entry, cache: KVCache, n: int) -> None:
        """The file's first n positions into the cache, once its length and crc32 are checked."""
        with open(entry.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as data:
            if len(data) != entry.size:
                raise BadFile(f"{len(data)} bytes, where it had {entry.size}")
            with memoryview(data) as view:
                stored, = CRC.unpack(view[-CRC.size:])
                if zlib.crc32(view[:-CRC.size]) != stored:
                    raise BadFile("its crc32 differs: the file changed after it was written")
            _copy_in(data, entry, cache, n)  # (its tensors over the map are gone when it returns)
        cache.tokens = entry.ids[:n]
        cache.exact = n
        entry.used = self.stamp(entry.path)  # recently used: kept longest, also after a restart

    def stamp(self, path: Path) -> int:
        """A time (ns) later than any this cache gave before, written as the file's mtime, which orders the files
        by use after a restart: the file system's own times come from a clock that ticks every few milliseconds,
        so two files written within one tick had the same, and the one to keep was left to chance."""
        with self._lock:
            self._last_used = max(time.time_ns(), self._last_used + 1,
                                  *(entry.used + 1 for entry in self._index.values()))
            now = self._last_used
        try:
            os.utime(path, ns=(now, now))
        except OSError:
            pass
        return now

    def _forget(self, entry: Entry, why: str | None) -> None:
        """Drop a file from the index; and from the disk, saying why, unless why is None (it is gone)."""
        with self._lock:
            self._index.pop(entry.path, None)
        if why is not None:
            self._remove(entry.path, why)

    def _trim(self) -> None:
        """Remove the least recently used files until they all fit max_bytes. Under the lock."""
        total = sum(entry.size for entry in self._index.values())
        for entry in sorted(self._index.values(), key=lambda e: e.used):
            if total <= self.max_bytes:
                break
            del self._index[entry.path]
            total -= entry.size
            _unlink(entry.path)

    def _remove(self, path: Path, why: str) -> None:
        log.warning("KV cache file %s removed: %s", path, why)
        _unlink(path)

    # -- the writer thread

    def _write_all(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    self._writer = None
                    self._idle.notify_all()
                    return
                job = self._jobs[0]  # listed until written, so that save() does not hand it over again
            try:
                self._write(job)
            except Exception:  # a full disk, a folder gone: this cache is not kept on disk, the next may be
                log.exception("writing a KV cache to %s failed", self.folder)
            with self._lock:
                self._jobs.popleft()

    def _write(self, job: _Job) -> None:
        started = time.perf_counter()
        layers, heads, n, head_dim = job.keys.shape
        dtype = str(job.keys.dtype).removeprefix("torch.")
        header = json.dumps({"model": job.model.digest, "identity": job.model.fields, "user": job.user,
                             "chunk": job.chunk, "ids": job.ids, "dtype": dtype,
                             "shape": [layers, heads, n, head_dim]}).encode()
        header += b" " * (-(PREAMBLE.size + len(header)) % ALIGN)  # JSON ignores trailing spaces
        size = PREAMBLE.size + len(header) + 2 * job.keys.numel() * job.keys.element_size() + CRC.size
        if size > self.max_bytes:
            log.info("KV cache of %d positions (%.0f MB) not written: more than LLAMA_KV_DISK_MB", n, size / 2**20)
            return
        name = hashlib.blake2b(f"{job.model.digest} {job.user} {job.chunk} ".encode() + array("q", job.ids).tobytes(),
                               digest_size=16).hexdigest() + SUFFIX
        path, part = self.folder / name, self.folder / f"{name}.{os.getpid()}.tmp"
        crc = 0
        try:
            with os.fdopen(open_private(part, os.O_TRUNC), "wb") as f:
                for piece in [PREAMBLE.pack(MAGIC, VERSION, len(header)), header]:
                    f.write(piece)
                    crc = zlib.crc32(piece, crc)
                for tensor in (job.keys, job.values):
                    for layer in tensor:
                        for head in layer:  # (n, head_dim): contiguous in the cache
                            piece = memoryview(head.cpu().contiguous().view(torch.uint8).numpy())
                            f.write(piece)
                            crc = zlib.crc32(piece, crc)
                f.write(CRC.pack(crc))
            os.replace(part, path)
        except BaseException:
            _unlink(part)
            raise
        entry = Entry(path, job.model.digest, job.user, job.chunk, job.ids, dtype, (layers, heads, n, head_dim),
                      PREAMBLE.size + len(header), size, self.stamp(path))
        with self._lock:
            for other in list(self._index.values()):  # those it holds all of, and more
                if (other.model, other.user, other.chunk) == (entry.model, entry.user, entry.chunk) \
                        and len(other.ids) <= n and job.ids[:len(other.ids)] == other.ids and other.path != path:
                    del self._index[other.path]
                    _unlink(other.path)
            self._index[path] = entry
            self._trim()
        self.written_bytes += size
        log.info("KV cache: %d positions written to %s (%.1f MB) in %.2f s", n, name, size / 2**20,
                 time.perf_counter() - started)


def _copy_in(data: mmap.mmap, entry: Entry, cache: KVCache, n: int) -> None:
    layers, heads, positions, head_dim = entry.shape
    if cache.k.shape[0] != layers or cache.k.shape[2] != heads or cache.k.shape[4] != head_dim \
            or cache.k.dtype != getattr(torch, entry.dtype) or cache.max_len < n or cache.chunk != entry.chunk:
        raise BadFile(f"its shape {entry.shape} ({entry.dtype}) does not fit the cache {tuple(cache.k.shape)} "
                      f"({cache.k.dtype})")
    dtype, count = getattr(torch, entry.dtype), _numel(entry.shape)
    for i, into in enumerate((cache.k, cache.v)):
        stored = torch.frombuffer(data, dtype=dtype, count=count, offset=entry.offset + i * count * dtype.itemsize)
        into[:, 0, :, :n].copy_(stored.view(entry.shape)[:, :, :n])


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
