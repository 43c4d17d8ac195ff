"""Kimi Delta Attention (Kimi Linear's linear attention): short causal convs on q, k, v, then the gated delta rule
with a per-channel (fine-grained) forget gate

    S_t = diag(exp(g_t)) S_{t-1} + k_t^T beta_t (v_t - k_t diag(exp(g_t)) S_{t-1}),    o_t = q_t S_t

where g_t is a vector of head_dim log decays (Gated DeltaNet's is one scalar per head, delta_rule.py). The state S
per head is [head_dim (keys), head_dim (values)] in float32, as transformers keeps it. Prefill runs the chunked
(UT-transform) form of delta_rule.py with the per-head decay exp(cum_t - cum_i) replaced by a per-channel one inside
the q.k and k.k products; decode advances every sequence by one token in one batched update."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stateserve.cache.spec import StateSpec
from stateserve.layers.delta_rule import delta_rule_step, l2norm
from stateserve.layers.markers import stacked
from stateserve.layers.metadata import StateMetadata
from stateserve.layers.moe import activation_fn
from stateserve.layers.param_cache import float32_copy
from stateserve.layers.recurrent import (StatefulLayer, causal_conv1d_decode, causal_conv1d_prefill, conv_state_at,
                                         mixed_step, zero_fresh_slots)


def chunk_kda_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   initial_state: torch.Tensor, chunk_size: int = 16,
                   snapshot_offsets: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """One sequence, float32. q, k: [H, L, Dk] (normalised, q already scaled); v: [H, L, Dv]; g: [H, L, Dk] (log
    decays, <= 0); beta: [H, L]; initial_state: [H, Dk, Dv]. Returns out [H, L, Dv], the final state [H, Dk, Dv] and
    {offset: state after `offset` tokens} for each requested 0 < offset <= L.

    Inside a chunk the decays between token i and a later token t are exp(cum_t - cum_i) per channel; they are
    formed as differences (never exp(cum_t) * exp(-cum_i), which overflows for fast-decaying channels), which makes
    a [H, C, C, Dk] tensor per chunk: the chunks run one after another, so memory stays per chunk. That tensor's
    work per token grows with C, so chunks are short (16: on a 2-core Zen 4, 16-token chunks ran 32- and 512-token
    prompts 6x and 2.5x faster than 64-token ones, 2048 tokens 1.2x faster than 32-token ones)."""
    H, L, Dk = k.shape
    Dv = v.shape[-1]
    C = chunk_size
    pad = (-L) % C
    if pad:  # padded tokens have k = 0, beta = 0, g = 0: they neither read nor change the state
        q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    N = (L + pad) // C
    q, k, v, g = (t.reshape(H, N, C, t.shape[-1]) for t in (q, k, v, g))
    beta = beta.reshape(H, N, C)
    cum = g.cumsum(2)  # [H, N, C, Dk] log decay from the chunk start through token t (inclusive)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    k_beta = k * beta.unsqueeze(-1)
    v_beta = v * beta.unsqueeze(-1)

    snapshots: dict[int, torch.Tensor] = {}
    state = initial_state
    out = torch.empty(H, N, C, Dv, dtype=q.dtype, device=q.device)
    for n in range(N):  # sequential only across chunks
        cn, kn = cum[:, n], k[:, n]  # [H, C, Dk]
        # decay[t, i, d] = exp(cum_t[d] - cum_i[d]) for i <= t, 0 above the diagonal
        diff = (cn.unsqueeze(2) - cn.unsqueeze(1)).masked_fill(~causal[:, :, None], float("-inf"))
        decay = diff.exp()  # [H, C, C, Dk]
        # delta_t + sum_{i<t} A[t, i] delta_i = beta_t v_t - beta_t (k_t * exp(cum_t)) S, as in delta_rule.py but
        # A[t, i] = beta_t sum_d k_t[d] k_i[d] exp(cum_t[d] - cum_i[d])
        system = torch.einsum("htd,hid,htid->hti", k_beta[:, n], kn, decay)  # diagonal unused (unitriangular)
        u = torch.linalg.solve_triangular(system, v_beta[:, n], upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, k_beta[:, n] * cn.exp(), upper=False, unitriangular=True)
        delta = u - w @ state  # [H, C, Dv]
        intra = torch.einsum("htd,hid,htid->hti", q[:, n], kn, decay)  # [H, C, C]
        out[:, n] = (q[:, n] * cn.exp()) @ state + intra @ delta
        for off in snapshot_offsets:
            j = off - n * C  # tokens of this chunk the snapshot includes
            if 0 < j < C:  # mid-chunk; a snapshot at the chunk's end is the carried state below
                last = cn[:, j - 1:j]  # [H, 1, Dk]
                keys = kn[:, :j] * (last - cn[:, :j]).exp()  # [H, j, Dk]
                snapshots[off] = state * last.transpose(-1, -2).exp() + keys.transpose(-1, -2) @ delta[:, :j]
        end = cn[:, -1:]  # [H, 1, Dk]
        keys = kn * (end - cn).exp()  # each key decayed to the chunk's last token
        state = state * end.transpose(-1, -2).exp() + keys.transpose(-1, -2) @ delta
        for off in snapshot_offsets:
            if off == (n + 1) * C:
                snapshots[off] = state
    return out.reshape(H, N * C, Dv)[:, :L], state, snapshots


class SigmoidGatedRMSNorm(nn.Module):
    """RMSNorm over the last dim in float32, times sigmoid(gate) (KimiLinearRMSNormGated), rounded once."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (float32_copy(self, "weight") * xf * torch.sigmoid(gate.float())).to(dtype)


