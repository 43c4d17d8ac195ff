"""The Mamba2 mixer as a stateful layer, and the gated RMSNorm it ends with.

Parameter names follow transformers' Mamba2Mixer (in_proj, conv1d, dt_bias, A_log, D, norm.weight, out_proj), so a
model maps checkpoint tensors 1:1. Data flow for T tokens:
    in_proj -> [gate z | x B C | dt]; causal depthwise conv + activation over (x B C); dt = clamp(softplus(dt +
    dt_bias), time_step_limit); SSD scan (layers/ssd.py) with D skip; gated RMSNorm(y, z); out_proj.
State per sequence: conv [conv_dim, conv_kernel-1] (model dtype) and ssm [num_heads, head_dim, state_size] (float32,
or bfloat16 with the engine's mamba_ssm_cache_dtype; the arithmetic stays float32).

Hooks for the hybrids that reuse this mixer (all read by transformers in the same place as here):
- Bamba, GraniteMoeHybrid: same arithmetic; in/out bias = mamba_proj_bias, conv bias = mamba_conv_bias,
  eps = rms_norm_eps, dt_bias init ones (`dt_bias_init=1.0`).
- NemotronH: intermediate = mamba_num_heads * mamba_head_dim (always the case here), activation =
  mamba_hidden_act, time_step_limit = (time_step_min, inf), norm group = intermediate // n_groups (default).
- Zamba2: n_groups = mamba_ngroups, conv bias always on, norm eps fixed 1e-5, in/out bias = add_bias_linear,
  time_step_limit = (time_step_min, inf), dt_bias init ones.
- FalconH1: intermediate = mamba_d_ssm (must still be num_heads * head_dim), `out_proj_bias` = projectors_bias
  (in_proj uses mamba_proj_bias), `use_norm=False` when mamba_rms_norm is off (then y * silu(z)),
  `norm_before_gate` = mamba_norm_before_gate, `zxbcdt_multipliers` = ssm_multipliers (transformers' mup_vector,
  applied to the in_proj output). ssm_in_multiplier scales the mixer input: the caller applies it.
transformers' single-token (generate-time) path skips the time_step_limit clamp that its prefill applies. We clamp
on every path so results do not depend on batching; `clamp_dt_on_decode=False` reproduces transformers' decode
arithmetic instead (only matters when time_step_limit[0] > 0 or the upper limit is finite)."""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from stateserve.cache.spec import StateSpec
from stateserve.platform import kernels
from stateserve.layers.linear import FewRowCall, decode_projections
from stateserve.layers.metadata import StateMetadata
from stateserve.layers.param_cache import derived_from_module, float32_copy
from stateserve.layers.recurrent import (StatefulLayer, causal_conv1d_decode, causal_conv1d_prefill, conv_state_at,
                                         mixed_step, verify_rounds, zero_fresh_slots)
from stateserve.layers.ssd import ssd_chunk_scan, ssd_decode_step

_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "relu": F.relu, "gelu": F.gelu, "identity": lambda t: t}


