"""Shared pieces of recurrent (Mamba-like) layers: the stateful-layer base and the causal depthwise conv.

A stateful layer declares its per-sequence state with `cache_spec()`; the runner binds a dict of
tensors [num_slots, *shape] to it; the layer reads and writes rows given by `StateMetadata.slots`.
Conv state keeps the last K-1 inputs of the sequence, oldest first: [num_slots, C, K-1]."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from stateserve.cache.spec import StateSpec
from stateserve.platform import kernels
from stateserve.layers.metadata import StateMetadata
from stateserve.layers.param_cache import derived


class StatefulLayer(nn.Module):
    """Base for layers whose inference state is a fixed-size tensor per sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.states: dict[str, torch.Tensor] | None = None

    def neg_exp_A(self) -> torch.Tensor:
        """-exp(A_log) in float32, for layers with an `A_log` parameter (Mamba, Mamba2, gated delta net). It is on
        every step's path, so it is computed once per weight version (loading a checkpoint in place bumps it)."""
        A_log = self.A_log
        return derived(self, "neg_exp_A", (A_log,), lambda: -torch.exp(A_log.detach().float()))

    def conv_taps(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This layer's `conv1d` as the decode kernel reads it: taps float32 [K, C] and the bias as float32 values of
        the weight's dtype (or None). Cached per weight version like `neg_exp_A`: converting and transposing them
        on every call cost more than the conv of a one-token step."""
        weight, bias = self.conv1d.weight, self.conv1d.bias

        def make() -> tuple[torch.Tensor, torch.Tensor | None]:
            taps = weight.detach().squeeze(1).float().t().contiguous()
            return taps, None if bias is None else bias.detach().to(weight.dtype).float().contiguous()
        return derived(self, "conv_taps", (weight, bias), make)

    def cache_spec(self) -> StateSpec:
        raise NotImplementedError

    # the dtypes this layer can keep its SSM state in (set_ssm_state_dtype); Mamba2-style mixers add theirs
    ssm_state_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32,)

    def set_ssm_state_dtype(self, dtype: torch.dtype) -> None:
        """Keep the SSM state in `dtype` (engine option mamba_ssm_cache_dtype). Layers whose kernels only take
        float32 states refuse, naming themselves."""
        raise ValueError(f"mamba_ssm_cache_dtype={str(dtype).removeprefix('torch.')}: {type(self).__name__} keeps "
                         f"its state in float32 (only Mamba2-style mixers support another dtype)")

    def bind_cache(self, states: dict[str, torch.Tensor] | None) -> None:
        self.states = states

    def release(self) -> None:
        self.states = None


@dataclass(frozen=True)
class ConvInput:
    """What a chunk's causal conv read: the K-1 inputs before the chunk and the chunk itself, time-major. Kept apart
    (not concatenated: that copy cost as much as the conv) and read by `conv_state_at`."""
    history: torch.Tensor  # [K-1, C]
    x: torch.Tensor  # [L, C]

    def padded(self) -> torch.Tensor:
        return torch.cat([self.history, self.x], dim=0)  # [K-1+L, C]


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          prev_state: torch.Tensor | None, silu_float32: bool = False
                          ) -> tuple[torch.Tensor, ConvInput]:
    """Depthwise causal conv of one sequence's chunk, resuming from `prev_state`.

    x: [L, C]; weight: [C, K]; prev_state: [C, K-1] or None (zeros).
    Returns y: [L, C] (before activation; with silu_float32, `F.silu(y).float()` in one pass) and the conv's input,
    from which `conv_state_at` reads the state after any number of the chunk's tokens."""
    C, K = weight.shape
    history = prev_state.t().to(x.dtype) if prev_state is not None else x.new_zeros(K - 1, C)
    inputs = ConvInput(history, x)
    kernel = kernels.table(x.device).conv_prefill(x.dtype, weight.dtype)
    if kernel is not None:
        return kernel(x, history, weight, bias, silu_float32), inputs
    padded = inputs.padded()
    y = F.conv1d(padded.t().contiguous().unsqueeze(0), weight.unsqueeze(1), bias, groups=C).squeeze(0).t()  # [L, C]
    return (F.silu(y).float() if silu_float32 else y), inputs


def conv_state_at(inputs: ConvInput, offset: int, kernel_size: int) -> torch.Tensor:
    """Conv state [C, K-1] after `offset` tokens of a chunk: rows offset .. offset+K-2 of [history; x]."""
    if offset >= kernel_size - 1:
        return inputs.x[offset - (kernel_size - 1):offset].t()
    return torch.cat([inputs.history[offset:], inputs.x[:offset]], dim=0).t()


def causal_conv1d_decode(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_state: torch.Tensor, slots: torch.Tensor, float_accumulate: bool = False,
                         silu_float32: bool = False,
                         taps: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
    """One new token per sequence. x: [S, C]; conv_state: [num_slots, C, K-1] updated in place at `slots`.

    float_accumulate=False rounds like `(window * weight).sum(-1) + bias` in x's dtype (transformers' Mamba2
    decode); True sums products and bias in float32 and rounds once, like F.conv1d (its Mamba1 decode).
    silu_float32: returns `F.silu(y).float()` instead of y, fused into the kernel's pass.
    taps: the layer's `conv_taps()` (weight and bias in the kernel's layout), computed here when not given."""
    kernel = kernels.table(x.device).conv_update(x.dtype, conv_state.dtype, weight.dtype)
    if kernel is not None and conv_state.is_contiguous():
        if taps is None:
            taps = (weight.float().t().contiguous(), None if bias is None else bias.to(weight.dtype).float())
        return kernel(conv_state, slots, x, taps[0], taps[1], float_accumulate, silu_float32)
    if silu_float32:
        return F.silu(causal_conv1d_decode(x, weight, bias, conv_state, slots, float_accumulate)).float()
    if float_accumulate:
        out_dtype = x.dtype
        bias = bias.float() if bias is not None else None
        return causal_conv1d_decode(x.float(), weight.float(), bias, conv_state, slots).to(out_dtype)
    window = torch.cat([conv_state[slots].to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [S, C, K]
    y = (window * weight.unsqueeze(0)).sum(-1)
    if bias is not None:
        y = y + bias
    conv_state.index_copy_(0, slots, window[:, :, 1:].to(conv_state.dtype))
    return y


def zero_fresh_slots(meta: StateMetadata, slots: torch.Tensor, states: tuple[torch.Tensor, ...],
                     seqs: list[int] | None = None) -> list[int]:
    """Decode rows of sequences with no state yet (the first token of a one-token prompt) start from zeros, not from
    what their slot held before. slots: [S'] the rows' slots; seqs: the step's sequence index of each row (all of the
    step's sequences if None); states: the pool tensors to clear, slot first. Returns the fresh rows' positions."""
    seqs = range(len(meta.query_lens)) if seqs is None else seqs
    fresh = [j for j, i in enumerate(seqs) if not meta.has_initial_state[i]]
    if fresh:
        rows = slots[torch.tensor(fresh, device=slots.device)]
        for state in states:
            state.index_fill_(0, rows, 0)
    return fresh


def sequence_chunks(meta: StateMetadata):
    """Yield (sequence index, start, length, slot, has_initial_state) for each sequence of the step."""
    slots = meta.slots.tolist()
    for i, (start, qlen) in enumerate(zip(meta.query_start_loc[:-1], meta.query_lens)):
        yield i, start, qlen, slots[i], meta.has_initial_state[i]


def checkpoints_of(meta: StateMetadata, seq_index: int) -> list[tuple[int, int]]:
    """(tokens into the chunk, destination slot) snapshots requested for one sequence."""
    return [(off, dst) for i, off, dst in meta.checkpoints if i == seq_index]


def verify_rounds(meta: StateMetadata) -> list[tuple[torch.Tensor, StateMetadata]]:
    """The chunks of meta.decode_rounds as rounds of one token per sequence: round r takes token r of every such
    chunk longer than r. -> (their rows in the flat batch [S_r] long, one-token metadata of the round whose
    checkpoints are those at offset r + 1) per round, for the layer's batched decode update to run in order. Made
    once per step (every recurrent layer runs the same rounds)."""
    if meta.round_plan is not None or not meta.decode_rounds:
        return meta.round_plan or []
    seqs = meta.decode_rounds
    host = meta.host_slots if meta.host_slots is not None else meta.slots.tolist()
    device = meta.slots.device
    plan = []
    for r in range(max(meta.query_lens[i] for i in seqs)):
        active = [i for i in seqs if meta.query_lens[i] > r]
        position = {i: j for j, i in enumerate(active)}
        rows = torch.tensor([meta.query_start_loc[i] + r for i in active], dtype=torch.long).to(device)
        slots = [host[i] for i in active]
        checkpoints = [(position[i], 1, dst) for i, off, dst in meta.checkpoints if i in position and off == r + 1]
        plan.append((rows, StateMetadata(
            query_start_loc=list(range(len(active) + 1)), query_lens=[1] * len(active),
            slots=torch.tensor(slots, dtype=torch.long).to(device), host_slots=slots,
            has_initial_state=[r > 0 or meta.has_initial_state[i] for i in active], is_decode_only=True,
            checkpoints=checkpoints)))
    meta.round_plan = plan
    return plan


def decode_group(meta: StateMetadata) -> list[int]:
    """Sequences of a mixed step that continue by one token (not verifying drafts): they take the batched decode
    update together, the arithmetic of a decode-only step, so a token's result does not depend on its step-mates."""
    rounds = set(meta.decode_rounds)
    return [i for i, n in enumerate(meta.query_lens) if n == 1 and meta.has_initial_state[i] and i not in rounds]


@dataclass(frozen=True)
class PrefillChunk:
    """One sequence's chunk that a mixed step leaves to the layer's own prefill."""
    index: int  # the sequence's index in the step
    start: int  # its first row in the flat batch
    length: int
    slot: int
    has_initial: bool  # False: its first chunk, starting from zeros
    snapshots: list[tuple[int, int]]  # (tokens into the chunk, destination slot), 0 < offset <= length

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.length)


DecodeRows = Callable[[torch.Tensor, StateMetadata, "list[int] | None"], torch.Tensor]


def mixed_step(meta: StateMetadata, out: torch.Tensor, decode: DecodeRows, *, group_decodes: bool = True,
               run_rounds: Callable[[], None] | None = None) -> list[PrefillChunk]:
    """The part of a step with prefill chunks that every recurrent layer runs alike. `decode(rows, meta, seqs)`
    runs the layer's batched one-token update on the flat batch's `rows` (seqs: their sequence indices in `meta`,
    None for all of meta's) and returns their outputs, which land in `out`'s rows:
    - the decode group (decode_group; group_decodes=False leaves them to the prefill chunks),
    - drafts being verified, round by round (verify_rounds; run_rounds: the layer's own runner of the rounds);
    then returns every other non-empty chunk with its validated snapshot checkpoints, for the layer's prefill."""
    group = decode_group(meta) if group_decodes else []
    if group:
        rows = torch.tensor([meta.query_start_loc[i] for i in group], device=out.device)
        out.index_copy_(0, rows, decode(rows, meta, group).to(out.dtype))
    if run_rounds is not None:
        run_rounds()
    else:
        for rows, round_meta in verify_rounds(meta):  # token by token, as plain decoding
            out.index_copy_(0, rows, decode(rows, round_meta, None).to(out.dtype))
    skip = set(group) | set(meta.decode_rounds)
    chunks = []
    for i, start, length, slot, has_initial in sequence_chunks(meta):
        if length == 0 or i in skip:
            continue
        snapshots = checkpoints_of(meta, i)
        if any(not 0 < off <= length for off, _ in snapshots):
            raise ValueError(f"state checkpoint offsets {[o for o, _ in snapshots]} outside the chunk of {length} "
                             "tokens")
        chunks.append(PrefillChunk(i, start, length, slot, has_initial, snapshots))
    return chunks
