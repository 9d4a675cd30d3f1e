"""What this machine's CPU can do, read once from /proc/cpuinfo.

The one place that reads CPU flags: the compute dtype (`has_native_bf16`), the decode kernel's
build folder (`cpu_tag`) and the benchmarks' machine description all ask here. On a system without
/proc/cpuinfo (macOS, Windows) every flag reads as absent, which only costs speed.
"""

from __future__ import annotations

import functools
import hashlib
import platform
from pathlib import Path


@functools.cache
def _cpuinfo() -> tuple[str, str, frozenset[str]]:
    """(model name, vendor, feature flags) of the first CPU listed; ("", "", {}) where there is no /proc/cpuinfo."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "", "", frozenset()

    def field(*keys: str) -> str:
        return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(keys)), "")

    # x86 lists "flags", ARM "Features".
    return field("model name"), field("vendor_id"), frozenset(field("flags", "Features").split())


def model_name() -> str:
    return _cpuinfo()[0] or platform.processor() or platform.machine()


def flags() -> frozenset[str]:
    return _cpuinfo()[2]


def is_intel() -> bool:
    """An Intel CPU: the decode kernel asks for its weights ahead into L2 there, not L1 (model/kernels.py)."""
    return _cpuinfo()[1] == "GenuineIntel"


def has_avx512() -> bool:
    """AVX-512 F and BW: what the decode kernel's AVX-512 code needs."""
    return {"avx512f", "avx512bw"} <= flags()


def has_avx512_bf16() -> bool:
    """vdpbf16ps: bf16 dot products accumulated in fp32."""
    return "avx512_bf16" in flags()


def has_amx() -> bool:
    """AMX tiles with bf16 (Sapphire Rapids and later): oneDNN's fastest bf16 matrix products."""
    return "amx_bf16" in flags()


def has_avx2() -> bool:
    """AVX2, FMA and F16C (every x86 CPU since 2013-2015): what the decode kernel's AVX2 code needs."""
    return {"avx2", "fma", "f16c"} <= flags()


def has_native_bf16() -> bool:
    """AVX-512 BF16 or AMX: CPUs on which PyTorch's bf16 matrix products are fast, so activations run in bf16."""
    return has_avx512_bf16() or has_amx()


def cpu_tag() -> str:
    """A short hash of the CPU model and its flags: code built with -march=native runs only on this kind of CPU."""
    name, _, found = _cpuinfo()
    text = name + " " + " ".join(sorted(found)) if found else model_name()
    return hashlib.sha256(text.encode()).hexdigest()[:12]
