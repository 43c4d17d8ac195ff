"""LLMEngine: validates and admits requests, runs scheduler -> runner -> sampler steps, applies stop rules."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from typing import Any

import torch

from stateserve import envs
from stateserve.cache.prefix import SnapshotIndex
from stateserve.config import EngineConfig, ModelConfig, load_hf_config, read_eos_ids, resolve_dtype
from stateserve.engine.cache_manager import CacheManager
from stateserve.engine import fault_inject
from stateserve.engine.detokenizer import Detokenizer, find_stop_string
from stateserve.engine.errors import EngineDeadError
from stateserve.engine.request import Request
from stateserve.engine.scheduler import Scheduler
from stateserve.models.registry import ModelRegistry
from stateserve.outputs import CompletionOutput, Logprob, RequestOutput
from stateserve.runner.input_batch import InputBatch
from stateserve.runner.model_runner import ModelRunner
from stateserve.runner.sampler import SampleResult
from stateserve.sampling_params import SamplingParams

logger = logging.getLogger("stateserve")
_DEFAULT_RECURRENT_MAX_LEN = 1 << 16
_MAX_SNAPSHOT_SLOTS = 1024
_SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes


def build_model_config(cfg: EngineConfig, device: torch.device) -> ModelConfig:
    hf = load_hf_config(cfg.model, cfg.hf_overrides)
    arch = ModelRegistry.architecture_of(hf)
    cls = ModelRegistry.resolve(arch)
    is_af, is_hybrid = bool(getattr(cls, "is_attention_free", False)), bool(getattr(cls, "is_hybrid", False))
    if hasattr(cls, "resolve_flags"):  # e.g. a hybrid family whose config may turn out all-attention
        is_af, is_hybrid = cls.resolve_flags(hf)
    # a model class may name its own limit (e.g. Whisper's decoder: max_target_positions)
    limit = cls.max_positions(hf) if hasattr(cls, "max_positions") else getattr(hf, "max_position_embeddings", None)
    if limit is None:
        limit = _DEFAULT_RECURRENT_MAX_LEN if is_af else 2048
    elif not is_af:
        from stateserve.layers.rotary import rope_parameters

        rope = rope_parameters(hf)
        if rope["rope_type"] in ("linear", "dynamic"):  # these stretch the usable context by `factor`
            limit = int(limit * rope.get("factor", 1.0))
    if cfg.max_model_len is not None:
        if cfg.max_model_len > limit and not is_af:
            raise ValueError(f"max_model_len={cfg.max_model_len} exceeds the model's max_position_embeddings={limit}")
        limit = cfg.max_model_len
    return ModelConfig(path=cfg.model, hf_config=hf, architecture=arch, dtype=resolve_dtype(cfg.dtype, hf, device),
                       max_model_len=int(limit), vocab_size=int(hf.vocab_size), is_attention_free=is_af,
                       is_hybrid=is_hybrid, eos_token_ids=read_eos_ids(cfg.model, hf))


def load_tokenizer(cfg: EngineConfig) -> Any | None:
    if cfg.skip_tokenizer_init:
        return None
    from transformers import AutoTokenizer

    path = cfg.tokenizer or cfg.model
    if not os.path.isdir(path):
        raise ValueError(f"tokenizer {path!r} is not a folder")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


class LLMEngine:
    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        envs.enable_envs_cache()
        self.config = config
        self.device = config.resolved_device()
        self.model_config = build_model_config(config, self.device)
        self.tokenizer = load_tokenizer(config)
        self.detokenizer = Detokenizer(self.tokenizer)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.reference = envs.STATESERVE_RUNNER == "reference"
        if envs.STATESERVE_RUNNER not in ("default", "reference"):
            raise ValueError(f"STATESERVE_RUNNER must be default or reference, got {envs.STATESERVE_RUNNER!r}")
        if self.reference:  # one request at a time, full recompute, no cache reuse
            from stateserve.runner.reference_runner import ReferenceRunner

            config = dataclasses.replace(config, max_num_seqs=1, enable_prefix_caching=False)
            self.config = config
        if fault_inject.requested() and not config.enforce_eager:  # a CUDA graph replay runs no Python hook
            config = self.config = dataclasses.replace(config, enforce_eager=True)
        runner_cls = ReferenceRunner if self.reference else ModelRunner
        self.runner = runner_cls(config, self.model_config, self.device)
        self.runner.load_model(show_progress)
        self.model_state = self.runner.model_state
        self.prefix_caching = (config.enable_prefix_caching if config.enable_prefix_caching is not None
                               else self.model_state.default_prefix_caching())
        self.mamba_cache_mode = self._resolve_mamba_cache_mode()
        num_snapshot_slots = 0
        if self.model_state.uses_state_cache and self.mamba_cache_mode != "none":
            num_snapshot_slots = min(_MAX_SNAPSHOT_SLOTS, config.max_num_seqs * 64)
        plan = self.runner.initialize_caches(config.max_num_seqs, num_snapshot_slots)
        self.max_num_seqs = plan.max_num_seqs
        snapshots = None
        if self.runner.snapshot_pool is not None:
            snapshots = SnapshotIndex(self.runner.snapshot_pool, self.runner.storage.copy_slot)
        self.cache = CacheManager(self.runner.block_pool, self.runner.slot_pool, config.block_size,
                                  prefix_caching=self.prefix_caching, snapshots=snapshots)
        self.model_state.attach_cache(self.cache, self.mamba_cache_mode)
        self.scheduler = Scheduler(self.cache, max_num_seqs=plan.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   chunk_size_fn=self.model_state.chunk_size)
        self.fault_injector = fault_inject.from_env(self.runner.model)  # None unless STATESERVE_FAULT_INJECT
        self.max_step_failures = envs.STATESERVE_MAX_CONSECUTIVE_STEP_FAILURES
        if self.max_step_failures < 1:
            raise ValueError("environment variable STATESERVE_MAX_CONSECUTIVE_STEP_FAILURES must be at least 1, "
                             f"got {self.max_step_failures}")
        self._consecutive_failures = 0
        self._death: tuple[str, BaseException] | None = None  # set when too many steps failed in a row
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, list[Request]] = {}
        self._counter = itertools.count()
        self._closed = False
        self.last_updated: list[str] = []  # group ids that got a new token (or finished) in the last step
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "prefix_cache_queries": 0,
                      "prefix_cache_hits": 0, "preemptions": 0}

    def _resolve_mamba_cache_mode(self) -> str:
        mode = self.config.mamba_cache_mode
        if not self.model_state.uses_state_cache or not self.prefix_caching:
            if mode not in (None, "none") and self.model_state.uses_state_cache:
                logger.warning("mamba_cache_mode=%s ignored: prefix caching is off", mode)
            return "none"
        return mode or "all"  # see docs/prefix_caching.md for why 'all' is the default

    # ---- requests ------------------------------------------------------------------------------
    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt has token id(s) outside the vocabulary [0, {vocab}): {bad[:5]}")
        if len(token_ids) > self.model_config.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_model_len="
                             f"{self.model_config.max_model_len}")
        if self.cache.block_pool is not None:
            needed = -(-len(token_ids) // self.config.block_size)
            if needed > self.cache.max_blocks():
                raise ValueError(f"prompt of {len(token_ids)} tokens needs {needed} KV blocks but the cache has "
                                 f"only {self.cache.max_blocks()}; raise kv_cache_memory_bytes")

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; with skip_tokenizer_init=True pass "
                             "{'prompt_token_ids': [...]}")
        return self.tokenizer(prompt).input_ids

    def prepare_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                        prompt: str | None = None, encoder_input: Any = None,
                        fairness_key: str | None = None) -> list[Request]:
        """Validate one submission and build its sequences (one per sample) without queueing anything, so a
        rejected submission leaves no trace. encoder_input: for encoder-decoder models, from
        model_state.prepare_prompt; without it the prompt ids are the encoder input and decoding starts from the
        decoder start token. fairness_key: admission is fair between keys (engine/fair_queue.py); default: the
        request id."""
        self._check_open()
        if not self.model_state.supports_generate:
            raise ValueError(f"{self.model_config.architecture} does not generate text; use LLM.embed")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if getattr(self.model_state, "is_encoder_decoder", False):
            if encoder_input is None:
                prompt_token_ids, encoder_input = self.model_state.prepare_prompt(
                    None, {"input_ids": list(prompt_token_ids)})
        elif encoder_input is not None:
            raise ValueError(f"{self.model_config.architecture} has no encoder: encoder inputs are only for "
                             "encoder-decoder models")
        self.validate_prompt(prompt_token_ids)
        lo, hi = _SEED_RANGE
        if params.seed is not None and not lo <= params.seed <= params.seed + params.n - 1 <= hi:
            raise ValueError(f"seed={params.seed} with n={params.n}: sample i is seeded with seed + i, which must "
                             f"lie in [-2**63, 2**64 - 1]")
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        params = params.with_stop_ids(stop_ids)
        children = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            if child_id in self.requests:
                raise ValueError(f"request id {child_id!r} is already in use")
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(params.seed + i)
            req = Request(child_id, list(prompt_token_ids), params, next(self._counter), prompt, request_id, gen,
                          fairness_key or request_id)
            if encoder_input is not None:  # prefix-cache keys must differ per encoder input
                req.encoder_input, req.cache_extra = encoder_input, encoder_input.cache_key
            children.append(req)
        return children

    def add_prepared(self, children: list[Request]) -> None:
        """Queue the sequences `prepare_request` built (all of them, or none when the id is taken by now)."""
        self._check_open()
        group_id = children[0].group_id
        if group_id in self.groups or any(r.request_id in self.requests for r in children):
            raise ValueError(f"request id {group_id!r} is already in use")
        self.groups[group_id] = children
        for req in children:
            self.requests[req.request_id] = req
            self.stats["prompt_tokens"] += req.num_prompt_tokens
            self.scheduler.add(req)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, encoder_input: Any = None, fairness_key: str | None = None) -> None:
        """Validate the whole submission (every sample), then queue all of it: on an error nothing is added."""
        self.add_prepared(self.prepare_request(request_id, prompt_token_ids, params, prompt, encoder_input,
                                               fairness_key))

    def abort_request(self, request_id: str) -> None:
        for req in self.groups.get(request_id, []):
            if not req.is_finished:
                req.finish_reason = "abort"
                self._finish(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[str]:
        """Run one scheduler step; returns ids of request groups that finished in it. A step whose forward or
        sampling raises fails the requests in it (finish_reason "error") and the engine goes on; the
        STATESERVE_MAX_CONSECUTIVE_STEP_FAILURES-th failed step in a row raises EngineDeadError instead."""
        self._check_open()
        self.last_updated = []
        sched = self.scheduler.schedule()
        self.stats["preemptions"] += len(sched.preempted)
        for req in sched.preempted:
            self.model_state.remove_request(req)
        for req in sched.admitted:
            self.model_state.add_request(req)
        if not sched.requests:
            if self.scheduler.waiting and not self.scheduler.running:
                req = self.scheduler.waiting.peek()  # cannot fit even alone: end it rather than spin
                req.finish_reason = "length"
                self._finish(req)
                logger.warning("request %s cannot fit in the cache and was stopped", req.request_id)
            return self._collect_finished()
        try:
            batch, result = self.runner.execute(sched)
        except BaseException as e:
            self._fail_step(sched.requests, e)  # raises EngineDeadError when too many failed in a row
            if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit: the step's requests failed, go on up
                raise
            return self._collect_finished()
        self._consecutive_failures = 0
        for req, n in zip(sched.requests, sched.num_new_tokens):
            req.num_computed_tokens += n
            self.cache.publish_blocks(req)
        self.stats["prefix_cache_queries"] = self.cache.num_queried_tokens
        self.stats["prefix_cache_hits"] = self.cache.num_hit_tokens
        if result is not None:
            self._apply_samples(batch, result)
        return self._collect_finished()

    def _fail_step(self, reqs: list[Request], exc: BaseException) -> None:
        """The step over `reqs` raised part-way. Its forward may have advanced their recurrent states in place and
        written KV rows and snapshot slots, but it only ever writes what these requests own: their running state
        slots (zeroed when next handed out), their not yet published KV blocks (freed unpublished, so never
        matched; published blocks are never written) and the snapshot slots reserved for this step (dropped by
        on_step_failed, never published). Ending exactly these requests therefore leaves nothing half-written
        that anyone could read, and every other request goes on as if the step had not run."""
        try:
            self.model_state.on_step_failed()
        except Exception:
            logger.exception("on_step_failed raised; going on with the failed step's clean-up")
        error = f"the engine step running this request failed: {type(exc).__name__}: {exc}"
        updated = dict.fromkeys(self.last_updated)
        for req in reqs:
            if not req.is_finished:
                req.finish_reason, req.error = "error", error
                self._finish(req)
                updated[req.group_id] = None
        self.last_updated = list(updated)
        if not isinstance(exc, Exception):
            return
        self._consecutive_failures += 1
        logger.error("a step failed; its %d request(s) finished with finish_reason 'error' (%d failed step(s) in "
                     "a row, the engine stops at %d)", len(reqs), self._consecutive_failures,
                     self.max_step_failures, exc_info=exc)
        if self._consecutive_failures >= self.max_step_failures:
            self._death = (f"the engine stopped after {self._consecutive_failures} failed steps in a row "
                           f"(STATESERVE_MAX_CONSECUTIVE_STEP_FAILURES={self.max_step_failures}); last error: "
                           f"{type(exc).__name__}: {exc}", exc)
            self._check_open()

    def _apply_samples(self, batch: InputBatch, result: SampleResult) -> None:
        updated = dict.fromkeys(self.last_updated)
        for j, i in enumerate(batch.sample_indices):
            req = batch.requests[i]
            token = result.token_ids[j]
            req.append_token(token)
            self.stats["generation_tokens"] += 1
            updated[req.group_id] = None
            if req.logprobs is not None:
                req.cumulative_logprob += result.sampled_logprobs[j]
                ids, vals = result.top_logprobs[j]
                entry = {t: Logprob(v, r + 1, self.detokenizer.decode_token(t)) for r, (t, v) in
                         enumerate(zip(ids, vals))}
                entry[token] = Logprob(result.sampled_logprobs[j], result.sampled_ranks[j],
                                       self.detokenizer.decode_token(token))
                req.logprobs.append(entry)
            self._check_stop(req, token)
        self.last_updated = list(updated)

    def _check_stop(self, req: Request, token: int) -> None:
        p = req.params
        if req.num_output_tokens >= p.min_tokens:
            if token in p._all_stop_token_ids:
                req.finish_reason = "stop"
                req.stop_reason = token if token in p.stop_token_ids else None
            elif p.stop:
                text = self.detokenizer.decode(req.output_token_ids, p.skip_special_tokens)
                hit = find_stop_string(text, p.stop, len(req.output_text))
                req.output_text = text
                if hit is not None:
                    req.output_text = text[:hit[0]]
                    req.finish_reason, req.stop_reason = "stop", hit[1]
        if req.finish_reason is None and p.max_tokens is not None and req.num_output_tokens >= p.max_tokens:
            req.finish_reason = "length"
        if req.finish_reason is None and req.num_tokens >= self.model_config.max_model_len:
            req.finish_reason = "length"
        if req.finish_reason is not None:
            self._finish(req)

    def _finish(self, req: Request) -> None:
        self.model_state.remove_request(req)
        self.scheduler.finish(req)
        if req.finish_reason != "stop" or not req.params.stop or req.stop_reason is None:
            req.output_text = self.detokenizer.decode(req.output_token_ids, req.params.skip_special_tokens)

    def _collect_finished(self) -> list[str]:
        return [gid for gid, reqs in self.groups.items() if all(r.is_finished for r in reqs)]

    # ---- outputs -------------------------------------------------------------------------------
    def make_output(self, group_id: str) -> RequestOutput:
        reqs = self.groups[group_id]
        outs = [CompletionOutput(index=i, text=r.output_text, token_ids=list(r.output_token_ids),
                                 cumulative_logprob=r.cumulative_logprob if r.logprobs is not None else None,
                                 logprobs=r.logprobs, finish_reason=r.finish_reason, stop_reason=r.stop_reason,
                                 error=r.error)
                for i, r in enumerate(reqs)]
        first = reqs[0]
        return RequestOutput(request_id=group_id, prompt=first.prompt, prompt_token_ids=list(first.prompt_token_ids),
                             outputs=outs, finished=all(r.is_finished for r in reqs),
                             num_cached_tokens=first.num_cached_tokens)

    def pop_output(self, group_id: str) -> RequestOutput:
        out = self.make_output(group_id)
        for r in self.groups.pop(group_id):
            self.requests.pop(r.request_id, None)
        return out

    # ---- lifecycle -----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.cache.check_integrity()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this engine has been shut down; create a new LLM")
        if self._death is not None:
            raise EngineDeadError(self._death[0]) from self._death[1]

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for req in list(self.requests.values()):
            if not req.is_finished:
                self.scheduler.finish(req)
        self.requests.clear()
        self.groups.clear()
        self.runner.shutdown()
        self.model_state = None
