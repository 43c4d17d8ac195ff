"""GQA self-attention with q/k/v fused into one matmul (qkv_proj), the attention layer of the hybrid decoders:
plain (no positional encoding, no biases, scale head_dim**-0.5: Jamba, Nemotron-H, whose Mamba layers carry the
position information) or with an explicit score scale, biases, rotary and a key multiplier (GraniteMoeHybrid,
Falcon-H1).

Checkpoints store q/k/v apart: QKV_SHARDS gives each checkpoint name its shard of the fused weight, and
map_qkv_name maps `...{q,k,v}_proj.{weight,bias}` onto it, for a model's map_weight_name."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stateserve.layers.attention import Attention
from stateserve.layers.markers import stacked
from stateserve.layers.metadata import AttnMetadata
from stateserve.layers.rotary import RotaryEmbedding

QKV_SHARDS = {"q_proj": 0, "k_proj": 1, "v_proj": 2}  # checkpoint projection -> shard of qkv_proj


def map_qkv_name(name: str) -> tuple[str, int | None] | None:
    """`...{q,k,v}_proj.{weight,bias}` -> the fused qkv_proj shard; None if not a q/k/v tensor."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in QKV_SHARDS:
        return ".".join(parts[:-2] + ["qkv_proj", parts[-1]]), QKV_SHARDS[parts[-2]]
    return None


class QKVAttention(nn.Module):
    """qkv_proj -> (rotary) -> paged attention with the given scale -> o_proj."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *, dtype: torch.dtype,
                 bias: bool = False, scale: float | None = None, rotary: RotaryEmbedding | None = None,
                 key_multiplier: float = 1.0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = nn.Linear(hidden_size, sum(self.sizes), bias=bias)
        stacked(self.qkv_proj.weight, self.sizes)
        if bias:
            stacked(self.qkv_proj.bias, self.sizes)
        self.o_proj = nn.Linear(q_size, hidden_size, bias=bias)
        self.rotary = rotary
        self.key_multiplier = key_multiplier
        self.attn = Attention(num_heads, num_kv_heads, head_dim, head_dim ** -0.5 if scale is None else scale, dtype)

    @classmethod
    def from_config(cls, cfg: Any, dtype: torch.dtype) -> "QKVAttention":
        """The plain kind from a transformers config's usual names; no num_key_value_heads means one kv head per
        head (MHA) and no head_dim means hidden_size / num_attention_heads."""
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(cfg.hidden_size, heads, kv_heads, head_dim, dtype=dtype)

    def forward(self, x: torch.Tensor, meta: AttnMetadata, positions: torch.Tensor | None = None,
                rope_lens: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]; positions [T] only with rotary
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.key_multiplier != 1.0:
            k = k * self.key_multiplier
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k, rope_lens)
        return self.o_proj(self.attn(q, k, v, meta).flatten(1))
