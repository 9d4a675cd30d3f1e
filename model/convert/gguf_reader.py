"""Opening a GGUF file and reading its metadata, with errors that name the file.

The `gguf` library's reader parses the whole header when it opens a file, and reads each value as a
slice of a `np.memmap`: every slice of a memmap runs numpy's Python-level `memmap.__array_finalize__`,
and a Llama 3 GGUF's header holds about 400,000 strings (its vocabulary and merges), two or three slices
each: 8 to 10 seconds to open a file, before a byte of weights is read. `Reader` takes the same slices
of a plain ndarray view of the same map (no copy): the same fields and tensors, about 2 seconds.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
from gguf import GGUFEndian, GGUFReader

from .folder import ConversionError

REQUIRED = object()  # `metadata` default: the key must be there


class Reader(GGUFReader):
    """gguf.GGUFReader, its values sliced from a plain ndarray over the file's map (see above)."""

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:  # the first read, made from GGUFReader.__init__ once self.data is mapped
            plain = self._plain = self.data.view(np.ndarray)
        dtype, count = np.dtype(dtype), int(count)
        values = plain[offset:offset + dtype.itemsize * count].view(dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return values if order == "I" else values.view(values.dtype.newbyteorder(order))


def open_gguf(path: Path) -> Reader:
    """The file's reader, or a ConversionError naming the file if it is not a complete Llama GGUF."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ConversionError(f"{path}: cannot read the GGUF file ({e.strerror})") from None
    if magic != b"GGUF":
        raise ConversionError(f"{path}: expected a GGUF file starting with b'GGUF', found {magic!r}")
    try:
        reader = Reader(path)
    except (ValueError, IndexError, KeyError, struct.error) as e:
        size = path.stat().st_size
        raise ConversionError(f"{path}: truncated or corrupt GGUF file ({size} bytes): {e}. "
                              "Delete it and fetch it again.") from None
    arch = metadata(reader, path, "general.architecture")
    if arch != "llama":
        raise ConversionError(f"{path}: expected general.architecture 'llama', found {arch!r}")
    if metadata(reader, path, "split.count", 1) > 1:
        raise ConversionError(f"{path}: one part of a split GGUF; merge the parts first "
                              "(llama.cpp: llama-gguf-split --merge FIRST-PART OUT.gguf)")
    if reader.endianess != GGUFEndian.LITTLE:
        raise ConversionError(f"{path}: a big-endian GGUF; expected little-endian")
    return reader


def metadata(reader: GGUFReader, path: Path, key: str, default=REQUIRED):
    field = reader.fields.get(key)
    if field is None:
        if default is REQUIRED:
            raise ConversionError(f"{path}: metadata key {key!r} is missing; a Llama GGUF has it")
        return default
    return field.contents()


def float32_value(value: float) -> float:
    """The shortest decimal that is this float32 (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))
