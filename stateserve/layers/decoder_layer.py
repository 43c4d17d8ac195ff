"""A Llama-style pre-norm decoder layer and the blocks it is made of, shared by the models that use them (Llama,
Qwen2, and the hybrids' attention layers): GQA attention with RoPE over the paged cache, a SwiGLU MLP, RMSNorms.
q/k/v and gate/up are fused into one matmul each (checkpoint shards are stacked on load). On CPU a decode step of a
whole layer can run as one C++ call (`DecoderLayer._fused_decode`)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stateserve.layers.attention import Attention
from stateserve.layers.linear import FewRowCall, decode_projections
from stateserve.layers.markers import stacked
from stateserve.layers.metadata import AttnMetadata
from stateserve.layers.norm import RMSNorm, silu_and_mul
from stateserve.layers.param_cache import derived_from_module
from stateserve.layers.rotary import RotaryEmbedding, rope_parameters
from stateserve.platform import kernels


def rope_seq_lens(meta: AttnMetadata, device: torch.device) -> torch.Tensor:
    """[T] the length each token's sequence reaches in this step (dynamic NTK rope needs it)."""
    return torch.repeat_interleave(torch.tensor(meta.seq_lens, device=device),
                                   torch.tensor(meta.query_lens, device=device))


class DecoderAttention(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=qkv_bias)
        stacked(self.qkv_proj.weight, [q_size, kv_size, kv_size])
        if qkv_bias:
            stacked(self.qkv_proj.bias, [q_size, kv_size, kv_size])
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=o_bias)
        self.sizes = [q_size, kv_size, kv_size]
        self.rotary = RotaryEmbedding(self.head_dim, rope_parameters(cfg), cfg.max_position_embeddings)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5, dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                rope_lens: torch.Tensor | None) -> torch.Tensor:
        # x: [T, hidden]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k, rope_lens)
        out = self.attn(q, k, v, meta)  # [T, H, D]
        return self.o_proj(out.flatten(1))


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        stacked(self.gate_up_proj.weight, [intermediate, intermediate])
        if bias:
            stacked(self.gate_up_proj.bias, [intermediate, intermediate])
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, qkv_bias: bool) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(cfg, dtype, qkv_bias, getattr(cfg, "attention_bias", False) and qkv_bias)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "mlp_bias", False))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, meta: AttnMetadata,
                rope_lens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] the previous layer's MLP output (the embeddings for the first layer, residual None);
        residual: the stream so far. -> (this layer's MLP output, the stream before it). Each add to the stream
        happens with the norm that follows it, in one kernel."""
        if meta.is_decode_only:
            fused = self._fused_decode(x, residual, positions, meta, rope_lens)
            if fused is not None:
                return fused
        h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, positions, meta, rope_lens)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual

    def _fused_decode(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                      meta: AttnMetadata, rope_lens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The decode step of forward in one kernel call (csrc/decoder_layer.cpp: the same kernels, same results),
        when every projection takes the few-row kernel and the norms, rotary and attention would take theirs; else
        None. x, residual: as forward."""
        kernel = kernels.table(x.device).decoder_layer_decode(x.dtype, x.dtype if residual is None else residual.dtype)
        call = derived_from_module(self, "fused decode", self._fused_decode_call) if kernel is not None else None
        if call is None or not call.applies(x) or (residual is not None and not residual.is_contiguous()):
            return None
        attn = self.self_attn
        cache = attn.attn.decode_kernel_args(x.dtype, meta)
        rope = attn.rotary.kernel_table(meta.max_seq_len, x.device, rope_lens)  # decode: positions < seq lens
        if cache is None or rope is None:
            return None
        before_attention, after_attention = call.args
        return tuple(kernel(x, residual, positions, *before_attention, rope, attn.rotary.dim, *cache, *after_attention))

    def _fused_decode_call(self) -> FewRowCall | None:
        """decoder_layer_decode_'s fixed arguments (made once per weight version): those before the rotary table and
        those after the cache; None when a projection lacks the few-row kernel or a norm has another dtype."""
        attn, mlp = self.self_attn, self.mlp
        proj = decode_projections((attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
        if proj is None:  # e.g. a projection of two formats: they run one by one
            return None
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        dtype = proj.dtype or norm1.weight.dtype
        if norm1.weight.dtype != dtype or norm2.weight.dtype != dtype:
            return None
        qkv, o, gate_up, down = proj.weights
        before = (norm1.weight, norm1.eps, qkv, attn.qkv_proj.bias, attn.num_heads, attn.num_kv_heads, attn.head_dim)
        after = (o, attn.o_proj.bias, norm2.weight, norm2.eps, gate_up, mlp.gate_up_proj.bias, down,
                 mlp.down_proj.bias, proj.quantize_activations)
        return FewRowCall(proj.max_rows, dtype, (before, after))
