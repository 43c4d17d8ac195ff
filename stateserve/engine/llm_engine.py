"""LLMEngine: validates and admits requests, runs scheduler -> runner -> sampler steps, applies stop rules.

One engine for every model kind: an embedding model's prompts are requests too (params: PoolingParams), scheduled
whole, run by the same runner and finished by the step that pools them."""
from __future__ import annotations

import itertools
import logging
from typing import Any

import torch

from stateserve import envs
from stateserve.config import EngineConfig
from stateserve.engine import fault_inject
from stateserve.engine.detokenizer import Detokenizer, IncrementalDetokenizer
from stateserve.engine.errors import EngineDeadError, FatalStepError
from stateserve.core.request import Request
from stateserve.engine.request_output import logprob_entry, make_output
from stateserve.engine.runner_factory import build_runner, runner_config, uses_reference_runner
from stateserve.engine.scheduler import Scheduler
from stateserve.engine.stop_rules import apply_stop_rules
from stateserve.engine.stats_log import StatsLog
from stateserve.engine.embed_prompts import parse_embed_prompt
from stateserve.models.folder import build_model_config, check_runner, load_tokenizer
from stateserve.outputs import EmbeddingRequestOutput, RequestOutput
from stateserve.core.batch import InputBatch
from stateserve.pooling_params import PoolingParams
from stateserve.runner.model_runner import PoolingResult
from stateserve.runner.sampler import SampleResult
from stateserve.runner.structured import GrammarCompiler
from stateserve.sampling_params import SamplingParams
from stateserve.spec_decode.speculator import Speculator, make_proposer

logger = logging.getLogger("stateserve")
_SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes


