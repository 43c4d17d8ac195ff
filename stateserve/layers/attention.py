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
from stateserve.platform import kernels
from stateserve.layers.metadata import AttnMetadata
from stateserve.layers.position_bias import PositionBias


class Attention(nn.Module):
    """softmax(q k^T * scale) v with GQA, causal or not. Holds no weights."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 dtype: torch.dtype, *, causal: bool = True, uses_cache: bool = True,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window} must be at least 1")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.dtype, self.causal, self.uses_cache = scale, dtype, causal, uses_cache
        # declared in the cache spec only: the model masks the window (a PositionBias); the cache manager may then
        # give back blocks before it, which only the biased path below reads around (metadata's block_offsets)
        self.sliding_window = sliding_window
        self.k_cache: torch.Tensor | None = None  # [num_blocks, KH, block_size, D], bound by the runner
        self.v_cache: torch.Tensor | None = None

    def cache_spec(self) -> KVCacheSpec | None:
        if not self.uses_cache:
            return None
        return KVCacheSpec(self.num_kv_heads, self.head_dim, self.dtype, self.sliding_window)

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
        kernel = kernels.table(k.device).write_kv(k.dtype)
        if kernel is not None:
            kernel(self.k_cache, self.v_cache, k.contiguous(), v.contiguous(), slot_mapping)
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

    def _forward_biased(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMetadata,
                        bias: PositionBias) -> torch.Tensor:
        """forward with `bias` added to the scores. No C++ kernel takes a bias, so decoding sequences are gathered
        and attended together, and each prefill chunk attends over its keys, all with SDPA and a float mask that
        carries the bias and the causal -inf. Query and key positions are absolute (a chunk's queries sit at
        context_len + r), so chunked prefill and decode see the scores a full recompute would."""
        cached = self.k_cache is not None
        if cached:
            self.write_kv(k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        bs = self.block_size if cached else 0
        if cached and meta.decode_rows is not None and meta.decode_rows.numel():
            # a table row starts at its sequence's first kept block (block_offsets: blocks a window gave back)
            first = meta.decode_block_offsets * bs if meta.decode_block_offsets is not None else None
            num_blocks = meta.decode_max_table_blocks or -(-meta.decode_max_seq_len // bs)
            kd, vd = (x.to(q.dtype) for x in self.cached_kv(meta.decode_block_tables[:, :num_blocks],
                                                             num_blocks * bs))  # [Sd, KH, nb*bs, D]
            # each query sits at seq_len - 1; the padding keys past it count as later keys, so causal masks them
            last = meta.decode_seq_lens - 1 if first is None else meta.decode_seq_lens - 1 - first
            rel = torch.arange(kd.shape[2], device=q.device) - last[:, None, None]
            mask = bias.scores("decode", rel, True, q.dtype)  # [Sd, H, 1, nb*bs]
            od = self._sdpa(q.index_select(0, meta.decode_rows).unsqueeze(2), kd, vd, mask, False).squeeze(2)
            if od.shape[0] == q.shape[0]:
                return od
            out.index_copy_(0, meta.decode_rows, od)
        for i in meta.prefill_seqs if cached else range(len(meta.query_lens)):
            start, qlen, ctx = meta.query_start_loc[i], meta.query_lens[i], meta.context_lens[i]
            if ctx == 0 or not cached:  # the keys are the chunk's own, at the queries' positions
                first, ki, vi = ctx, k[start:start + qlen].transpose(0, 1), v[start:start + qlen].transpose(0, 1)
            else:  # the keys from the sequence's first kept block on
                first = meta.block_offsets[i] * bs if meta.block_offsets is not None else 0
                ki, vi = self.cached_kv(meta.block_tables[i, :-(-(ctx + qlen - first) // bs)], ctx + qlen - first)
            keys = torch.arange(first, ctx + qlen, device=q.device)
            rel = keys[None, :] - torch.arange(ctx, ctx + qlen, device=q.device)[:, None]  # [Lq, Lk]
            mask = bias.scores(("prefill", i), rel, self.causal, q.dtype).unsqueeze(0)  # [1, H, Lq, Lk]
            qi = q[start:start + qlen].transpose(0, 1).unsqueeze(0)  # [1, H, Lq, D]
            ki, vi = ki.unsqueeze(0).to(q.dtype), vi.unsqueeze(0).to(q.dtype)
            out[start:start + qlen] = self._sdpa(qi, ki, vi, mask, False).squeeze(0).transpose(0, 1)
        return out

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMetadata,
                bias: PositionBias | None = None) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, KH, D] -> [T, H, D]; bias: added to the scores (T5's relative positions)
        if bias is not None:
            return self._forward_biased(q, k, v, meta, bias)
        if meta.block_offsets is not None:
            raise RuntimeError("block tables start past position 0 (a sliding window gave blocks back) but this step "
                               "has no window mask: the model must pass its window bias in such steps")
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
        if k_cache is None or not meta.is_decode_only or self.v_cache.dtype != k_cache.dtype or \
                meta.block_offsets is not None:
            return None
        table = kernels.table(k_cache.device)
        if table.write_kv(k_cache.dtype) is None or table.decode_attention(dtype, k_cache.dtype) is None:
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
        kernel = kernels.table(q.device).decode_attention(q.dtype, self.k_cache.dtype)
        if kernel is not None:
            return kernel(q.contiguous(), self.k_cache, self.v_cache, tables, lens, self.scale)
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

    def _prefill_kernel(self, q: torch.Tensor):
        """The causal prefill kernel and the most keys a sequence may have for it, where the kernel table has one
        for q and this layer's cache (a causal layer with its cache bound), else (None, 0)."""
        if self.k_cache is None or not self.causal:
            return None, 0
        found = kernels.table(q.device).prefill_attention(q.dtype, self.k_cache.dtype, self.head_dim)
        return found if found is not None else (None, 0)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMetadata, seqs,
                 out: torch.Tensor) -> torch.Tensor:
        bs = self.block_size if self.k_cache is not None else 0
        kernel, max_keys = self._prefill_kernel(q)
        for i in seqs:
            start, qlen, ctx = meta.query_start_loc[i], meta.query_lens[i], meta.context_lens[i]
            if kernel is not None and ctx + qlen <= max_keys:  # the chunk's keys are cached: read blocks in place
                out[start:start + qlen] = kernel(
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
