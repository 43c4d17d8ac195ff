"""Attention over the paged KV cache. The layer writes its new K/V through `slot_mapping` and reads
each sequence's context through its block table; model code only calls `forward`.

Sequences decoding one token are attended together (a C++ kernel that reads blocks in place on CPU, a
gather + SDPA elsewhere); prefill chunks are attended one sequence at a time (on CPU by a C++ kernel reading the
blocks in place where it covers the dtype and head size, else with SDPA)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stateserve.cache.spec import KVCacheSpec
from stateserve.layers import cpu_kernels
from stateserve.layers.metadata import AttnMetadata

# With AVX2's 8-lane vectors the C++ prefill kernel is used up to this many keys (context + chunk) a sequence. 2 Zen 3
# cores, 12 heads of 64, causal GFLOP/s kernel / PyTorch's flash: 512 rows 84 / 61 (bfloat16 98 / 53), 2048 rows
# 95 / 108 (102 / 103), a 2048-row chunk after 2048 of context 102 / 121 (101 / 118); past that the flash kernel's
# blocked products pull ahead. With AVX-512 the kernel has no such limit.
PREFILL_KERNEL_MAX_KEYS_8_LANES = 4096


class Attention(nn.Module):
    """softmax(q k^T * scale) v with GQA, causal or not. Holds no weights."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 dtype: torch.dtype, *, causal: bool = True, uses_cache: bool = True) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.dtype, self.causal, self.uses_cache = scale, dtype, causal, uses_cache
        self.k_cache: torch.Tensor | None = None  # [num_blocks, KH, block_size, D], bound by the runner
        self.v_cache: torch.Tensor | None = None

    def cache_spec(self) -> KVCacheSpec | None:
        return KVCacheSpec(self.num_kv_heads, self.head_dim, self.dtype) if self.uses_cache else None

    def bind_cache(self, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache

    def release(self) -> None:
        self.k_cache = self.v_cache = None

    # The cache layout is known only to these three methods and the C++ kernels: a block holds each kv head's
    # block_size rows together, so a head's keys of a block stream from memory as one piece.
    @property
    def block_size(self) -> int:
        return self.k_cache.shape[2]

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Stores new keys and values ([T, KH, D]) at their slots (block * block_size + offset)."""
        k, v = k.to(self.k_cache.dtype), v.to(self.v_cache.dtype)
        kernels = cpu_kernels.load() if k.device.type == "cpu" else None
        if kernels is not None:
            kernels.write_kv_cache(self.k_cache, self.v_cache, k.contiguous(), v.contiguous(), slot_mapping)
            return
        blocks, offsets = slot_mapping // self.block_size, slot_mapping % self.block_size
        self.k_cache[blocks, :, offsets] = k
        self.v_cache[blocks, :, offsets] = v

    def cached_kv(self, block_tables: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the first `length` positions of the sequences whose block tables are given
        ([..., num_blocks] -> [..., KH, length, D] each, copies)."""
        def rows(cache: torch.Tensor) -> torch.Tensor:
            return cache[block_tables].transpose(-4, -3).flatten(-3, -2)[..., :length, :]
        return rows(self.k_cache), rows(self.v_cache)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, KH, D] -> [T, H, D]
        if self.k_cache is None:
            return self._prefill(q, k, v, meta, range(len(meta.query_lens)), torch.empty_like(q))
        self.write_kv(k, v, meta.slot_mapping)
        if meta.is_decode_only:
            return self._decode(q, meta)
        out = torch.empty_like(q)
        if meta.decode_rows is not None and meta.decode_rows.numel():
            out.index_copy_(0, meta.decode_rows, self._decode(q.index_select(0, meta.decode_rows), meta))
        return self._prefill(q, k, v, meta, meta.prefill_seqs, out)

    def decode_kernel_args(self, dtype: torch.dtype, meta: AttnMetadata) -> tuple | None:
        """(k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale): what a fused CPU decode step passes to
        write_kv_cache and paged_decode_attention for this layer, as forward would; None where forward would not
        take those kernels (no cache, not a decode-only step, another device or dtype, no kernels)."""
        k_cache = self.k_cache
        if k_cache is None or not meta.is_decode_only or k_cache.device.type != "cpu" or k_cache.dtype != dtype \
                or self.v_cache.dtype != dtype or cpu_kernels.load() is None:
            return None
        return k_cache, self.v_cache, meta.slot_mapping, meta.decode_block_tables, meta.decode_seq_lens, self.scale

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              is_causal: bool) -> torch.Tensor:
        # q: [B, H, Lq, D]; k, v: [B, KH, Lk, D]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale,
                                              enable_gqa=self.num_heads != self.num_kv_heads)

    def _decode(self, q: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        # q: [Sd, H, D], one new token per decoding sequence (already written to the cache)
        tables, lens, max_len = meta.decode_block_tables, meta.decode_seq_lens, meta.decode_max_seq_len
        if q.device.type == "cpu" and q.dtype == self.k_cache.dtype:
            kernels = cpu_kernels.load()
            if kernels is not None:
                return kernels.paged_decode_attention(q.contiguous(), self.k_cache, self.v_cache, tables, lens,
                                                      self.scale)
        return self._decode_gather(q, tables, lens, max_len)

    def _decode_gather(self, q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                       max_len: int) -> torch.Tensor:
        num_seqs = q.shape[0]
        num_blocks = -(-max_len // self.block_size)
        k, v = self.cached_kv(tables[:, :num_blocks], num_blocks * self.block_size)  # [Sd, KH, nb*bs, D]
        positions = torch.arange(k.shape[2], device=q.device)
        mask = (positions[None, :] < lens[:, None]).view(num_seqs, 1, 1, -1)
        out = self._sdpa(q.view(num_seqs, self.num_heads, 1, self.head_dim), k.to(q.dtype), v.to(q.dtype), mask,
                         False)
        return out.view(num_seqs, self.num_heads, self.head_dim)

    def _prefill_with_context_cpu(self, qi: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                                  ctx_blocks: torch.Tensor, ctx: int) -> torch.Tensor:
        """A later chunk of a prompt on CPU: flash attention over the cached context (every key visible) and over
        the chunk itself (causal), merged by their log-sum-exps. The single masked SDPA call it replaces takes the
        math path and builds a [H, chunk, context + chunk] score tensor.
        qi: [1, H, Lq, D]; k_new, v_new: [Lq, KH, D] (the chunk's own keys, already written to the cache)."""
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        rep = self.num_heads // self.num_kv_heads

        def heads(x: torch.Tensor) -> torch.Tensor:  # [KH, L, D] -> [1, H, L, D] in q's dtype, as the cache holds it
            x = x.to(self.k_cache.dtype).to(qi.dtype)
            return (x.repeat_interleave(rep, 0) if rep > 1 else x).unsqueeze(0)

        k_ctx, v_ctx = self.cached_kv(ctx_blocks, ctx)
        o_ctx, lse_ctx = flash(qi, heads(k_ctx), heads(v_ctx), 0.0, False, scale=self.scale)[:2]
        o_new, lse_new = flash(qi, heads(k_new.transpose(0, 1)), heads(v_new.transpose(0, 1)), 0.0, True,
                               scale=self.scale)[:2]
        lse = torch.logaddexp(lse_ctx, lse_new)  # [1, H, Lq] float32
        out = o_ctx.float() * (lse_ctx - lse).exp().unsqueeze(-1) + o_new.float() * (lse_new - lse).exp().unsqueeze(-1)
        return out.to(qi.dtype)

    def _prefill_kernels(self, q: torch.Tensor):
        """The C++ module and the most keys a sequence may have for it, when its causal prefill kernel covers this
        layer and q (CPU, cache bound, float32 or bfloat16, head size 64 or 128), else (None, 0)."""
        if self.k_cache is None or not self.causal or q.device.type != "cpu" or q.dtype != self.k_cache.dtype:
            return None, 0
        kernels = cpu_kernels.load()
        if kernels is None or not kernels.prefill_attention_supported(q.dtype, self.head_dim):
            return None, 0
        eight_lanes = kernels.simd_float32_lanes() == 8
        return kernels, PREFILL_KERNEL_MAX_KEYS_8_LANES if eight_lanes else float("inf")

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMetadata, seqs,
                 out: torch.Tensor) -> torch.Tensor:
        bs = self.block_size if self.k_cache is not None else 0
        kernels, max_keys = self._prefill_kernels(q)
        for i in seqs:
            start, qlen, ctx = meta.query_start_loc[i], meta.query_lens[i], meta.context_lens[i]
            if kernels is not None and ctx + qlen <= max_keys:  # the chunk's keys are cached: read blocks in place
                out[start:start + qlen] = kernels.paged_prefill_attention(
                    q[start:start + qlen], self.k_cache, self.v_cache, meta.block_tables[i, :-(-(ctx + qlen) // bs)],
                    ctx, self.scale)
                continue
            qi = q[start:start + qlen].transpose(0, 1).unsqueeze(0)  # [1, H, Lq, D]
            if ctx == 0 or self.k_cache is None:
                ki = k[start:start + qlen].transpose(0, 1).unsqueeze(0)
                vi = v[start:start + qlen].transpose(0, 1).unsqueeze(0)
                oi = self._sdpa(qi, ki.to(qi.dtype), vi.to(qi.dtype), None, self.causal and qlen > 1)
            elif q.device.type == "cpu" and self.causal:
                oi = self._prefill_with_context_cpu(qi, k[start:start + qlen], v[start:start + qlen],
                                                    meta.block_tables[i, :-(-ctx // bs)], ctx)
            else:
                total = ctx + qlen
                blocks = meta.block_tables[i, :-(-total // bs)]
                ki, vi = (x.unsqueeze(0).to(qi.dtype) for x in self.cached_kv(blocks, total))
                # query row r sits at absolute position ctx + r and sees keys 0..ctx + r
                rows = torch.arange(qlen, device=q.device)[:, None] + ctx
                mask = torch.arange(total, device=q.device)[None, :] <= rows
                oi = self._sdpa(qi, ki, vi, mask, False)
            out[start:start + qlen] = oi.squeeze(0).transpose(0, 1)
        return out
