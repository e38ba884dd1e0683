"""`--load-format dummy`: a model built from its config with random weights; no checkpoint is
read. For benchmarks and tests of everything around the model (serving paths, scheduling, KV
transfer) at a real model's shape, on machines that have no weights.

Weights come from one seeded generator in parameter order, so every worker of a cluster
(prefill and decode alike) builds the same model on the same kind of device, and a decode
worker continues a prefill worker's KV as one model would. Matrices are N(0, 1/in_features),
norms 1 and biases 0: each projection keeps its input's scale, RMSNorm resets it at every
layer, and the residual stream grows like the square root of the depth, so activations and
logits (of order 1) stay finite in bf16 at 80 layers.

A shape served with a smaller tokenizer (`--model-shape llama3-8b`: 128,256 rows, SmolLM2's
49,152 tokens) keeps its full head, so the lm_head costs what the real model's does, but the
rows past the tokenizer's vocabulary are zero: their logit is 0 against a maximum of about 4
among the others, so greedy decoding never picks a token the tokenizer cannot show (such a
token streams no text, and a client timing text chunks would see none of its steps). Rows that
pad a tensor-parallel shard are zero as with a checkpoint.
"""

from __future__ import annotations

import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.models import LlamaForCausalLM
from pdserve.engine.tp.group import TPGroup

DUMMY_SEED = 0


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int = DUMMY_SEED) -> None:
    """Fill every parameter of `model` in place (a tied head is drawn once, as the embedding)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.fill_(0.0 if name.endswith("bias") else 1.0)
        else:
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)


@torch.no_grad()
def zero_rows_from(model: LlamaForCausalLM, first: int) -> None:
    """Zero this rank's embedding and head rows of token ids >= `first` (padding included)."""
    shard = model.shard
    local = min(max(first - shard.vocab_start, 0), shard.vocab_len)
    for w in {id(p): p for p in (model.embed_tokens, model.lm_head)}.values():
        w[local:].zero_()


def load_dummy_model(config: ModelConfig, dtype: torch.dtype, device: torch.device,
                     tp: TPGroup | None = None, seed: int = DUMMY_SEED,
                     text_vocab: int | None = None) -> tuple[LlamaForCausalLM, ModelConfig]:
    """`text_vocab`: the tokenizer's size where it is smaller than the model's vocabulary."""
    model = LlamaForCausalLM(config, dtype=dtype, device=device, tp=tp)
    init_dummy_weights(model, seed + (tp.rank if tp is not None else 0))
    zero_rows_from(model, min(config.vocab_size, text_vocab or config.vocab_size))
    return model.eval(), config
