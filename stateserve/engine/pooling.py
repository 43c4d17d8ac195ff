"""PoolingEngine: embeddings from encoder-only models. No scheduler and no cache: prompts are packed, in
order, into steps of at most max_num_batched_tokens tokens (and max_num_seqs sequences), each step is one
flat forward over the unpadded batch with non-causal attention, and the pooler turns each sequence's rows
into one vector.

An encoder cannot run a prompt in chunks (every token attends to every other), so a prompt longer than
max_num_batched_tokens runs in a step of its own. The model is loaded by the shared ModelRunner; its
model state (EncoderOnlyModelState) says it uses no KV cache and no state slots, so none is planned."""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from tqdm import tqdm

from stateserve import envs
from stateserve.config import EngineConfig, load_hf_config
from stateserve.engine.llm_engine import build_model_config, load_tokenizer
from stateserve.engine.scheduler import SchedulerOutput
from stateserve.layers.pooler import Pooler, load_pooling_config
from stateserve.models.registry import ModelRegistry
from stateserve.outputs import EmbeddingOutput, EmbeddingRequestOutput
from stateserve.runner.input_batch import build_input_batch
from stateserve.runner.model_runner import ModelRunner

logger = logging.getLogger("stateserve")


def is_pooling_architecture(model_cls: type) -> bool:
    return bool(getattr(model_cls, "is_pooling_model", False))


def select_runner(config: EngineConfig) -> str:
    """'generate' or 'pooling' for this model; runner='auto' picks by the architecture's class."""
    hf_config = load_hf_config(config.model, config.hf_overrides)
    arch = ModelRegistry.architecture_of(hf_config)
    pooling = is_pooling_architecture(ModelRegistry.resolve(arch))
    if config.runner == "auto":
        return "pooling" if pooling else "generate"
    if config.runner == "pooling" and not pooling:
        raise ValueError(f"{arch} has no pooling head: runner='pooling' needs an embedding model "
                         "(BertModel, RobertaModel, XLMRobertaModel)")
    if config.runner == "generate" and pooling:
        raise ValueError(f"{arch} is an embedding model with no LM head: it cannot run with runner='generate'; "
                         "use runner='pooling' (the default for it) and LLM.embed")
    return config.runner


@dataclass(eq=False)
class PoolingRequest:
    """One prompt to embed. Has the fields build_input_batch and the model state read from a Request."""

    request_id: str
    prompt_token_ids: list[int]
    prompt: str | None = None
    token_type_ids: list[int] | None = None
    num_computed_tokens: int = 0
    state_slot: int | None = None
    block_ids: list[int] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)


