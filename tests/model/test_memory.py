"""model/memory.py: the weights' stretches of memory, and moving them into 2 MB pages."""

import logging
import sys
from pathlib import Path

import pytest
import torch
from support.checkpoints import hf_model

from model import load_checkpoint
from model.memory import HUGE_PAGE, NEAR, move_to_huge_pages, stretches

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_on() -> bool:
    """Linux with transparent huge pages for anyone who asks (`[always]` or `[madvise]`)."""
    return sys.platform.startswith("linux") and THP.is_file() and "[never]" not in THP.read_text()


def huge_bytes_in(start: int, end: int) -> int:
    """AnonHugePages of this process's mappings that overlap [start, end) (from /proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo < end and start < hi
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


def test_stretches_join_neighbours_and_leave_gaps():
    big = torch.empty(4 * NEAR, dtype=torch.uint8)
    a, b, far = big[:1000], big[1000 + NEAR // 2: 2000 + NEAR // 2], big[3 * NEAR + 3000:]
    start = big.data_ptr()
    joined = [(start, start + 2000 + NEAR // 2), (start + 3 * NEAR + 3000, start + 4 * NEAR)]
    assert stretches([a, b, far, torch.empty(0)]) == joined
    assert stretches([b, a, a]) == stretches([a, b])  # order and repeats do not matter


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps and madvise are Linux's")
def test_a_large_tensor_moves_into_huge_pages_with_its_values():
    values = torch.randn((12 << 20) // 4)  # 12 MB of floats, written (so in 4 KB pages) before the move
    before = values.clone()
    start, end = values.data_ptr(), values.data_ptr() + values.nbytes
    moved = move_to_huge_pages([values])
    assert torch.equal(values, before)
    if thp_on():
        whole = (end // HUGE_PAGE - -(-start // HUGE_PAGE)) * HUGE_PAGE  # the whole 2 MB pages inside
        assert moved == whole >= 4 * HUGE_PAGE
        assert huge_bytes_in(start, end) >= moved
    else:
        assert moved == 0


def test_loading_moves_converted_weights_and_says_how_much(tmp_path, caplog):
    """fp32 in the file, bf16 in memory: the converted matrices (8 MB each) are anonymous memory."""
    hf_model(hidden_size=1024, intermediate_size=4096, num_hidden_layers=2).save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="model.checkpoint"):
        ckpt = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    said = [m for m in caplog.messages if m.startswith("weights in 2 MB pages: ")]
    assert len(said) == 1
    megabytes = float(said[0].split(": ")[1].removesuffix(" MB"))
    matrices = sum(t.nbytes for t in ckpt.model.state_dict().values() if t.dim() == 2) / 1e6
    if thp_on():
        assert 0.5 * matrices <= megabytes <= 1.01 * matrices
    else:
        assert megabytes == 0
    reference = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    for (name, ours), theirs in zip(ckpt.model.state_dict().items(), reference.model.state_dict().values()):
        assert torch.equal(ours, theirs), name
