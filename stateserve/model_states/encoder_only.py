"""EncoderOnlyModelState: bidirectional encoders (BERT-like) run for pooling; no KV cache and no state slots.

Every sequence is seen whole in a single step (an encoder's attention is not causal, so a later chunk would
change what earlier tokens attend to): there is nothing to keep between steps and nothing to allocate.
Per-request token type ids (segment A/B), when a prompt gives them, are kept here from add_request to
remove_request and handed to the model in ForwardMeta.extra["token_type_ids"]."""
from __future__ import annotations

import torch

from stateserve.layers.metadata import AttnMetadata, ForwardMeta
from stateserve.model_states.interface import ModelState
from stateserve.runner.input_batch import InputBatch


class EncoderOnlyModelState(ModelState):
    uses_kv_cache = False
    uses_state_cache = False
    supports_generate = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._token_type_ids: dict[str, list[int]] = {}  # request id -> one type id per prompt token

    def default_prefix_caching(self) -> bool:
        return False

    def add_request(self, req) -> None:
        types = getattr(req, "token_type_ids", None)
        if types is not None:
            if len(types) != len(req.prompt_token_ids):
                raise ValueError(f"token_type_ids has {len(types)} entries for a prompt of "
                                 f"{len(req.prompt_token_ids)} tokens")
            self._token_type_ids[req.request_id] = list(types)

    def remove_request(self, req) -> None:
        self._token_type_ids.pop(req.request_id, None)

    def prepare_meta(self, batch: InputBatch) -> ForwardMeta:
        if any(c != 0 for c in batch.context_lens) or any(
                q != r.num_tokens for q, r in zip(batch.query_lens, batch.requests)):
            raise RuntimeError("an encoder-only model runs each sequence whole in one step; got a partial chunk")
        attn = AttnMetadata(query_start_loc=batch.query_start_loc, query_lens=batch.query_lens,
                            context_lens=[0] * len(batch.query_lens), seq_lens=list(batch.query_lens),
                            is_decode_only=False, causal=False)
        meta = ForwardMeta(batch.num_tokens, attn=attn)
        if any(r.request_id in self._token_type_ids for r in batch.requests):
            flat: list[int] = []
            for req, n in zip(batch.requests, batch.query_lens):
                flat.extend(self._token_type_ids.get(req.request_id, [0] * n))
            meta.extra["token_type_ids"] = torch.tensor(flat, dtype=torch.long).to(self.device)  # [T]
        return meta

    def release(self) -> None:
        self._token_type_ids.clear()