class GatedRMSNorm(nn.Module):
    """RMSNorm over groups of `group_size` channels, gated by silu(z), computed in float32.

    norm_before_gate=False (Mamba2 and most hybrids): normalize(y * silu(z)) * weight.
    norm_before_gate=True (FalconH1 option): normalize(y) * weight * silu(z)."""

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-6, norm_before_gate: bool = False) -> None:
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"gated norm: hidden size {hidden_size} is not a multiple of group size {group_size}")
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.eps = eps
        self.norm_before_gate = norm_before_gate

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # y: [T, hidden_size] float32, gate: [T, hidden_size] in the model dtype -> [T, hidden_size] in gate's dtype
        if y.dim() == 2:
            kernel = kernels.table(y.device).gated_rms_norm(y.dtype, gate.dtype)
            if kernel is not None:  # one pass instead of ~8 float32 elementwise ops and their temporaries
                return kernel(y, gate, float32_copy(self, "weight"), self.group_size, self.eps, self.norm_before_gate)
        dtype = gate.dtype
        h = y.float()
        if not self.norm_before_gate:
            h = h * F.silu(gate.float())
        grouped = h.view(*h.shape[:-1], -1, self.group_size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        h = grouped.view(h.shape)
        if self.norm_before_gate:
            return (self.weight * h * F.silu(gate.float())).to(dtype)
        return (self.weight * h).to(dtype)


class Mamba2Mixer(StatefulLayer):
    def __init__(self, *, hidden_size: int, num_heads: int, head_dim: int, state_size: int, n_groups: int = 1,
                 conv_kernel: int = 4, chunk_size: int = 256, intermediate_size: int | None = None,
                 use_conv_bias: bool = True, use_bias: bool = False, out_proj_bias: bool | None = None,
                 activation: str = "silu", norm_eps: float = 1e-5, norm_group_size: int | None = None,
                 norm_before_gate: bool = False, use_norm: bool = True,
                 time_step_limit: Sequence[float] = (0.0, float("inf")), clamp_dt_on_decode: bool = True,
                 time_step_min: float = 1e-3, time_step_max: float = 0.1, time_step_floor: float = 1e-4,
                 dt_bias_init: float | None = None, zxbcdt_multipliers: Sequence[float] | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        inner = num_heads * head_dim
        if intermediate_size is not None and intermediate_size != inner:
            raise ValueError(f"mamba2 mixer: intermediate size {intermediate_size} must equal num_heads * head_dim "
                             f"= {num_heads} * {head_dim}")
        if n_groups < 1 or num_heads % n_groups:
            raise ValueError(f"mamba2 mixer: num_heads {num_heads} is not a multiple of n_groups {n_groups}")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"mamba2 mixer: activation {activation!r} is not supported "
                             f"(supported: {', '.join(sorted(_ACTIVATIONS))})")
        if chunk_size < 1 or conv_kernel < 2:
            raise ValueError(f"mamba2 mixer: chunk_size ({chunk_size}) must be >= 1 and conv_kernel "
                             f"({conv_kernel}) >= 2")
        if len(time_step_limit) != 2:
            raise ValueError(f"mamba2 mixer: time_step_limit must be (min, max), got {time_step_limit!r}")
        self.num_heads, self.head_dim, self.n_groups, self.state_size = num_heads, head_dim, n_groups, state_size
        self.intermediate_size = inner
        self.conv_kernel, self.chunk_size = conv_kernel, chunk_size
        self.conv_dim = inner + 2 * n_groups * state_size
        self.act = _ACTIVATIONS[activation]
        self.time_step_limit = (float(time_step_limit[0]), float(time_step_limit[1]))
        self.clamp_dt_on_decode = clamp_dt_on_decode
        self.dtype = dtype
        self.ssm_state_dtype = torch.float32  # see set_ssm_state_dtype

        self.in_proj = nn.Linear(hidden_size, inner + self.conv_dim + num_heads, bias=use_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim,
                                padding=conv_kernel - 1, bias=use_conv_bias)
        # 1-D parameters get real initial values: dummy-weight runs keep them (see models/loader.py).
        self.dt_bias = nn.Parameter(self._initial_dt_bias(time_step_min, time_step_max, time_step_floor,
                                                          dt_bias_init))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, num_heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(num_heads))
        self.norm = (GatedRMSNorm(inner, norm_group_size or inner // n_groups, norm_eps, norm_before_gate)
                     if use_norm else None)
        self.out_proj = nn.Linear(inner, hidden_size, bias=use_bias if out_proj_bias is None else out_proj_bias)
        scale = None
        if zxbcdt_multipliers is not None:
            gn = n_groups * state_size
            sizes = [inner, inner, gn, gn, num_heads]  # z | x | B | C | dt sections of the in_proj output
            if len(zxbcdt_multipliers) != 5:
                raise ValueError(f"zxbcdt_multipliers needs 5 values (z, x, B, C, dt), got {zxbcdt_multipliers!r}")
            scale = torch.cat([torch.full((n,), float(m)) for n, m in zip(sizes, zxbcdt_multipliers)])
        self.in_proj_scale: torch.Tensor | None
        self.register_buffer("in_proj_scale", scale, persistent=False)  # not a checkpoint tensor

    def _initial_dt_bias(self, dt_min: float, dt_max: float, dt_floor: float, const: float | None) -> torch.Tensor:
        if const is not None:
            return torch.full((self.num_heads,), float(const))
        # Mamba2's init: dt log-uniform in [dt_min, dt_max], stored as softplus^-1(dt).
        dt = torch.exp(torch.rand(self.num_heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_floor)
        return dt + torch.log(-torch.expm1(-dt))

    def cache_spec(self) -> StateSpec:
        return StateSpec.of({"conv": (self.conv_dim, self.conv_kernel - 1),
                             "ssm": (self.num_heads, self.head_dim, self.state_size)},
                            {"conv": self.dtype, "ssm": self.ssm_state_dtype})

    ssm_state_dtypes = (torch.float32, torch.bfloat16, torch.float16)  # float16: the PyTorch (CUDA) path only

    def set_ssm_state_dtype(self, dtype: torch.dtype) -> None:
        """bfloat16 states halve the bytes a decode step reads and writes (in batched decode they outweigh the
        weights); every update still computes in float32 and rounds only what it stores."""
        if dtype not in self.ssm_state_dtypes:
            raise ValueError(f"mamba_ssm_cache_dtype: Mamba2 states can be float32, bfloat16 or float16, not {dtype}")
        self.ssm_state_dtype = dtype

    # ---- shared pieces -------------------------------------------------------------------------
    def _conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight.squeeze(1)  # [conv_dim, K]

    def _step_sizes(self, dt: torch.Tensor, clamp: bool) -> torch.Tensor:
        """dt: [T, H] raw projection -> softplus(dt + dt_bias), clamped; in the model dtype like transformers."""
        kernel = kernels.table(dt.device).dt_softplus(dt.dtype) if dt.dim() == 2 else None
        if kernel is not None:  # the 4 ops below in one pass
            lo, hi = self.time_step_limit if clamp else (float("-inf"), float("inf"))
            return kernel(dt, float32_copy(self, "dt_bias"), lo, hi)
        dt = F.softplus(dt + self.dt_bias.to(dt.dtype))
        if clamp:
            dt = torch.clamp(dt, min=self.time_step_limit[0], max=self.time_step_limit[1])
        return dt.float()

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, conv_dim] -> x [T, H, P], B [T, G, N], C [T, G, N]."""
        gn = self.n_groups * self.state_size
        x, B, C = xbc.split([self.intermediate_size, gn, gn], dim=-1)
        return (x.reshape(-1, self.num_heads, self.head_dim), B.reshape(-1, self.n_groups, self.state_size),
                C.reshape(-1, self.n_groups, self.state_size))

    # ---- forward -------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        """hidden_states: [T, hidden] -> [T, hidden]; reads and writes this layer's state rows at meta.slots."""
        if self.states is None:
            raise RuntimeError("Mamba2Mixer has no bound state cache")
        if meta.is_decode_only:
            fused = self._fused_decode(hidden_states, meta)
            if fused is not None:
                return fused
        dtype = hidden_states.dtype
        proj = self.in_proj(hidden_states)  # [T, I + conv_dim + H]
        if self.in_proj_scale is not None:
            proj = proj * self.in_proj_scale
        gate, xbc, dt = proj.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        A = self.neg_exp_A()  # [H]
        if meta.is_decode_only:
            y = self._decode(xbc, dt, A, meta)
        else:
            y = self._prefill(xbc, dt, A, meta)
        y = y.reshape(-1, self.intermediate_size)  # [T, I] float32
        if self.norm is not None:
            y = self.norm(y, gate)
        else:
            y = y * F.silu(gate.float())
        return self.out_proj(y.to(dtype))

    def _prefill(self, xbc: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        """A mixed step. Sequences continuing by one token go through the batched decode update (the arithmetic
        of a decode-only step, so results do not depend on what else is batched); each other sequence's chunk
        runs the conv resuming from its conv state, then the SSD scan. -> [T, H, P]"""
        out = xbc.new_empty(xbc.shape[0], self.num_heads, self.head_dim, dtype=torch.float32)
        chunks = mixed_step(meta, out, lambda rows, m, seqs: self._decode(xbc[rows], dt[rows], A, m, seqs),
                            run_rounds=lambda: self._verify_rounds(xbc, dt, A, meta, out))
        if not chunks:
            return out
        conv_states, ssm_states = self.states["conv"], self.states["ssm"]
        weight, bias = self._conv_weight(), self.conv1d.bias
        dt = self._step_sizes(dt, clamp=True)
        for c in chunks:
            slot, has_initial, snapshots = c.slot, c.has_initial, c.snapshots
            fuse_silu = self.act is F.silu  # conv + silu + float32 for the scan in one pass
            conv_out, padded = causal_conv1d_prefill(xbc[c.rows], weight, bias,
                                                     conv_states[slot] if has_initial else None, fuse_silu)
            x, B, C = self._split_xbc(conv_out if fuse_silu else self.act(conv_out))
            out[c.rows], state_after = self._scan(x, dt[c.rows], A, B, C,
                                                  ssm_states[slot].float() if has_initial else None,
                                                  sorted({off for off, _ in snapshots} | {c.length}))
            for off, dst in snapshots:
                conv_states[dst].copy_(conv_state_at(padded, off, self.conv_kernel))
                ssm_states[dst].copy_(state_after[off])
            conv_states[slot].copy_(conv_state_at(padded, c.length, self.conv_kernel))
            ssm_states[slot].copy_(state_after[c.length])
        return out

    def _scan(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
              initial: torch.Tensor | None, offsets: list[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """One sequence's SSD scan from `initial` (zeros if None) -> (y [L, H, P] float32, {offset: state after
        that many tokens}) for the sorted `offsets`, whose last entry is L."""
        kernel = kernels.table(x.device).ssd_scan()
        if kernel is not None:  # sequential recurrence: fewer FLOPs than the chunked form on a CPU
            y, final, snaps = kernel(x.float(), dt, A, B.float(), C.float(), float32_copy(self, "D"), initial,
                                     offsets[:-1])
            return y, {**{off: snaps[j] for j, off in enumerate(offsets[:-1])}, offsets[-1]: final}
        # Chunked SSD; requested snapshots split it into segments, each resuming from the previous one's state.
        y = x.new_empty(x.shape, dtype=torch.float32)
        state_after: dict[int, torch.Tensor] = {}
        state, seg_start = initial, 0
        for cut in offsets:
            seg = slice(seg_start, cut)
            y[seg], state = ssd_chunk_scan(x[seg], dt[seg], A, B[seg], C[seg], self.chunk_size, self.D, state)
            state_after[cut] = state
            seg_start = cut
        return y, state_after

    def _decode(self, xbc: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, meta: StateMetadata,
                seqs: list[int] | None = None) -> torch.Tensor:
        """One token for each of the sequences `seqs` of the step (all if None), in one batched update.
        xbc, dt: their rows [S', ...]. -> [S', H, P]"""
        conv_states, ssm_states = self.states["conv"], self.states["ssm"]
        seqs = list(range(len(meta.query_lens))) if seqs is None else seqs
        slots = meta.slots if len(seqs) == len(meta.query_lens) else meta.slots[seqs]
        zero_fresh_slots(meta, slots, (conv_states, ssm_states), seqs)
        fuse_silu = self.act is F.silu  # conv + silu + float32 for the state update in one pass
        kernel = kernels.table(ssm_states.device).mamba2_decode(xbc.dtype, dt.dtype, conv_states.dtype,
                                                                self.conv1d.weight.dtype, ssm_states.dtype)
        if kernel is not None and fuse_silu and conv_states.is_contiguous():
            # conv, step sizes and state update in one call: the same kernels as below, ~40 us less a layer
            lo, hi = self.time_step_limit if self.clamp_dt_on_decode else (float("-inf"), float("inf"))
            taps, conv_bias = self.conv_taps()
            y = kernel(conv_states, ssm_states, slots, xbc, dt, taps, conv_bias, float32_copy(self, "dt_bias"), lo,
                       hi, A, float32_copy(self, "D"), self.n_groups)  # [S', H, P]
        else:
            y = self._decode_unfused(xbc, dt, A, slots)
        self._copy_decode_checkpoints(meta, seqs, slots)
        return y

    def _verify_rounds(self, xbc: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, meta: StateMetadata,
                       out: torch.Tensor) -> None:
        """Drafts being verified: token by token through _decode's update, as plain decoding; the kernel's fixed
        arguments are looked up once for all rounds (per round, _decode's lookups cost more than its kernel)."""
        plan = verify_rounds(meta)
        if not plan:
            return
        conv_states, ssm_states = self.states["conv"], self.states["ssm"]
        kernel = kernels.table(ssm_states.device).mamba2_decode(xbc.dtype, dt.dtype, conv_states.dtype,
                                                                self.conv1d.weight.dtype, ssm_states.dtype)
        fresh = not all(h for _, round_meta in plan for h in round_meta.has_initial_state)
        if kernel is None or fresh or self.act is not F.silu or not conv_states.is_contiguous():
            for rows, round_meta in plan:
                out.index_copy_(0, rows, self._decode(xbc[rows], dt[rows], A, round_meta))
            return
        lo, hi = self.time_step_limit if self.clamp_dt_on_decode else (float("-inf"), float("inf"))
        taps, conv_bias = self.conv_taps()
        dt_bias, D = float32_copy(self, "dt_bias"), float32_copy(self, "D")
        for rows, round_meta in plan:
            out.index_copy_(0, rows, kernel(conv_states, ssm_states, round_meta.slots, xbc[rows], dt[rows], taps,
                                            conv_bias, dt_bias, lo, hi, A, D, self.n_groups))
            self._copy_decode_checkpoints(round_meta, list(range(len(round_meta.query_lens))), round_meta.slots)

    def _fused_decode(self, x: torch.Tensor, meta: StateMetadata) -> torch.Tensor | None:
        """x: [S, hidden] -> [S, hidden]: a decode-only step from in_proj to out_proj in one kernel call (the kernels
        of the path through forward and _decode, same roundings), when both projections take the few-row kernel
        and _decode would take mamba2_decode_; None otherwise."""
        conv_states, ssm_states = self.states["conv"], self.states["ssm"]
        kernel = kernels.table(x.device).mamba2_mixer_decode(x.dtype, conv_states.dtype, ssm_states.dtype)
        call = derived_from_module(self, "fused decode", self._fused_decode_call) if kernel is not None else None
        if call is None or not call.applies(x) or not conv_states.is_contiguous():
            return None
        before_limits, after_limits = call.args
        lo, hi = self.time_step_limit if self.clamp_dt_on_decode else (float("-inf"), float("inf"))  # a switch
        out = kernel(x, conv_states, ssm_states, meta.slots, *before_limits, lo, hi, *after_limits)
        self._copy_decode_checkpoints(meta, list(range(len(meta.query_lens))), meta.slots)
        return out

    def _fused_decode_call(self) -> FewRowCall | None:
        """mamba2_mixer_decode_'s fixed arguments (made once per weight version) before and after the step-size
        limits, or None: no gated norm, an in_proj scale, another activation, or a projection without the few-row
        kernel."""
        proj = decode_projections((self.in_proj, self.out_proj))
        if proj is None:
            return None
        dtype = proj.dtype or self.conv1d.weight.dtype
        if self.norm is None or self.in_proj_scale is not None or self.act is not F.silu \
                or self.conv1d.weight.dtype != dtype:
            return None
        taps, conv_bias = self.conv_taps()
        norm = self.norm
        in_weight, out_weight = proj.weights
        before_limits = (in_weight, self.in_proj.bias, taps, conv_bias, float32_copy(self, "dt_bias"))
        after_limits = (self.neg_exp_A(), float32_copy(self, "D"), self.n_groups, float32_copy(norm, "weight"),
                        norm.group_size, norm.eps, norm.norm_before_gate, out_weight, self.out_proj.bias,
                        proj.quantize_activations)
        return FewRowCall(proj.max_rows, dtype, (before_limits, after_limits))

    def _decode_unfused(self, xbc: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, slots: torch.Tensor
                        ) -> torch.Tensor:
        """The decode update op by op (any device, any activation). -> [S', H, P]"""
        conv_states, ssm_states = self.states["conv"], self.states["ssm"]
        fuse_silu = self.act is F.silu
        conv_out = causal_conv1d_decode(xbc, self._conv_weight(), self.conv1d.bias, conv_states, slots,
                                        silu_float32=fuse_silu, taps=self.conv_taps())
        x, B, C = self._split_xbc(conv_out if fuse_silu else self.act(conv_out))
        dt = self._step_sizes(dt, clamp=self.clamp_dt_on_decode)
        kernel = kernels.table(ssm_states.device).ssd_update(ssm_states.dtype)
        if kernel is not None:  # in place, [S', H, P]
            y = kernel(ssm_states, slots, x, dt, A, B, C, float32_copy(self, "D"))
        else:
            y, new_state = ssd_decode_step(ssm_states[slots], x, dt, A, B, C, self.D)
            ssm_states.index_copy_(0, slots, new_state.to(ssm_states.dtype))
        return y

    def _copy_decode_checkpoints(self, meta: StateMetadata, seqs: list[int], slots: torch.Tensor) -> None:
        """Prefix-cache snapshots after a decode token: the new conv and ssm state rows copied to their slots."""
        if not meta.checkpoints:
            return
        conv_states, ssm_states = self.states["conv"], self.states["ssm"]
        position = {seq: j for j, seq in enumerate(seqs)}
        host = meta.host_slots
        for i, off, dst in meta.checkpoints:
            if i not in position:
                continue
            if off != 1:
                raise ValueError(f"state checkpoint offset {off} in a decode step (one token per sequence)")
            src = host[i] if host is not None else int(slots[position[i]])
            conv_states[dst].copy_(conv_states[src])
            ssm_states[dst].copy_(ssm_states[src])
