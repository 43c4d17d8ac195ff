"""xLSTM's mLSTM cell (transformers' xLSTMLayer with its native recurrent kernels) as a stateful layer.

Per head, with q scaled by dqk^-0.5, gates soft-capped (cap * tanh(x / cap)) and log f = logsigmoid(f_preact):
    m_t = max(log f_t + m_{t-1}, i_t)                         (the stabiliser; m starts at 0)
    C_t = exp(log f_t + m_{t-1} - m_t) C_{t-1} + exp(i_t - m_t) k_t v_t^T
    n_t = exp(log f_t + m_{t-1} - m_t) n_{t-1} + exp(i_t - m_t) k_t
    h_t = q_t C_t / (max(|q_t . n_t|, exp(-m_t)) + eps)
State per slot, float32 (transformers' inference_state_dtype): "C" [H, dqk, dv], "n" [H, dqk], "m" [H].

A prefill chunk runs in its parallel form, 64 tokens at a time (a Python loop over sub-chunks, none over tokens):
unrolled, m_t = max(F_t + m_0, max_{s<=t} i_s + F_t - F_s) with F the cumulative log f, so every weight
exp(i_s + F_t - F_s - m_t) is at most 1 and the outputs are those of the recurrence up to float32 round-off. (For
prompts of chunk_size tokens or more, transformers switches to a chunkwise kernel with a coarser stabiliser,
in autocast_kernel_dtype; this follows its recurrent kernels, which it uses below that and for every decode step.)
The model's per-head layer norm of h cancels the denominator (one scalar per head and token) up to its eps."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from stateserve.cache.spec import StateSpec
from stateserve.layers.metadata import StateMetadata
from stateserve.layers.recurrent import StatefulLayer, mixed_step, zero_fresh_slots

_SUB = 64  # parallel-form sub-chunk: [H, 64, 64] weights at a time


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else cap * torch.tanh(x / cap)


class MLSTMCell(StatefulLayer):
    """forward(q [T, H, dqk], k [T, H, dqk], v [T, H, dv], i [T, H], f [T, H] (gate pre-activations, capped),
    meta) -> h [T, H, dv] in q's dtype. Holds no weights: the projections are the model's."""

    def __init__(self, num_heads: int, qk_head_dim: int, v_head_dim: int, eps: float) -> None:
        super().__init__()
        self.num_heads, self.dqk, self.dv, self.eps = num_heads, qk_head_dim, v_head_dim, eps

    def cache_spec(self) -> StateSpec:
        H = self.num_heads
        return StateSpec.of({"C": (H, self.dqk, self.dv), "n": (H, self.dqk), "m": (H,)},
                            {"C": torch.float32, "n": torch.float32, "m": torch.float32})

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: torch.Tensor, f: torch.Tensor,
                meta: StateMetadata) -> torch.Tensor:
        if self.states is None:
            raise RuntimeError("MLSTMCell has no bound state cache")
        q = q * self.dqk ** -0.5
        log_f = F.logsigmoid(f.float())  # [T, H]
        i = i.float()
        if meta.is_decode_only:
            return self._decode(q, k, v, i, log_f, meta)
        return self._mixed(q, k, v, i, log_f, meta)

    # ---- one token per sequence -----------------------------------------------------------------
    def _decode(self, q, k, v, i, log_f, meta: StateMetadata, seqs: list[int] | None = None) -> torch.Tensor:
        """transformers' recurrent step for the sequences `seqs` (all if None), batched, states in place.
        q, k: [S', H, dqk]; v: [S', H, dv]; i, log_f: [S', H] float32 -> h [S', H, dv]"""
        C_all, n_all, m_all = self.states["C"], self.states["n"], self.states["m"]
        seqs = list(range(len(meta.query_lens))) if seqs is None else seqs
        slots = meta.slots if len(seqs) == len(meta.query_lens) else meta.slots[seqs]
        zero_fresh_slots(meta, slots, (C_all, n_all, m_all), seqs)
        C, n, m = C_all[slots], n_all[slots], m_all[slots]
        m_new = torch.maximum(log_f + m, i)  # [S', H]
        f_act, i_act = torch.exp(log_f + m - m_new), torch.exp(i - m_new)
        kf, vf, qf = k.float(), v.float(), q.float()
        C = f_act[..., None, None] * C + i_act[..., None, None] * (kf[..., :, None] * vf[..., None, :])
        n = f_act[..., None] * n + i_act[..., None] * kf
        num = (qf[..., None, :] @ C).squeeze(-2)  # [S', H, dv]
        qn = (qf * n).sum(-1, keepdim=True)  # [S', H, 1]
        h = num / (torch.maximum(qn.abs(), torch.exp(-m_new)[..., None]) + self.eps)
        C_all.index_copy_(0, slots, C)
        n_all.index_copy_(0, slots, n)
        m_all.index_copy_(0, slots, m_new)
        if meta.checkpoints:  # a snapshot after a decode token is the slot's new state
            position = {s: j for j, s in enumerate(seqs)}
            for s, off, dst in meta.checkpoints:
                if s not in position:
                    continue
                if off != 1:
                    raise ValueError(f"state checkpoint offset {off} in a decode step (one token per sequence)")
                src = meta.host_slots[s] if meta.host_slots is not None else int(slots[position[s]])
                for t in (C_all, n_all, m_all):
                    t[dst].copy_(t[src])
        return h.to(q.dtype)

    # ---- prefill chunks (and the decodes sharing their step) ----------------------------------------
    def _mixed(self, q, k, v, i, log_f, meta: StateMetadata) -> torch.Tensor:
        out = q.new_empty(q.shape[0], self.num_heads, self.dv)
        chunks = mixed_step(meta, out, lambda rows, m, seqs: self._decode(q[rows], k[rows], v[rows], i[rows],
                                                                           log_f[rows], m, seqs))
        C_all, n_all, m_all = self.states["C"], self.states["n"], self.states["m"]
        for c in chunks:
            start, qlen, slot, has_initial, snapshots = c.start, c.length, c.slot, c.has_initial, dict(c.snapshots)
            H = self.num_heads
            if has_initial:
                state = (C_all[slot].clone(), n_all[slot].clone(), m_all[slot].clone())
            else:
                state = (q.new_zeros(H, self.dqk, self.dv, dtype=torch.float32),
                         q.new_zeros(H, self.dqk, dtype=torch.float32), q.new_zeros(H, dtype=torch.float32))
            for a in range(0, qlen, _SUB):
                b = min(a + _SUB, qlen)
                r = slice(start + a, start + b)
                h, ends = self._parallel(q[r], k[r], v[r], i[r], log_f[r], state,
                                         [off - a for off in snapshots if a < off <= b])
                out[r] = h.to(out.dtype)
                for rel, st in ends.items():
                    if a + rel in snapshots:
                        dst = snapshots[a + rel]
                        for t, x in zip((C_all, n_all, m_all), st):
                            t[dst].copy_(x)
                state = ends[b - a]
            for t, x in zip((C_all, n_all, m_all), state):
                t[slot].copy_(x)
        return out

    def _parallel(self, q, k, v, i, log_f, state, offsets: list[int]):
        """One sub-chunk of L tokens from `state` (C [H, dqk, dv], n [H, dqk], m [H]). q, k: [L, H, dqk];
        v: [L, H, dv]; i, log_f: [L, H] -> (h [L, H, dv] float32, {offset: state after `offset` tokens} for the
        given offsets and L)."""
        C0, n0, m0 = state
        L = q.shape[0]
        qh, kh, vh = (x.float().transpose(0, 1) for x in (q, k, v))  # [H, L, d]
        Fc = log_f.t().cumsum(-1)  # [H, L] inclusive cumulative log forget
        ih = i.t()
        D = ih[:, None, :] + Fc[:, :, None] - Fc[:, None, :]  # [H, t, s]: i_s + F_t - F_s
        causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        D = D.masked_fill(~causal, float("-inf"))
        from_state = Fc + m0[:, None]  # [H, L]: the log weight of the carried state
        m = torch.maximum(from_state, D.amax(-1))  # [H, L]
        W = torch.exp(D - m[..., None])  # [H, L, L], <= 1
        w0 = torch.exp(from_state - m)  # [H, L]
        S = (qh @ kh.transpose(1, 2)) * W  # [H, L, L]
        num = S @ vh + w0[..., None] * (qh @ C0)  # [H, L, dv]
        qn = S.sum(-1) + w0 * (qh @ n0[..., None]).squeeze(-1)  # [H, L]
        h = num / (torch.maximum(qn.abs(), torch.exp(-m))[..., None] + self.eps)
        ends = {}
        for off in set(offsets) | {L}:
            row = off - 1
            w, c0 = W[:, row, :off], w0[:, row]  # [H, off], [H]
            C = (kh[:, :off] * w[..., None]).transpose(1, 2) @ vh[:, :off] + c0[:, None, None] * C0
            n = (kh[:, :off] * w[..., None]).sum(1) + c0[:, None] * n0
            ends[off] = (C, n, m[:, row].clone())
        return h.transpose(0, 1), ends
