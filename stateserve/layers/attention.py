"""Attention over the paged KV cache. The layer writes its new K/V through `slot_mapping` and reads
each sequence's context through its block table; model code only calls `forward`."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stateserve.cache.spec import KVCacheSpec
from stateserve.layers.metadata import AttnMetadata


class Attention(nn.Module):
    """softmax(q k^T * scale) v with GQA, causal or not. Holds no weights."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 dtype: torch.dtype, *, causal: bool = True, uses_cache: bool = True) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.dtype, self.causal, self.uses_cache = scale, dtype, causal, uses_cache
        self.k_cache: torch.Tensor | None = None  # [num_blocks, bs, KH, D], bound by the runner
        self.v_cache: torch.Tensor | None = None

    def cache_spec(self) -> KVCacheSpec | None:
        return KVCacheSpec(self.num_kv_heads, self.head_dim, self.dtype) if self.uses_cache else None

    def bind_cache(self, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache

    def release(self) -> None:
        self.k_cache = self.v_cache = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, KH, D] -> [T, H, D]
        if self.k_cache is not None:
            flat_k = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)
            flat_v = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)
            flat_k.index_copy_(0, meta.slot_mapping, k.to(flat_k.dtype))
            flat_v.index_copy_(0, meta.slot_mapping, v.to(flat_v.dtype))
            if meta.is_decode_only:
                return self._decode(q, meta)
        return self._prefill(q, k, v, meta)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              is_causal: bool) -> torch.Tensor:
        # q: [B, H, Lq, D]; k, v: [B, KH, Lk, D]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale,
                                              enable_gqa=self.num_heads != self.num_kv_heads)

    def _decode(self, q: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        # One new token per sequence: gather every sequence's blocks, mask past its length.
        num_seqs = q.shape[0]
        max_blocks = -(-meta.max_seq_len // self.k_cache.shape[1])
        tables = meta.block_tables[:, :max_blocks]
        k = self.k_cache[tables].flatten(1, 2)  # [S, nb*bs, KH, D]
        v = self.v_cache[tables].flatten(1, 2)
        positions = torch.arange(k.shape[1], device=q.device)
        mask = (positions[None, :] < meta.seq_lens_t[:, None]).view(num_seqs, 1, 1, -1)
        out = self._sdpa(q.view(num_seqs, self.num_heads, 1, self.head_dim), k.transpose(1, 2),
                         v.transpose(1, 2), mask, False)
        return out.view(num_seqs, self.num_heads, self.head_dim)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        bs = self.k_cache.shape[1] if self.k_cache is not None else 0
        for i, (start, qlen) in enumerate(zip(meta.query_start_loc[:-1], meta.query_lens)):
            ctx = meta.context_lens[i]
            qi = q[start:start + qlen].transpose(0, 1).unsqueeze(0)  # [1, H, Lq, D]
            if ctx == 0 or self.k_cache is None:
                ki = k[start:start + qlen].transpose(0, 1).unsqueeze(0)
                vi = v[start:start + qlen].transpose(0, 1).unsqueeze(0)
                oi = self._sdpa(qi, ki.to(qi.dtype), vi.to(qi.dtype), None, self.causal and qlen > 1)
            else:
                total = ctx + qlen
                blocks = meta.block_tables[i, :-(-total // bs)]
                ki = self.k_cache[blocks].flatten(0, 1)[:total].transpose(0, 1).unsqueeze(0)
                vi = self.v_cache[blocks].flatten(0, 1)[:total].transpose(0, 1).unsqueeze(0)
                # query row r sits at absolute position ctx + r and sees keys 0..ctx + r
                rows = torch.arange(qlen, device=q.device)[:, None] + ctx
                mask = torch.arange(total, device=q.device)[None, :] <= rows
                oi = self._sdpa(qi, ki, vi, mask, False)
            out[start:start + qlen] = oi.squeeze(0).transpose(0, 1)
        return out
