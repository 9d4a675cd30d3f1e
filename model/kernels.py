"""The decode kernel: csrc/matvec.cpp and csrc/decode_step.cpp built with the system compiler once,
cached, and loaded.

Decode multiplies every weight matrix by a few rows, so it runs at the speed weights stream from
memory; the kernel's ops stream 16-, 8- or 4-bit weights directly (see matvec.cpp), and
decode_layers runs a whole decode step's layers in one call (see decode_step.cpp). The
instruction set is picked when the file is compiled, by `-march`: `native` (the default) gives
the AVX-512 or AVX2 code on CPUs that have it and plain loops elsewhere; `configure(march=...)`
overrides it (e.g. `znver3` to run the AVX2 code on an AVX-512 machine, `x86-64` for the plain
loops). The build is cached in the cache folder's kernels/ (~/.cache/llama-chat/kernels/ unless
configured) under a hash of the sources, the flags and the CPU, so it is compiled once per machine
and code version, not once per checkout; `load_checkpoint` builds or loads it while the model
loads. Loading a build marks it used; builds no process has loaded for UNUSED_DAYS (an older version's
code, a torch since upgraded) are removed then, with the folders of compiles that never finished.
Without a compiler everything still works through `F.linear`, only slower; `configure(enabled=False)`
turns the kernel off.

The options are arguments: whoever starts a process calls `configure` before the first model loads,
with what `model.options` read from LLAMA_KERNELS, LLAMA_KERNEL_MARCH, LLAMA_DETERMINISTIC and
LLAMA_CACHE_DIR (`kernels.configure(**ModelOptions.from_env().kernel_options)`); a process that does
not gets the defaults (on, -march=native, int8 tiles on, ~/.cache/llama-chat).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import re
import shutil
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

from .block_formats import FORMATS
from .cpu import cpu_tag, is_intel
from .options import DEFAULT_CACHE_DIR

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "matvec.cpp", CSRC / "decode_step.cpp", CSRC / "dequantize.cpp",  # they include dot_*.h, ggml_blocks.h
           CSRC / "prefill_blocks.cpp"]
log = logging.getLogger(__name__)

UNUSED_DAYS = 30  # a build not loaded for this long is removed when another is loaded (_prune)
FLAGS = ["-O3", "-ffast-math", "-fno-associative-math", "-ffp-contract=off", "-fopenmp", "-fvisibility=hidden"]  # and -march=...


def cflags(march: str) -> list[str]:
    """The compiler's flags for a build: FLAGS, -march, and where the weights are prefetched to
    (csrc/dot_portable.h: into L2 on Intel CPUs, where that decoded 1.05-1.36x faster than into L1)."""
    return [*FLAGS, f"-march={march}", *(["-DLLAMA_PREFETCH_L2"] if is_intel() else [])]


class KernelBuildError(RuntimeError):
    """The extension could not be built or loaded (no compiler, or -march unknown to it)."""


@dataclass(frozen=True)
class Kernels:
    """One build of the extension: torch.ops.<name> with matvec_bf16(x, ws), matvec_f32(x, ws), matvec_int8(x, ws, scales),
    matvec_int4(x, ws, scales, offsets), matvec_blocks(x, ws) (llama.cpp's blocks, model/blocks.py) (each with
    fp32_out=True for y in fp32 whatever x's dtype), dequantize_blocks(w, dtype),
    decode_layers(...) (model/decode_step.py calls it; teams(): its steps run as one parallel region, csrc/team.h), dequantize_int4(w, scale, offset, dtype) and dequantize_int8(w, scale, dtype) (prefill), path(),
    set_int8_x(on) (AVX-512 and AVX2 builds round x to int8 blocks for int4 weights, and AMX builds for int8
    batches in tiles; off: int16 rows, for tests), set_amx(on) (bf16 and int8 batches in AMX tiles where the CPU has
    them; off: the AVX-512 loops) and set_amx_int8(on) (int8 batches alone)."""

    march: str
    name: str  # the library's and the ops' namespace: one per -march, so builds load side by side
    ops: object
    path: str  # which code the build compiled: "AVX-512 BF16" (+ " + AMX"), "AVX-512", "AVX2" or "portable"
    folder: Path


@dataclass(frozen=True)
class Options:
    """How this process uses the kernel: set by configure()."""

    enabled: bool = True
    march: str = "native"
    deterministic: bool = False  # int8 batches stay out of AMX tiles (csrc/matvec.cpp)
    cache_dir: Path = DEFAULT_CACHE_DIR  # builds go in its kernels/


_lock = threading.Lock()
_builds: dict[str, Kernels | KernelBuildError] = {}
_options = Options()
_engine = None  # the ops linears() uses: None until first asked for, False where there are none


def configure(*, enabled: bool = True, march: str = "native", deterministic: bool = False,
              cache_dir: str | Path = DEFAULT_CACHE_DIR) -> None:
    """Whether linears() use the kernel, which -march build, whether int8 batches keep out of AMX tiles, and
    where builds are cached. Call it before the first model loads: the kernel is decided again on the next
    kernels(), but a model compiled with torch.compile keeps what it traced."""
    global _options, _engine
    with _lock:
        _options = Options(enabled, march or "native", deterministic, Path(cache_dir))
        _engine = None


def configured() -> Options:
    """What configure() last set (the defaults before it is called)."""
    return _options


def build(march: str = "native") -> Kernels:
    """The extension compiled with -march=`march`, built on first call (or loaded from the cache folder).

    Raises KernelBuildError when it cannot be built; the same error again on later calls.
    """
    with _lock:
        if march not in _builds:
            try:
                _builds[march] = _build(march)
            except KernelBuildError as e:
                _builds[march] = e
    found = _builds[march]
    if isinstance(found, KernelBuildError):
        raise found
    return found


def kernels():
    """The ops linears() uses (the configured -march build), built on first call; None where the kernel is
    off or cannot be built. Decided once per configure(). Deterministic: int8 batches keep out of AMX tiles
    (csrc/matvec.cpp: their x rounds otherwise than one sequence's)."""
    global _engine
    if _engine is None:  # once decided, no lock and no exception (torch.compile traces the callers)
        options = _options
        try:
            ops = build(options.march).ops if options.enabled else False
        except KernelBuildError:
            ops = False
        if ops:
            ops.set_amx_int8(not options.deterministic)  # the build's default is on where it has the tiles
        _engine = ops
    return _engine or None


def decode_path() -> str:
    """Which path decode takes: the kernel build's instruction set, or F.linear and why."""
    if not _options.enabled:
        return "F.linear (kernel off)"
    try:
        found = build(_options.march)
    except KernelBuildError as e:
        return f"F.linear (no kernel: {e})"
    return found.path if found.march == "native" else f"{found.path} (-march={found.march})"


def build_folder(march: str, csrc: Path = CSRC) -> Path:
    """Where the build for -march=`march` lives: keyed by what decides the binary (the sources'
    contents, the flags, this CPU for -march=native, torch's and Python's versions), never by the
    checkout's path, so every checkout of the same code shares one build."""
    digest = hashlib.sha256()
    for file in sorted(csrc.iterdir()):
        if file.suffix in (".cpp", ".h"):
            digest.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
    digest.update(" ".join([*cflags(march), cpu_tag(), torch.__version__, platform.python_version()]).encode())
    return _options.cache_dir / "kernels" / f"{_name(march)}-{digest.hexdigest()[:16]}"


def _name(march: str) -> str:
    return "llama_kernels_" + re.sub(r"\W", "_", march)


def _build(march: str) -> Kernels:
    name, folder = _name(march), build_folder(march)
    library = folder / f"{name}.so"
    with _compiling(folder):  # processes starting together (engines, test workers) compile a build once
        if library.is_file():  # built before, by this or any checkout of the same code
            torch.ops.load_library(str(library))
            os.utime(folder)  # used now (what _prune goes by)
        else:
            _compile(name, march, folder)
    _prune(folder.parent, keep=folder)
    ops = getattr(torch.ops, name)
    # Shapes of the outputs, so torch.compile can trace through the ops: x (..., K) -> (..., sum N_i).
    torch.library.register_fake(f"{name}::matvec_bf16")(lambda x, ws, fp32_out=False: _fake_output(x, ws, fp32_out))
    torch.library.register_fake(f"{name}::matvec_f32")(lambda x, ws, fp32_out=False: _fake_output(x, ws, fp32_out))
    torch.library.register_fake(f"{name}::matvec_int8")(
        lambda x, ws, scales, fp32_out=False: _fake_output(x, ws, fp32_out))
    torch.library.register_fake(f"{name}::decode_layers")(lambda x, *rest: torch.empty_like(x))
    torch.library.register_fake(f"{name}::matvec_int4")(
        lambda x, ws, scales, offsets, fp32_out=False: _fake_output(x, ws, fp32_out))
    torch.library.register_fake(f"{name}::dequantize_int4")(
        lambda w, scale, offset, dtype: w.new_empty(w.shape[0], w.shape[1] * 2, dtype=dtype))
    torch.library.register_fake(f"{name}::dequantize_int8")(lambda w, scale, dtype: w.new_empty(w.shape, dtype=dtype))
    torch.library.register_fake(f"{name}::dequantize_blocks")(
        lambda w, dtype: w.new_empty(w.shape[0], w.shape[1] * FORMATS[w.shape[2]].block, dtype=dtype))
    torch.library.register_fake(f"{name}::matvec_blocks")(lambda x, ws, fp32_out=False: _fake_output(x, ws, fp32_out))
    return Kernels(march=march, name=name, ops=ops, path=ops.path(), folder=folder)


@contextmanager
def _compiling(folder: Path):
    """While inside, this process alone of those on the machine builds `folder` (a lock file beside it); where
    there are no POSIX file locks, each process may compile its own copy (_compile keeps the first)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(f"{folder.name}.lock"), "a") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def _prune(kernels: Path, keep: Path, now: float | None = None) -> list[str]:
    """Remove from `kernels` the builds (with their lock files) that no process has loaded for UNUSED_DAYS, and the
    scratch folders of compiles left as long (their process killed); never `keep`, nor a build whose lock another
    process holds (it is compiling or loading that build). Returns the names removed."""
    cutoff = (time.time() if now is None else now) - UNUSED_DAYS * 86400
    removed = []
    for entry in sorted(kernels.iterdir()) if kernels.is_dir() else []:
        if entry == keep or not entry.is_dir() or not entry.name.startswith("llama_kernels_"):
            continue
        try:
            if entry.stat().st_mtime >= cutoff:
                continue
            lock_path = entry.with_name(f"{entry.name}.lock")
            with open(lock_path, "a") as lock:
                if fcntl is not None:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # OSError where another process holds it
                shutil.rmtree(entry)
                lock_path.unlink(missing_ok=True)
        except OSError:
            continue
        removed.append(entry.name)
    if removed:
        log.info("removed %d kernel builds no process had loaded for %d days from %s", len(removed), UNUSED_DAYS,
                 kernels)
    return removed


def _compile(name: str, march: str, folder: Path) -> None:
    """Compile and load the library, building in a folder of its own that takes `folder`'s name
    only once complete, so another process never loads a half-written library."""
    from torch.utils.cpp_extension import load

    scratch = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        load(name=name, sources=[str(source) for source in SOURCES], extra_cflags=cflags(march),
             build_directory=str(scratch), is_python_module=False, verbose=False)  # builds and loads
    except Exception as e:  # no compiler, an -march it does not know, or an unsupported platform
        shutil.rmtree(scratch, ignore_errors=True)
        raise KernelBuildError(f"building {CSRC} with -march={march} failed: {_first_error(str(e))}") from None
    try:
        scratch.rename(folder)
    except OSError:  # another process finished the same build first: keep its folder
        shutil.rmtree(scratch, ignore_errors=True)


def _first_error(log: str) -> str:
    """The compiler's first error line (or the message's last line) from a failed build's output."""
    lines = [line.strip() for line in log.splitlines() if line.strip()] or ["unknown error"]
    return next((line for line in lines if "error:" in line), lines[-1])[:300]


def _fake_output(x: torch.Tensor, weights: list[torch.Tensor], fp32_out: bool = False) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], sum(w.shape[0] for w in weights), dtype=torch.float32 if fp32_out else x.dtype)
