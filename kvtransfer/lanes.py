"""KV between tensor-parallel workers of different sizes: layouts, lanes and the parts of a chunk.

A worker's KV lives in one page-major pool per tensor-parallel rank, each holding some of the
model's KV heads, all with the same page indices. `KVLayout` lists per rank the first head and
how many (rank 0 of a worker maps every rank's pool, so transfers run there). Moving a page from
prefill to decode means: each decode rank receives, for that page, the heads it holds, from the
prefill ranks that hold them. `plan_lanes(prefill, decode)` plans this once per peer, at the
handshake: one lane per decode rank, made of pieces (a prefill rank, a head range of its pool,
where those heads land in the decode rank's pool).

A lane whose one piece is a whole prefill pool landing as a whole decode pool (same TP size, or
TP 1 on both sides) moves pages as they are: one descriptor per run of pages. Otherwise a
one-sided engine (shm, cuda_ipc) copies each piece's heads of each run of pages straight into
the decode rank's mapped pool (a strided copy per run and piece); for a message engine (tcp)
`PartBuilder` gathers the lane's heads of a chunk's pages into a staging buffer laid out as the
decode rank's pages (kernels/page_copy.copy_heads on the host, kernels/head_copy.py on a GPU),
which then moves as whole pages: one descriptor per run of destination pages, never one per
head. A chunk's parts go together (one message, or every one-sided write before the chunk's
notification), so a room completes only when every rank's part arrived.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.kvtransfer.descriptors import NUM, SRC


class LayoutError(ValueError):
    """Two workers' KV layouts cannot be mapped onto each other (the message names both)."""


@dataclass(frozen=True)
class KVLayout:
    num_kv_heads: int  # the model's
    ranks: tuple[tuple[int, int], ...]  # per rank: (first KV head, count)

    @classmethod
    def single(cls, num_kv_heads: int) -> KVLayout:
        return cls(num_kv_heads, ((0, num_kv_heads),))

    @property
    def tp(self) -> int:
        return len(self.ranks)

    def describe(self) -> str:
        heads = " | ".join(str(s) if n == 1 else f"{s}-{s + n - 1}" for s, n in self.ranks)
        return f"tp={self.tp} (kv heads {heads} of {self.num_kv_heads})"


@dataclass(frozen=True)
class Piece:
    """Heads [src_head, src_head + num_heads) of prefill rank `src_rank`'s pool land as heads
    [dst_head, dst_head + num_heads) of the lane's decode rank's pool."""

    src_rank: int
    src_head: int
    dst_head: int
    num_heads: int


@dataclass(frozen=True)
class Lane:
    dst_rank: int
    dst_heads: int  # KV heads in the decode rank's pool
    pieces: tuple[Piece, ...]
    direct: int | None  # prefill rank whose whole pool is this lane's whole pool, if any


def identity(lanes: tuple[Lane, ...]) -> bool:
    """One lane fed whole from prefill rank 0: exactly the transfer without tensor parallelism."""
    return len(lanes) == 1 and lanes[0].direct == 0


def _holders(layout: KVLayout) -> dict[int, tuple[int, int]]:
    """KV head -> (rank, index in that rank's pool): the first rank holding it."""
    held: dict[int, tuple[int, int]] = {}
    for rank, (start, count) in enumerate(layout.ranks):
        for i in range(count):
            held.setdefault(start + i, (rank, i))
    return held


def plan_lanes(src: KVLayout, dst: KVLayout) -> tuple[Lane, ...]:
    """The lanes that feed `dst` (decode) from `src` (prefill); LayoutError naming both."""
    both = f"prefill {src.describe()}, decode {dst.describe()}"
    if src.num_kv_heads != dst.num_kv_heads:
        raise LayoutError(f"kv layout: different KV head counts: {both}")
    for layout in (src, dst):
        for start, count in layout.ranks:
            if count <= 0 or start < 0 or start + count > layout.num_kv_heads:
                raise LayoutError(f"kv layout: a rank's heads {start}+{count} lie outside the "
                                  f"model's: {both}")
    held = _holders(src)
    missing = sorted(set(range(src.num_kv_heads)) - set(held))
    if missing:
        raise LayoutError(f"kv layout: no prefill rank holds KV heads {missing}: {both}")
    lanes = []
    for d, (start, count) in enumerate(dst.ranks):
        pieces: list[Piece] = []
        for h in range(count):
            rank, i = held[start + h]
            last = pieces[-1] if pieces else None
            if last is not None and last.src_rank == rank and \
                    last.src_head + last.num_heads == i:
                pieces[-1] = Piece(rank, last.src_head, last.dst_head, last.num_heads + 1)
            else:
                pieces.append(Piece(rank, i, h, 1))
        whole = (len(pieces) == 1 and pieces[0].src_head == 0
                 and src.ranks[pieces[0].src_rank][1] == count)
        lanes.append(Lane(d, count, tuple(pieces), pieces[0].src_rank if whole else None))
    return tuple(lanes)


@dataclass(frozen=True)
class Part:
    """What one decode rank (`lane`) receives of a chunk from `src` (a prefill pool, or a
    staging buffer laid out as the lane's pages) per `descs` row: whole pages, or with `heads`
    = (src_head, dst_head, num_heads) that range of heads of each page."""

    lane: int
    src: torch.Tensor
    descs: np.ndarray  # [n, 4] (src_page in `src`, dst_page, num_pages, pos)
    heads: tuple[int, int, int] | None = None


