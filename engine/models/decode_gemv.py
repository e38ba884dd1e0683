"""A one-token decode step (batch 1) through the fused matrix-vector kernels of kernels/gemv.py.

Per layer, four launches besides attention instead of nine: the input norm, qkv projection,
RoPE and KV store in one; the attention backend reads the pool (k = v = None: already stored);
o_proj with the residual add; gate_up with the post-attention norm in front and SiLU-mul
behind; down_proj with the residual add. The residual stream is carried whole (each block's
output added at once), not in the unfused path's (output, residual) pair, so the norms read
one vector. The final norm rides on the lm_head GEMV.

Same model, same weights: the numbers differ from the unfused path only by rounding (one fp32
accumulation per output instead of a bf16 rounding after each op); the GPU tests compare both
paths' logits and greedy tokens.

Under tensor parallelism each GEMV runs over this rank's shard; the two closing projections add
the residual on rank 0 only and an all-reduce sums the partial results (as row_parallel does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdserve.engine.forward_batch import ForwardBatch, ForwardMode
from pdserve.engine.models.fused import kernels
from pdserve.engine.tp.group import TPGroup

if TYPE_CHECKING:
    from pdserve.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM


def applies(model: LlamaForCausalLM, fb: ForwardBatch) -> bool:
    """Whether `fb` takes this path: one DECODE token, fused kernels on, the model on CUDA
    with row-major matmul weights (the kernels read column-major ones up to 7x slower than
    cuBLAS does, docs/performance.md)."""
    return (fb.mode == ForwardMode.DECODE and fb.num_tokens == 1
            and model.fusion.use_decode_gemv(model.embed_tokens)
            and (not model.layers or model.layers[0].mlp.down_proj.stride(-1) == 1))


def _layer(layer: LlamaDecoderLayer, r: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           fb: ForwardBatch) -> torch.Tensor:
    """The residual stream after `layer`, for one token."""
    ops = kernels()
    attn, mlp = layer.self_attn, layer.mlp
    pool, i = fb.kv_pool, attn.layer_id
    q = ops.qkv_rope_store(r, attn.qkv_proj, attn.qkv_bias, layer.input_layernorm.weight,
                           layer.input_layernorm.eps, cos, sin, pool.k_view(i), pool.v_view(i),
                           fb.out_cache_loc, attn.num_heads, attn.num_kv_heads)
    o = fb.attn_backend.forward(i, q, None, None, fb, attn.scale)
    r = _closing(o.reshape(1, attn.q_size), attn.o_proj, r, attn.tp)
    norm = layer.post_attention_layernorm
    act = ops.gemv(r, mlp.gate_up_proj, norm_weight=norm.weight, eps=norm.eps, silu_mul=True)
    return _closing(act, mlp.down_proj, r, mlp.tp)


def _closing(x: torch.Tensor, w: torch.Tensor, r: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """r + x @ w^T; w split by input columns under TP (residual on rank 0, then all-reduce)."""
    if not tp.active:
        return kernels().gemv(x, w, residual=r)
    return tp.all_reduce_(kernels().gemv(x, w, residual=r if tp.rank == 0 else None))


def forward(model: LlamaForCausalLM, fb: ForwardBatch) -> torch.Tensor:
    """fp32 logits [1, vocab] of the one new token."""
    r = model.embed(fb.input_ids)
    cos, sin = model.rotary.cos_sin_half(fb.positions)
    for layer in model.layers:
        r = _layer(layer, r, cos, sin, fb)
    return model.gather_logits(kernels().gemv(
        r, model.lm_head, norm_weight=model.norm.weight, eps=model.norm.eps,
        out_dtype=torch.float32))
