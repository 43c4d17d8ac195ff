"""MambaHybridModelState: attention-free models (Mamba, Mamba2) and hybrids (attention + recurrent layers).
Recurrent layers read and write their state slot; attention layers, if any, use paged KV."""
from __future__ import annotations

import torch

from stateserve.layers.metadata import ForwardMeta, StateMetadata
from stateserve.model_states.default import DefaultModelState, build_paged_attn_metadata
from stateserve.runner.input_batch import InputBatch


class MambaHybridModelState(DefaultModelState):
    uses_state_cache = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # attention-free models have no KV at all; hybrids have both
        self.uses_kv_cache = not self.model_config.is_attention_free

    def prepare_meta(self, batch: InputBatch) -> ForwardMeta:
        slots = [r.state_slot for r in batch.requests]
        if any(s is None for s in slots):
            raise RuntimeError("a scheduled request of a recurrent model has no state slot")
        state = StateMetadata(
            query_start_loc=batch.query_start_loc, query_lens=batch.query_lens,
            slots=torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True),
            has_initial_state=[c > 0 for c in batch.context_lens], is_decode_only=batch.is_decode_only)
        attn = build_paged_attn_metadata(batch, self.block_size, self.device) if self.uses_kv_cache else None
        return ForwardMeta(batch.num_tokens, attn=attn, state=state)