def kda_softplus(x: torch.Tensor) -> torch.Tensor:
    # transformers' forget gate: x above 20 passes through, else log(1 + exp(x)) (not log1p)
    return torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))


class KimiDeltaAttention(StatefulLayer):
    """Kimi Linear's KDA mixer: forward(x [T, hidden], meta) -> [T, hidden].

    State per sequence: "conv" [3 * H * D, K-1] (model dtype; q, k, v channels) and "ssm" [H, D, D] (float32).
    Parameters follow transformers' names, with q/k/v_proj fused into qkv_proj and the three q/k/v_conv1d of the
    checkpoint into conv1d (stacked shards); the forget gate's f_a_proj, f_b_proj, dt_bias [H*D] (kept float32) and
    A_log [1, 1, H, 1] sit on this layer as in the checkpoint.

    Bailing Hybrid's variant (models/bailing_hybrid.py) differs only in the gates: `low_rank_gates=False` makes the
    forget and output gates one full-rank projection each (f_proj, g_proj [H*D, hidden]) with A_log [H], and
    `gate_lower_bound` (its "safe gate") bounds the log decay to lower_bound * sigmoid(exp(A) * (f + dt_bias))
    instead of Kimi's -exp(A) * softplus(f + dt_bias)."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, conv_kernel: int, eps: float,
                 activation: str, dtype: torch.dtype, chunk_size: int = 16, low_rank_gates: bool = True,
                 gate_lower_bound: float | None = None) -> None:
        super().__init__()
        self.low_rank_gates, self.gate_lower_bound = low_rank_gates, gate_lower_bound
        self.num_heads, self.head_dim = num_heads, head_dim
        self.qkv_dim = num_heads * head_dim
        self.conv_dim = 3 * self.qkv_dim
        self.kernel, self.dtype, self.chunk_size = conv_kernel, dtype, chunk_size
        self.act = activation_fn(activation)
        self.qkv_proj = nn.Linear(hidden_size, self.conv_dim, bias=False)
        stacked(self.qkv_proj.weight, [self.qkv_dim] * 3)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False)
        stacked(self.conv1d.weight, [self.qkv_dim] * 3)
        if low_rank_gates:  # Kimi: hidden -> head_dim -> H*D for both gates
            self.f_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
            self.f_b_proj = nn.Linear(head_dim, self.qkv_dim, bias=False)
            self.g_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
            self.g_b_proj = nn.Linear(head_dim, self.qkv_dim, bias=False)
        else:  # Bailing: hidden -> H*D directly
            self.f_proj = nn.Linear(hidden_size, self.qkv_dim, bias=False)
            self.g_proj = nn.Linear(hidden_size, self.qkv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(self.qkv_dim))
        # deterministic decay rates spread over transformers' init range [1, 16], in the checkpoint's shape
        a_log = torch.linspace(0.0, 2.77, num_heads)
        self.A_log = nn.Parameter(a_log.view(1, 1, num_heads, 1) if low_rank_gates else a_log)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.o_norm = SigmoidGatedRMSNorm(head_dim, eps)
        self.o_proj = nn.Linear(self.qkv_dim, hidden_size, bias=False)

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        self.dt_bias.data = self.dt_bias.data.float()  # transformers keeps it float32 in every dtype
        return self

    def cache_spec(self) -> StateSpec:
        return StateSpec.of({"conv": (self.conv_dim, self.kernel - 1),
                             "ssm": (self.num_heads, self.head_dim, self.head_dim)},
                            {"conv": self.dtype, "ssm": torch.float32})

    def _gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> per-channel log decays g [T, H, D] and beta [T, H], both float32."""
        T = x.shape[0]
        f = self.f_b_proj(self.f_a_proj(x)) if self.low_rank_gates else self.f_proj(x)
        f = (f.float() + self.dt_bias.float()).view(T, self.num_heads, self.head_dim)
        neg_a = self.neg_exp_A().view(self.num_heads, 1)  # -exp(A_log) per head
        if self.gate_lower_bound is None:
            g = neg_a * kda_softplus(f)
        else:  # bounded: every channel keeps at least exp(lower_bound) of its state per token
            g = self.gate_lower_bound * torch.sigmoid(-neg_a * f)
        return g, torch.sigmoid(self.b_proj(x)).float()

    def _qkv(self, conv_out: torch.Tensor):
        """Activated conv output [T, 3*H*D] -> float32 q (l2-normed, scaled), k (l2-normed), v, each [T, H, D]."""
        T = conv_out.shape[0]
        q, k, v = (t.float().reshape(T, self.num_heads, self.head_dim) for t in conv_out.split(self.qkv_dim, dim=-1))
        return l2norm(q) * self.head_dim ** -0.5, l2norm(k), v

    def forward(self, x: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        mixed = self.qkv_proj(x)  # [T, 3*H*D] as the conv wants it: [q | k | v]
        g, beta = self._gates(x)
        if meta.is_decode_only:
            core = self._decode(mixed, g, beta, meta)
        else:
            core = self._prefill(mixed, g, beta, meta)  # [T, H, D] float32
        gate = self.g_b_proj(self.g_a_proj(x)) if self.low_rank_gates else self.g_proj(x)
        gate = gate.view(x.shape[0], self.num_heads, self.head_dim)
        # transformers rounds the core output to the model dtype before the norm
        out = self.o_norm(core.to(x.dtype), gate, x.dtype)
        return self.o_proj(out.flatten(1))

    def _prefill(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        conv_state, ssm_state = self.states["conv"], self.states["ssm"]
        weight = self.conv1d.weight.squeeze(1)  # [C, K]
        core = mixed.new_empty(mixed.shape[0], self.num_heads, self.head_dim, dtype=torch.float32)
        chunks = mixed_step(meta, core, lambda rows, m, seqs: self._decode(mixed[rows], g[rows], beta[rows], m),
                            group_decodes=False)  # a one-token chunk of a mixed step takes the chunked rule too
        for c in chunks:
            y, inputs = causal_conv1d_prefill(mixed[c.rows], weight, None,
                                              conv_state[c.slot] if c.has_initial else None)
            q, k, v = self._qkv(self.act(y).to(mixed.dtype))
            init = ssm_state[c.slot] if c.has_initial else ssm_state.new_zeros(ssm_state.shape[1:])
            out, final, states_at = chunk_kda_rule(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g[c.rows].transpose(0, 1),
                beta[c.rows].t(), init.float(), self.chunk_size, tuple(off for off, _ in c.snapshots))
            core[c.rows] = out.transpose(0, 1)
            for off, dst in c.snapshots:  # prefix-cache snapshots, taken before the live slot moves on
                conv_state[dst] = conv_state_at(inputs, off, self.kernel).to(conv_state.dtype)
                ssm_state[dst] = states_at[off]
            conv_state[c.slot] = conv_state_at(inputs, c.length, self.kernel).to(conv_state.dtype)
            ssm_state[c.slot] = final
        return core

    def _decode(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        # one token per sequence: mixed [S, 3*H*D], g [S, H, D], beta [S, H] -> [S, H, D] float32
        conv_state, ssm_state = self.states["conv"], self.states["ssm"]
        slots = meta.slots
        zero_fresh_slots(meta, slots, (conv_state, ssm_state))
        # float32 sums rounded once, as our prefill and transformers' conv1d do (bf16: products unrounded)
        y = causal_conv1d_decode(mixed, self.conv1d.weight.squeeze(1), None, conv_state, slots, float_accumulate=True,
                                 taps=self.conv_taps())
        q, k, v = self._qkv(self.act(y).to(mixed.dtype))
        core = delta_rule_step(ssm_state, slots, q, k, v, g.exp(), beta)  # each key channel decayed
        for i, _off, dst in meta.checkpoints:  # a decode chunk is one token: the snapshot is the new state
            conv_state[dst] = conv_state[slots[i]]
            ssm_state[dst] = ssm_state[slots[i]]
        return core
