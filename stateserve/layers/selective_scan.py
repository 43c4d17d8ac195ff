"""Mamba1 selective state space: the chunked parallel scan for prefill, the fused one-step decode update,
and the `MambaMixer` stateful layer (Mamba, FalconMamba, and Jamba's Mamba layers).

Per channel d and state index n: h_t = exp(dt_t[d] * A[d, n]) * h_{t-1} + dt_t[d] * B_t[n] * u_t[d],
y_t[d] = sum_n C_t[n] * h_t[d, n] + D[d] * u_t[d], gated by silu(z_t).
Glossary: L = tokens of one sequence's chunk, D = intermediate_size (d_inner), N = state_size, S = sequences.

Dtypes follow transformers exactly: dt gets its bias and softplus in the model dtype, the recurrence runs in
float32 and C . h is a model-dtype matmul; prefill (its `mamba_selective_scan`) then does the D skip and the gate
in float32, decode (its `selective_state_update`) in the model dtype. The ssm state is stored in float32
because it accumulates over the whole sequence."""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from stateserve.cache.spec import StateSpec
from stateserve.platform import kernels
from stateserve.layers.linear import FewRowCall, decode_projections, linear_without_bias
from stateserve.layers.metadata import StateMetadata
from stateserve.layers.norm import RMSNorm
from stateserve.layers.param_cache import derived_from_module, dtype_copy
from stateserve.layers.recurrent import (StatefulLayer, causal_conv1d_decode, causal_conv1d_prefill, checkpoints_of,
                                         conv_state_at, decode_group, verify_rounds)

# Elements of one [Q, D, N] float32 scan temporary; the scan chunk Q is chosen to stay under it.
SCAN_BUDGET_ELEMENTS = 1 << 23
MIN_SCAN_CHUNK, MAX_SCAN_CHUNK = 16, 256


