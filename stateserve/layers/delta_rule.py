"""Gated DeltaNet (Qwen3-Next and Qwen3.5 linear attention): short causal conv, then the gated delta rule

    S_t = exp(g_t) S_{t-1} + k_t^T beta_t (v_t - k_t exp(g_t) S_{t-1}),    o_t = q_t S_t

with a per-head state S of shape [head_k_dim, head_v_dim] (transformers' layout), kept in float32.
Prefill runs the chunked (UT-transform) form: inside a chunk the delta corrections solve one unit lower
triangular system, and the state is carried across chunks, so no loop runs over tokens. Decode advances all
sequences of the step by one token in one batched update."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from stateserve.cache.spec import StateSpec
from stateserve.layers.markers import stacked
from stateserve.layers.metadata import StateMetadata
from stateserve.layers.moe import activation_fn
from stateserve.layers.param_cache import float32_copy
from stateserve.layers.recurrent import (StatefulLayer, causal_conv1d_decode, causal_conv1d_prefill, conv_state_at,
                                         mixed_step, zero_fresh_slots)
from stateserve.platform import kernels


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # the FLA / transformers convention: x * rsqrt(sum(x^2) + eps)
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def delta_rule_step(ssm_state: torch.Tensor, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    decay: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """One decode token of the delta rule on the states at `slots` ([num_slots, H, Dk, Dv]), in place: S <- S * decay,
    S <- S + k ((v - k^T S) * beta)^T; returns q^T S [S, H, Dv] float32. q, k [S, H, Dk], v [S, H, Dv], beta [S, H]
    float32; decay [S, H] (one factor per head: the gated delta net) or [S, H, Dk] (per key channel: KDA). The C++
    kernel on float32 states (csrc/delta_rule_update.cpp: two passes over each state), else PyTorch."""
    kernel = kernels.table(ssm_state.device).delta_rule_decode(ssm_state.dtype)
    if kernel is not None and ssm_state.is_contiguous():
        return kernel(ssm_state, slots, q.contiguous(), k.contiguous(), v.contiguous(), decay.contiguous(),
                      beta.contiguous())
    state = ssm_state[slots] * (decay[..., None, None] if decay.dim() == 2 else decay.unsqueeze(-1))
    predicted = torch.einsum("shk,shkv->shv", k, state)
    delta = (v - predicted) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    ssm_state.index_copy_(0, slots, state)
    return torch.einsum("shk,shkv->shv", q, state)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           initial_state: torch.Tensor, chunk_size: int = 64,
                           snapshot_offsets: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """One sequence, float32. q, k: [H, L, Dk] (normalised, q already scaled); v: [H, L, Dv]; g, beta: [H, L];
    initial_state: [H, Dk, Dv]. Returns out [H, L, Dv], final state [H, Dk, Dv] and {offset: state after
    `offset` tokens} for each requested 0 < offset <= L."""
    H, L, Dk = k.shape
    Dv = v.shape[-1]
    # a sequence shorter than a chunk is padded only to a multiple of 16 (a 32-token prompt in 64-token chunks took
    # 3.8x as long on a 2-core Zen 4: the padding's work is real work)
    C = min(chunk_size, max(16, -(-L // 16) * 16))
    pad = (-L) % C
    if pad:  # padded tokens have k = 0, beta = 0, g = 0: they neither read nor change the state
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    N = (L + pad) // C
    q, k, v = (t.reshape(H, N, C, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(H, N, C), beta.reshape(H, N, C)

    cum = g.cumsum(-1)  # [H, N, C] log decay from the chunk start through token t (inclusive)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # decay[t, i] = exp(cum_t - cum_i) for i <= t, 0 above the diagonal
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # [H, N, C, C]
    k_beta = k * beta.unsqueeze(-1)
    # delta_t + sum_{i<t} A[t, i] delta_i = beta_t v_t - beta_t exp(cum_t) k_t S   (S: state at chunk start)
    # so delta = u - w S with (I + strict_lower(A)) [u | w] = [beta v | beta exp(cum) k]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # diagonal ignored by the unit-triangular solve
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay  # [H, N, C, C]
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)  # each key decayed to the chunk's last token
    chunk_decay = cum[..., -1].exp()  # [H, N]

    snapshots: dict[int, torch.Tensor] = {}
    state = initial_state
    out = torch.empty(H, N, C, Dv, dtype=q.dtype, device=q.device)
    for n in range(N):  # sequential only across chunks
        delta = u[:, n] - w[:, n] @ state  # [H, C, Dv]
        out[:, n] = q_decayed[:, n] @ state + intra[:, n] @ delta
        for off in snapshot_offsets:
            j = off - n * C  # tokens of this chunk the snapshot includes
            if 0 < j < C:  # mid-chunk; a snapshot at the chunk's end is the carried state below
                last = cum[:, n, j - 1:j]  # [H, 1]
                keys = k[:, n, :j] * (last - cum[:, n, :j]).exp().unsqueeze(-1)  # [H, j, Dk]
                snapshots[off] = state * last.exp().unsqueeze(-1) + keys.transpose(-1, -2) @ delta[:, :j]
        state = state * chunk_decay[:, n, None, None] + k_to_end[:, n].transpose(-1, -2) @ delta
        for off in snapshot_offsets:
            if off == (n + 1) * C:
                snapshots[off] = state
    return out.reshape(H, N * C, Dv)[:, :L], state, snapshots


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim, then times silu(gate) (norm before gate, as Qwen3NextRMSNormGated)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * xf.to(dtype)) * F.silu(gate.float())).to(dtype)


# The input projection layouts of the checkpoints (transformers' names):
#   "grouped"  Qwen3-Next: in_proj_qkvz rows grouped per key head [q | k | v of its value heads | z of them],
#              in_proj_ba grouped per key head [b of its value heads | a of them].
#   "flat"     Qwen3.5: four matrices in_proj_qkv [q (all heads) | k | v], in_proj_z, in_proj_b, in_proj_a; kept
#              here as two fused matmuls, in_proj_qkvz = [qkv | z] and in_proj_ba = [b | a], loaded by shard.
#   "separate" OLMo Hybrid: six matrices q_proj, k_proj, v_proj, g_proj (the output gate z), b_proj, a_proj; the
#              same two fused matmuls as "flat", each filled by shard from its own matrices; the conv weight is
#              stored per projection too (q_conv1d, k_conv1d, v_conv1d), as three shards of conv1d.
PROJECTION_LAYOUTS = ("grouped", "flat", "separate")
# "flat" checkpoint matrix -> (this layer's fused parameter, its shard)
FLAT_PROJECTION_SHARDS = {"in_proj_qkv": ("in_proj_qkvz", 0), "in_proj_z": ("in_proj_qkvz", 1),
                          "in_proj_b": ("in_proj_ba", 0), "in_proj_a": ("in_proj_ba", 1)}
# "separate" checkpoint matrix -> (this layer's fused parameter, its shard)
SEPARATE_PROJECTION_SHARDS = {"q_proj": ("in_proj_qkvz", 0), "k_proj": ("in_proj_qkvz", 1),
                              "v_proj": ("in_proj_qkvz", 2), "g_proj": ("in_proj_qkvz", 3),
                              "b_proj": ("in_proj_ba", 0), "a_proj": ("in_proj_ba", 1),
                              "q_conv1d": ("conv1d", 0), "k_conv1d": ("conv1d", 1), "v_conv1d": ("conv1d", 2)}


class GatedDeltaNet(StatefulLayer):
    """Qwen3-Next / Qwen3.5 / OLMo Hybrid linear-attention mixer: forward(x [T, hidden], meta) -> [T, hidden].

    State per sequence: "conv" [conv_dim, K-1] (model dtype) and "ssm" [num_v_heads, head_k_dim, head_v_dim]
    (float32). Checkpoint names follow transformers (conv1d, dt_bias, A_log, norm, out_proj and the input
    projections of `layout`, see PROJECTION_LAYOUTS); value heads h*r .. h*r+r-1 share key head h in both."""

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int, eps: float, activation: str, dtype: torch.dtype, chunk_size: int = 64,
                 layout: str = "grouped", beta_scale: float = 1.0) -> None:
        """beta_scale: beta = beta_scale * sigmoid(b); OLMo Hybrid's linear_allow_neg_eigval uses 2, so the
        transition I - beta k k^T may have negative eigenvalues."""
        super().__init__()
        if layout not in PROJECTION_LAYOUTS:
            raise ValueError(f"GatedDeltaNet layout {layout!r} is not one of {PROJECTION_LAYOUTS}")
        self.layout = layout
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads={num_v_heads} is not a multiple of "
                             f"linear_num_key_heads={num_k_heads}")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.group = num_v_heads // num_k_heads  # value heads per key head
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = conv_kernel
        self.dtype, self.chunk_size = dtype, chunk_size
        self.beta_scale = float(beta_scale)
        self.act = activation_fn(activation)
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * num_v_heads, bias=False)
        if layout == "flat":  # each fused matrix is filled from two checkpoint matrices
            stacked(self.in_proj_qkvz.weight, [self.conv_dim, self.value_dim])
            stacked(self.in_proj_ba.weight, [num_v_heads, num_v_heads])
        elif layout == "separate":  # [q | k | v | z] and [b | a], each shard its own checkpoint matrix
            stacked(self.in_proj_qkvz.weight, [self.key_dim, self.key_dim, self.value_dim, self.value_dim])
            stacked(self.in_proj_ba.weight, [num_v_heads, num_v_heads])
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False)
        if layout == "separate":
            stacked(self.conv1d.weight, [self.key_dim, self.key_dim, self.value_dim])
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        # deterministic decay rates spread over transformers' init range (1-D params survive dummy init)
        self.A_log = nn.Parameter(torch.linspace(math.log(0.5), math.log(16.0), num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def cache_spec(self) -> StateSpec:
        return StateSpec.of({"conv": (self.conv_dim, self.kernel - 1),
                             "ssm": (self.num_v_heads, self.head_k_dim, self.head_v_dim)},
                            {"conv": self.dtype, "ssm": torch.float32})

    def _project(self, x: torch.Tensor):
        # x: [T, hidden] -> mixed qkv [T, conv_dim], z [T, Hv, Dv], b and a [T, Hv]
        T = x.shape[0]
        if self.layout != "grouped":  # already [q | k | v] as the conv wants it: views, no copy
            mixed, z = self.in_proj_qkvz(x).split([self.conv_dim, self.value_dim], dim=-1)
            b, a = self.in_proj_ba(x).chunk(2, dim=-1)
            return mixed, z.view(T, self.num_v_heads, self.head_v_dim), b, a
        dk, dv, r = self.head_k_dim, self.head_v_dim, self.group
        qkvz = self.in_proj_qkvz(x).view(T, self.num_k_heads, 2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = self.in_proj_ba(x).view(T, self.num_k_heads, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        return mixed, z.reshape(T, self.num_v_heads, dv), b.reshape(T, -1), a.reshape(T, -1)

    def _qkv_gates(self, conv_out: torch.Tensor, b: torch.Tensor, a: torch.Tensor):
        """conv_out [T, conv_dim] -> float32 q, k [T, Hv, Dk] (l2-normed, q scaled), v [T, Hv, Dv], g, beta [T, Hv]."""
        T = conv_out.shape[0]
        q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2norm(q.float().view(T, self.num_k_heads, self.head_k_dim)) * self.head_k_dim ** -0.5
        k = l2norm(k.float().view(T, self.num_k_heads, self.head_k_dim))
        if self.group > 1:  # value heads h*r .. h*r+r-1 share key head h
            q, k = q.repeat_interleave(self.group, dim=1), k.repeat_interleave(self.group, dim=1)
        v = v.float().view(T, self.num_v_heads, self.head_v_dim)
        beta = torch.sigmoid(b).float()
        if self.beta_scale != 1.0:
            beta = beta * self.beta_scale
        g = self.neg_exp_A() * F.softplus(a.float() + self.dt_bias)
        return q, k, v, g, beta

    def forward(self, x: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        mixed, z, b, a = self._project(x)
        if meta.is_decode_only:
            core = self._decode(mixed, b, a, meta)
        else:
            core = self._prefill(mixed, b, a, meta)  # [T, Hv, Dv] float32
        out = self.norm(core.to(x.dtype), z)
        return self.out_proj(out.flatten(1))

    def _prefill(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        conv_state, ssm_state = self.states["conv"], self.states["ssm"]
        weight = self.conv1d.weight.squeeze(1)  # [C, K]
        core = mixed.new_empty(mixed.shape[0], self.num_v_heads, self.head_v_dim, dtype=torch.float32)
        chunks = mixed_step(meta, core, lambda rows, m, seqs: self._decode(mixed[rows], b[rows], a[rows], m),
                            group_decodes=False)  # a one-token chunk of a mixed step takes the chunked rule too
        for c in chunks:
            y, padded = causal_conv1d_prefill(mixed[c.rows], weight, None,
                                              conv_state[c.slot] if c.has_initial else None)
            q, k, v, g, beta = self._qkv_gates(self.act(y).to(mixed.dtype), b[c.rows], a[c.rows])
            init = ssm_state[c.slot] if c.has_initial else ssm_state.new_zeros(ssm_state.shape[1:])
            out, final, states_at = chunk_gated_delta_rule(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.t(), beta.t(), init.float(),
                self.chunk_size, tuple(off for off, _ in c.snapshots))
            core[c.rows] = out.transpose(0, 1)
            for off, dst in c.snapshots:  # prefix-cache snapshots, taken before the live slot moves on
                conv_state[dst] = conv_state_at(padded, off, self.kernel).to(conv_state.dtype)
                ssm_state[dst] = states_at[off]
            conv_state[c.slot] = conv_state_at(padded, c.length, self.kernel).to(conv_state.dtype)
            ssm_state[c.slot] = final
        return core

    def _decode(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        # one token per sequence: mixed [S, conv_dim]
        conv_state, ssm_state = self.states["conv"], self.states["ssm"]
        slots = meta.slots
        zero_fresh_slots(meta, slots, (conv_state, ssm_state))
        # float32 sums rounded once, as our prefill and transformers' conv1d do (bf16: products unrounded)
        y = causal_conv1d_decode(mixed, self.conv1d.weight.squeeze(1), None, conv_state, slots, float_accumulate=True,
                                 taps=self.conv_taps())
        qkv = self.act(y).to(mixed.dtype)
        fused = kernels.table(ssm_state.device).gated_delta_decode(qkv.dtype)
        if fused is not None and ssm_state.is_contiguous():  # the gates and the update in one call
            core = fused(ssm_state, slots, qkv.contiguous(), b, a, self.neg_exp_A(), float32_copy(self, "dt_bias"),
                         self.num_k_heads, self.beta_scale)
        else:
            q, k, v, g, beta = self._qkv_gates(qkv, b, a)  # [S, Hv, ...]
            core = delta_rule_step(ssm_state, slots, q, k, v, g.exp(), beta)  # decay per head
        for i, _off, dst in meta.checkpoints:  # a decode chunk is one token: the snapshot is the new state
            conv_state[dst] = conv_state[slots[i]]
            ssm_state[dst] = ssm_state[slots[i]]
        return core
