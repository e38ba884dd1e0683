"""ScheduleBatch: the requests of one forward pass and the tensors the model needs for it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.forward_batch import ForwardBatch, ForwardMode, HostBatch
from pdserve.engine.req import Req


@dataclass
class ExtendEntry:
    """`req` computes fill_ids[start : start + num_tokens] in this pass."""

    req: Req
    start: int
    num_tokens: int

    @property
    def completes(self) -> bool:
        return self.start + self.num_tokens == self.req.seq_len


@dataclass
class ScheduleBatch:
    mode: ForwardMode
    reqs: list[Req]
    entries: list[ExtendEntry] | None = None  # EXTEND only

    def build(self, req_to_token: torch.Tensor, kv_pool, attn_backend,
              device: torch.device) -> ForwardBatch:
        """Gather ids, positions and slots from the ReqToTokenPool table (CPU) to `device`.

        Slots for the new tokens must already be written to the table rows.
        """
        return self.host_batch(req_to_token).to_forward_batch(kv_pool, attn_backend, device)

    def host_batch(self, req_to_token: torch.Tensor) -> HostBatch:
        """The forward inputs on the host, packed (see HostBatch)."""
        if self.mode == ForwardMode.EXTEND:
            assert self.entries is not None
            starts = [e.start for e in self.entries]
            lens = [e.num_tokens for e in self.entries]
            ids: list[int] = []
            for e in self.entries:
                ids.extend(e.req.fill_ids[e.start:e.start + e.num_tokens])
        else:
            starts = [r.seq_len - 1 for r in self.reqs]
            lens = [1] * len(self.reqs)
            ids = [r.output_ids[-1] if r.output_ids else r.input_ids[-1] for r in self.reqs]
        seq_lens = [s + n for s, n in zip(starts, lens)]
        rows = [r.req_pool_idx for r in self.reqs]
        starts_t, lens_t, seq_t = (torch.tensor(v, dtype=torch.int64)
                                   for v in (starts, lens, seq_lens))
        if self.mode == ForwardMode.EXTEND:
            kv_indices = torch.cat([req_to_token[row, :sl] for row, sl in zip(rows, seq_lens)])
            out_loc = torch.cat([req_to_token[row, s:s + n]
                                 for row, s, n in zip(rows, starts, lens)])
            positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
        else:
            # One token per request: the rows' prefixes gathered with one mask, not a slice
            # per request (those slices took ~1.7 ms of a batch-64 step's host time, under
            # cProfile).
            positions = starts_t
            block = req_to_token[rows, :max(seq_lens, default=0)]
            kv_indices = block[torch.arange(block.shape[1]) < seq_t[:, None]]
            out_loc = block[torch.arange(len(rows)), positions]
        indptr = torch.zeros(len(rows) + 1, dtype=torch.int64)
        torch.cumsum(seq_t, 0, out=indptr[1:])
        # Every index tensor in one host buffer: one upload, then split on the device.
        parts = [torch.tensor(ids, dtype=torch.int64), positions, out_loc, seq_t, starts_t,
                 lens_t, indptr, kv_indices]
        return HostBatch(self.mode, len(rows), len(ids), torch.cat(parts))
