"""Llama-family decoder (Llama 2/3/3.1, Qwen2/2.5, Mistral, SmolLM) over the paged KV pool.

Differences between the families are all in ModelConfig: q/k/v bias (Qwen2), rope scaling
(Llama 3.1), tied embeddings (SmolLM, small Qwen2), head_dim decoupled from hidden size.
Projections are fused (q/k/v into one matmul, gate/up into another) because on CPU and in
decode each matmul launch and each pass over the activations costs more than the FLOPs.

Tensor parallelism (`tp`, engine/tp/): each rank holds a TPShard of every weight. q/k/v and
gate/up are split by output rows (column-parallel: no communication), o_proj and down_proj by
input columns (row-parallel: one all-reduce each), the embedding and the output head by
vocabulary rows (the embedding's lookups summed by an all-reduce, the logits all-gathered).
Weights load sharded: `weight_slices()` says which slice of each checkpoint tensor a rank reads.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.forward_batch import ForwardBatch, ForwardMode
from pdserve.engine.models import decode_gemv
from pdserve.engine.models.fused import Fusion, kernels
from pdserve.engine.models.layers import RMSNorm, SwiGLUMLP, empty_param, row_parallel
from pdserve.engine.models.rope import RotaryEmbedding, apply_rope
from pdserve.engine.tp.group import TPGroup
from pdserve.engine.tp.layout import TPShard

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

Device = torch.device | str | None


class LlamaAttention(nn.Module):
    """Self-attention over this rank's heads (all of them without tensor parallelism)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, device: Device,
                 fusion: Fusion, tp: TPGroup, shard: TPShard):
        super().__init__()
        self.layer_id = layer_id
        self.fusion = fusion
        self.tp = tp
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        qkv_rows = self.q_size + 2 * self.kv_size
        self.qkv_proj = empty_param(qkv_rows, cfg.hidden_size, dtype=dtype, device=device)
        self.qkv_bias = (empty_param(qkv_rows, dtype=dtype, device=device)
                         if cfg.attention_bias else None)
        self.o_proj = empty_param(cfg.hidden_size, self.q_size, dtype=dtype, device=device)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The attention block's output; with `residual`, added into it in place by o_proj's
        GEMM (and `residual` returned)."""
        t = x.shape[0]
        qkv = F.linear(x, self.qkv_proj, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if fb.mode == ForwardMode.DECODE and self.fusion.use_rope_store(x):
            # RoPE and the KV store in one launch; attention then reads K/V from the pool only.
            pool = fb.kv_pool
            kernels().apply_rope_store_(q, k, v, cos, sin, pool.k_view(self.layer_id),
                                        pool.v_view(self.layer_id), fb.out_cache_loc)
            k = v = None
        elif self.fusion.use_fused(x):
            kernels().apply_rope_qk_(q, k, cos, sin)  # in place, on the qkv output
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = fb.attn_backend.forward(self.layer_id, q, k, v, fb, self.scale)
        return row_parallel(o.reshape(t, self.q_size), self.o_proj, residual, self.tp)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, device: Device,
                 fusion: Fusion, tp: TPGroup, shard: TPShard):
        super().__init__()
        self.fusion = fusion
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, device, fusion)
        self.self_attn = LlamaAttention(cfg, layer_id, dtype, device, fusion, tp, shard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, device, fusion)
        self.mlp = SwiGLUMLP(cfg.hidden_size, shard.intermediate_size, dtype, device, fusion,
                             tp)

    def forward(
        self, x: torch.Tensor | None, residual: torch.Tensor | None, cos: torch.Tensor,
        sin: torch.Tensor, fb: ForwardBatch,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(block output, residual stream before it is added): each block's closing residual
        add is done by the next norm, fused with it. Where the closing projections add into
        the stream in their GEMMs (`Fusion.use_residual_gemm`), (None, the stream with it added).
        x is None when the layer before returned so; residual is None in the first layer."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        elif x is None:
            h = self.input_layernorm(residual)
        else:
            h, residual = self.input_layernorm(x, residual)
        if self.fusion.use_residual_gemm(h):
            self.self_attn(h, cos, sin, fb, residual)
            self.mlp(self.post_attention_layernorm(residual), residual)
            return None, residual
        h, residual = self.post_attention_layernorm(self.self_attn(h, cos, sin, fb), residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """`forward(fb)` -> fp32 logits [B, vocab] of the last new token of each sequence.
    `fusion`: which fused kernel paths it takes (default: the PDSERVE_* switches). `tp`: this
    rank's tensor-parallel group (default: one rank, no collectives)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: Device = None,
                 fusion: Fusion | None = None, tp: TPGroup | None = None):
        super().__init__()
        if cfg.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture: unsupported {cfg.architecture!r} "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        self.config = cfg
        self.fusion = Fusion.from_envs() if fusion is None else fusion
        self.tp = tp if tp is not None else TPGroup()
        self.shard = shard = TPShard.of(cfg, self.tp.size, self.tp.rank)
        self.embed_tokens = empty_param(shard.vocab_per_rank, cfg.hidden_size, dtype=dtype,
                                        device=device)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, dtype, device, self.fusion, self.tp, shard)
            for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, self.fusion)
        # Tied: the output head is the embedding matrix itself (one tensor, one copy).
        self.lm_head = (self.embed_tokens if cfg.tie_word_embeddings else
                        empty_param(shard.vocab_per_rank, cfg.hidden_size, dtype=dtype,
                                    device=device))
        if shard.vocab_len < shard.vocab_per_rank:  # padding rows: never loaded, kept zero
            with torch.no_grad():
                for w in {id(p): p for p in (self.embed_tokens, self.lm_head)}.values():
                    w[shard.vocab_len:].zero_()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings of `input_ids` [T] -> [T, hidden]; vocab-parallel under TP: each rank
        looks up the ids in its rows (zeros elsewhere) and an all-reduce sums them."""
        if not self.tp.active:
            return F.embedding(input_ids, self.embed_tokens)
        local = input_ids - self.shard.vocab_start
        inside = (local >= 0) & (local < self.shard.vocab_len)
        h = F.embedding(torch.where(inside, local, 0), self.embed_tokens)
        return self.tp.all_reduce_(h.masked_fill_(~inside[:, None], 0))

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary slice of the logits [B, vocab_per_rank] -> [B, vocab]."""
        if not self.tp.active:
            return logits
        return self.tp.all_gather_last(logits)[:, :self.config.vocab_size]

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        if fb.num_tokens == 0:
            return torch.empty(0, self.config.vocab_size, device=self.embed_tokens.device)
        if decode_gemv.applies(self, fb):
            return decode_gemv.forward(self, fb)
        h = self.embed(fb.input_ids)
        # One cos/sin per forward, shared by every layer.
        if self.fusion.use_fused(h):
            cos, sin = self.rotary.cos_sin_half(fb.positions)
        else:
            cos, sin = self.rotary.cos_sin(fb.positions, h.dtype)
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin, fb)
        # Tokens are laid out sequence by sequence, so the last one of each is at cumsum - 1.
        last = torch.cumsum(fb.extend_lens, dim=0) - 1
        if residual is None:  # no layers
            h = self.norm(h[last])
        elif h is None:
            h = self.norm(residual[last])
        else:
            h, _ = self.norm(h[last], residual[last])
        return self.gather_logits(F.linear(h, self.lm_head)).float()

    def projection_weights(self) -> list[nn.Parameter]:
        """The matmul weights: per layer qkv, o, gate_up, down; and an untied lm_head."""
        ws = [w for layer in self.layers for w in (
            layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj)]
        return ws if self.config.tie_word_embeddings else [*ws, self.lm_head]

    # ---- weight loading: checkpoint (HF) names -> slices of our fused parameters ----

    def _targets(self) -> dict[str, WeightTarget]:
        """HF tensor name -> where (which rows of which parameter) it goes, and which slice of
        the checkpoint tensor this rank takes."""
        cfg, sh = self.config, self.shard
        d = cfg.head_dim
        t: dict[str, WeightTarget] = {}

        def whole(name: str, p: torch.Tensor) -> None:
            t[name] = WeightTarget(p, 0, p.shape[0], tuple(p.shape))

        def vocab(name: str, p: torch.Tensor) -> None:
            t[name] = WeightTarget(p, 0, sh.vocab_len, (cfg.vocab_size, cfg.hidden_size), 0,
                                   sh.vocab_start)

        vocab("model.embed_tokens.weight", self.embed_tokens)
        whole("model.norm.weight", self.norm.weight)
        if not cfg.tie_word_embeddings:
            vocab("lm_head.weight", self.lm_head)
        for i, layer in enumerate(self.layers):
            pre = f"model.layers.{i}."
            attn = layer.self_attn
            q, kv = attn.q_size, attn.kv_size
            # (rows in qkv_proj, rows of the checkpoint tensor: first, full count)
            rows = {"q": (0, q, sh.head_start * d, cfg.num_heads * d),
                    "k": (q, q + kv, sh.kv_head_start * d, cfg.num_kv_heads * d),
                    "v": (q + kv, q + 2 * kv, sh.kv_head_start * d, cfg.num_kv_heads * d)}
            for name, (lo, hi, start, full) in rows.items():
                t[f"{pre}self_attn.{name}_proj.weight"] = WeightTarget(
                    attn.qkv_proj, lo, hi, (full, cfg.hidden_size), 0, start)
                if attn.qkv_bias is not None:
                    t[f"{pre}self_attn.{name}_proj.bias"] = WeightTarget(
                        attn.qkv_bias, lo, hi, (full,), 0, start)
            t[f"{pre}self_attn.o_proj.weight"] = WeightTarget(
                attn.o_proj, 0, cfg.hidden_size, (cfg.hidden_size, cfg.num_heads * d), 1,
                sh.head_start * d)
            n, full_n = sh.intermediate_size, cfg.intermediate_size
            up_shape = (full_n, cfg.hidden_size)
            t[f"{pre}mlp.gate_proj.weight"] = WeightTarget(
                layer.mlp.gate_up_proj, 0, n, up_shape, 0, sh.intermediate_start)
            t[f"{pre}mlp.up_proj.weight"] = WeightTarget(
                layer.mlp.gate_up_proj, n, 2 * n, up_shape, 0, sh.intermediate_start)
            t[f"{pre}mlp.down_proj.weight"] = WeightTarget(
                layer.mlp.down_proj, 0, cfg.hidden_size, (cfg.hidden_size, full_n), 1,
                sh.intermediate_start)
            whole(f"{pre}input_layernorm.weight", layer.input_layernorm.weight)
            whole(f"{pre}post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
        return t

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor this model needs, by HF name, with its full shape."""
        return {name: t.shape for name, t in self._targets().items()}

    def weight_slices(self) -> dict[str, tuple[int, int, int] | None]:
        """By HF name: the (dim, start, length) slice of the checkpoint tensor that this rank
        reads, or None for the whole tensor."""
        return {name: t.slice for name, t in self._targets().items()}

    @torch.no_grad()
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]],
                     sliced: bool = False) -> None:
        """Copies checkpoint tensors (HF names, shapes already checked) into our parameters;
        whole tensors are cut to this rank's slice, unless `sliced` (already cut)."""
        targets = self._targets()
        for name, tensor in tensors:
            t = targets[name]
            if not sliced and t.slice is not None:
                tensor = tensor.narrow(*t.slice)
            t.param[t.lo:t.hi].copy_(tensor)


@dataclass(frozen=True)
class WeightTarget:
    """A checkpoint tensor of `shape` fills rows [lo, hi) of `param`: whole, or (sharded) its
    slice along `dim` from `start` (as long as the rows, or as the parameter's columns)."""

    param: torch.Tensor
    lo: int
    hi: int
    shape: tuple[int, ...]
    dim: int = 0
    start: int = 0

    @property
    def slice(self) -> tuple[int, int, int] | None:
        length = self.hi - self.lo if self.dim == 0 else self.param.shape[1]
        if length == self.shape[self.dim] and self.start == 0:
            return None
        return self.dim, self.start, length
