"""Opening a GGUF file and reading its metadata, with errors that name the file.

The `gguf` library's reader parses the whole header when it opens a file, and makes each value a slice of
a `np.memmap` (every slice runs numpy's Python-level `memmap.__array_finalize__`): a Llama 3 GGUF's header
holds about 400,000 strings (its vocabulary and merges), two or three slices each, 8 to 10 seconds to open
a file before a byte of weights is read (numbers in arrays, such as the vocabulary's token types, are read
one slice each too). `Reader` keeps the library's fields and tensors but reads an array as one field
(ArrayField): numbers as one array, strings as a Strings that knows where each string lies and decodes them
when they are asked for. A Llama 3 GGUF opens in under a tenth of a second (2 s before, with slices of a
plain view; 8.6 s by the library's reader; Zen 4), and its vocabulary and merges decode in about 0.15 s.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFEndian, GGUFReader, GGUFValueType, ReaderField

from .folder import ConversionError

REQUIRED = object()  # `metadata` default: the key must be there


class Strings:
    """An array of `count` GGUF strings (each a uint64 length, then its UTF-8 bytes) from `first` in the header:
    where each one ends, found in one pass over the lengths; decoded when asked for."""

    def __init__(self, header: np.ndarray, first: int, count: int, order: str):
        unpack, view = struct.Struct(f"{order}Q").unpack_from, memoryview(header)
        starts, at = [], first
        append = starts.append
        try:
            for _ in range(count):  # the loop's body is kept small: a Llama 3 header has 400,000 strings
                at += 8 + unpack(view, at)[0]
                append(at)  # the end of the string (its start: the end before it, and its length's 8 bytes)
        except (struct.error, OverflowError):
            raise ValueError(f"an array of {count} strings runs past the end of the file") from None
        if at > len(header):
            raise ValueError(f"an array of {count} strings runs past the end of the file")
        self.header, self.first, self.end, self.ends = header, first, at, starts
        self._decoded = None

    def decoded(self) -> list[str]:
        if self._decoded is None:
            blob, first = self.header[self.first:self.end].tobytes(), self.first
            ends = [end - first for end in self.ends]
            starts = [8, *(end + 8 for end in ends[:-1])]
            self._decoded = [str(blob[start:end], "utf-8") for start, end in zip(starts, ends)]
        return self._decoded


class ArrayField(ReaderField):
    """A field whose value is an array of strings or of numbers: its parts are the key's (length, bytes), the
    value's type, the array's item type and count, then the items (a Strings, or one array of the numbers);
    contents() gives what the library's field gives (a list, or one item)."""

    __slots__ = ()

    def contents(self, index_or_slice: int | slice = slice(None)):
        items = self.parts[-1]
        return (items.decoded() if isinstance(items, Strings) else items.tolist())[index_or_slice]


class Reader(GGUFReader):
    """gguf.GGUFReader, its values sliced from a plain ndarray over the file's map, its arrays read whole
    (ArrayField, see above)."""

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:  # the first read, made from GGUFReader.__init__ once self.data is mapped
            plain = self._plain = self.data.view(np.ndarray)
        dtype, count = np.dtype(dtype), int(count)
        values = plain[offset:offset + dtype.itemsize * count].view(dtype)[:count]
        if len(values) < count:
            raise ValueError(f"{count} values of {dtype} at offset {offset} run past the end of the file")
        order = self.byte_order if override_order is None else override_order
        return values if order == "I" else values.view(values.dtype.newbyteorder(order))

    def _build_fields(self, offs: int, count: int) -> int:
        """The key-value pairs from `offs` on, as the library's reader has them, but each array of strings or of
        numbers as one ArrayField; returns the offset past them."""
        for _ in range(count):
            start = offs
            key_length, key = self._get_str(offs)
            offs += 8 + len(key)
            value_type = self._get(offs, np.uint32)
            offs += 4
            head = [key_length, key, value_type]
            name = str(bytes(key), encoding="utf-8")
            if value_type[0] == GGUFValueType.ARRAY:
                item_type, length = self._get(offs, np.uint32), self._get(offs + 4, np.uint64)
                kind = GGUFValueType(item_type[0])
                number = self.gguf_scalar_to_np.get(kind)
                if length[0] > 0 and (kind == GGUFValueType.STRING or number is not None):  # else the library's way
                    if number is None:
                        order = "<" if (self.byte_order == "I") == (sys.byteorder == "little") else ">"
                        items = Strings(self._plain, offs + 12, int(length[0]), order)
                        end = items.end
                    else:
                        items = self._get(offs + 12, number, length[0])
                        end = offs + 12 + items.nbytes
                    self._push_field(ArrayField(start, name, [*head, item_type, length, items], [5],
                                                [GGUFValueType.ARRAY, kind]), skip_sum=True)
                    offs = end
                    continue
            size, parts, data, types = self._get_field_parts(offs, value_type[0])
            self._push_field(ReaderField(start, name, head + parts, [i + len(head) for i in data], types),
                             skip_sum=True)
            offs += size
        return offs


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
