"""ChunkHeader: what a receiver needs to place (or count) one chunk, and its binary encoding.

Wire format (little-endian): a fixed struct
`magic "PDKV", protocol version u16, flags u8 (1 last, 2 aux), k u8, room u64, seq u32, n u32,
first_token_id i64, first_logprob f64, cached_tokens i64`, then the first token's k top
alternatives (k int32 ids, then k float64 logprobs), then the descriptors as n rows of four
int32 `(src_page, dst_page, num_pages, pos)`. Decoding is strict: wrong magic or version,
unknown flags, k over MAX_TOP_LOGPROBS, a length that is not exactly the struct plus the
alternatives plus n rows, or aux data on a chunk that is not the last are rejected with
ValueError before anything looks at the descriptors; the receiver then validates every row
against the room's registration (descriptors.validate_dst).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from pdserve.kvtransfer.aux import MAX_TOP_LOGPROBS, AuxData
from pdserve.kvtransfer.fingerprint import PROTOCOL_VERSION

MAGIC = b"PDKV"
_HEAD = struct.Struct("<4sHBBQIIqdq")
_LAST, _AUX = 1, 2
_ROW = 4 * 4  # four int32 per descriptor
_TOP = 4 + 8  # one int32 id and one float64 logprob per top alternative
MAX_DESCS = 1 << 22  # far above any real chunk (a 4M-page pool); bounds a forged n
_I32 = np.iinfo(np.int32)


@dataclass(frozen=True, eq=False)
class ChunkHeader:
    room: int
    seq: int  # chunk number within the room
    descs: np.ndarray  # int64 [n, 4]: src_page, dst_page, num_pages, pos (descriptors.py)
    last: bool
    aux: AuxData | None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ChunkHeader):
            return NotImplemented
        return (self.room, self.seq, self.last, self.aux) == (
            other.room, other.seq, other.last, other.aux) and np.array_equal(
            self.descs, other.descs)

    __hash__ = None  # type: ignore[assignment]

    def to_bytes(self) -> bytes:
        d = np.asarray(self.descs, dtype=np.int64).reshape(-1, 4)
        if d.size and (d.min() < _I32.min or d.max() > _I32.max):
            raise ValueError("descs: page numbers must fit in int32")
        if self.aux is not None and not self.last:
            raise ValueError("aux: only the last chunk carries aux data")
        aux = self.aux or AuxData(0, 0.0, 0)
        k = len(aux.top_ids)
        flags = (_LAST if self.last else 0) | (_AUX if self.aux is not None else 0)
        head = _HEAD.pack(MAGIC, PROTOCOL_VERSION, flags, k, self.room, self.seq, len(d),
                          aux.first_token_id, aux.first_logprob, aux.cached_tokens)
        top = np.asarray(aux.top_ids, dtype="<i4").tobytes() + \
            np.asarray(aux.top_logprobs, dtype="<f8").tobytes()
        return head + top + d.astype("<i4").tobytes()

    @classmethod
    def from_bytes(cls, raw: bytes | memoryview) -> ChunkHeader:
        if len(raw) < _HEAD.size:
            raise ValueError(f"chunk header: {len(raw)} bytes, need at least {_HEAD.size}")
        magic, version, flags, k, room, seq, n, tok, logprob, cached = _HEAD.unpack_from(raw)
        if magic != MAGIC:
            raise ValueError(f"chunk header: bad magic {magic!r}")
        if version != PROTOCOL_VERSION:
            raise ValueError(f"chunk header: protocol version {version}, expected "
                             f"{PROTOCOL_VERSION}")
        if flags & ~(_LAST | _AUX):
            raise ValueError(f"chunk header: unknown flags {flags:#x}")
        last, has_aux = bool(flags & _LAST), bool(flags & _AUX)
        if k > MAX_TOP_LOGPROBS or (k and not has_aux):
            raise ValueError(f"chunk header: {k} top alternatives")
        rows_at = _HEAD.size + k * _TOP
        if n > MAX_DESCS or len(raw) != rows_at + n * _ROW:
            raise ValueError(f"chunk header: {len(raw)} bytes for {n} descriptors")
        if has_aux and not last:
            raise ValueError("chunk header: aux data on a chunk that is not the last")
        aux = None
        if has_aux:
            ids = np.frombuffer(raw, dtype="<i4", count=k, offset=_HEAD.size)
            lps = np.frombuffer(raw, dtype="<f8", count=k, offset=_HEAD.size + 4 * k)
            aux = AuxData(tok, logprob, cached, tuple(ids.tolist()), tuple(lps.tolist()))
        d = np.frombuffer(raw, dtype="<i4", count=n * 4, offset=rows_at)
        return cls(room, seq, d.astype(np.int64).reshape(n, 4), last, aux)
