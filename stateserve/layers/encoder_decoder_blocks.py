"""Attention modules with their own q/k/v/out projections for BART-style encoder-decoders (BART, Whisper), and the
text-encoder input helpers shared by the text encoder-decoders (BART, T5).

Parameter names follow transformers' Bart/Whisper attention (q_proj, k_proj, v_proj, out_proj), so checkpoints
load 1:1 whichever model assembles them; Whisper's k_proj has no bias (k_bias=False). The model files keep only
their own assembly (norm placement, embeddings, heads)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stateserve.layers.attention import Attention
from stateserve.layers.cross_attention import KV, CrossAttention, CrossAttnMetadata, encoder_attention
from stateserve.layers.metadata import AttnMetadata


class Projections(nn.Module):
    """q/k/v/out projections of one multi-head attention, scaled by head_dim**-0.5."""

    def __init__(self, d_model: int, num_heads: int, bias: bool = True, k_bias: bool = True) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not a multiple of the attention heads ({num_heads})")
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.scale = self.head_dim ** -0.5
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, d_model, bias=bias and k_bias)
        self.v_proj = nn.Linear(d_model, d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:-1], self.num_heads, self.head_dim)


class EncoderSelfAttention(Projections):
    """Bidirectional self-attention over a right-padded encoder batch (no KV cache)."""

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        # x: [B, L, d]; valid: [B, L] or None
        q, k, v = self.heads(self.q_proj(x)), self.heads(self.k_proj(x)), self.heads(self.v_proj(x))
        return self.out_proj(encoder_attention(q, k, v, valid, self.scale).flatten(2))


class DecoderSelfAttention(Projections):
    """Causal decoder self-attention over the paged KV cache."""

    def __init__(self, d_model: int, num_heads: int, dtype: torch.dtype, k_bias: bool = True) -> None:
        super().__init__(d_model, num_heads, k_bias=k_bias)
        self.attn = Attention(num_heads, num_heads, self.head_dim, self.scale, dtype)

    def forward(self, x: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        # x: [T, d]
        q, k, v = self.heads(self.q_proj(x)), self.heads(self.k_proj(x)), self.heads(self.v_proj(x))
        return self.out_proj(self.attn(q, k, v, meta).flatten(1))


class DecoderCrossAttention(Projections):
    """Decoder-to-encoder attention of decoder layer `layer_idx`; its K/V come from project_kv, once a request."""

    def __init__(self, d_model: int, num_heads: int, layer_idx: int, k_bias: bool = True) -> None:
        super().__init__(d_model, num_heads, k_bias=k_bias)
        self.attn = CrossAttention(num_heads, num_heads, self.head_dim, self.scale, layer_idx)

    def project_kv(self, encoder_hidden: torch.Tensor) -> KV:
        # encoder_hidden: [L, d] -> k, v: [H, L, D]
        k = self.heads(self.k_proj(encoder_hidden)).transpose(0, 1).contiguous()
        v = self.heads(self.v_proj(encoder_hidden)).transpose(0, 1).contiguous()
        return k, v

    def forward(self, x: torch.Tensor, meta: CrossAttnMetadata) -> torch.Tensor:
        return self.out_proj(self.attn(self.heads(self.q_proj(x)), meta).flatten(1))


def text_encoder_input(raw: dict[str, Any], vocab_size: int, max_len: int, limit_name: str) -> tuple[dict, int]:
    """Validate {"input_ids": [...]} for a text encoder: non-empty, in the vocabulary, within max_len."""
    unknown = set(raw) - {"input_ids"}
    if unknown or "input_ids" not in raw:
        raise ValueError(f"this model's encoder takes text (an encoder prompt); got encoder input key(s) "
                         f"{sorted(raw)}")
    ids = raw["input_ids"]
    if not isinstance(ids, (list, tuple)) or not ids:
        raise ValueError("encoder prompt is empty: give at least one token")
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"encoder prompt has token id(s) outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if len(ids) > max_len:
        raise ValueError(f"encoder prompt has {len(ids)} tokens, more than the encoder's {limit_name}={max_len}")
    return {"input_ids": list(ids)}, len(ids)


def pad_ids(seqs: list[list[int]], device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """Right-pad token id lists into [B, L_max] (pad id 0; padded keys are masked out)."""
    lens = [len(s) for s in seqs]
    ids = torch.zeros(len(seqs), max(lens), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
    return ids.to(device), lens
