"""EncoderOnlyModelState: bidirectional encoders (BERT-like) run for pooling; no KV cache and no state slots.

Every sequence is seen whole in a single step (an encoder's attention is not causal, so a later chunk would
change what earlier tokens attend to; the engine schedules whole prompts for this kind): there is nothing to keep
between steps and nothing to allocate. The pooler turns each sequence's rows into one vector, as the model folder
asks (layers/pooler.py). Per-request token type ids (segment A/B), when a prompt gives them, are handed to the
model in ForwardMeta.extra["token_type_ids"]."""
from __future__ import annotations

import torch

from stateserve.core.batch import InputBatch
from stateserve.core.request import Request
from stateserve.layers.metadata import AttnMetadata, ForwardMeta
from stateserve.layers.pooler import Pooler, load_pooling_config
from stateserve.model_states.interface import ModelState, PoolingSpec


class EncoderOnlyModelState(ModelState):
    uses_kv_cache = False
    uses_state_cache = False
    supports_generate = False
    runs_whole_prompts = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pooling_config = load_pooling_config(self.model_config.path, self.model.default_pooling_mode)
        self.pooler = Pooler(self.pooling_config)
        hf = self.model_config.hf_config
        max_len, reason = self._resolve_max_len()
        # Matryoshka support, declared as vLLM reads it from config.json: is_matryoshka (any size up to the full
        # one) or matryoshka_dimensions (only those sizes)
        dims = getattr(hf, "matryoshka_dimensions", None)
        self.pooling = PoolingSpec(
            modes=self.pooling_config.modes, normalize=self.pooling_config.normalize,
            embedding_size=int(hf.hidden_size) * len(self.pooling_config.modes), max_len=max_len,
            limit_reason=reason, matryoshka_dimensions=tuple(sorted(int(d) for d in dims)) if dims else None,
            is_matryoshka=bool(dims) or bool(getattr(hf, "is_matryoshka", False)),
            source=self.pooling_config.source)
        self._token_type_ids: dict[str, list[int]] = {}  # request id -> one type id per prompt token

    def _resolve_max_len(self) -> tuple[int, str]:
        hf, arch = self.model_config.hf_config, self.model_config.architecture
        limit, reason = self.model_config.max_model_len, "max_model_len"
        encoder_limit = self.model.max_encoder_len(hf)
        if encoder_limit is not None:
            limit = encoder_limit
            offset = hf.max_position_embeddings - limit
            reason = f"max_position_embeddings={hf.max_position_embeddings}" + (
                f" minus the position offset {offset} of {arch}" if offset else "")
        asked = self.engine_config.max_model_len
        if asked is not None:
            if asked > limit:
                raise ValueError(f"max_model_len={asked} exceeds the encoder's limit of {limit} tokens ({reason})")
            return asked, "max_model_len"
        st_len = self.pooling_config.max_seq_length
        if st_len is not None and st_len < limit:  # as vLLM: sentence-transformers' max_seq_length bounds prompts
            return int(st_len), f"max_seq_length={st_len} in sentence_bert_config.json"
        return limit, reason

    # ---- prompts -------------------------------------------------------------------------------
    def default_prefix_caching(self) -> bool:
        return False

    def prompt_limit(self) -> tuple[int, str]:
        return self.pooling.max_len, self.pooling.limit_reason

    def text_for_tokenizer(self, text: str) -> str:
        # sentence-transformers lower-cases before tokenizing when its folder says so
        return text.lower() if self.pooling_config.do_lower_case else text

    def validate_request(self, req: Request) -> None:
        types = req.token_type_ids
        if types is None:
            return
        if len(types) != req.num_prompt_tokens:
            raise ValueError(f"token_type_ids has {len(types)} entries but the prompt has {req.num_prompt_tokens} "
                             "tokens")
        num_types = int(getattr(self.model_config.hf_config, "type_vocab_size", 1))
        bad = [t for t in types if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < num_types]
        if bad:
            raise ValueError(f"token_type_ids must be ints in [0, {num_types}), got {bad[:5]}")

    def dummy_seq_len(self) -> int | None:
        return self.pooling.max_len

    # ---- requests and steps --------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.token_type_ids is not None:
            self._token_type_ids[req.request_id] = list(req.token_type_ids)

    def remove_request(self, req: Request) -> None:
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

    def pool(self, hidden: torch.Tensor, batch: InputBatch) -> torch.Tensor:
        """hidden [T, H] of whole sequences -> one float32 vector per sequence [S, embedding_size]."""
        return self.pooler(hidden, batch.query_start_loc)

    def pooling_spec(self) -> PoolingSpec:
        return self.pooling

    def release(self) -> None:
        self._token_type_ids.clear()