class PoolingEngine:
    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        envs.enable_envs_cache()
        self.config = config
        self.device = config.resolved_device()
        self.model_config = build_model_config(config, self.device)
        model_cls = ModelRegistry.resolve(self.model_config.architecture)
        if not is_pooling_architecture(model_cls):
            raise ValueError(f"{self.model_config.architecture} has no pooling head")
        self.tokenizer = load_tokenizer(config)
        # the full-recompute reference runner only matters for generation: an encoder recomputes every step
        self.runner = ModelRunner(config, self.model_config, self.device)
        self.runner.load_model(show_progress)
        self.model_state = self.runner.model_state
        if self.model_state.uses_kv_cache or self.model_state.uses_state_cache:
            raise ValueError(f"{type(self.model_state).__name__} needs a cache; the pooling engine runs only "
                             "models that keep nothing between steps")
        self.pooling_config = load_pooling_config(config.model, getattr(model_cls, "default_pooling_mode", "cls"))
        self.pooler = Pooler(self.pooling_config)
        self.max_len, self.limit_reason = self._resolve_max_len(model_cls)
        self._ids = itertools.count()
        self._closed = False
        logger.info("Pooling: modes %s, normalize=%s (%s config); longest prompt %d tokens (%s)",
                    ",".join(self.pooling_config.modes), self.pooling_config.normalize, self.pooling_config.source,
                    self.max_len, self.limit_reason)

    def _resolve_max_len(self, model_cls: type) -> tuple[int, str]:
        hf = self.model_config.hf_config
        limit, reason = self.model_config.max_model_len, "max_model_len"
        if hasattr(model_cls, "max_encoder_len"):
            limit = model_cls.max_encoder_len(hf)
            offset = hf.max_position_embeddings - limit
            reason = f"max_position_embeddings={hf.max_position_embeddings}" + (
                f" minus the position offset {offset} of {self.model_config.architecture}" if offset else "")
        if self.config.max_model_len is not None:
            if self.config.max_model_len > limit:
                raise ValueError(f"max_model_len={self.config.max_model_len} exceeds the encoder's limit of {limit} "
                                 f"tokens ({reason})")
            return self.config.max_model_len, "max_model_len"
        st_len = self.pooling_config.max_seq_length
        if st_len is not None and st_len < limit:  # as vLLM: sentence-transformers' max_seq_length bounds prompts
            return int(st_len), f"max_seq_length={st_len} in sentence_bert_config.json"
        return limit, reason

    # ---- prompts -------------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; with skip_tokenizer_init=True pass "
                             "{'prompt_token_ids': [...]}")
        if self.pooling_config.do_lower_case:  # sentence-transformers lower-cases before tokenizing
            prompt = prompt.lower()
        return self.tokenizer(prompt).input_ids

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt has token id(s) outside the vocabulary [0, {vocab}): {bad[:5]}")
        if len(token_ids) > self.max_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than this encoder's limit of {self.max_len} "
                             f"tokens ({self.limit_reason}); shorten it or pass truncate_prompt_tokens")

    def _truncation(self, truncate_prompt_tokens: int | None) -> int | None:
        k = truncate_prompt_tokens
        if k is None:
            return None
        if not isinstance(k, int) or isinstance(k, bool) or k == 0 or k < -1:
            raise ValueError(f"truncate_prompt_tokens must be None, -1 (the model's limit) or a positive int, "
                             f"got {k!r}")
        if k > self.max_len:
            raise ValueError(f"truncate_prompt_tokens={k} is more than this encoder's limit of {self.max_len} "
                             f"tokens ({self.limit_reason})")
        return self.max_len if k == -1 else k

    def make_request(self, prompt: str | dict[str, Any], keep_last: int | None) -> PoolingRequest:
        """A prompt (text, or a dict with prompt / prompt_token_ids and optional token_type_ids), tokenized,
        truncated to its last `keep_last` tokens (vLLM's left truncation) and validated."""
        text, types = None, None
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenize(prompt)
        elif isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "token_type_ids"}
            if unknown:
                raise ValueError(f"prompt dict has unsupported key(s): {sorted(unknown)}")
            text = prompt.get("prompt")
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)):
                    raise ValueError("prompt_token_ids must be a list of ints")
                ids = list(ids)
            elif isinstance(text, str):
                ids = self.tokenize(text)
            else:
                raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
            if prompt.get("token_type_ids") is not None:
                types = list(prompt["token_type_ids"])
                self._check_token_types(types, len(ids))
        else:
            raise ValueError(f"a prompt must be a string or a dict with 'prompt_token_ids', got "
                             f"{type(prompt).__name__}")
        if keep_last is not None and len(ids) > keep_last:
            ids = ids[-keep_last:]
            types = types[-keep_last:] if types is not None else None
        self.validate_prompt(ids)
        return PoolingRequest(f"embd-{next(self._ids)}", ids, text, types)

    def _check_token_types(self, types: list[int], num_tokens: int) -> None:
        if len(types) != num_tokens:
            raise ValueError(f"token_type_ids has {len(types)} entries but the prompt has {num_tokens} tokens")
        num_types = int(getattr(self.model_config.hf_config, "type_vocab_size", 1))
        bad = [t for t in types if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < num_types]
        if bad:
            raise ValueError(f"token_type_ids must be ints in [0, {num_types}), got {bad[:5]}")

    # ---- running -------------------------------------------------------------------------------
    def plan_batches(self, requests: list[PoolingRequest]) -> list[list[PoolingRequest]]:
        """Consecutive prompts while the step stays within max_num_batched_tokens and max_num_seqs."""
        budget, max_seqs = self.config.max_num_batched_tokens, self.config.max_num_seqs
        batches: list[list[PoolingRequest]] = []
        current, tokens = [], 0
        for req in requests:
            if current and (tokens + req.num_tokens > budget or len(current) == max_seqs):
                batches.append(current)
                current, tokens = [], 0
            current.append(req)
            tokens += req.num_tokens
        if current:
            batches.append(current)
        return batches

    @torch.inference_mode()
    def run_batch(self, requests: list[PoolingRequest]) -> torch.Tensor:
        """One forward over the whole batch -> pooled vectors [S, dim] (float32, on the model's device)."""
        sched = SchedulerOutput()
        for req in requests:
            sched.add(req, req.num_tokens)
        for req in requests:
            self.model_state.add_request(req)
        try:
            self.runner.poll_threads()
            batch = build_input_batch(sched, self.device)
            meta = self.model_state.prepare_meta(batch)
            hidden = self.runner.model(batch.input_ids, batch.positions, meta)  # [T, hidden]
            self.model_state.after_step(batch)
            return self.pooler(hidden, batch.query_start_loc)  # [S, dim]
        except BaseException:
            self.model_state.on_step_failed()
            raise
        finally:
            for req in requests:
                self.model_state.remove_request(req)

    def embed(self, prompts: Sequence[str | dict[str, Any]], truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        self._check_open()
        keep_last = self._truncation(truncate_prompt_tokens)
        requests = [self.make_request(p, keep_last) for p in prompts]  # validate all before running any
        outputs: list[EmbeddingRequestOutput] = []
        with tqdm(total=len(requests), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True) as bar:
            for batch in self.plan_batches(requests):
                vectors = self.run_batch(batch).cpu().tolist()
                for req, vec in zip(batch, vectors):
                    outputs.append(EmbeddingRequestOutput(request_id=req.request_id,
                                                          prompt_token_ids=list(req.prompt_token_ids),
                                                          outputs=EmbeddingOutput(embedding=vec), finished=True,
                                                          prompt=req.prompt))
                bar.update(len(batch))
        return outputs

    # ---- lifecycle -----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this engine has been shut down; create a new LLM")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.runner.shutdown()
        self.model_state = None
