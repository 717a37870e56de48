"""The tensors of a GGUF file, found without decoding its metadata.

`gguf.GGUFReader` builds a numpy view for every metadata value on open, and a tokenizer's
vocabulary and merges are ~100,000 strings: opening the embedded model's 98 MB file took 6.2 s on
an AMD EPYC Zen 3 core (and about 1.5 s on a Xeon), at every start of a q4_1/int4 target. The
tensors need only the metadata's *length*: this reads each value's size and steps over it (the
strings of an array one length at a time), then the tensor directory, and maps the data.

Layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64 metadata
count; per metadata entry a string key, a u32 value type and the value (an array: u32 element
type, u64 count, the elements; a string: u64 length, the bytes); per tensor a string name, u32
dims, u64 dims (innermost first), u32 ggml type, u64 offset into the data section, which starts at
the next multiple of `general.alignment` (default 32) after the directory.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_SCALAR_BYTES = {GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1,
                 GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
                 GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
                 GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8}
DEFAULT_ALIGNMENT = 32


@dataclass
class GGUFTensor:
    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]   # GGUF order, innermost first: a linear's is (in, out)
    data: np.ndarray         # uint8 [outer dims..., bytes per innermost row], read-only, mapped


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values if len(values) > 1 else values[0]

    def string(self) -> str:
        n = self.take("Q")
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos]).decode("utf-8")

    def skip_value(self, kind: int) -> None:
        if kind == GGUFValueType.STRING:
            n = self.take("Q")   # not `self.pos += self.take(...)`: that reads pos before take moves it
            self.pos += n
        elif kind == GGUFValueType.ARRAY:
            item, count = self.take("IQ")
            if item in _SCALAR_BYTES:
                self.pos += count * _SCALAR_BYTES[item]
            else:
                for _ in range(count):
                    self.skip_value(item)
        else:
            self.pos += _SCALAR_BYTES[GGUFValueType(kind)]


def read_tensors(path: str) -> list[GGUFTensor]:
    """Every tensor of the GGUF at `path`, its data a read-only map of the file's bytes."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(data))
    magic, version, n_tensors, n_meta = cur.take("4sIQQ")
    if magic != b"GGUF" or version < 2:
        raise ValueError(f"{path}: not a GGUF file of version 2 or later")
    alignment = DEFAULT_ALIGNMENT
    for _ in range(n_meta):
        key, kind = cur.string(), cur.take("I")
        if key == "general.alignment" and kind == GGUFValueType.UINT32:
            alignment = cur.take("I")
        else:
            cur.skip_value(kind)
    directory = []
    for _ in range(n_tensors):
        name, n_dims = cur.string(), cur.take("I")
        shape = tuple(int(d) for d in cur.take("Q" * n_dims)) if n_dims > 1 else (int(cur.take("Q")),)
        kind, offset = cur.take("IQ")
        directory.append((name, GGMLQuantizationType(kind), shape, offset))
    start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, kind, shape, offset in directory:
        block, block_bytes = GGML_QUANT_SIZES[kind]
        row_bytes = shape[0] // block * block_bytes
        rows = int(np.prod(shape[1:], dtype=np.int64))
        raw = data[start + offset:start + offset + rows * row_bytes]
        tensors.append(GGUFTensor(name, kind, shape, raw.reshape(*reversed(shape[1:]), row_bytes)))
    return tensors
