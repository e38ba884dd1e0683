"""A lean GGUF container reader: metadata as plain Python values, tensors as mmap'd arrays.

The `gguf` package's GGUFReader builds numpy views for every element of every metadata array;
for a tokenizer of ~50k tokens and ~50k merges that alone takes seconds, paid at every worker
start. Here metadata is parsed with `struct` straight from the mapping and tensor data is never
copied until it is dequantized (still by `gguf.quants.dequantize`).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
# GGUF metadata value types -> struct format (8: string and 9: array are handled separately).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order (slowest dim first), i.e. GGUF's dims reversed
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # raw, as gguf.quants.dequantize expects it; a view into the file


class GGUFFile:
    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        if self._map[:4] != _MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        self._pos = 4
        version, num_tensors, num_kv = self._unpack("<IQQ")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        self.fields: dict[str, Any] = {}
        for _ in range(num_kv):
            key = self._string()
            (vtype,) = self._unpack("<I")
            self.fields[key] = self._value(vtype)
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            qtype, offset = self._unpack("<IQ")
            infos.append((name, dims, qtype, offset))
        align = int(self.fields.get("general.alignment", 32))
        data_start = -(-self._pos // align) * align
        self.tensors = [self._tensor(name, dims, qtype, data_start + offset)
                        for name, dims, qtype, offset in infos]

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        s = self._map[self._pos:self._pos + n].decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            itype, count = self._unpack("<IQ")
            if itype in _SCALARS:
                values = self._unpack(f"<{count}{_SCALARS[itype]}")
                return list(values)
            return [self._value(itype) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"unknown GGUF metadata type {vtype}")
        return self._unpack("<" + _SCALARS[vtype])[0]

    def _tensor(self, name: str, dims: tuple[int, ...], qtype: int, start: int) -> GGUFTensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        ttype = GGMLQuantizationType(qtype)
        shape = tuple(int(d) for d in reversed(dims))
        block, type_size = GGML_QUANT_SIZES[ttype]
        row = shape[-1] if shape else 1
        if row % block:
            raise ValueError(f"tensor {name!r}: row of {row} not a multiple of block {block}")
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        nbytes = rows * (row // block) * type_size
        if start + nbytes > len(self._map):
            raise ValueError(f"tensor {name!r} extends past the end of the file")
        plain = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
        if ttype in plain:
            data = np.frombuffer(self._map, plain[ttype], rows * row, start).reshape(shape)
        else:
            data = np.frombuffer(self._map, np.uint8, nbytes, start)
            data = data.reshape(*shape[:-1], row // block * type_size)
        return GGUFTensor(name, shape, ttype, data)
