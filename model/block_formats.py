"""The formats of llama.cpp's blocks that weights may be kept in (model/blocks.py, csrc/ggml_blocks.h), by
their size in bytes, which names each: no two of them share a size. No torch: the web process reads these to
describe a model."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockFormat:
    name: str  # GGML's: gguf.GGMLQuantizationType[name]
    block: int  # weights a block
    bytes: int  # bytes a block


FORMATS = {f.bytes: f for f in (
    BlockFormat("Q4_K", 256, 144), BlockFormat("Q5_K", 256, 176), BlockFormat("Q6_K", 256, 210),
    BlockFormat("Q3_K", 256, 110), BlockFormat("Q2_K", 256, 84), BlockFormat("Q5_0", 32, 22),
    BlockFormat("Q5_1", 32, 24),
)}
BY_NAME = {f.name: f for f in FORMATS.values()}
