"""Per-step batch descriptions passed explicitly to every layer (no global context).

Glossary: T = tokens in this step (all sequences, flattened), S = sequences in this step,
bs = block size. A sequence's chunk is tokens [query_start_loc[i], query_start_loc[i+1]) of the flat batch."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttnMetadata:
    query_start_loc: list[int]  # [S + 1] host ints
    query_lens: list[int]  # [S]
    context_lens: list[int]  # [S] tokens already in the cache before this step
    seq_lens: list[int]  # [S] context_lens + query_lens
    is_decode_only: bool
    causal: bool = True
    slot_mapping: torch.Tensor | None = None  # [T] long: block_id * bs + offset where each new K/V goes
    block_tables: torch.Tensor | None = None  # [S, max_blocks] long; entries past a sequence's blocks are padding
    seq_lens_t: torch.Tensor | None = None  # [S] long, on device (decode masking)
    max_seq_len: int = 0
    # Rows attended as one-token decodes by the decode kernel, as one group: each row of a sequence with one new
    # token and a cached context, and each row of a chunk verifying drafts (row r of it sees its context + r + 1 keys)
    decode_rows: torch.Tensor | None = None  # [Sd] long: their rows in the flat batch (ascending)
    decode_block_tables: torch.Tensor | None = None  # [Sd, max_blocks]
    decode_seq_lens: torch.Tensor | None = None  # [Sd]
    decode_max_seq_len: int = 0
    prefill_seqs: list[int] = field(default_factory=list)  # the other sequences, attended one by one
    # Sliding-window caches (cache/manager.py): blocks before a sequence's window were given back, so its block
    # table row starts at logical block block_offsets[i] (position block_offsets[i] * bs). None: every row starts at 0.
    block_offsets: list[int] | None = None  # [S]
    decode_block_offsets: torch.Tensor | None = None  # [Sd] long
    decode_max_table_blocks: int = 0  # the longest decode table row in use (0: derive from decode_max_seq_len)


@dataclass
class StateMetadata:
    query_start_loc: list[int]  # [S + 1]
    query_lens: list[int]  # [S]
    slots: torch.Tensor  # [S] long: state slot of each sequence
    has_initial_state: list[bool]  # [S] False on a sequence's first chunk: start from zeros
    is_decode_only: bool
    # Snapshots requested for prefix caching: (sequence index, tokens into its chunk, destination slot).
    # The state after that many tokens of the chunk is copied into the destination slot.
    checkpoints: list[tuple[int, int, int]] = field(default_factory=list)
    # Sequences verifying drafts: their chunk runs token by token through the layer's batched one-token update
    # (layers/recurrent.py: verify_rounds), so the state after each token is what plain decoding holds.
    decode_rounds: list[int] = field(default_factory=list)
    host_slots: list[int] | None = None  # `slots` as host ints, where the builder had them (saves device reads)
    # verify_rounds' plan, made by the first layer that asks and shared by the others
    round_plan: list | None = field(default=None, repr=False, compare=False)


@dataclass
class ForwardMeta:
    num_tokens: int
    attn: AttnMetadata | None = None
    state: StateMetadata | None = None
    # Encoder-decoder models: per-layer cross-attention inputs, filled by their model state.
    extra: dict = field(default_factory=dict)
