"""The Scheduler with the real cache parts (issue 33, item 6) driven by hypothesis through random add / abort / step
sequences: "running" a step marks its tokens computed on the fake runner of tests/cache_fakes.py. After every rule no
request is lost or duplicated, `check_integrity()` holds and the reference counts equal the requests' holdings; at the
end every live request has run to its end and every pool is full. The CacheManager on its own:
tests/test_cache_properties.py."""
from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from cache_fakes import (CONFIGS, SETTINGS, FakeCache, build, check_contents, check_full, check_holdings, new_request,
                         prompts, run_chunk)
from stateserve.core.request import Request, RequestStatus
from stateserve.engine.scheduler import Scheduler


class SchedulerMachine(RuleBasedStateMachine):
    """The Scheduler with the real CacheManager; "running" a step marks its tokens computed (FakeCache)."""
    config = CONFIGS["kv-prefix"]
    MAX_SEQS, MAX_BATCHED = 3, 8

    def __init__(self) -> None:
        super().__init__()
        self.fake = FakeCache()
        self.cm = build(*self.config[:3], self.fake, *self.config[3:])
        self.sched = Scheduler(self.cm, max_num_seqs=self.MAX_SEQS, max_num_batched_tokens=self.MAX_BATCHED)
        self.live: dict[str, Request] = {}
        self.count = 0

    @rule(prompt=prompts, max_tokens=st.integers(1, 4), key=st.sampled_from("ab"))
    def add(self, prompt, max_tokens, key):
        self.count += 1
        req = new_request(self.count, prompt, max_tokens, key)
        self.live[req.request_id] = req
        self.sched.add(req)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        req = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.sched.finish(req)
        assert req.status == RequestStatus.FINISHED and not req.block_ids and req.state_slot is None

    @rule()
    def step(self):
        self._step()

    def _step(self) -> None:
        sched, out = self.sched, self.sched.schedule()
        assert len({id(r) for r in out.requests}) == len(out.requests), "a request scheduled twice in one step"
        assert len(sched.running) <= self.MAX_SEQS and out.total_tokens <= self.MAX_BATCHED
        assert not any(r in out.requests for r in out.preempted)
        for r in out.preempted:
            assert r.status == RequestStatus.WAITING and not r.block_ids and r.state_slot is None
        for r, n in zip(out.requests, out.num_new_tokens):
            assert r.status == RequestStatus.RUNNING and r in sched.running and r.request_id in self.live
            assert 0 < n and r.num_computed_tokens + n <= r.num_tokens
            check_contents(self.cm, self.fake, r)
            run_chunk(self.cm, self.fake, r, n)
            if r.num_computed_tokens == r.num_tokens:  # the fake sampler
                if r.num_output_tokens >= r.params.max_tokens:
                    sched.finish(self.live.pop(r.request_id))
                else:
                    r.append_token(r.num_tokens % 3)

    @invariant()
    def nothing_lost(self):
        waiting, running = list(self.sched.waiting), self.sched.running
        assert len(waiting) == len(self.sched.waiting) and not set(waiting) & set(running)
        assert sorted(r.request_id for r in waiting + running) == sorted(self.live), "a request lost or duplicated"
        assert all(r.status == RequestStatus.WAITING for r in waiting)
        assert all(r.status == RequestStatus.RUNNING for r in running)
        check_holdings(self.cm, waiting + running)

    def teardown(self):
        for _ in range(2000):  # every live request runs to its end
            if not self.sched.has_unfinished():
                break
            self._step()
            self.nothing_lost()
        assert not self.sched.has_unfinished() and not self.live
        check_full(self.cm)


@pytest.mark.parametrize("config", ["kv", "kv-prefix", "hybrid-prefix", "state-prefix", "kv-window-prefix",
                                    "hybrid-window-prefix"])
def test_scheduler_random_sequences(config):
    run_state_machine_as_test(type("M", (SchedulerMachine,), {"config": CONFIGS[config]}), settings=SETTINGS)
