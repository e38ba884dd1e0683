"""Llama-family decoder (Llama 2/3/3.1, Qwen2/2.5, Mistral, SmolLM) over the paged KV pool.

Differences between the families are all in ModelConfig: q/k/v bias (Qwen2), rope scaling
(Llama 3.1), tied embeddings (SmolLM, small Qwen2), head_dim decoupled from hidden size.
Projections are fused (q/k/v into one matmul, gate/up into another) because on CPU and in
decode each matmul launch and each pass over the activations costs more than the FLOPs.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.forward_batch import ForwardBatch, ForwardMode
from pdserve.engine.models import decode_gemv
from pdserve.engine.models.fused import Fusion, kernels
from pdserve.engine.models.layers import RMSNorm, SwiGLUMLP, empty_param, linear_into
from pdserve.engine.models.rope import RotaryEmbedding, apply_rope

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

Device = torch.device | str | None


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, device: Device,
                 fusion: Fusion):
        super().__init__()
        self.layer_id = layer_id
        self.fusion = fusion
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
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
        return linear_into(o.reshape(t, self.q_size), self.o_proj, residual)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, device: Device,
                 fusion: Fusion):
        super().__init__()
        self.fusion = fusion
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, device, fusion)
        self.self_attn = LlamaAttention(cfg, layer_id, dtype, device, fusion)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, device, fusion)
        self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, dtype, device, fusion)

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
    `fusion`: which fused kernel paths it takes (default: the PDSERVE_* switches)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: Device = None,
                 fusion: Fusion | None = None):
        super().__init__()
        if cfg.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture: unsupported {cfg.architecture!r} "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        self.config = cfg
        self.fusion = Fusion.from_envs() if fusion is None else fusion
        self.embed_tokens = empty_param(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                                        device=device)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, dtype, device, self.fusion) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, self.fusion)
        # Tied: the output head is the embedding matrix itself (one tensor, one copy).
        self.lm_head = (self.embed_tokens if cfg.tie_word_embeddings else
                        empty_param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device))

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        if fb.num_tokens == 0:
            return torch.empty(0, self.config.vocab_size, device=self.embed_tokens.device)
        if decode_gemv.applies(self, fb):
            return decode_gemv.forward(self, fb)
        h = F.embedding(fb.input_ids, self.embed_tokens)
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
        return F.linear(h, self.lm_head).float()

    def projection_weights(self) -> list[nn.Parameter]:
        """The matmul weights: per layer qkv, o, gate_up, down; and an untied lm_head."""
        ws = [w for layer in self.layers for w in (
            layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj)]
        return ws if self.config.tie_word_embeddings else [*ws, self.lm_head]

    # ---- weight loading: checkpoint (HF) names -> slices of our fused parameters ----

    def _targets(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """HF tensor name -> (our parameter, first row, end row) that it fills."""
        cfg = self.config
        t: dict[str, tuple[torch.Tensor, int, int]] = {}

        def whole(name: str, p: torch.Tensor) -> None:
            t[name] = (p, 0, p.shape[0])

        whole("model.embed_tokens.weight", self.embed_tokens)
        whole("model.norm.weight", self.norm.weight)
        if not cfg.tie_word_embeddings:
            whole("lm_head.weight", self.lm_head)
        for i, layer in enumerate(self.layers):
            pre = f"model.layers.{i}."
            attn = layer.self_attn
            q, kv = attn.q_size, attn.kv_size
            rows = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}
            for name, (lo, hi) in rows.items():
                t[f"{pre}self_attn.{name}_proj.weight"] = (attn.qkv_proj, lo, hi)
                if attn.qkv_bias is not None:
                    t[f"{pre}self_attn.{name}_proj.bias"] = (attn.qkv_bias, lo, hi)
            whole(f"{pre}self_attn.o_proj.weight", attn.o_proj)
            n = cfg.intermediate_size
            t[f"{pre}mlp.gate_proj.weight"] = (layer.mlp.gate_up_proj, 0, n)
            t[f"{pre}mlp.up_proj.weight"] = (layer.mlp.gate_up_proj, n, 2 * n)
            whole(f"{pre}mlp.down_proj.weight", layer.mlp.down_proj)
            whole(f"{pre}input_layernorm.weight", layer.input_layernorm.weight)
            whole(f"{pre}post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
        return t

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor this model needs, by HF name, with its expected shape."""
        return {name: (hi - lo, *p.shape[1:]) for name, (p, lo, hi) in self._targets().items()}

    @torch.no_grad()
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies checkpoint tensors (HF names, shapes already checked) into our parameters."""
        targets = self._targets()
        for name, tensor in tensors:
            p, lo, hi = targets[name]
            p[lo:hi].copy_(tensor)
