"""What every checkpoint format shares: the error type and checked, streamed weight copying."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from tqdm.auto import tqdm

from pdserve.engine.models import LlamaForCausalLM

# (file the tensor lives in, checkpoint tensor name in HF naming, loads the tensor on demand)
TensorSource = tuple[str, str, Callable[[], torch.Tensor]]


class ModelLoadError(ValueError):
    """A checkpoint cannot be loaded; the message names the file and tensor at fault."""


def fill_weights(
    model: LlamaForCausalLM, sources: Iterable[TensorSource], where: str, desc: str
) -> None:
    """Copies every tensor the model needs from `sources`, checking names and shapes.

    Tensors are read one at a time (a lazy callable each), so peak host memory is the model plus
    one tensor, not the model plus the checkpoint. Tensors the model does not use (rotary
    caches, an lm_head duplicated into a tied checkpoint) are skipped.
    """
    expected = model.weight_shapes()
    seen: set[str] = set()
    bar = tqdm(total=len(expected), desc=desc, unit="tensor", leave=False)

    def checked() -> Iterator[tuple[str, torch.Tensor]]:
        for file, name, read in sources:
            if name not in expected:
                continue
            if name in seen:
                raise ModelLoadError(f"{file}: tensor {name!r} appears more than once")
            tensor = read()
            if tuple(tensor.shape) != expected[name]:
                raise ModelLoadError(
                    f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {expected[name]}")
            seen.add(name)
            bar.update(1)
            yield name, tensor

    try:
        model.load_weights(checked())
    finally:
        bar.close()
    missing = [n for n in expected if n not in seen]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelLoadError(f"{where}: missing tensor(s) {shown}{more}")
