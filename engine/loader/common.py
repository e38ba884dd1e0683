"""What every checkpoint format shares: the error type and checked, streamed weight copying."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

import torch
from tqdm.auto import tqdm

from pdserve.engine.models import LlamaForCausalLM

# (dim, start, length): the part of a checkpoint tensor one tensor-parallel rank reads
Slice = tuple[int, int, int]


class LazyTensor(Protocol):
    """A checkpoint tensor not read yet: its shape from the file's header, its data on demand."""

    shape: tuple[int, ...]

    def read(self, part: Slice | None = None) -> torch.Tensor:
        """The whole tensor, or only `part` of it (read from the file as far as the format
        allows)."""
        ...


# (file the tensor lives in, checkpoint tensor name in HF naming, the tensor)
TensorSource = tuple[str, str, LazyTensor]


class ModelLoadError(ValueError):
    """A checkpoint cannot be loaded; the message names the file and tensor at fault."""


def fill_weights(
    model: LlamaForCausalLM, sources: Iterable[TensorSource], where: str, desc: str
) -> None:
    """Copies every tensor the model needs from `sources`, checking names and shapes.

    Tensors are read one at a time, so peak host memory is the model plus one tensor, not the
    model plus the checkpoint; a tensor-parallel rank reads only its slice of each. Tensors the
    model does not use (rotary caches, an lm_head duplicated into a tied checkpoint) are skipped.
    """
    expected = model.weight_shapes()
    parts = model.weight_slices()
    seen: set[str] = set()
    bar = tqdm(total=len(expected), desc=desc, unit="tensor", leave=False)

    def checked() -> Iterator[tuple[str, torch.Tensor]]:
        for file, name, lazy in sources:
            if name not in expected:
                continue
            if name in seen:
                raise ModelLoadError(f"{file}: tensor {name!r} appears more than once")
            if tuple(lazy.shape) != expected[name]:
                raise ModelLoadError(
                    f"{file}: tensor {name!r} has shape {tuple(lazy.shape)}, "
                    f"expected {expected[name]}")
            seen.add(name)
            bar.update(1)
            yield name, lazy.read(parts[name])

    try:
        model.load_weights(checked(), sliced=True)
    finally:
        bar.close()
    missing = [n for n in expected if n not in seen]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelLoadError(f"{where}: missing tensor(s) {shown}{more}")


def narrow(tensor: torch.Tensor, part: Slice | None) -> torch.Tensor:
    return tensor if part is None else tensor.narrow(*part)
