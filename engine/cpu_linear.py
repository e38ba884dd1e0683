"""oneDNN-prepacked fp32 linear weights for small-batch (decode) matmuls on CPU.

Why: `F.linear` on CPU calls MKL's sgemm, which repacks the weight on every call; with a few
rows of activations (a decode step) that costs as much as the multiply, and with two threads
MKL splits a 2-8 row product badly. oneDNN packs a weight once (`_reorder_linear_weight`) and
reuses it. Measured on a 2-core AVX2 host, two threads, over SmolLM2-135M's 30 layers of
weights (cold in cache, as in a real step): 1.5x less time at 8 rows, 1.3x at 32, 1.1x at 128;
the [49152, 576] output head 1.4x at 32 rows and 1.9x at 8 (one thread). From ~256 rows on
(prefill) MKL is as fast or faster, so larger batches keep `F.linear`.

How it attaches without changing the model code: `pack_linear_weights(model)` swaps 2-D
parameters for `PackedLinearWeight`, a Parameter subclass sharing the original storage. Its
`__torch_function__` sends `F.linear(x, weight)` with at most `max_rows` rows to the packed
copy, made on first such use (so a weight only ever used as an embedding table is never
packed); every other use of the tensor (embedding lookups of a tied head, `.data`) sees the
plain weight. Row counts are padded up to a few buckets (`bucket_rows`), and the first use of
a weight shape builds oneDNN's kernels for all of them at once, so a server's memory does not
creep up as new batch sizes appear. Cost: a second copy of every weight that decode multiplies
by, and ~0.5 MiB per (shape, bucket) of oneDNN kernels. Results agree with MKL's to fp32
rounding, not bit for bit.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_MAX_ROWS = 128  # decode-sized batches; larger ones (prefill) stay on MKL


def packed_linear_supported() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def bucket_rows(rows: int) -> int:
    """Rows padded up to 1, 2, 4, 8, then a multiple of 8 up to 64, then of 16. oneDNN builds
    (JIT-compiles) and caches one kernel per shape, ~0.5 MiB each: one per row count would grow
    a server's memory by hundreds of MiB; these buckets keep it to ~15 per weight shape, for at
    most 15 padded rows of extra work."""
    if rows <= 8:
        return 1 << (rows - 1).bit_length()
    step = 8 if rows <= 64 else 16
    return -(-rows // step) * step


def row_buckets(max_rows: int) -> list[int]:
    return sorted({bucket_rows(r) for r in range(1, max_rows + 1)})


class PackedLinearWeight(nn.Parameter):
    """A frozen fp32 CPU weight [out, in] plus, once used, its oneDNN-packed copy."""

    packed: torch.Tensor | None
    max_rows: int
    # (shape, has bias, max_rows) whose oneDNN kernels this process has built: oneDNN's cache is
    # process-wide and keyed by shape, so weights of one shape share them.
    _warmed: ClassVar[set[tuple]] = set()

    def __new__(cls, weight: torch.Tensor, max_rows: int = DEFAULT_MAX_ROWS
                ) -> PackedLinearWeight:
        w = weight.detach()
        if w.dim() != 2 or w.dtype != torch.float32 or w.device.type != "cpu":
            raise ValueError(f"weight: need a 2-D fp32 CPU tensor, got {tuple(w.shape)} "
                             f"{w.dtype} on {w.device}")
        self = torch.Tensor._make_subclass(cls, w, False)
        self.packed = None
        self.max_rows = max_rows
        return self

    def __reduce_ex__(self, proto):  # noqa: ANN001, ANN204 - pickles as the plain weight
        return nn.Parameter(self.as_subclass(torch.Tensor), False).__reduce_ex__(proto)

    def __deepcopy__(self, memo: dict) -> PackedLinearWeight:
        if id(self) not in memo:
            memo[id(self)] = type(self)(self.as_subclass(torch.Tensor).clone(), self.max_rows)
        return memo[id(self)]

    def pack(self, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The packed copy, made on first call. The first call for a weight shape also builds
        the kernels of every row bucket (one-time work, ~0.5 s for all of SmolLM2-135M's shapes
        on 2 cores), so memory is flat from the first request on rather than creeping up as
        new batch sizes appear."""
        if self.packed is None:
            with torch._C.DisableTorchFunctionSubclass():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(
                    self.as_subclass(torch.Tensor), None)
        key = (tuple(self.shape), bias is not None, self.max_rows)
        if key not in self._warmed:
            self._warmed.add(key)
            for rows in row_buckets(self.max_rows):
                torch.ops.mkldnn._linear_pointwise(
                    torch.zeros(rows, self.shape[1]), self.packed, bias, "none", [], "")
        return self.packed

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2 and type(args[1]) is cls:
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            rows = x.shape[0] if x.dim() == 2 else 0
            if (0 < rows <= w.max_rows and x.dtype == torch.float32 and x.is_cpu and w.is_cpu
                    and not x.requires_grad and type(x) is torch.Tensor
                    and (bias is None or type(bias) in (torch.Tensor, nn.Parameter))):
                padded = bucket_rows(rows)
                x = F.pad(x, (0, 0, 0, padded - rows)) if padded != rows else x.contiguous()
                out = torch.ops.mkldnn._linear_pointwise(x, w.pack(bias), bias, "none", [], "")
                return out[:rows]
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def pack_linear_weights(model: nn.Module, max_rows: int = DEFAULT_MAX_ROWS) -> list[str]:
    """Swap every 2-D fp32 CPU parameter for a PackedLinearWeight (one object per tensor, so
    tied weights stay tied). Returns the swapped names. Inference only: a packed copy does not
    follow later in-place updates of the weight."""
    if not packed_linear_supported():
        return []
    swapped: dict[int, PackedLinearWeight] = {}
    names = []
    for mod_name, mod in model.named_modules():
        for name, p in list(mod._parameters.items()):
            if p is None or isinstance(p, PackedLinearWeight) or p.dim() != 2 \
                    or p.dtype != torch.float32 or p.device.type != "cpu":
                continue
            if id(p) not in swapped:
                swapped[id(p)] = PackedLinearWeight(p, max_rows)
            mod._parameters[name] = swapped[id(p)]
            names.append(f"{mod_name}.{name}" if mod_name else name)
    return names