class LLMEngine:
    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        envs.enable_envs_cache()
        self.device = config.resolved_device()
        self.model_config = build_model_config(config, self.device)
        check_runner(config, self.model_config)
        self.tokenizer = load_tokenizer(config)
        self.detokenizer = Detokenizer(self.tokenizer)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.reference = uses_reference_runner()
        config = self.config = runner_config(config, self.reference)
        self.runner = build_runner(config, self.model_config, self.device, self.reference)
        try:
            self._start(config, show_progress)
        except BaseException:
            self.runner.shutdown()  # its memory, and a tensor-parallel runner's worker processes
            raise

    def _start(self, config: EngineConfig, show_progress: bool) -> None:
        """Load the model, build the caches and everything that reads them (the second half of __init__)."""
        self.runner.load_model(show_progress)
        proposer = None
        if config.speculative_config is not None:
            if self.reference:
                raise ValueError("speculative_config cannot be used with STATESERVE_RUNNER=reference (one request "
                                 "at a time, recomputed whole)")
            proposer = make_proposer(config, self.model_config, self.tokenizer, self.runner.cache_budget_bytes())
        self.cache = self.runner.initialize_caches(reserved_bytes=proposer.cache_bytes if proposer else 0)
        self.max_num_seqs = self.runner.max_num_seqs
        self.scheduler = Scheduler(self.cache, max_num_seqs=self.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   chunk_size_fn=self.runner.chunk_size, whole_prompts=self.runner.runs_whole_prompts)
        self.pooling = self.runner.pooling_spec()  # None: a model that generates
        self.max_prompt_len, self._prompt_limit_reason = self.runner.prompt_limit()
        if self.pooling is not None:
            logger.info("Pooling: modes %s, normalize=%s (%s config); longest prompt %d tokens (%s)",
                        ",".join(self.pooling.modes), self.pooling.normalize, self.pooling.source,
                        self.pooling.max_len, self.pooling.limit_reason)
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
        self.speculator = None if proposer is None else Speculator(config, proposer, self.runner, self.cache,
                                                                   self.stats, self.model_config)
        self.stats_log = StatsLog()
        self.grammars = GrammarCompiler(self.tokenizer)  # structured outputs

    # ---- requests ------------------------------------------------------------------------------
    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt has token id(s) outside the vocabulary [0, {vocab}): {bad[:5]}")
        if len(token_ids) > self.max_prompt_len:
            if self.pooling is not None:
                raise ValueError(f"prompt has {len(token_ids)} tokens, more than this encoder's limit of "
                                 f"{self.max_prompt_len} tokens ({self._prompt_limit_reason}); shorten it or pass "
                                 "truncate_prompt_tokens")
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_model_len={self.max_prompt_len}")
        if self.cache.block_pool is not None:
            needed = self.cache.peak_blocks(len(token_ids), self.config.max_num_batched_tokens)
            if needed > self.cache.max_blocks():
                raise ValueError(f"prompt of {len(token_ids)} tokens needs {needed} KV blocks but the cache has "
                                 f"only {self.cache.max_blocks()}; raise kv_cache_memory_bytes")

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; with skip_tokenizer_init=True pass "
                             "{'prompt_token_ids': [...]}")
        return self.tokenizer(self.runner.text_for_tokenizer(prompt)).input_ids

    def resolve_truncation(self, truncate_prompt_tokens: int | None) -> int | None:
        """How many last prompt tokens an embedding request keeps (None: all); ValueError beyond the model's limit."""
        k = PoolingParams(truncate_prompt_tokens).truncate_prompt_tokens
        if k is not None and k > self.max_prompt_len:
            raise ValueError(f"truncate_prompt_tokens={k} is more than this encoder's limit of {self.max_prompt_len} "
                             f"tokens ({self._prompt_limit_reason})")
        return self.max_prompt_len if k == -1 else k

    def prepare_embed(self, request_id: str, prompt: str | dict[str, Any], keep_last: int | None = None,
                      fairness_key: str | None = None) -> list[Request]:
        """One embedding request (a group of one), tokenized, truncated to its last `keep_last` tokens (vLLM's left
        truncation) and validated, without queueing anything (add_prepared queues it)."""
        self._check_open()
        if self.pooling is None:
            raise ValueError(f"{self.model_config.architecture} has no pooling head: embeddings need an embedding "
                             "model (BertModel, RobertaModel, XLMRobertaModel)")
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids, types = parse_embed_prompt(prompt, self.tokenize)
        if keep_last is not None and len(ids) > keep_last:
            ids = ids[-keep_last:]
            types = types[-keep_last:] if types is not None else None
        req = Request(request_id, ids, PoolingParams(keep_last), next(self._counter), text,
                      fairness_key=fairness_key or request_id, token_type_ids=types)
        self.runner.validate_request(req)
        self.validate_prompt(ids)
        return [req]

    def prepare_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                        prompt: str | None = None, encoder_input: Any = None,
                        fairness_key: str | None = None, stream_text: bool = False) -> list[Request]:
        """Validate one submission and build its sequences (one per sample) without queueing anything, so a
        rejected submission leaves no trace. encoder_input: for encoder-decoder models, from the runner's
        parse_prompt (LLM.generate's prompt forms); without it the prompt ids are the encoder input and decoding
        starts from the decoder start token. fairness_key: admission is fair between keys (engine/fair_queue.py); default: the
        request id."""
        self._check_open()
        if self.pooling is not None:
            raise ValueError(f"{self.model_config.architecture} is an embedding model with no LM head: it cannot "
                             "generate text; use LLM.embed")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.truncate_prompt_tokens is not None:  # the last k tokens, as vLLM (-1: as many as fit)
            keep = self.max_prompt_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            prompt_token_ids = list(prompt_token_ids)[-keep:]
        prompt_token_ids, encoder_input = self.runner.prepare_inputs(prompt_token_ids, encoder_input)
        self.validate_prompt(prompt_token_ids)
        if params.logit_bias and max(params.logit_bias) >= self.model_config.vocab_size:
            raise ValueError(f"logit_bias has token id(s) outside the vocabulary [0, {self.model_config.vocab_size}):"
                             f" {sorted(t for t in params.logit_bias if t >= self.model_config.vocab_size)[:5]}")
        lo, hi = _SEED_RANGE
        if params.seed is not None and not lo <= params.seed <= params.seed + params.num_samples - 1 <= hi:
            raise ValueError(f"seed={params.seed} with {params.num_samples} samples: sample i is seeded with seed + "
                             f"i, which must lie in [-2**63, 2**64 - 1]")
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        params = params.with_stop_ids(stop_ids)
        children = []
        hold_back = max((len(s) for s in params.stop), default=1) - 1  # what may be the start of a stop string
        for i in range(params.num_samples):
            child_id = request_id if params.num_samples == 1 else f"{request_id}#{i}"
            if child_id in self.requests:
                raise ValueError(f"request id {child_id!r} is already in use")
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(params.seed + i)
            req = Request(child_id, list(prompt_token_ids), params, next(self._counter), prompt, request_id, gen,
                          fairness_key or request_id)
            if encoder_input is not None:  # prefix-cache keys must differ per encoder input
                req.encoder_input, req.cache_extra = encoder_input, encoder_input.cache_key
            if self.tokenizer is not None and (params.stop or stream_text):
                req.detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, hold_back)
            if params.structured_outputs is not None:
                req.constraint = self.grammars.constraint(params.structured_outputs)
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
        if self.speculator is not None:  # drafts for the running requests that decode, scheduled with them
            self.speculator.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        self.stats["preemptions"] += len(sched.preempted)
        self.runner.update_requests(sched)
        if self.speculator is not None:
            self.speculator.on_preempted(sched.preempted)
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
            if not req.spec_token_ids:  # a verify step's requests are committed after its tokens are applied
                req.num_computed_tokens += n
                self.cache.publish_blocks(req)
        self.stats["prefix_cache_queries"] = self.cache.num_queried_tokens
        self.stats["prefix_cache_hits"] = self.cache.num_hit_tokens
        if isinstance(result, PoolingResult):
            self._apply_pooled(batch, result)
        elif result is not None:
            if result.prompt_logprobs:
                self._apply_prompt_logprobs(batch, result.prompt_logprobs)
            self._apply_samples(batch, result)
        if self.speculator is not None:
            self.speculator.commit(batch, sched)
        self.stats_log.maybe_log(self)
        return self._collect_finished()

    def _apply_pooled(self, batch: InputBatch, result: PoolingResult) -> None:
        updated = dict.fromkeys(self.last_updated)
        for req, vector in zip(batch.requests, result.vectors):
            req.embedding = vector
            req.finish_reason = "stop"
            self._finish(req)
            updated[req.group_id] = None
        self.last_updated = list(updated)

    def _fail_step(self, reqs: list[Request], exc: BaseException) -> None:
        """The step over `reqs` raised part-way. Its forward may have advanced their recurrent states in place and
        written KV rows and snapshot slots, but it only ever writes what these requests own: their running state
        slots (zeroed when next handed out), their not yet published KV blocks (freed unpublished, so never
        matched; published blocks are never written) and the snapshot slots reserved for this step (dropped by
        on_step_failed, never published). Ending exactly these requests therefore leaves nothing half-written
        that anyone could read, and every other request goes on as if the step had not run."""
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
        if isinstance(exc, FatalStepError):  # e.g. a tensor-parallel rank died: no later step can run
            self._death = (f"the engine stopped: {type(exc).__name__}: {exc}", exc)
            self._check_open()
        if self._consecutive_failures >= self.max_step_failures:
            self._death = (f"the engine stopped after {self._consecutive_failures} failed steps in a row "
                           f"(STATESERVE_MAX_CONSECUTIVE_STEP_FAILURES={self.max_step_failures}); last error: "
                           f"{type(exc).__name__}: {exc}", exc)
            self._check_open()

    def _apply_samples(self, batch: InputBatch, result: SampleResult) -> None:
        """Each sampled sequence's tokens (several after a verify step), each checked against the stop rules: a
        stop inside an accepted run ends the request there and drops the tokens after it."""
        updated = dict.fromkeys(self.last_updated)
        counts = result.num_emitted or [1] * len(batch.sample_indices)
        first = 0
        for i, count in zip(batch.sample_indices, counts):
            req = batch.requests[i]
            updated[req.group_id] = None
            for j in range(first, first + count):
                if req.is_finished:
                    break
                self._apply_token(req, result, j)
            first += count
        self.last_updated = list(updated)

    def _apply_prompt_logprobs(self, batch: InputBatch, found: dict[int, list]) -> None:
        """Entries for the prompt positions the step computed (placed by position: a recompute overwrites)."""
        for i, entries in found.items():
            req = batch.requests[i]
            for pos, found_at in enumerate(entries, batch.context_lens[i] + 1):
                entry = logprob_entry(*found_at, self.detokenizer.decode_token)
                if pos < len(req.prompt_logprobs):
                    req.prompt_logprobs[pos] = entry
                else:
                    req.prompt_logprobs.append(entry)

    def _apply_token(self, req: Request, result: SampleResult, j: int) -> None:
        token = result.token_ids[j]
        req.append_token(token)
        if req.detok is not None:
            req.detok.add([token])
        self.stats["generation_tokens"] += 1
        if req.logprobs is not None:
            req.cumulative_logprob += result.sampled_logprobs[j]
            req.logprobs.append(logprob_entry(token, result.sampled_logprobs[j], result.sampled_ranks[j],
                                              *result.top_logprobs[j], self.detokenizer.decode_token))
        if apply_stop_rules(req, token, self.model_config.max_model_len):
            self._finish(req)

    def _finish(self, req: Request) -> None:
        self.runner.remove_request(req)
        if self.speculator is not None:
            self.speculator.remove(req)
        self.scheduler.finish(req)
        if req.is_pooling:
            return
        if req.finish_reason != "stop" or not req.params.stop or req.stop_reason is None:
            req.output_text = self.detokenizer.decode(req.output_token_ids, req.params.skip_special_tokens)

    def _collect_finished(self) -> list[str]:
        return [gid for gid, reqs in self.groups.items() if all(r.is_finished for r in reqs)]

    # ---- outputs -------------------------------------------------------------------------------
    def make_output(self, group_id: str) -> RequestOutput | EmbeddingRequestOutput:
        return make_output(group_id, self.groups[group_id], self.speculator is not None)

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
        if self.speculator is not None:
            self.speculator.shutdown()
        self.runner.shutdown()
