"""DefaultModelState: decoders with paged KV attention."""
from __future__ import annotations

import torch

from stateserve.layers.metadata import AttnMetadata, ForwardMeta
from stateserve.model_states.interface import GraphBuffers, ModelState
from stateserve.core.batch import InputBatch


def build_paged_attn_metadata(batch: InputBatch, block_size: int, device: torch.device) -> AttnMetadata:
    """Slot mapping and block tables of a step. A table row lists a sequence's blocks from its first kept one: a
    sliding-window cache gives back the blocks before the window (their block_ids entries are NO_BLOCK)."""
    slot_mapping: list[int] = []
    for req, c, q in zip(batch.requests, batch.context_lens, batch.query_lens):
        blocks = req.block_ids
        slot_mapping.extend(blocks[p // block_size] * block_size + p % block_size for p in range(c, c + q))
    offsets = [req.num_released_blocks for req in batch.requests]
    seq_lens = batch.seq_lens
    max_blocks = max(len(r.block_ids) - off for r, off in zip(batch.requests, offsets))
    tables = torch.zeros(len(batch.requests), max_blocks, dtype=torch.long)
    for i, (req, off) in enumerate(zip(batch.requests, offsets)):
        tables[i, :len(req.block_ids) - off] = torch.tensor(req.block_ids[off:], dtype=torch.long)
    # The decode group: one entry per query row attended as a one-token decode, (its row, its sequence, keys it
    # sees). A sequence continuing by one token is one entry; a sequence verifying drafts gives one entry per row of
    # its chunk (row r sees the context and rows 0..r), so each verified token's attention is the decode kernel's,
    # what plain decoding computes at that position, for k + 1 reads of a context a decode step reads once (cheaper
    # than a prefill-shaped pass over a chunk of a few rows, and the same arithmetic as not speculating).
    verifying = set(batch.spec_seqs)
    entries = [(batch.query_start_loc[i] + r, i, c + r + 1)
               for i, (c, q) in enumerate(zip(batch.context_lens, batch.query_lens)) if c > 0
               and (q == 1 or i in verifying) for r in range(q)]
    decode_set = {i for _, i, _ in entries}
    prefill = [i for i in range(len(batch.requests)) if i not in decode_set]
    decode = [i for _, i, _ in entries]
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.long)
    decode_t = torch.tensor(decode, dtype=torch.long)
    decode_lens = [n for _, _, n in entries]
    rows = torch.tensor([row for row, _, _ in entries], dtype=torch.long)
    windowed = any(offsets)
    return AttnMetadata(
        query_start_loc=batch.query_start_loc, query_lens=batch.query_lens, context_lens=batch.context_lens,
        seq_lens=seq_lens, is_decode_only=batch.is_decode_only,
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long).to(device, non_blocking=True),
        block_tables=tables.to(device, non_blocking=True),
        seq_lens_t=seq_lens_t.to(device, non_blocking=True),
        max_seq_len=max(seq_lens),
        decode_rows=rows.to(device, non_blocking=True),
        decode_block_tables=tables[decode_t].to(device, non_blocking=True),
        decode_seq_lens=torch.tensor(decode_lens, dtype=torch.long).to(device, non_blocking=True),
        decode_max_seq_len=max(decode_lens, default=0),
        prefill_seqs=prefill,
        block_offsets=offsets if windowed else None,
        decode_block_offsets=torch.tensor([offsets[i] for i in decode], dtype=torch.long).to(device)
        if windowed else None,
        decode_max_table_blocks=max((len(batch.requests[i].block_ids) - offsets[i] for i in decode), default=0)
        if windowed else 0)


class DefaultModelState(ModelState):
    uses_kv_cache = True
    uses_state_cache = False

    def prepare_meta(self, batch: InputBatch) -> ForwardMeta:
        return ForwardMeta(batch.num_tokens, attn=build_paged_attn_metadata(batch, self.block_size, self.device))

    def graph_unsupported_reason(self) -> str | None:
        # graph_meta must rebuild what prepare_meta builds: a subclass that changes one without the other cannot
        # replay (encoder-decoder states, plug-in states with extra inputs)
        if _defined_by(type(self), "prepare_meta") is not _defined_by(type(self), "graph_meta"):
            return super().graph_unsupported_reason()
        if self.model.dynamic_rope:
            return "dynamic NTK rope reads host-side sequence lengths each step"
        return self.model.graph_blocker

    def graph_meta(self, buffers: GraphBuffers, size: int, width: int) -> ForwardMeta:
        return ForwardMeta(size, attn=graph_attn_metadata(buffers, size, width) if self.uses_kv_cache else None)


def _defined_by(cls: type, name: str) -> type:
    return next(c for c in cls.__mro__ if name in vars(c))


def graph_attn_metadata(buffers: GraphBuffers, size: int, width: int) -> AttnMetadata:
    """Decode metadata over the persistent buffers: every sequence attends over the full table width, masked by
    its length, so the host-side values are the same at every replay."""
    tables, lens = buffers.block_tables[:size], buffers.seq_lens[:size]
    return AttnMetadata(query_start_loc=list(range(size + 1)), query_lens=[1] * size,
                        context_lens=[width - 1] * size, seq_lens=[width] * size, is_decode_only=True,
                        slot_mapping=buffers.slot_mapping[:size], block_tables=tables, seq_lens_t=lens,
                        max_seq_len=width, decode_rows=buffers.rows[:size], decode_block_tables=tables,
                        decode_seq_lens=lens, decode_max_seq_len=width)
