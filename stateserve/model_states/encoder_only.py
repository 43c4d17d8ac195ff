"""EncoderOnlyModelState: bidirectional encoders (BERT-like) for pooling; no KV cache at all."""
from __future__ import annotations

from stateserve.layers.metadata import AttnMetadata, ForwardMeta
from stateserve.model_states.default import DefaultModelState
from stateserve.runner.input_batch import InputBatch


class EncoderOnlyModelState(DefaultModelState):
    uses_kv_cache = False
    supports_generate = False

    def default_prefix_caching(self) -> bool:
        return False

    def prepare_meta(self, batch: InputBatch) -> ForwardMeta:
        attn = AttnMetadata(query_start_loc=batch.query_start_loc, query_lens=batch.query_lens,
                            context_lens=[0] * len(batch.query_lens), seq_lens=batch.query_lens,
                            is_decode_only=False, causal=False)
        return ForwardMeta(batch.num_tokens, attn=attn)
