"""The memory behind loaded weights: file pages let go once a converted copy replaces them, the
conversion's scratch handed back, and the weights moved into 2 MB pages for decode.

Decode reads every weight once a token, from end to end. In 4 KB pages that is a TLB miss and a
page walk every 4 KB; in 2 MB pages, one every 2 MB. Weights converted while loading (bf16 from an
fp32 file, int8, int4) are anonymous memory that Linux gives out in 4 KB pages unless asked
(`/sys/kernel/mm/transparent_hugepage/enabled` is `madvise` on most distributions): once loaded,
the 2 MB-aligned stretches they fill are marked MADV_HUGEPAGE and collapsed at once with
MADV_COLLAPSE (Linux 6.1+; otherwise khugepaged may do it later, in its own time). Weights mapped
straight from the file stay in the file's pages. The default model (bf16 from its fp32 file) decoded
1.10x faster, the 1B shape in int4 1.11x (docs/benchmarks.md). Where these calls are not supported
(another OS, an older kernel, THP off, another C library) nothing changes.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import sys
from collections.abc import Iterable

import torch


def release_pages(mapped: torch.Tensor) -> None:
    """Drop the resident file pages behind a memory-mapped tensor once a converted copy replaces it.

    Only whole pages inside the tensor are dropped; the mapping is private and never written, so
    a later read would simply fault the pages in again from the file. Linux only; a no-op elsewhere.
    """
    if mapped.device.type != "cpu" or not hasattr(os, "sysconf") or _libc() is None:
        return
    page = os.sysconf("SC_PAGE_SIZE")
    start = -(-mapped.data_ptr() // page) * page
    end = (mapped.data_ptr() + mapped.nbytes) // page * page
    if end > start:
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)


MADV_DONTNEED = 4


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


@contextlib.contextmanager
def scratch_returned():
    """While converting weights, have glibc give every freed block of 1 MB or more straight back.

    Quantizing at load allocates and frees fp32 scratch of 4-40 MB a matrix. By default glibc raises
    its mmap threshold after the first such block is freed, so later ones come from its heap and stay
    there: over a model's hundred matrices that grew the peak by 0.1-0.6 GB, differently from run to
    run. Afterwards blocks under 32 MB come from the heap again (what glibc's own adjustment settles
    at): mapping each of prefill's activations afresh made prefill 20% slower. A no-op where the C
    library is not glibc."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        yield
        return
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(M_TRIM_THRESHOLD, 64 << 20)


@functools.cache
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25
# Tensors closer than a huge page are one stretch: between them lie the allocator's headers, other
# small blocks or free ones, which share the 2 MB pages (the layers' smaller matrices come from the
# heap, where gaps of over 64 KB between them kept 30% of the default model's weights in 4 KB pages).
NEAR = HUGE_PAGE


def stretches(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """The [start, end) address ranges the CPU tensors' bytes cover, neighbours within NEAR joined."""
    ranges = sorted({(t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors if t.device.type == "cpu" and t.nbytes})
    joined: list[tuple[int, int]] = []
    for start, end in ranges:
        if joined and start <= joined[-1][1] + NEAR:
            joined[-1] = (joined[-1][0], max(joined[-1][1], end))
        else:
            joined.append((start, end))
    return joined


def move_to_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Ask for the whole 2 MB pages inside the tensors' stretches to be huge pages; returns the bytes
    that now are (0 where the system does not do it)."""
    libc = _libc()
    if libc is None:
        return 0
    moved = 0
    for start, end in stretches(tensors):
        first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
        if last <= first:
            continue
        # The hint first: pages the stretch faults in later come as huge pages too. Then each page
        # alone: one that is not anonymous memory (the file's pages) or spans a hole between two
        # mappings stays as it is without holding back the others.
        libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_HUGEPAGE)
        for page in range(first, last, HUGE_PAGE):
            if libc.madvise(ctypes.c_void_p(page), ctypes.c_size_t(HUGE_PAGE), MADV_COLLAPSE) == 0:
                moved += HUGE_PAGE
    return moved


def available_bytes(device: torch.device) -> int:
    """Memory free for new tensors on `device`: the GPU's free memory, or the system's MemAvailable (the
    page cache it may take back counted as free), or the free pages where /proc/meminfo is not there."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
