"""Zamba v1's Mamba mixer: Mamba1 (layers/selective_scan.py's MambaMixer) split into `n_mamba_heads` independent
heads over the channels. What differs from MambaMixer, per transformers' ZambaMambaMixer:
- in_proj's output interleaves the two halves per channel: row 2c is channel c's input u, row 2c+1 its gate z;
- each head h (channels h*Dh .. h*Dh+Dh-1) has its own x_proj (x_proj_weight [H, R + 2N, Dh]) and dt_proj
  (dt_proj_weight [H, Dh, R], dt_proj_bias [H, Dh]), so dt, B and C are per head; A_log is [H, Dh, N], D [H, Dh].
The conv, the state layout (conv [D, K-1], ssm [D, N]: the heads' [Dh, N] states stacked), snapshots and the
batching of decode / prefill / verify rounds are MambaMixer's; only the split and the two scan hooks change."""
from __future__ import annotations

import torch
from torch import nn

from stateserve.layers.linear import FewRowCall
from stateserve.layers.selective_scan import MambaMixer, selective_scan_prefill, selective_state_update


class ZambaMambaMixer(MambaMixer):
    """forward(x [T, hidden], meta) -> [T, hidden]; checkpoint names: in_proj, conv1d, x_proj_weight,
    dt_proj_weight, dt_proj_bias, A_log, D, out_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int, state_size: int, conv_kernel: int,
                 time_step_rank: int, num_heads: int, use_conv_bias: bool, use_bias: bool,
                 dtype: torch.dtype = torch.float32, activation: str = "silu") -> None:
        if intermediate_size % num_heads:
            raise ValueError(f"Zamba: mamba_expand * hidden_size = {intermediate_size} is not divisible by "
                             f"n_mamba_heads={num_heads}")
        super().__init__(hidden_size, intermediate_size, state_size, conv_kernel, time_step_rank, use_conv_bias,
                         use_bias, dtype=dtype, activation=activation)
        H, Dh, R, N = num_heads, intermediate_size // num_heads, time_step_rank, state_size
        self.num_heads, self.head_dim = H, Dh
        dt_bias = self.dt_proj.bias.detach().reshape(H, Dh).clone()  # MambaMixer's inverse-softplus dt init
        del self.x_proj, self.dt_proj  # per head below
        self.x_proj_weight = nn.Parameter(torch.randn(H, R + 2 * N, Dh) * Dh ** -0.5)
        self.dt_proj_weight = nn.Parameter(torch.randn(H, Dh, R) * R ** -0.5)
        self.dt_proj_bias = nn.Parameter(dt_bias)
        self.A_log = nn.Parameter(self.A_log.detach().reshape(H, Dh, N).clone())
        self.D = nn.Parameter(torch.ones(H, Dh))

    def _fused_decode_call(self) -> FewRowCall | None:
        return None  # the C++ one-call decode assumes MambaMixer's layout (one x_proj, halves in in_proj)

    def _split_in_proj(self, xz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [T, 2D] with channel c's (u, z) at rows (2c, 2c + 1) -> u, z [T, D], contiguous for the conv and scans
        pairs = xz.view(xz.shape[0], self.intermediate_size, 2)
        return pairs[..., 0].contiguous(), pairs[..., 1].contiguous()

    def _head_inputs(self, u: torch.Tensor, h: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Head h's u [T, Dh] -> dt before its bias [T, Dh], B [T, N], C [T, N], in the model dtype."""
        R, N = self.time_step_rank, self.state_size
        dt_low, B, C = (u @ self.x_proj_weight[h].t()).split([R, N, N], dim=-1)
        return dt_low @ self.dt_proj_weight[h].t(), B, C

    def _heads(self):
        for h in range(self.num_heads):
            yield h, slice(h * self.head_dim, (h + 1) * self.head_dim)

    def _ssm_decode(self, ssm_state: torch.Tensor, slots: torch.Tensor, u: torch.Tensor,
                    z: torch.Tensor) -> torch.Tensor:
        # u, z: [S, D] -> [S, D]; each head updates its channels' rows of the sequences' states
        A = self.neg_exp_A().reshape(self.intermediate_size, self.state_size)  # [D, N]
        rows = torch.arange(u.shape[0], device=u.device)
        out = torch.empty_like(u)
        for h, ch in self._heads():
            uh = u[:, ch].contiguous()
            dt_raw, B, C = self._head_inputs(uh, h)
            state = ssm_state[slots, ch].contiguous()  # [S, Dh, N]: the update runs in place on a dense copy
            out[:, ch] = selective_state_update(state, rows, uh, dt_raw, self.dt_proj_bias[h], A[ch], B, C,
                                                self.D[h], z[:, ch].contiguous())
            ssm_state[slots, ch] = state
        return out

    def _ssm_prefill(self, u: torch.Tensor, z: torch.Tensor, h0: torch.Tensor | None, offsets: list[int]
                     ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        # u, z: [L, D]; h0: [D, N] or None -> y [L, D], final [D, N], {offset: [D, N]}
        A = self.neg_exp_A().reshape(self.intermediate_size, self.state_size)
        ys, finals, snaps = [], [], []
        for h, ch in self._heads():
            uh = u[:, ch].contiguous()
            dt_raw, B, C = self._head_inputs(uh, h)
            y, final, at = selective_scan_prefill(uh, dt_raw, A[ch], B, C, None if h0 is None else h0[ch], offsets,
                                                  self.scan_chunk, D=self.D[h], z=z[:, ch].contiguous(),
                                                  dt_bias=self.dt_proj_bias[h])
            ys.append(y)
            finals.append(final)
            snaps.append(at)
        return (torch.cat(ys, dim=-1), torch.cat(finals, dim=0),
                {off: torch.cat([s[off] for s in snaps], dim=0) for off in offsets})
