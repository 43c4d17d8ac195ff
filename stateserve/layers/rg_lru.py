"""Griffin's recurrent block (RecurrentGemma, transformers' RecurrentGemmaRecurrentBlock) as a stateful layer:

    y = gelu(linear_y(x));  u = conv1d(linear_x(x));  h = RG-LRU(u);  out = linear_out(h * y)

RG-LRU, per channel c of lru_width W (gates block-diagonal over `num_heads` blocks of W/num_heads):
    i_t = sigmoid(u_t @ Wi + bi),  r_t = sigmoid(u_t @ Wr + br),  log a_t = -8 r_t softplus(Λ)
    h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t u_t)
At a sequence's first token (transformers' reset, position 0) a_t is 0 and the sqrt factor 1.

State per slot: "conv" [W, K-1] (the last K-1 conv inputs, model dtype, oldest first, as the Mamba layers keep
it) and "lru" [W] (h, float32: transformers accumulates it in float32 whatever the model dtype). A prefill chunk
runs the recurrence as a Hillis-Steele associative scan over (a, b) pairs (log2(L) tensor passes, no per-token
Python loop); a decode step updates every sequence's slot in one batched pass."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stateserve.cache.spec import StateSpec
from stateserve.layers.metadata import StateMetadata
from stateserve.layers.recurrent import (StatefulLayer, causal_conv1d_decode, causal_conv1d_prefill, conv_state_at,
                                         mixed_step, zero_fresh_slots)


def linear_scan(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None) -> torch.Tensor:
    """h_t = a_t h_{t-1} + b_t for t = 0..L-1 from h_{-1} = h0 (zeros when None), by an inclusive associative scan
    of the pairs (a, b) with (a1, b1) then (a2, b2) = (a1 a2, a2 b1 + b2): log2(L) whole-tensor steps.
    a, b: [L, W] float32; h0: [W] -> h: [L, W] float32."""
    a, b = a.clone(), b.clone()
    step = 1
    while step < a.shape[0]:
        # right-hand sides are evaluated before the in-place assignment, so every row combines pre-step values
        b[step:] = b[step:] + a[step:] * b[:-step]
        a[step:] = a[step:] * a[:-step]
        step *= 2
    return b if h0 is None else b + a * h0  # a is now the product a_0..a_t


class RGLRUBlock(StatefulLayer):
    """forward(x [T, hidden], meta) -> [T, hidden]. Parameter names are transformers' (temporal_block.*), but
    `conv_1d` is `conv1d` here (renamed by the model's map_weight_name) so `conv_taps()` finds it."""

    def __init__(self, hidden_size: int, lru_width: int, num_heads: int, conv_width: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        if lru_width % num_heads:
            raise ValueError(f"RG-LRU: lru_width={lru_width} is not a multiple of num_attention_heads={num_heads}")
        if conv_width < 2:
            raise ValueError(f"RG-LRU: conv1d_width={conv_width} must be >= 2 (a one-tap conv keeps no state)")
        self.width, self.num_heads, self.block_width = lru_width, num_heads, lru_width // num_heads
        self.kernel_size, self.dtype = conv_width, dtype
        self.linear_y = nn.Linear(hidden_size, lru_width)
        self.linear_x = nn.Linear(hidden_size, lru_width)
        self.linear_out = nn.Linear(lru_width, hidden_size)
        self.conv1d = nn.Conv1d(lru_width, lru_width, conv_width, groups=lru_width, padding=conv_width - 1)
        bw = self.block_width
        self.recurrent_param = nn.Parameter(torch.empty(lru_width))
        self.input_gate_weight = nn.Parameter(torch.empty(num_heads, bw, bw))
        self.input_gate_bias = nn.Parameter(torch.empty(num_heads, bw))
        self.recurrent_gate_weight = nn.Parameter(torch.empty(num_heads, bw, bw))
        self.recurrent_gate_bias = nn.Parameter(torch.empty(num_heads, bw))

    def cache_spec(self) -> StateSpec:
        return StateSpec.of({"conv": (self.width, self.kernel_size - 1), "lru": (self.width,)},
                            {"conv": self.dtype, "lru": torch.float32})

    # ---- the pieces every path shares -----------------------------------------------------------
    def _gates(self, u: torch.Tensor, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """u: conv outputs [T, W]; first: [T] bool, a sequence's first token (reset) -> (a [T, W] float32 with 0
        at resets, b [T, W] float32: the normalised gated input the recurrence adds)."""
        T = u.shape[0]
        heads = u.view(T, self.num_heads, self.block_width).transpose(0, 1)  # [H, T, bw]
        gate_in = torch.baddbmm(self.input_gate_bias[:, None, :], heads, self.input_gate_weight)
        gate_rec = torch.baddbmm(self.recurrent_gate_bias[:, None, :], heads, self.recurrent_gate_weight)
        gate_in = torch.sigmoid(gate_in.transpose(0, 1).reshape(T, self.width))
        gate_rec = torch.sigmoid(gate_rec.transpose(0, 1).reshape(T, self.width))
        log_a = -8.0 * gate_rec * F.softplus(self.recurrent_param)
        a = torch.exp(log_a)
        scale = torch.sqrt(1 - torch.exp(2 * log_a))
        reset = first[:, None]
        scale = torch.where(reset, torch.ones_like(scale), scale)
        b = (u * gate_in) * scale.to(u.dtype)
        return torch.where(reset, torch.zeros_like(a), a).float(), b.float()

    def forward(self, x: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        if self.states is None:
            raise RuntimeError("RGLRUBlock has no bound state cache")
        y = F.gelu(self.linear_y(x), approximate="tanh")
        ux = self.linear_x(x)  # [T, W]: the conv's input, what the conv state keeps
        h = self._decode(ux, meta) if meta.is_decode_only else self._mixed(ux, meta)
        return self.linear_out(h * y)

    def _weight(self) -> torch.Tensor:
        return self.conv1d.weight.squeeze(1)  # [W, K]

    # ---- prefill chunks (and the decodes that share their step) -------------------------------------
    def _mixed(self, ux: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        """Sequences continuing by one token take the batched decode update together (the arithmetic of a
        decode-only step, so a token's result does not depend on its step-mates); drafts being verified go round
        by round through it; every other chunk is a prefill conv plus one scan. ux: [T, W] -> [T, W]"""
        out = torch.empty_like(ux)
        chunks = mixed_step(meta, out, lambda rows, m, seqs: self._decode(ux[rows], m, seqs))
        conv_states, lru_states = self.states["conv"], self.states["lru"]
        weight, bias = self._weight(), self.conv1d.bias
        for c in chunks:
            u, inputs = causal_conv1d_prefill(ux[c.rows], weight, bias,
                                              conv_states[c.slot] if c.has_initial else None)
            first = torch.zeros(c.length, dtype=torch.bool, device=ux.device)
            first[0] = not c.has_initial
            a, b = self._gates(u, first)
            h = linear_scan(a, b, lru_states[c.slot] if c.has_initial else None)  # [L, W] float32
            out[c.rows] = h.to(ux.dtype)
            # snapshots first: `inputs.history` may be a view of the live slot, which the last copy overwrites
            for off, dst in c.snapshots:
                conv_states[dst].copy_(conv_state_at(inputs, off, self.kernel_size))
                lru_states[dst].copy_(h[off - 1])
            conv_states[c.slot].copy_(conv_state_at(inputs, c.length, self.kernel_size))
            lru_states[c.slot].copy_(h[-1])
        return out

    # ---- one token per sequence -----------------------------------------------------------------
    def _decode(self, ux: torch.Tensor, meta: StateMetadata, seqs: list[int] | None = None) -> torch.Tensor:
        """One token for each of the sequences `seqs` of the step (all if None), their conv and LRU states
        updated in place in one batched pass. ux: their rows [S', W] -> [S', W]"""
        conv_states, lru_states = self.states["conv"], self.states["lru"]
        seqs = list(range(len(meta.query_lens))) if seqs is None else seqs
        slots = meta.slots if len(seqs) == len(meta.query_lens) else meta.slots[seqs]
        fresh = zero_fresh_slots(meta, slots, (conv_states, lru_states), seqs)
        first = torch.zeros(len(seqs), dtype=torch.bool, device=ux.device)  # rows starting a sequence
        first[fresh] = True
        # transformers' decode conv: (window * weight).sum(-1) + bias in the model dtype
        u = causal_conv1d_decode(ux, self._weight(), self.conv1d.bias, conv_states, slots, taps=self.conv_taps())
        a, b = self._gates(u, first)
        h = a * lru_states[slots] + b  # [S', W] float32
        lru_states.index_copy_(0, slots, h)
        if meta.checkpoints:  # a snapshot after a decode token is the slot's new state
            position = {seq: j for j, seq in enumerate(seqs)}
            for i, off, dst in meta.checkpoints:
                if i not in position:
                    continue
                if off != 1:
                    raise ValueError(f"state checkpoint offset {off} in a decode step (one token per sequence)")
                src = meta.host_slots[i] if meta.host_slots is not None else int(slots[position[i]])
                conv_states[dst].copy_(conv_states[src])
                lru_states[dst].copy_(lru_states[src])
        return h.to(ux.dtype)
