"""The engine's one handle on speculative decoding: drafts for the running requests that decode (before the
scheduler runs), and after a verify step the commit of what was accepted (counters, the recurrent-state rollback
through the runner, the KV blocks of rejected drafts given back, blocks published only up to committed tokens)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from stateserve.cache.manager import CacheManager
from stateserve.config import EngineConfig, ModelConfig
from stateserve.core.batch import InputBatch, SchedulerOutput
from stateserve.core.request import Request

logger = logging.getLogger("stateserve")
# Adaptive drafting: a request's recent share of accepted drafts (an exponential average) sets how many it is
# offered; when it stays below what its drafts cost (DraftRowCost: measured, LOW_ACCEPTANCE until then) it stops
# drafting for a while, longer after each relapse, so a workload that cannot benefit runs (nearly) as without
# speculation.
RATE_WEIGHT = 0.3
LOW_ACCEPTANCE = 0.2
MIN_STEPS_BEFORE_PAUSE = 4
MAX_PAUSE_STEPS = 64
# Rows a step may verify in all (each decoding request's own row included): a CPU decode step streams the weights
# once for a few rows, so drafts ride nearly free beside one or two sequences, while at batch 16 every draft row is
# extra compute (measured with bench/spec_decode.py: 16 requests ran at 0.25-0.5x of plain decoding without a cap).
MAX_VERIFY_ROWS = 8


@dataclass
class SpecStats:
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    rate: float = 1.0  # recent accepted share of drafts
    paused: int = 0  # decode steps left without drafts
    relapses: int = 0

    def offer(self, k: int) -> int:
        """How many drafts to ask for in this decode step (0 while paused)."""
        if self.paused:
            self.paused -= 1
            return 0
        return max(1, min(k, round(self.rate * k) + 1))

    def record(self, drafted: int, accepted: int, break_even: float = LOW_ACCEPTANCE) -> None:
        """One verify step's outcome; below `break_even` (the accepted share at which drafts pay for their rows)
        the request pauses drafting."""
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.num_verify_steps += 1
        self.rate = _ema(self.rate, accepted / drafted)
        if self.num_verify_steps >= MIN_STEPS_BEFORE_PAUSE and self.rate < break_even:
            self.paused = min(MAX_PAUSE_STEPS, 4 << self.relapses)
            self.relapses += 1
            self.rate = 0.5  # try again with a middling offer after the pause


@dataclass
class DraftRowCost:
    """What drafts add to an engine step, as a share of the same step without them, measured on this engine's own
    steps that only decode (propose to commit: drafting, the forward, sampling, rollback): a step of n sequences
    verifying d drafts against the recent steps of n sequences that drafted nothing, kept per d (a verify step
    costs a fixed part, another forward path and the rollback, plus a part per row, so the cost per draft falls as d
    grows). Each accepted draft saves a step, so d drafts pay while the accepted share exceeds `break_even(d)`, the
    added share divided by d, never below LOW_ACCEPTANCE (a request whose drafts all fail must still pause within a
    few steps, and timings of small steps are noisy). A model whose verify rows are dear (a cheap decode step,
    per-token state updates) so pauses at a higher acceptance than one whose rows ride almost free."""
    added: dict[int, float] = field(default_factory=dict)  # drafts in the step -> recent added share of a step
    plain_seconds: dict[int, float] = field(default_factory=dict)  # sequences -> recent seconds of a step

    def record(self, num_seqs: int, drafts: int, seconds: float) -> None:
        plain = self.plain_seconds.get(num_seqs)
        if not drafts:
            self.plain_seconds[num_seqs] = seconds if plain is None else _ema(plain, seconds)
        elif plain:
            sample = seconds / plain - 1
            self.added[drafts] = sample if drafts not in self.added else _ema(self.added[drafts], sample)

    def break_even(self, drafts: int) -> float:
        added = self.added.get(drafts)
        return LOW_ACCEPTANCE if added is None or drafts < 1 else min(0.9, max(LOW_ACCEPTANCE, added / drafts))


def _ema(old: float, sample: float) -> float:
    return (1 - RATE_WEIGHT) * old + RATE_WEIGHT * sample


def _is_decoding(req: Request) -> bool:
    """Every known token but the last is computed (not a prompt still being computed, not a pooled prompt)."""
    return not req.is_pooling and not req.is_finished and 0 < req.num_computed_tokens == req.num_tokens - 1 \
        and req.constraint is None  # (a structured output's matcher cannot take back rejected drafts)


def make_proposer(config: EngineConfig, model_config: ModelConfig, tokenizer: Any, budget_bytes: int) -> Any:
    """The proposer of config.speculative_config; a draft model takes its caches out of budget_bytes (its
    `cache_bytes`, which the target's caches then leave out)."""
    spec = config.speculative_config
    if spec.method == "ngram":
        from stateserve.spec_decode.ngram import NgramProposer

        return NgramProposer(spec)
    from stateserve.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(config, model_config, tokenizer, budget_bytes)


class Speculator:
    def __init__(self, config: EngineConfig, proposer: Any, runner: Any, cache: CacheManager,
                 stats: dict[str, int], model_config: ModelConfig) -> None:
        self.k = config.speculative_config.num_speculative_tokens
        self.runner, self.cache, self.stats = runner, cache, stats
        self.max_model_len = model_config.max_model_len
        self.proposer = proposer
        self.row_cost = DraftRowCost()
        self._step_start: float | None = None
        for key in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
            stats[key] = 0
        logger.info("Speculative decoding: %s", config.speculative_config.to_dict())

    def _offer(self, req: Request) -> int:
        """Drafts this request may verify now: within k, its adaptive offer, max_tokens and max_model_len."""
        if req.spec is None:
            req.spec = SpecStats()
        limit = min(self.k, self.max_model_len - req.num_tokens)
        if req.params.max_tokens is not None:  # a verify step emits at most drafts + 1 tokens
            limit = min(limit, req.params.max_tokens - req.num_output_tokens - 1)
        return req.spec.offer(limit) if limit > 0 else 0

    def propose(self, running: list[Request]) -> None:
        self._step_start = time.perf_counter()
        decoding = [req for req in running if _is_decoding(req)]
        room = MAX_VERIFY_ROWS - len(decoding)  # draft rows left in this step
        wanted = []
        for req in decoding:
            k = min(self._offer(req), room)
            if k > 0:
                wanted.append((req, k))
                room -= k
        if wanted:
            self.proposer.propose(wanted)

    def commit(self, batch: InputBatch, sched: SchedulerOutput) -> None:
        """After the step's tokens were applied: each verifying request keeps its prompt, earlier outputs and
        accepted drafts as computed tokens; the rest of what the step fed is rolled back."""
        step_drafts = sum(batch.num_drafts)
        for i, (req, n) in enumerate(zip(sched.requests, sched.num_new_tokens)):  # the batch's order too
            drafts = len(req.spec_token_ids)
            if not drafts:
                continue
            accepted = batch.num_accepted.get(i, 0)
            req.spec_token_ids = []
            req.spec.record(drafts, accepted, self.row_cost.break_even(step_drafts))
            self.stats["spec_decode_num_drafts"] += 1
            self.stats["spec_decode_num_draft_tokens"] += drafts
            self.stats["spec_decode_num_accepted_tokens"] += accepted
            if req.is_finished:  # its caches are already freed
                continue
            start = req.num_computed_tokens
            req.num_computed_tokens = start + 1 + accepted
            if req.num_computed_tokens != req.num_tokens - 1:
                raise RuntimeError(f"request {req.request_id}: {req.num_tokens} tokens after committing "
                                   f"{req.num_computed_tokens} computed ones")
            self.runner.rollback(req, start, start + n, req.num_computed_tokens)
            self.cache.trim(req)
            self.cache.publish_blocks(req)  # (a draft model's mirror rolls back when the request next drafts)
        self._time_step(batch, step_drafts)

    def _time_step(self, batch: InputBatch, drafts: int) -> None:
        """Feeds DraftRowCost with this step's time when every sequence in it only decoded or verified."""
        start, self._step_start = self._step_start, None
        if start is not None and batch.num_tokens == len(batch.query_lens) + drafts and all(batch.context_lens):
            self.row_cost.record(len(batch.query_lens), drafts, time.perf_counter() - start)

    def on_preempted(self, reqs: list[Request]) -> None:
        for req in reqs:
            self.proposer.remove(req)

    def remove(self, req: Request) -> None:
        self.proposer.remove(req)

    def shutdown(self) -> None:
        self.proposer.shutdown()
