"""MiniMax's lightning attention: linear attention with a fixed scalar decay per head,

    S_t = lambda_h S_{t-1} + k_t^T v_t,    o_t = q_t S_t,    lambda_h = exp(-slope_h)

with q, k, v = act(qkv_proj(x)) (no normalisation, no delta rule), then RMSNorm over all heads, a sigmoid output gate
and out_proj. The state per sequence is one "kv" tensor [H, D (keys), D (values)] in float32 (transformers keeps it
in the model dtype: identical in float32). The slopes are not weights: they follow from the head count and the
layer's depth (transformers' get_slope_rate), and the checkpoint's copies of them are skipped.

Prefill runs in chunks of `chunk_size` tokens, all of a chunk in matrix products: inside it the decay between token
i and a later t is lambda^(t - i) (formed from the difference, never lambda^t / lambda^i, which overflows); the
state enters each chunk once and leaves it once. Decode advances every sequence by one token in one batched update.
Prefix-cache snapshots (the state after `off` tokens of a chunk) are formed inside the chunk that holds them."""
from __future__ import annotations

import torch
from torch import nn

from stateserve.cache.spec import StateSpec
from stateserve.layers.metadata import StateMetadata
from stateserve.layers.moe import activation_fn
from stateserve.layers.norm import RMSNorm
from stateserve.layers.recurrent import StatefulLayer, mixed_step, zero_fresh_slots


def lightning_slopes(num_heads: int, layer_idx: int, num_layers: int) -> torch.Tensor:
    """Per-head decay rates [H] (float32): a geometric series over the heads, scaled down with depth (transformers'
    MiniMaxLightningAttention.get_slope_rate)."""
    base = 1 / (2 ** (8 / num_heads))
    factor = 1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5
    return base ** (torch.arange(num_heads) + 1).float() * factor


