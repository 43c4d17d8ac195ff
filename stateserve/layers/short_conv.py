"""LFM2's gated short convolution as a stateful layer (transformers' Lfm2ShortConv, shared by Lfm2, Lfm2-MoE and
LFM3):

    in_proj(x) -> [B | C | u] (each [T, hidden]);  y = C * causal_depthwise_conv(B * u);  out_proj(y)

The conv has `kernel_size` taps (config conv_L_cache) and an optional bias (conv_bias, which also puts a bias on
both projections); there is no activation anywhere. Its only state is the conv's: per sequence the last K-1 conv
inputs B*u, oldest first, "conv" [hidden, K-1] in the model dtype; no SSM state. It reuses the conv machinery of
the Mamba layers (layers/recurrent.py): the C++ prefill conv per chunk, the C++ batched conv update for decode, and
`conv_state_at` for prefix-cache snapshots and speculative-decoding checkpoints at any offset of a chunk."""
from __future__ import annotations

import torch
from torch import nn

from stateserve.cache.spec import StateSpec
from stateserve.layers.metadata import StateMetadata
from stateserve.layers.recurrent import (StatefulLayer, causal_conv1d_decode, causal_conv1d_prefill, conv_state_at,
                                         mixed_step, zero_fresh_slots)


class ShortConv(StatefulLayer):
    """forward(x [T, hidden], meta) -> [T, hidden]. Parameter names: in_proj, conv1d (transformers' `conv`, renamed
    by the model's map_weight_name so `conv_taps()` finds it), out_proj."""

    # No SSM state: mamba_ssm_cache_dtype has nothing to change here, whatever it names.
    ssm_state_dtypes = (torch.float32, torch.bfloat16, torch.float16)

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        if kernel_size < 2:
            raise ValueError(f"short conv: conv_L_cache={kernel_size} must be >= 2 (a kernel of one tap keeps no "
                             f"state)")
        self.hidden_size, self.kernel_size, self.dtype = hidden_size, kernel_size, dtype
        self.in_proj = nn.Linear(hidden_size, 3 * hidden_size, bias=bias)
        self.conv1d = nn.Conv1d(hidden_size, hidden_size, kernel_size, groups=hidden_size, bias=bias,
                                padding=kernel_size - 1)
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=bias)

    def cache_spec(self) -> StateSpec:
        return StateSpec.of({"conv": (self.hidden_size, self.kernel_size - 1)}, {"conv": self.dtype})

    def set_ssm_state_dtype(self, dtype: torch.dtype) -> None:
        """Nothing to do: the conv state stays in the model dtype, as in every Mamba-style layer."""

    def forward(self, x: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        if self.states is None:
            raise RuntimeError("ShortConv has no bound state cache")
        B, C, u = self.in_proj(x).chunk(3, dim=-1)  # [T, hidden] each, in transformers' order
        bu = B * u  # the conv's input, what the state keeps
        y = self._decode(bu, meta) if meta.is_decode_only else self._mixed(bu, meta)
        return self.out_proj(C * y)

    def _weight(self) -> torch.Tensor:
        return self.conv1d.weight.squeeze(1)  # [hidden, K]

    def _mixed(self, bu: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        """A step with prefill chunks. Sequences continuing by one token take the batched decode update together
        (the arithmetic of a decode-only step, so a token's result does not depend on what shares its step); drafts
        being verified go round by round through it; each other chunk is one prefill conv resuming from its state.
        bu: [T, hidden] -> [T, hidden]"""
        out = torch.empty_like(bu)
        chunks = mixed_step(meta, out, lambda rows, m, seqs: self._decode(bu[rows], m, seqs))
        conv_states, weight, bias = self.states["conv"], self._weight(), self.conv1d.bias
        for c in chunks:
            out[c.rows], inputs = causal_conv1d_prefill(bu[c.rows], weight, bias,
                                                        conv_states[c.slot] if c.has_initial else None)
            # snapshots first: `inputs.history` may be a view of the live slot, which the last copy overwrites
            for off, dst in c.snapshots:
                conv_states[dst].copy_(conv_state_at(inputs, off, self.kernel_size))
            conv_states[c.slot].copy_(conv_state_at(inputs, c.length, self.kernel_size))
        return out

    def _decode(self, bu: torch.Tensor, meta: StateMetadata, seqs: list[int] | None = None) -> torch.Tensor:
        """One token for each of the sequences `seqs` of the step (all if None), in one batched conv update that
        shifts their states in place. bu: their rows [S', hidden] -> [S', hidden]"""
        conv_states = self.states["conv"]
        seqs = list(range(len(meta.query_lens))) if seqs is None else seqs
        slots = meta.slots if len(seqs) == len(meta.query_lens) else meta.slots[seqs]
        zero_fresh_slots(meta, slots, (conv_states,), seqs)
        # float_accumulate: products and bias summed in float32 and rounded once, as transformers' F.conv1d does
        y = causal_conv1d_decode(bu, self._weight(), self.conv1d.bias, conv_states, slots, float_accumulate=True,
                                 taps=self.conv_taps())
        if meta.checkpoints:  # a snapshot after a decode token is the slot's new state
            position = {seq: j for j, seq in enumerate(seqs)}
            for i, off, dst in meta.checkpoints:
                if i not in position:
                    continue
                if off != 1:
                    raise ValueError(f"state checkpoint offset {off} in a decode step (one token per sequence)")
                src = meta.host_slots[i] if meta.host_slots is not None else int(slots[position[i]])
                conv_states[dst].copy_(conv_states[src])
        return y