def scan_chunk_size(d_inner: int, d_state: int) -> int:
    """Tokens per scan chunk: the largest power of two in [16, 256] whose [Q, D, N] tensor fits the budget."""
    fit = max(1, SCAN_BUDGET_ELEMENTS // (d_inner * d_state))
    q = 1 << int(math.floor(math.log2(fit)))
    return max(MIN_SCAN_CHUNK, min(MAX_SCAN_CHUNK, q))


def _inclusive_scan_(decay: torch.Tensor, inputs: torch.Tensor) -> None:
    """Hillis-Steele scan over dim 0 of the linear recurrence h_t = decay_t * h_{t-1} + inputs_t, in place.

    decay, inputs: [Q, D, N]. Afterwards decay[t] = prod(decay[0..t]) and inputs[t] = h_t for h_{-1} = 0,
    in log2(Q) whole-chunk steps; each step combines element t with element t - step."""
    q = decay.shape[0]
    step = 1
    while step < q:
        # the products are computed into fresh tensors before the in-place writes, so overlapping
        # slices read the values of the previous step
        carried = decay[step:] * inputs[:-step]
        inputs[step:] += carried
        del carried
        decay[step:] = decay[step:] * decay[:-step]
        step *= 2


def selective_scan_prefill(u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                           h0: torch.Tensor | None, snapshot_offsets: Sequence[int] = (),
                           chunk_size: int | None = None, D: torch.Tensor | None = None,
                           z: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """Selective scan of one sequence's chunk, resuming from state h0, chunk by chunk.

    u: [L, D] model dtype (conv output); dt: [L, D] after bias and softplus, or with dt_bias [D] before them (the
    step is then F.softplus(dt + dt_bias), taken inside the CPU kernel); A: [D, N] float32;
    B, C: [L, N] model dtype; h0: [D, N] float32 or None (zeros).
    Returns y = C . h in u's dtype [L, D], the final state [D, N] float32 and the state after each requested
    offset (1 <= offset <= L). With D [D] and z [L, D] (the gate before its SiLU), y is (C . h + u * D) * silu(z)
    in u's dtype: the block's skip and gate, fused into the scan on CPU. Only [Q, D, N] temporaries exist."""
    if (D is None) != (z is None):
        raise ValueError("selective_scan_prefill: D and z come together")
    L, d_inner = u.shape
    d_state = A.shape[1]
    kernel = kernels.table(u.device).selective_scan(u.dtype)
    if kernel is not None:
        offsets = sorted(set(snapshot_offsets))
        # u, dt and z are read in place in u's dtype; y's product with C rounds the state to that dtype first, as
        # the matmul below does
        y, h, snaps = kernel(u, dt, A, B, C, h0, offsets, D, z, dt_bias)
        return y.to(u.dtype), h, {off: snaps[i] for i, off in enumerate(offsets)}
    if dt_bias is not None:
        dt = F.softplus(dt + dt_bias.to(dt.dtype))
    q = chunk_size or scan_chunk_size(d_inner, d_state)
    y = u.new_empty(L, d_inner)
    h = h0.float() if h0 is not None else A.new_zeros(d_inner, d_state)
    snapshots: dict[int, torch.Tensor] = {}
    for start in range(0, L, q):
        end = min(start + q, L)
        dt_c = dt[start:end].float()  # [Q, D]
        decay = torch.exp(A[None] * dt_c[:, :, None])  # [Q, D, N]
        # (dt * B) * u: the same association as transformers
        inputs = dt_c[:, :, None] * B[start:end, None, :].float()
        inputs *= u[start:end, :, None].float()
        _inclusive_scan_(decay, inputs)
        states = torch.addcmul(inputs, decay, h[None])  # [Q, D, N]: h_t including the carried state
        del decay, inputs
        y[start:end] = torch.matmul(states.to(u.dtype), C[start:end, :, None].to(u.dtype)).squeeze(-1)
        for off in snapshot_offsets:
            if start < off <= end:
                snapshots[off] = states[off - start - 1].clone()
        h = states[-1].clone()
        del states
    if D is not None:
        y = ((y.float() + u.float() * D.float()) * F.silu(z).float()).to(u.dtype)
    return y, h, snapshots


def selective_state_update(ssm_state: torch.Tensor, slots: torch.Tensor, u: torch.Tensor, dt_raw: torch.Tensor,
                           dt_bias: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                           D: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """One token for each of S sequences, batched. ssm_state: [num_slots, D, N] float32, updated at `slots`.

    u, dt_raw (before bias), z: [S, D]; B, C: [S, N]; A: [D, N] float32. Returns the gated output [S, D]."""
    kernel = kernels.table(ssm_state.device).selective_update(ssm_state.dtype, u.dtype, dt_raw.dtype, B.dtype,
                                                              C.dtype, z.dtype)
    if kernel is not None:
        # step sizes, the update and everything below in one pass over each state, in place, same rounding
        return kernel(ssm_state, slots, u, dt_raw, dt_bias, A, B, C, D, z)
    dt = F.softplus(dt_raw + dt_bias.to(dt_raw.dtype))  # model dtype, as transformers
    dt32 = dt.float()[:, :, None]
    h = ssm_state[slots].float() * torch.exp(dt32 * A) + (dt32 * B.float()[:, None, :]) * u.float()[:, :, None]
    ssm_state.index_copy_(0, slots, h.to(ssm_state.dtype))
    y = torch.matmul(h.to(C.dtype), C[:, :, None]).squeeze(-1)  # [S, D]
    y = y + u * D.to(u.dtype)
    return y * F.silu(z)


class WeightlessRMSNorm(nn.Module):
    """FalconMamba's parameter-free RMS norm on dt, B and C: normalised in float32, cast back."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class MambaMixer(StatefulLayer):
    """The Mamba1 block's mixer: in_proj -> causal conv + silu -> selective SSM gated by silu(z) -> out_proj.

    Parameter names follow transformers (in_proj, conv1d, x_proj, dt_proj, A_log, D, out_proj and, with a
    B/C/dt norm, dt_layernorm / b_layernorm / c_layernorm). State per slot: conv [D, K-1] in the model
    dtype and ssm [D, N] in float32.
    bcdt_norm: None (Mamba), "weightless" (FalconMamba) or "weighted" (Jamba: RMSNorms with weights)."""

    def __init__(self, hidden_size: int, intermediate_size: int, state_size: int, conv_kernel: int,
                 time_step_rank: int, use_conv_bias: bool, use_bias: bool, bcdt_norm: str | None = None,
                 rms_eps: float = 1e-6, dtype: torch.dtype = torch.float32, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ("silu", "swish"):
            raise ValueError(f"Mamba mixer: hidden_act={activation!r} is not supported (only 'silu')")
        if bcdt_norm not in (None, "weightless", "weighted"):
            raise ValueError(f"Mamba mixer: unknown bcdt_norm {bcdt_norm!r}")
        self.intermediate_size, self.state_size = intermediate_size, state_size
        self.conv_kernel, self.time_step_rank = conv_kernel, time_step_rank
        self.dtype = dtype
        self.scan_chunk = scan_chunk_size(intermediate_size, state_size)
        self.in_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=use_bias)
        # depthwise conv weights in transformers' nn.Conv1d layout [D, 1, K]; the conv runs functionally
        self.conv1d = nn.Conv1d(intermediate_size, intermediate_size, conv_kernel, groups=intermediate_size,
                                bias=use_conv_bias, padding=conv_kernel - 1)
        self.x_proj = nn.Linear(intermediate_size, time_step_rank + 2 * state_size, bias=False)
        self.dt_proj = nn.Linear(time_step_rank, intermediate_size, bias=True)
        self.out_proj = nn.Linear(intermediate_size, hidden_size, bias=use_bias)
        # S4D-real init (A = -[1..N]) and dt in [1e-3, 0.1]: what random (dummy) weights keep for stability
        a = torch.arange(1, state_size + 1, dtype=torch.float32).expand(intermediate_size, -1)
        self.A_log = nn.Parameter(torch.log(a).contiguous())
        self.D = nn.Parameter(torch.ones(intermediate_size))
        with torch.no_grad():
            dt = torch.exp(torch.linspace(math.log(1e-3), math.log(0.1), intermediate_size))
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        self.bcdt_norm = bcdt_norm
        if bcdt_norm == "weightless":
            self.dt_layernorm, self.b_layernorm, self.c_layernorm = (WeightlessRMSNorm(rms_eps) for _ in range(3))
        elif bcdt_norm == "weighted":
            self.dt_layernorm = RMSNorm(time_step_rank, rms_eps)
            self.b_layernorm = RMSNorm(state_size, rms_eps)
            self.c_layernorm = RMSNorm(state_size, rms_eps)

    def cache_spec(self) -> StateSpec:
        return StateSpec.of({"conv": (self.intermediate_size, self.conv_kernel - 1),
                             "ssm": (self.intermediate_size, self.state_size)},
                            {"conv": self.dtype, "ssm": torch.float32})

    # ---- pieces shared by prefill and decode ----------------------------------------------------
    def _conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight.squeeze(1)  # [D, K]

    def _ssm_inputs(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """u: [T, D] conv output -> dt before bias [T, D], B [T, N], C [T, N], all in the model dtype."""
        dt_low, B, C = self.x_proj(u).split([self.time_step_rank, self.state_size, self.state_size], dim=-1)
        if self.bcdt_norm is not None:
            dt_low, B, C = self.dt_layernorm(dt_low), self.b_layernorm(B), self.c_layernorm(C)
        return linear_without_bias(self.dt_proj, dt_low), B, C

    # ---- the hooks a variant overrides (Zamba v1's multi-head mixer: layers/zamba_mamba.py) ----------------
    def _split_in_proj(self, xz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """in_proj's output [T, 2D] -> (u, z), each [T, D]: the first half and the second."""
        u, z = xz.chunk(2, dim=-1)
        return u, z

    def _ssm_decode(self, ssm_state: torch.Tensor, slots: torch.Tensor, u: torch.Tensor,
                    z: torch.Tensor) -> torch.Tensor:
        """One token per sequence: u (after conv and silu), z: [S, D]; ssm_state updated at `slots`. -> [S, D]."""
        dt_raw, B, C = self._ssm_inputs(u)
        return selective_state_update(ssm_state, slots, u, dt_raw, self.dt_proj.bias, self.neg_exp_A(), B, C,
                                      self.D, z)

    def _ssm_prefill(self, u: torch.Tensor, z: torch.Tensor, h0: torch.Tensor | None, offsets: list[int]
                     ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """One sequence's chunk: u, z [L, D]; h0 [D, N] or None. -> (y [L, D], final state, {offset: state})."""
        dt_raw, B, C = self._ssm_inputs(u)
        # the step is F.softplus(dt_raw + bias) in the model dtype, as transformers; the kernel takes it per token
        return selective_scan_prefill(u, dt_raw, self.neg_exp_A(), B, C, h0, offsets, self.scan_chunk, D=self.D,
                                      z=z, dt_bias=self.dt_proj.bias)

    def forward(self, x: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        if self.states is None:
            raise RuntimeError("MambaMixer: no state cache is bound")
        if meta.is_decode_only:
            fused = self._fused_decode(x, meta)
            if fused is not None:
                return fused
        u, z = self._split_in_proj(self.in_proj(x))  # [T, D] each
        if meta.is_decode_only:
            return self.out_proj(self._decode(u, z, meta, list(range(len(meta.query_lens)))))
        # A sequence continuing by one token takes transformers' decode arithmetic, batched with the others.
        rounds = set(meta.decode_rounds)
        decode = decode_group(meta)
        prefill = sorted(set(range(len(meta.query_lens))) - set(decode) - rounds)
        slot_of = meta.slots.tolist()  # one host copy for the per-sequence loop
        if not decode and not rounds and len(prefill) == 1:  # one prompt chunk fills the step: its output is the step's
            return self.out_proj(self._prefill_one(u, z, meta, 0, slot_of[0]))
        out = x.new_empty(x.shape[0], self.intermediate_size)  # [T, D]
        if decode:
            rows = torch.tensor([meta.query_start_loc[i] for i in decode], device=x.device)
            out.index_copy_(0, rows, self._decode(u[rows], z[rows], meta, decode).to(out.dtype))
        for rows, round_meta in verify_rounds(meta):  # drafts being verified: token by token, as plain decoding
            every = list(range(len(round_meta.query_lens)))
            out.index_copy_(0, rows, self._decode(u[rows], z[rows], round_meta, every).to(out.dtype))
        for i in prefill:
            start, n = meta.query_start_loc[i], meta.query_lens[i]
            out[start:start + n] = self._prefill_one(u[start:start + n], z[start:start + n], meta, i, slot_of[i])
        return self.out_proj(out)

    # ---- decode: one token per sequence ---------------------------------------------------------
    def _fused_decode(self, x: torch.Tensor, meta: StateMetadata) -> torch.Tensor | None:
        """x: [S, hidden] -> [S, hidden]: the whole step in one kernel call (csrc mamba1_update.cpp), same ops and
        roundings as the path below, when every linear takes the few-row kernel; None where it does not apply."""
        conv_state, ssm_state = self.states["conv"], self.states["ssm"]
        kernel = kernels.table(x.device).mamba1_decode(x.dtype, conv_state.dtype, ssm_state.dtype)
        call = derived_from_module(self, "fused decode", self._fused_decode_call) if kernel is not None else None
        if call is None or not call.applies(x):
            return None
        out = kernel(x, conv_state, ssm_state, meta.slots, *call.args)
        self._decode_checkpoints(meta, list(range(len(meta.query_lens))), meta.slots)
        return out

    def _fused_decode_call(self) -> FewRowCall | None:
        """mamba1_decode_'s weight arguments (made once per weight version), or None: dt/B/C norms, or a projection
        without the few-row kernel."""
        proj = decode_projections((self.in_proj, self.x_proj, self.dt_proj, self.out_proj))
        if self.bcdt_norm is not None or proj is None:
            return None
        dtype = proj.dtype or self.conv1d.weight.dtype
        taps, conv_bias = self.conv_taps()
        in_weight, x_weight, dt_weight, out_weight = proj.weights
        args = (in_weight, self.in_proj.bias, taps, conv_bias, x_weight, dt_weight,
                dtype_copy(self.dt_proj, "bias", dtype), self.neg_exp_A(), dtype_copy(self, "D", dtype),
                out_weight, self.out_proj.bias, proj.quantize_activations)
        return FewRowCall(proj.max_rows, dtype, args)

    def _decode(self, u: torch.Tensor, z: torch.Tensor, meta: StateMetadata, seqs: list[int]) -> torch.Tensor:
        """u, z: [S', D] for the sequences `seqs` of the step; returns the gated SSM output [S', D]."""
        conv_state, ssm_state = self.states["conv"], self.states["ssm"]
        slots = meta.slots[seqs] if len(seqs) != len(meta.query_lens) else meta.slots
        # summed in float32 and rounded once, as transformers' F.conv1d with its bias (F.conv1d itself costs
        # ~10x more on a one-token window)
        conv = causal_conv1d_decode(u, self._conv_weight(), self.conv1d.bias, conv_state, slots, float_accumulate=True,
                                    taps=self.conv_taps())
        y = self._ssm_decode(ssm_state, slots, F.silu(conv), z)
        self._decode_checkpoints(meta, seqs, slots)
        return y

    def _decode_checkpoints(self, meta: StateMetadata, seqs: list[int], slots: torch.Tensor) -> None:
        position = {seq: j for j, seq in enumerate(seqs)}
        for seq, offset, dst in meta.checkpoints:
            if seq in position:  # offset is necessarily 1: the state after this step's only token
                src = int(slots[position[seq]])
                for t in self.states.values():
                    t[dst].copy_(t[src])

    # ---- prefill: one sequence's chunk ----------------------------------------------------------
    def _prefill_one(self, u: torch.Tensor, z: torch.Tensor, meta: StateMetadata, seq: int,
                     slot: int) -> torch.Tensor:
        """u, z: [L, D] of one sequence; returns the gated SSM output [L, D] in the model dtype."""
        conv_state, ssm_state = self.states["conv"], self.states["ssm"]
        resume = meta.has_initial_state[seq]
        L = u.shape[0]
        snaps = checkpoints_of(meta, seq)
        if any(not 0 < off <= L for off, _ in snaps):
            raise ValueError(f"MambaMixer: checkpoint offsets {[o for o, _ in snaps]} outside a chunk of {L} tokens")
        weight = self._conv_weight()
        conv_out, padded = causal_conv1d_prefill(u.to(weight.dtype), weight, self.conv1d.bias,
                                                 conv_state[slot] if resume else None)
        u = F.silu(conv_out).to(u.dtype)  # [L, D]
        y, h_last, states_at = self._ssm_prefill(u, z, ssm_state[slot] if resume else None,
                                                 [off for off, _ in snaps])
        for off, dst in snaps:
            conv_state[dst].copy_(conv_state_at(padded, off, self.conv_kernel))
            ssm_state[dst].copy_(states_at[off])
        conv_state[slot].copy_(conv_state_at(padded, L, self.conv_kernel))
        ssm_state[slot].copy_(h_last)
        return y  # [L, D] in the model dtype: (C . h + u * D) * silu(z)