def chunk_lightning(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor,
                    initial_state: torch.Tensor, chunk_size: int = 64,
                    snapshot_offsets: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """One sequence, float32. q, k, v: [H, L, D]; slopes [H]; initial_state [H, D, D]. Returns out [H, L, D], the
    final state and {offset: state after `offset` tokens} for each requested 0 < offset <= L."""
    H, L, D = q.shape
    snapshots: dict[int, torch.Tensor] = {}
    state = initial_state
    out = torch.empty_like(v)
    rate = slopes.view(H, 1, 1)
    for start in range(0, L, chunk_size):  # sequential only across chunks
        end = min(start + chunk_size, L)
        C = end - start
        qc, kc, vc = q[:, start:end], k[:, start:end], v[:, start:end]
        t = torch.arange(1, C + 1, dtype=q.dtype, device=q.device)
        gap = t[:, None] - t[None, :]  # t - i
        decay = torch.where(gap >= 0, torch.exp(-rate * gap.clamp(min=0)), torch.zeros((), device=q.device))
        scores = (qc @ kc.transpose(-1, -2)) * decay  # [H, C, C]: lambda^(t-i) q_t . k_i, causal
        out[:, start:end] = (qc * torch.exp(-rate * t.view(1, C, 1))) @ state + scores @ vc
        for off in snapshot_offsets:
            j = off - start  # tokens of this chunk the snapshot includes
            if 0 < j < C:
                keys = kc[:, :j] * torch.exp(-rate * (j - t[:j]).view(1, j, 1))  # each key decayed to token j
                snapshots[off] = state * torch.exp(-rate * j) + keys.transpose(-1, -2) @ vc[:, :j]
        keys = kc * torch.exp(-rate * (C - t).view(1, C, 1))
        state = state * torch.exp(-rate * C) + keys.transpose(-1, -2) @ vc
        if end in snapshot_offsets:
            snapshots[end] = state
    return out, state, snapshots


class LightningAttention(StatefulLayer):
    """forward(x [T, hidden], meta) -> [T, hidden]. Parameter names as transformers': qkv_proj (per head [q|k|v]),
    norm (RMSNorm over H*D), output_gate, out_proj."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, layer_idx: int, num_layers: int,
                 activation: str, eps: float = 1e-6, chunk_size: int = 64) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.chunk_size = num_heads, head_dim, chunk_size
        self.act = activation_fn(activation)
        self.qkv_proj = nn.Linear(hidden_size, 3 * num_heads * head_dim, bias=False)
        self.norm = RMSNorm(num_heads * head_dim, eps)  # transformers leaves it at 1e-6, not rms_norm_eps
        self.output_gate = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.out_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self._depth = (layer_idx, num_layers)
        # the layer's heads [first_head, first_head + num_heads) of all_heads: a tensor-parallel rank keeps a share
        self.all_heads, self.first_head = num_heads, 0
        self.register_buffer("slopes", self._slopes(torch.device("cpu")), persistent=False)

    def _slopes(self, device: torch.device) -> torch.Tensor:
        rates = lightning_slopes(self.all_heads, *self._depth)  # the slope of a head depends on the layer's count
        return rates[self.first_head:self.first_head + self.num_heads].to(device)

    def keep_heads(self, first: int, count: int) -> None:
        """A tensor-parallel rank's heads [first, first + count) (distributed/rules_recurrent.py)."""
        self.first_head, self.num_heads = first, count
        self.slopes = self._slopes(self.slopes.device)

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        # recomputed in float32 on the new device, not cast back: a rate once rounded to bfloat16 by a dtype change
        # would change every token's decay
        self.slopes = self._slopes(self.slopes.device)
        return self

    def cache_spec(self) -> StateSpec:
        return StateSpec.of({"kv": (self.num_heads, self.head_dim, self.head_dim)}, {"kv": torch.float32})

    def forward(self, x: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        if self.states is None:
            raise RuntimeError("LightningAttention has no bound state cache")
        T = x.shape[0]
        qkv = self.act(self.qkv_proj(x)).view(T, self.num_heads, 3 * self.head_dim).float()
        q, k, v = qkv.split(self.head_dim, dim=-1)  # [T, H, D] each
        core = self._decode(q, k, v, meta) if meta.is_decode_only else self._prefill(q, k, v, meta)
        y = self.norm(core.to(x.dtype).flatten(1))  # [T, H*D]
        return self.out_proj(torch.sigmoid(self.output_gate(x)) * y)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        kv = self.states["kv"]
        core = torch.empty_like(v)
        chunks = mixed_step(meta, core, lambda rows, m, seqs: self._decode(q[rows], k[rows], v[rows], m),
                            group_decodes=False)  # a one-token chunk of a mixed step takes the chunked rule too
        for c in chunks:
            init = kv[c.slot] if c.has_initial else kv.new_zeros(kv.shape[1:])
            out, final, states_at = chunk_lightning(
                q[c.rows].transpose(0, 1), k[c.rows].transpose(0, 1), v[c.rows].transpose(0, 1),
                self.slopes, init, self.chunk_size, tuple(off for off, _ in c.snapshots))
            core[c.rows] = out.transpose(0, 1)
            for off, dst in c.snapshots:  # prefix-cache snapshots, taken before the live slot moves on
                kv[dst] = states_at[off]
            kv[c.slot] = final
        return core

    def _decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        # one token per sequence: q, k, v [S, H, D] -> [S, H, D] float32
        kv, slots = self.states["kv"], meta.slots
        zero_fresh_slots(meta, slots, (kv,))
        decay = torch.exp(-self.slopes).view(1, self.num_heads, 1, 1)
        state = kv[slots] * decay + k.unsqueeze(-1) * v.unsqueeze(-2)  # [S, H, D, D]
        kv.index_copy_(0, slots, state)
        for i, _off, dst in meta.checkpoints:  # a decode chunk is one token: the snapshot is the new state
            kv[dst] = kv[slots[i]]
        return torch.einsum("shk,shkv->shv", q, state)