@dataclass
class PartBuilder:
    """A chunk's parts for one peer's lanes, gathered from this worker's pools (`pools[r]`,
    rank r's). Staging buffers are kept per lane and reused: the transfer thread alone uses a
    builder, and a chunk's writes finish before the next chunk is built."""

    pools: list[torch.Tensor]
    lanes: tuple[Lane, ...]
    _staging: dict[int, torch.Tensor] = field(default_factory=dict)

    def parts(self, descs: np.ndarray, staged: bool) -> list[Part]:
        """Whole-page parts, one per lane (`staged`: heads gathered here), or for engines that
        copy head ranges themselves one part per piece, in lane order."""
        out = []
        for lane in self.lanes:
            if lane.direct is not None:
                out.append(Part(lane.dst_rank, self.pools[lane.direct], descs))
                continue
            if not staged:
                out += [Part(lane.dst_rank, self.pools[p.src_rank], descs,
                             (p.src_head, p.dst_head, p.num_heads)) for p in lane.pieces]
                continue
            num = descs[:, NUM]
            offsets = np.cumsum(num) - num  # pages of the chunk, packed in descriptor order
            packed_descs = descs.copy()
            packed_descs[:, SRC] = offsets
            buf = self._buffer(lane, int(num.sum()))
            if buf.device.type == "cpu" and all(
                    self.pools[p.src_rank].device.type == "cpu" for p in lane.pieces):
                runs = np.stack([descs[:, SRC], offsets, num], axis=1).tolist()
                assemble_pages([(head_bytes(buf), [
                    (head_bytes(self.pools[p.src_rank]), p.src_head, p.dst_head, p.num_heads)
                    for p in lane.pieces])], None, runs)
            else:
                src_pages = _pages(descs[:, SRC], num)
                packed = list(range(int(num.sum())))
                for p in lane.pieces:
                    _copy_heads(self.pools[p.src_rank], buf, src_pages, packed, p.src_head,
                                p.dst_head, p.num_heads)
            out.append(Part(lane.dst_rank, buf, packed_descs))
        return out

    def _buffer(self, lane: Lane, pages: int) -> torch.Tensor:
        buf = self._staging.get(lane.dst_rank)
        if buf is None or buf.shape[0] < pages:
            ref = self.pools[lane.pieces[0].src_rank]
            shape = (max(pages, 2 * (buf.shape[0] if buf is not None else 0)),
                     *ref.shape[1:4], lane.dst_heads, ref.shape[5])
            buf = torch.empty(shape, dtype=ref.dtype, device=ref.device)
            self._staging[lane.dst_rank] = buf
        return buf


def head_bytes(pool: torch.Tensor) -> np.ndarray:
    """A pool as bytes shaped [pages, rows, heads, head_bytes]: one row per layer, K/V, token."""
    p = pool.shape
    return pool.view(torch.uint8).numpy().reshape(p[0], p[1] * p[2] * p[3], p[4], -1)


HostLane = tuple[np.ndarray, list[tuple[np.ndarray, int, int, int]]]  # dst, pieces


def assemble_pages(lanes: list[HostLane], _: object, runs: list[list[int]]) -> None:
    """Pages of each lane's `dst` ([pages, rows, heads, head_bytes]) from head ranges of
    source pools, one page at a time for every lane (a source page is read from memory once
    and stays in cache for the others). A lane fed whole by one source range copies it
    straight; several ranges that tile the destination's heads are interleaved by torch.cat
    into the destination page, which writes it in order, row by row, each source's heads in
    turn: within 10% of a whole-page memcpy (SmolLM2's 3 -> 1 gather, one thread), where writing
    the destination in 128-byte pieces from each source in turn, or interleaving in a
    cache-sized buffer and copying that, ran 30-40% slower."""
    plans = []
    for dst, pieces in lanes:
        order = sorted(pieces, key=lambda p: p[2])  # plan_lanes' pieces tile the lane's heads
        if len(order) == 1:
            plans.append((dst, order[0], None))
        else:
            plans.append((_as_words(dst), None,
                          [(_as_words(src), s_head, num) for src, s_head, _, num in order]))
    for s, d, n in runs:
        for i in range(n):
            for dst, whole, pieces in plans:
                if pieces is None:
                    src, s_head, _, num = whole
                    np.copyto(dst[d + i], src[s + i, :, s_head:s_head + num])
                else:
                    torch.cat([src[s + i, :, h:h + num] for src, h, num in pieces], dim=1,
                              out=dst[d + i])


def _as_words(a: np.ndarray) -> torch.Tensor:
    """Bytes [..., head_bytes] as a tensor of float32 words where they divide (torch.cat's
    serial kernel, the fast one, runs for floating types only; copying words is bit-exact)."""
    t = torch.from_numpy(a)
    return t.view(torch.float32) if a.shape[-1] % 4 == 0 else t


def _pages(first: np.ndarray, num: np.ndarray) -> list[int]:
    """Every page of runs starting at `first` of `num` pages, in order."""
    offs = np.arange(int(num.sum())) - np.repeat(np.cumsum(num) - num, num)
    return (np.repeat(first, num) + offs).tolist()


def _copy_heads(src: torch.Tensor, dst: torch.Tensor, src_pages: list[int],
                dst_pages: list[int], src_head: int, dst_head: int, num_heads: int) -> None:
    """The head copy: the Triton kernel where both sides are on one GPU, else torch's."""
    if src.is_cuda and src.device == dst.device:
        from pdserve.kernels.head_copy import copy_heads
    else:
        from pdserve.kernels.page_copy import copy_heads
    copy_heads(src, dst, src_pages, dst_pages, src_head, dst_head, num_heads)
