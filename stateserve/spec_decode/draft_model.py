"""Drafting with a smaller model of the same vocabulary, of any kind we run (a Mamba2 drafting for a hybrid, a
Llama for a Mamba): it has its own ModelRunner, caches and model state, and a mirror request per target request.

Per decode step of the target, each mirror catches up on the committed tokens it has not seen (usually the 1 + a
the last verify step committed) and samples d1 greedily, then feeds d1 .. d_{k-1} one step each. The states after
the committed tokens and after each draft but the last are kept (spare slots of the draft's running pool), so once
the target has verified, the mirror rolls back to the last draft that was accepted, exactly as the target does.
Greedy drafts make the proposal a point mass, which is what runner/spec_verify.py's acceptance rule is exact for."""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from stateserve.config import EngineConfig, ModelConfig
from stateserve.core.batch import SchedulerOutput
from stateserve.core.request import Request
from stateserve.models.folder import build_model_config, load_tokenizer
from stateserve.sampling_params import SamplingParams
from stateserve.spec_decode.proposer import Proposer

logger = logging.getLogger("stateserve")
GiB = 1 << 30
DRAFT_CACHE_SHARE = 0.2  # of the engine's cache budget, for the draft model's KV blocks and state slots


@dataclass(eq=False)
class _Mirror:
    req: Request  # the draft model's request: committed tokens (+ this step's drafts), its blocks and slot
    base: int = 0  # committed tokens when the last drafts were made (the first draft sits at this position)
    drafts: list[int] = field(default_factory=list)  # drafts fed so far that are not resolved yet


def _check_same_vocabulary(target: ModelConfig, draft: ModelConfig, target_tokenizer: Any,
                           draft_cfg: EngineConfig) -> None:
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config: the draft model {draft.path!r} has a vocabulary of {draft.vocab_size} "
                         f"tokens, the target {target.vocab_size}; a draft model must share the target's tokenizer")
    has_tokenizer = any(os.path.isfile(os.path.join(draft.path, f)) for f in ("tokenizer.json", "tokenizer.model"))
    if target_tokenizer is None or not has_tokenizer:
        return
    if load_tokenizer(draft_cfg).get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(f"speculative_config: the draft model {draft.path!r} has another tokenizer than the target "
                         "(same size, different tokens); a draft model must share the target's tokenizer")


