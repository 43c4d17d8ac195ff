"""Attention over a paged latent KV cache (multi-head latent attention, MLA, with the up-projections absorbed).

Per token the cache keeps one row [latent_dim] = [kv latent (rank r) | shared rope key]: `LatentKVCacheSpec`, one
tensor [num_blocks, block_size, latent_dim] in the same blocks, block tables and prefix keys as paged K/V. The model
folds the key up-projection into the query (q_latent = q_nope W_uk, so q_latent . c == q_nope . (W_uk c)) and the
value up-projection into the output (out = (p . c) W_uv), so every head attends over the shared rows: keys are the
whole rows, values their first r channels. This holds no weights; the model owns the projections. PyTorch only (no
C++ kernel reads this layout yet): decoding sequences are gathered and attended together, prefill chunks one by
one."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from stateserve.cache.spec import LatentKVCacheSpec
from stateserve.layers.attention import Attention
from stateserve.layers.metadata import AttnMetadata


class LatentAttention(Attention):
    """softmax(q rows^T * scale) rows[..., :value_dim] per head over one shared latent row per token.
    An `Attention` for the runner (it declares a cache and is bound one), with its own spec and layout."""

    def __init__(self, num_heads: int, latent_dim: int, value_dim: int, scale: float, dtype: torch.dtype) -> None:
        super().__init__(num_heads, 1, latent_dim, scale, dtype)
        self.latent_dim, self.value_dim = latent_dim, value_dim
        # batch_invariant (layers/linear.make_batch_invariant): each decoding sequence attends over exactly its own
        # rows, one product per sequence, so its sums do not depend on the batch's longest sequence
        self.batch_invariant = False

    def cache_spec(self) -> LatentKVCacheSpec:
        return LatentKVCacheSpec(self.latent_dim, self.dtype)

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]  # [num_blocks, block_size, latent_dim]

    def decode_kernel_args(self, dtype: torch.dtype, meta: AttnMetadata) -> tuple | None:
        return None  # no fused decode kernel reads the latent layout

    def write_rows(self, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Stores the step's latent rows [T, latent_dim] at their slots (block * block_size + offset)."""
        self.k_cache.view(-1, self.latent_dim).index_copy_(0, slot_mapping, rows.to(self.k_cache.dtype))

    def cached_rows(self, block_tables: torch.Tensor, length: int) -> torch.Tensor:
        """Rows of the first `length` positions: block tables [..., nb] -> [..., length, latent_dim] (a copy)."""
        return self.k_cache[block_tables].flatten(-3, -2)[..., :length, :]

    def _attend(self, q: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        # q: [B, H, Lq, D]; rows: [B, Lk, D] -> [B, H, Lq, value_dim]; every head reads the same rows (expand, no copy)
        k = rows.unsqueeze(1).expand(-1, self.num_heads, -1, -1).to(q.dtype)
        v = k[..., :self.value_dim]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale)

    def _attend_decode(self, q: torch.Tensor, rows: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """One query per sequence: q [S, H, D], rows [S, L, D], visible [S, L] -> [S, H, value_dim]. The heads are
        the rows of one matrix product per sequence against its shared latent rows (the scaled-dot-product kernel
        would materialise the rows once per head), in float32 and rounded once at the end."""
        rows = rows.float()
        scores = torch.bmm(q.float(), rows.transpose(1, 2)).mul_(self.scale)  # [S, H, L]
        scores.masked_fill_(~visible[:, None, :], float("-inf"))
        return torch.bmm(scores.softmax(dim=-1), rows[..., :self.value_dim]).to(q.dtype)

    def _decode_one_by_one(self, q: torch.Tensor, out: torch.Tensor, meta: AttnMetadata) -> None:
        """The decoding rows, each over its own sequence's rows only (no padding to the batch's longest)."""
        bs = self.block_size
        for j, (row, length) in enumerate(zip(meta.decode_rows.tolist(), meta.decode_seq_lens.tolist())):
            cached = self.cached_rows(meta.decode_block_tables[j, :-(-length // bs)], length)[None]  # [1, L, D]
            visible = torch.ones(1, length, dtype=torch.bool, device=q.device)
            out[row] = self._attend_decode(q[row:row + 1], cached, visible)[0]

    def forward(self, q: torch.Tensor, rows: torch.Tensor,  # type: ignore[override]
                meta: AttnMetadata) -> torch.Tensor:
        # q: [T, H, latent_dim] (absorbed queries); rows: [T, latent_dim] -> [T, H, value_dim]
        T = q.shape[0]
        out = q.new_empty(T, self.num_heads, self.value_dim)
        if self.k_cache is None:  # no cache (profiling without one): each chunk attends over its own rows
            for i in range(len(meta.query_lens)):
                start, qlen = meta.query_start_loc[i], meta.query_lens[i]
                qi = q[start:start + qlen].transpose(0, 1)[None]  # [1, H, Lq, D]
                oi = self._attend(qi, rows[None, start:start + qlen], None, qlen > 1)  # [1, H, Lq, value_dim]
                out[start:start + qlen] = oi[0].transpose(0, 1)
            return out
        self.write_rows(rows, meta.slot_mapping)
        bs = self.block_size
        if meta.decode_rows is not None and meta.decode_rows.numel() and self.batch_invariant:
            self._decode_one_by_one(q, out, meta)
        elif meta.decode_rows is not None and meta.decode_rows.numel():
            num_blocks = -(-meta.decode_max_seq_len // bs)
            cached = self.cached_rows(meta.decode_block_tables[:, :num_blocks], num_blocks * bs)  # [Sd, nb*bs, D]
            mask = (torch.arange(cached.shape[1], device=q.device)[None, :] < meta.decode_seq_lens[:, None])
            od = self._attend_decode(q.index_select(0, meta.decode_rows), cached, mask)  # [Sd, H, value_dim]
            if od.shape[0] == T:
                return od
            out.index_copy_(0, meta.decode_rows, od)
        seqs = meta.prefill_seqs if not meta.is_decode_only else []
        for i in seqs:
            start, qlen, ctx = meta.query_start_loc[i], meta.query_lens[i], meta.context_lens[i]
            qi = q[start:start + qlen].transpose(0, 1).unsqueeze(0)  # [1, H, Lq, D]
            if ctx == 0:  # the keys are the chunk's own rows
                oi = self._attend(qi, rows[None, start:start + qlen], None, qlen > 1)
            else:
                total = ctx + qlen
                ri = self.cached_rows(meta.block_tables[i, :-(-total // bs)], total)[None]  # [1, total, D]
                # query row r sits at absolute position ctx + r and sees keys 0..ctx + r
                visible = torch.arange(total, device=q.device)[None, :] <= \
                    torch.arange(qlen, device=q.device)[:, None] + ctx
                oi = self._attend(qi, ri, visible, False)
            out[start:start + qlen] = oi.squeeze(0).transpose(0, 1)
        return out
