"""Continuous batching with chunked prefill under a token budget, and preemption by recompute.

Each step: running requests first (decodes and unfinished prefills, in admission order), then waiting
ones while the budget, max_num_seqs and the caches allow, picked fairly between shares of requests
(engine/fair_queue.py: preempted ones first, then the share with the fewest running sequences). When blocks
run out for a running request, the most recently admitted running request is preempted: its cache is freed
and it is recomputed later."""
from __future__ import annotations

from stateserve.cache.manager import CacheManager
from stateserve.engine.fair_queue import FairWaitingQueue
from stateserve.core.batch import SchedulerOutput
from stateserve.core.request import Request, RequestStatus


class Scheduler:
    def __init__(self, cache: CacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 chunk_size_fn=None, whole_prompts: bool = False) -> None:
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting = FairWaitingQueue()
        self.running: list[Request] = []
        # model states may restrict chunk ends (e.g. to block boundaries); default: no restriction
        self.chunk_size_fn = chunk_size_fn or (lambda req, n: n)
        # encoders see a prompt whole: it waits for a step with room for all of it, or runs alone in an
        # otherwise empty step when it is longer than the token budget
        self.whole_prompts = whole_prompts

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.add(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _num_new(self, req: Request, budget: int) -> int:
        remaining = req.num_tokens - req.num_computed_tokens
        if self.whole_prompts:
            return remaining if remaining <= budget or budget == self.max_num_batched_tokens else 0
        if req.spec_token_ids:  # verify as many drafts as the budget leaves room for (maybe none)
            del req.spec_token_ids[max(0, budget - remaining):]
            remaining += len(req.spec_token_ids)
        return self.chunk_size_fn(req, min(remaining, budget))

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._num_new(req, budget)
            if n <= 0:
                i += 1
                continue
            while not self.cache.can_allocate(req, n):
                if req.spec_token_ids:  # drafts are optional: drop them before preempting anyone
                    n -= len(req.spec_token_ids)
                    req.spec_token_ids = []
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                self.cache.allocate(req, n)
                out.add(req, n)
                budget -= n
                i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            req = self.waiting.peek()
            self.cache.match_prefix(req)
            n = self._num_new(req, budget)
            if n <= 0 or not self.cache.can_allocate(req, n):
                self.cache.unmatch(req)
                break
            self.waiting.started(req)
            self.cache.allocate(req, n)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.admitted.append(req)
            out.add(req, n)
            budget -= n
        return out

    def _preempt(self, req: Request) -> None:
        req.spec_token_ids = []
        if req.prompt_logprobs is not None:  # the recompute runs the prompt again, and fills them again
            req.prompt_logprobs = [None]
        self.cache.free(req)
        req.num_computed_tokens = req.num_cached_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.add_preempted(req)

    def finish(self, req: Request) -> None:
        """Remove a request (finished or aborted) wherever it is and free its cache."""
        if req.status == RequestStatus.RUNNING and req in self.running:
            self.running.remove(req)
            self.waiting.stopped(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        self.cache.free(req)
        req.status = RequestStatus.FINISHED