class DraftModelProposer(Proposer):
    def __init__(self, config: EngineConfig, target: ModelConfig, tokenizer: Any, budget_bytes: int) -> None:
        from stateserve.runner.model_runner import ModelRunner

        spec = config.speculative_config
        self.k = spec.num_speculative_tokens
        self.cfg = dataclasses.replace(
            config, model=spec.model, tokenizer=None, speculative_config=None, enable_prefix_caching=False,
            mamba_cache_mode=None, hf_overrides=None, num_gpu_blocks_override=None,
            max_model_len=None, kv_cache_memory_bytes=max(1, int(budget_bytes * DRAFT_CACHE_SHARE)))
        device = config.resolved_device()
        self.model_config = build_model_config(self.cfg, device)
        # no longer than the target's sequences; longer ones than the draft takes just decode without drafts
        self.max_model_len = min(self.model_config.max_model_len, target.max_model_len)
        self.cfg = dataclasses.replace(self.cfg, max_model_len=self.max_model_len)
        self.model_config = dataclasses.replace(self.model_config, max_model_len=self.max_model_len)
        _check_same_vocabulary(target, self.model_config, tokenizer, self.cfg)
        self.runner = ModelRunner(self.cfg, self.model_config, device, spare_slots_per_seq=self.k)
        self.runner.load_model(show_progress=False)
        self.cache = self.runner.initialize_caches()
        self.cache_bytes = self.runner.caches.plan.kv_bytes + self.runner.caches.plan.state_bytes
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.mirrors: dict[Request, _Mirror] = {}
        self._greedy = SamplingParams(temperature=0, max_tokens=None)
        logger.info("Draft model %s (%s): %.4f GiB of caches", spec.model, self.model_config.architecture,
                    self.cache_bytes / GiB)

    # ---- mirrors -------------------------------------------------------------------------------
    def _mirror(self, req: Request) -> _Mirror:
        m = self.mirrors.get(req)
        if m is None:
            m = self.mirrors[req] = _Mirror(Request(req.request_id, list(req.token_ids), self._greedy, 0))
        return m

    def _resolve(self, m: _Mirror, target: Request) -> None:
        """Roll the mirror back to the longest run of its drafts the target committed, and take the target's
        committed tokens as its own."""
        if m.drafts:
            fed = m.req.num_computed_tokens
            a = 0
            while a < len(m.drafts) - 1 and m.base + a < target.num_tokens - 1 \
                    and target.token_ids[m.base + a] == m.drafts[a]:
                a += 1
            # fed covers drafts[:-1]; the last draft was sampled, never fed
            a = min(a, fed - m.base)
            self.runner.rollback(m.req, m.base, fed, m.base + a)
            m.req.num_computed_tokens = m.base + a
            self.cache.trim(m.req)
            m.drafts = []
        m.req.token_ids = list(target.token_ids)

    # ---- drafting ------------------------------------------------------------------------------
    def propose(self, wanted: list[tuple[Request, int]]) -> None:
        budget = self.max_num_batched_tokens
        sched = SchedulerOutput()
        entries: list[tuple[_Mirror, int]] = []
        for target, k in wanted:
            if target.num_tokens + k > self.max_model_len or \
                    (target not in self.mirrors and len(self.mirrors) >= self.runner.max_num_seqs):
                continue  # longer than the draft takes, or its cache is full: this one decodes without drafts
            m = self._mirror(target)
            self._resolve(m, target)
            n = min(m.req.num_tokens - m.req.num_computed_tokens, budget)
            if n <= 0 or not self.cache.can_allocate(m.req, n + k - 1):
                continue  # no room in the draft's cache (or budget): this request decodes without drafts
            self.cache.allocate(m.req, n + k - 1)
            if n == m.req.num_tokens - m.req.num_computed_tokens and k > 1:
                sched.keep_offsets[len(sched.requests)] = (n,)  # the state after the committed tokens
            sched.add(m.req, n)
            entries.append((m, k))
            budget -= n
        if not sched.requests:
            return
        sampled = self._run(sched)
        active = []
        for i, (m, k) in enumerate(entries):
            m.base = m.req.num_tokens
            if i in sampled:
                m.drafts = [sampled[i]]
                active.append((m, k))
        for step in range(1, max((k for _, k in active), default=1)):
            active = [(m, k) for m, k in active if k > step]
            sched = SchedulerOutput()
            for i, (m, k) in enumerate(active):
                m.req.token_ids.append(m.drafts[-1])  # fed now; the target's tokens replace them in _resolve
                if k > step + 1:
                    sched.keep_offsets[i] = (1,)
                sched.add(m.req, 1)
            sampled = self._run(sched)
            for i, (m, _) in enumerate(active):
                m.drafts.append(sampled[i])
        for target, _ in wanted:
            m = self.mirrors.get(target)
            if m is not None and m.drafts and m.base == target.num_tokens:
                target.spec_token_ids = list(m.drafts)

    def _run(self, sched: SchedulerOutput) -> dict[int, int]:
        """One draft step -> {sequence index: its greedy next token} for the sequences that sampled."""
        batch, result = self.runner.execute(sched)
        for req, n in zip(sched.requests, sched.num_new_tokens):
            req.num_computed_tokens += n
        return dict(zip(batch.sample_indices, result.token_ids)) if result is not None else {}

    def remove(self, req: Request) -> None:
        m = self.mirrors.pop(req, None)
        if m is not None:
            self.runner.remove_request(m.req)
            self.cache.free(m.req)

    def shutdown(self) -> None:
        for req in list(self.mirrors):
            self.remove(req)
        self.runner.shutdown()
