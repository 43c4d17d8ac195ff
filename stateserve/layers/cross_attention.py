"""Encoder-decoder building blocks: decoder-to-encoder cross-attention over the per-request encoder cache,
bidirectional attention for encoders (no KV cache), and the activations encoder-decoder configs name.

The encoder cache (cross-attention K/V of every decoder layer, computed once per request from the encoder
output) is owned by EncoderDecoderModelState; each step it hands the layers a CrossAttnMetadata through
ForwardMeta.extra["cross"]. CrossAttention only reads from it, at the index of its decoder layer."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from stateserve.layers.markers import CrossAttentionMarker

KV = tuple[torch.Tensor, torch.Tensor]  # (k, v), each [KH, L_enc, D]


@dataclass
class CrossAttnMetadata:
    seq_kv: list[list[KV]]  # [S][layer]: each sequence's cross K/V
    encoder_lens: list[int]  # [S]
    query_start_loc: list[int]  # [S + 1]
    # Sequences with exactly one query token this step are attended together over padded K/V:
    decode_seqs: list[int] = field(default_factory=list)
    decode_rows: torch.Tensor | None = None  # [Sd] long: their rows in the flat batch
    decode_kv: list[KV] | None = None  # [layer]: (k, v) each [Sd, KH, L_max, D], zero-padded
    decode_mask: torch.Tensor | None = None  # [Sd, 1, 1, L_max] bool (True = real key); None: no padding
    prefill_seqs: list[int] = field(default_factory=list)  # the others, attended one by one


class CrossAttention(nn.Module, CrossAttentionMarker):
    """softmax(q k_enc^T * scale) v_enc for decoder layer `layer_idx`. Holds no weights and no cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.layer_idx = scale, layer_idx

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        # q: [B, H, Lq, D]; k, v: [B, KH, Lk, D]
        return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=self.scale,
                                              enable_gqa=self.num_heads != self.num_kv_heads)

    def forward(self, q: torch.Tensor, meta: CrossAttnMetadata) -> torch.Tensor:
        # q: [T, H, D] -> [T, H, D]
        out = torch.empty_like(q)
        if meta.decode_seqs:
            k, v = meta.decode_kv[self.layer_idx]
            qd = q.index_select(0, meta.decode_rows).unsqueeze(2)  # [Sd, H, 1, D]
            od = self._sdpa(qd, k, v, meta.decode_mask).squeeze(2)
            if len(meta.decode_seqs) == q.shape[0]:  # every row decodes: rows are 0..T-1 in order
                return od
            out.index_copy_(0, meta.decode_rows, od)
        for i in meta.prefill_seqs:
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            k, v = meta.seq_kv[i][self.layer_idx]
            qi = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, Lq, D]
            out[start:end] = self._sdpa(qi, k.unsqueeze(0), v.unsqueeze(0), None).squeeze(0).transpose(0, 1)
        return out


def stack_padded(kvs: list[KV]) -> tuple[KV, torch.Tensor | None]:
    """Pad per-sequence (k, v) [KH, L_i, D] to [S, KH, L_max, D]; mask [S, 1, 1, L_max] or None if all equal."""
    lens = [k.shape[1] for k, _ in kvs]
    if len(set(lens)) == 1:
        return (torch.stack([k for k, _ in kvs]), torch.stack([v for _, v in kvs])), None
    ks = nn.utils.rnn.pad_sequence([k.transpose(0, 1) for k, _ in kvs], batch_first=True).transpose(1, 2)
    vs = nn.utils.rnn.pad_sequence([v.transpose(0, 1) for _, v in kvs], batch_first=True).transpose(1, 2)
    device = kvs[0][0].device
    mask = torch.arange(max(lens), device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
    return (ks.contiguous(), vs.contiguous()), mask.view(len(kvs), 1, 1, -1)


def padding_mask(lens: list[int], device: torch.device) -> torch.Tensor | None:
    """[B, L_max] bool, True at real positions; None when every sequence has the same length."""
    if len(set(lens)) == 1:
        return None
    return torch.arange(max(lens), device=device)[None, :] < torch.tensor(lens, device=device)[:, None]


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None,
                      scale: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Bidirectional attention over right-padded encoder sequences (no cache).
    q, k, v: [B, L, H, D]; valid: [B, L] bool or None; bias: [1 or B, H, L, L] added to the scores."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, L, D]
    mask = None
    if bias is not None:
        mask = bias.to(q.dtype)
        if valid is not None:
            mask = mask.masked_fill(~valid[:, None, None, :], float("-inf"))
    elif valid is not None:
        mask = valid[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)  # [B, L, H, D]


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "silu": F.silu,
    "swish": F.silu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "tanh": torch.tanh,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """[length, channels] sin | cos position table (Whisper's encoder positions)."""
    if channels % 2:
        raise ValueError(f"sinusoidal positions need an even number of channels, got {channels}")
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-increment * torch.arange(channels // 2, dtype=torch.float32))
    scaled = torch.arange(length, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([scaled.sin(), scaled.cos()], dim=1)
