"""Linear layers whose weights may be stored as bf16 or int8, with activations in fp32 or bf16.

Prefill (many rows) goes to `F.linear`. Decode (one row) is a matrix-vector product bound by
memory bandwidth; a small C++ kernel (csrc/matvec.cpp, built with the system compiler on first use
and cached) streams the 16-bit or 8-bit weights directly, several matrices of the same input in one
call (q|k|v, gate|up). Without a compiler everything still works through `F.linear`, only slower.
`LLAMA_KERNELS=0` turns the kernel off.
"""

from __future__ import annotations

import hashlib
import os
import threading
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

_lock = threading.Lock()
_ops = None  # None: not tried yet; False: unavailable


def cache_dir() -> Path:
    return Path(os.environ.get("LLAMA_CACHE_DIR", Path.home() / ".cache" / "llama-chat"))


def kernels():
    """torch.ops.llama_kernels, built on first call; None where no compiler is available."""
    global _ops
    with _lock:
        if _ops is None:
            _ops = _build() if os.environ.get("LLAMA_KERNELS", "1") != "0" else False
    return _ops or None


def _build():
    from torch.utils.cpp_extension import load
    build_dir = cache_dir() / "kernels" / _cpu_tag()  # -march=native code runs only on this kind of CPU
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        load(name="llama_kernels", sources=[str(Path(__file__).parent / "csrc" / "matvec.cpp")],
             extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"], build_directory=str(build_dir),
             is_python_module=False, verbose=False)
    except Exception as e:  # no compiler, or an unsupported platform
        warnings.warn(f"decode kernel unavailable, using F.linear ({str(e).splitlines()[0][:200]})")
        return False
    # Shapes of the outputs, so torch.compile can trace through the ops.
    torch.library.register_fake("llama_kernels::matvec_bf16")(lambda x, ws: x.new_empty(sum(w.shape[0] for w in ws)))
    torch.library.register_fake("llama_kernels::matvec_int8")(
        lambda x, ws, scales: x.new_empty(sum(w.shape[0] for w in ws)))
    return torch.ops.llama_kernels


def _cpu_tag() -> str:
    """A short hash of the CPU model and its feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        text = "".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))
    except OSError:
        import platform
        text = platform.processor() or platform.machine()
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ weight (N, K).T, weight in any dtype (int8 with group scales (N, K // group))."""
    return linears(x, [weight], [scale])


def linears(x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor | None]) -> torch.Tensor:
    """x (..., K) through several weight matrices (N_i, K) at once: outputs side by side, (..., sum N_i)."""
    kind = weights[0].dtype
    if (x.numel() == x.shape[-1] and x.device.type == "cpu" and kind in (torch.bfloat16, torch.int8)
            and x.dtype in (torch.float32, torch.bfloat16) and all(w.dtype == kind for w in weights)):
        ops = _ops if _ops is not None else kernels()  # no lock once built (torch.compile traces this)
        if ops:  # one row: y comes back in x's dtype
            flat = x.reshape(-1)
            y = ops.matvec_bf16(flat, weights) if kind == torch.bfloat16 else ops.matvec_int8(flat, weights, scales)
            return y.view(*x.shape[:-1], -1)
    outputs = [F.linear(x, w.to(x.dtype) if s is None else dequantize_int8(w, s, x.dtype))
               for w, s in zip(weights, scales)]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)


def project(x: torch.Tensor, *layers: Linear) -> torch.Tensor:
    """x through several Linear layers of the same input size, outputs side by side (q|k|v, gate|up)."""
    return linears(x, [layer.weight for layer in layers], [layer.scale for layer in layers])


class Linear(nn.Linear):
    """nn.Linear without bias whose weight may be bf16, or int8 with `scale`s per group of a row."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self.scale: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self)


INT8_GROUP = 64  # weights of a row that share one scale


@torch.no_grad()
def quantize_int8(weight: torch.Tensor, rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per group of INT8_GROUP weights of a row (of fewer where K is not a
    multiple of it: the largest divisor of K below it).

    Returns (q int8 (N, K), scale fp32 (N, K // group)): weight ~= dequantize_int8(q, scale).
    Works through `rows` rows at a time, so a large matrix never has a full fp32 copy.
    """
    n, k = weight.shape
    group = next(g for g in range(min(INT8_GROUP, k), 0, -1) if k % g == 0)
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(n, k // group, dtype=torch.float32, device=weight.device)
    for i in range(0, n, rows):
        w = weight[i:i + rows].float().view(-1, k // group, group)  # (rows, groups, group)
        s = w.abs().amax(dim=-1).clamp(min=1e-8) / 127.0
        q[i:i + rows] = torch.round(w / s[..., None]).clamp_(-127, 127).view(-1, k)
        scale[i:i + rows] = s
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The (N, K) matrix that int8 q with group scales (N, K // group) stands for."""
    n, k = q.shape
    return (q.view(n, scale.shape[1], -1).to(dtype) * scale.to(dtype)[..., None]).view(n, k)


@torch.no_grad()
def quantize_model(model: nn.Module) -> None:
    """Store every Linear of `model` as int8 (a tied output head gets its own int8 copy)."""
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.dtype != torch.int8:
            q, module.scale = quantize_int8(module.weight)
            module.weight = nn.Parameter(q, requires_grad=False)
