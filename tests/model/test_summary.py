"""A checkpoint told without loading it (model/summary.py): format, size on disk, parameters, dtype."""

from __future__ import annotations

import pytest
from support.checkpoints import hf_model, write_meta, write_tiny_checkpoint
from support.gguf_checkpoints import write_llama3_gguf

from model.checkpoint import CheckpointError
from model.config import LlamaConfig
from model.convert.gguf import convert_gguf
from model.summary import CheckpointSummary, count, parameters, size, summarize


def test_a_safetensors_folder_is_told_from_its_header(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "tiny")
    hf = hf_model(num_hidden_layers=2)
    summary = summarize(folder)
    assert summary == CheckpointSummary("safetensors", (folder / "model.safetensors").stat().st_size,
                                        sum(p.numel() for p in hf.parameters()), "fp32")
    # the formula from the config counts the same (tied embeddings once)
    assert parameters(LlamaConfig.from_hf_config(folder / "config.json")) == summary.parameters
    assert summary.describe() == f"{count(summary.parameters)} parameters · {size(summary.bytes)} · safetensors · fp32"


def test_a_meta_checkpoint_is_counted_from_its_params(tmp_path):
    hf = hf_model(tie=False, num_hidden_layers=2)
    folder = write_meta(hf, tmp_path / "meta")
    summary = summarize(folder)
    assert summary.format == "Meta" and summary.dtype is None
    assert summary.parameters == sum(p.numel() for p in hf.parameters())
    assert summary.bytes == (folder / "consolidated.00.pth").stat().st_size


def test_a_gguf_import_says_so_and_int8_weights_are_int8(tmp_path):
    gguf = write_llama3_gguf(hf_model(num_hidden_layers=2), tmp_path / "tiny.q8_0.gguf", "q8_0")
    summary = summarize(convert_gguf(gguf, tmp_path / "imported"))
    assert summary.format == "GGUF import" and summary.dtype == "int8"
    assert summary.parameters == sum(p.numel() for p in hf_model(num_hidden_layers=2).parameters())


def test_int4_weights_count_two_a_byte_and_their_offsets_count_none(tmp_path):
    gguf = write_llama3_gguf(hf_model(num_hidden_layers=2), tmp_path / "tiny.q4_1.gguf", "q4_1")
    summary = summarize(convert_gguf(gguf, tmp_path / "imported"))
    assert summary.dtype == "int4"
    assert summary.parameters == sum(p.numel() for p in hf_model(num_hidden_layers=2).parameters())


def test_a_broken_weights_file_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"this is not a safetensors file")
    with pytest.raises(CheckpointError, match="model.safetensors: expected a safetensors header"):
        summarize(tmp_path)


@pytest.mark.parametrize("header", [b'{"w": {}}', b'{"w": {"dtype": "F32", "shape": "big"}}', b'[1, 2]',
                                    b'{"w": {"dtype": "F32", "shape": [2, "x"]}}', b'{"w": 5}'])
def test_a_header_of_another_shape_is_named(tmp_path, header):
    """JSON, but not a safetensors header (a tensor without dtype or shape): a CheckpointError that the model
    lists (/api/tags, the models panel) show beside the model, never an exception that loses the whole list."""
    import struct
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CheckpointError, match="does not give each tensor's dtype and shape"):
        summarize(tmp_path)


def test_numbers_for_people():
    assert [count(n) for n in (134_515_008, 1_235_814_400, 8_030_261_248, 5_000)] == ["135M", "1.2B", "8.0B", "5K"]
    assert [size(n) for n in (538_090_408, 2_471_645_608, 4_000)] == ["538 MB", "2.5 GB", "4 kB"]
