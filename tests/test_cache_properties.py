"""The cache parts on their own (issue 33, item 6): BlockPool, SlotPool, SnapshotIndex and CacheManager driven by
hypothesis through random add / allocate / prefix hit / step / preempt / abort / finish sequences, against the fake
runner of tests/cache_fakes.py (no model, no tensors; a prefix hit that hands out the wrong block or snapshot fails
too), then directed cases: a hit after publish, and sliding windows. After every rule `check_integrity()` holds and
the reference counts equal the requests' holdings; at the end every pool is full. The Scheduler over the same parts:
tests/test_scheduler_properties.py."""
from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from cache_fakes import (BS, CONFIGS, MAX_LEN, NUM_BLOCKS, SETTINGS, WINDOW, FakeCache, build, check_contents,
                         check_full, check_holdings, check_window_released, new_request, prompts, run_chunk)
from stateserve.cache.prefix import block_hashes
from stateserve.core.request import Request


class CacheMachine(RuleBasedStateMachine):
    """The engine's use of a CacheManager, step by step, without the scheduler's policy."""
    config = CONFIGS["kv-prefix"]

    def __init__(self) -> None:
        super().__init__()
        self.fake = FakeCache()
        self.cm = build(*self.config[:3], self.fake, *self.config[3:])
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.seen: list[list[int]] = []
        self.published: set[tuple[int, ...]] = set()  # whole-block token prefixes some request published
        self.count = 0

    def _end(self, req: Request) -> None:
        self.cm.free(req)
        assert not req.block_ids and req.state_slot is None
        (self.waiting if req in self.waiting else self.running).remove(req)

    @rule(data=st.data(), suffix=prompts)
    def add_request(self, data, suffix):
        prompt = []
        if self.seen and data.draw(st.booleans(), label="extends an earlier prompt"):
            old = data.draw(st.sampled_from(self.seen))
            prompt = old[:data.draw(st.integers(0, len(old)))]
        prompt = (prompt + suffix)[:MAX_LEN - 2] or [0]
        self.seen.append(prompt)
        self.count += 1
        self.waiting.append(new_request(self.count, prompt))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data):
        req = data.draw(st.sampled_from(self.waiting))
        limit, cm = (req.num_tokens - 1) // BS, self.cm
        keys = block_hashes(req.token_ids, BS, limit, req.cache_extra)
        lower = 0  # the hit must cover every published block that is still cached (and end at a snapshot)
        while (cm.block_pool is not None and lower < limit and tuple(req.token_ids[:(lower + 1) * BS]) in
               self.published and cm.block_pool.lookup(keys[lower]) is not None):
            lower += 1
        if cm.block_pool is None and cm.snapshots is not None:
            lower = limit
        while cm.snapshots is not None and lower and keys[lower - 1] not in cm.snapshots:
            lower -= 1
        cm.match_prefix(req)
        hit = req.num_computed_tokens
        assert hit % BS == 0 and hit < req.num_tokens and (cm.prefix_caching or hit == 0)
        assert hit >= lower * BS, f"hit of {hit} tokens, {lower} blocks are cached"
        n = data.draw(st.integers(1, req.num_tokens - hit))
        if not cm.can_allocate(req, n):
            cm.unmatch(req)
            assert req.num_computed_tokens == 0 and not req.block_ids and not req.prefix_matched
            return
        cm.allocate(req, n)
        check_contents(cm, self.fake, req)
        check_window_released(cm, req)
        self.waiting.remove(req)
        self.running.append(req)
        self._run(req, n)

    def _run(self, req: Request, n: int) -> None:
        run_chunk(self.cm, self.fake, req, n)
        self.published.update(tuple(req.token_ids[:(b + 1) * BS]) for b in range(req.num_published_blocks))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data):
        req = data.draw(st.sampled_from(self.running))
        if req.num_computed_tokens == req.num_tokens:  # a decode: the sampled token is appended first
            if req.num_tokens >= MAX_LEN:
                return self._end(req)  # finish
            req.append_token(data.draw(st.integers(0, 2)))
        n = data.draw(st.integers(1, req.num_tokens - req.num_computed_tokens))
        check_contents(self.cm, self.fake, req)
        if not self.cm.can_allocate(req, n):
            return self.preempt_req(req)
        self.cm.allocate(req, n)
        check_window_released(self.cm, req)
        if data.draw(st.integers(0, 9), label="step fails") == 0:
            run_chunk(self.cm, self.fake, req, n, fail=True)
            return self._end(req)  # the engine ends a failed step's requests
        self._run(req, n)

    def preempt_req(self, req: Request) -> None:
        self.cm.free(req)
        req.num_computed_tokens = req.num_cached_tokens = 0
        self.running.remove(req)
        self.waiting.append(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        self.preempt_req(data.draw(st.sampled_from(self.running)))

    @precondition(lambda self: self.waiting or self.running)
    @rule(data=st.data())
    def abort(self, data):
        self._end(data.draw(st.sampled_from(self.waiting + self.running)))

    @precondition(lambda self: any(r.num_computed_tokens == r.num_tokens for r in self.running))
    @rule(data=st.data())
    def finish(self, data):
        self._end(data.draw(st.sampled_from([r for r in self.running if r.num_computed_tokens == r.num_tokens])))

    @rule()
    def reset_prefix_cache(self):
        self.cm.reset_prefix_cache()

    @invariant()
    def integrity(self):
        check_holdings(self.cm, self.waiting + self.running)
        assert all(not r.block_ids and r.state_slot is None and not r.num_computed_tokens for r in self.waiting)

    def teardown(self):
        for req in self.waiting + self.running:
            self.cm.free(req)
        check_full(self.cm)


@pytest.mark.parametrize("config", CONFIGS)
def test_cache_manager_random_sequences(config):
    run_state_machine_as_test(type("M", (CacheMachine,), {"config": CONFIGS[config]}), settings=SETTINGS)


def test_prefix_hit_after_publish():
    """A prompt extending a published prefix hits all of its full blocks; freed, they stay parked for the next one."""
    fake = FakeCache()
    cm = build(True, True, True, fake)
    a = new_request(1, [1, 2, 0, 1, 2, 2, 0, 1, 1])
    cm.match_prefix(a)
    cm.allocate(a, a.num_tokens)
    run_chunk(cm, fake, a, a.num_tokens)
    assert a.num_published_blocks == 2
    cm.free(a)
    b = new_request(2, a.token_ids[:8] + [2, 2])
    cm.match_prefix(b)
    assert b.num_computed_tokens == 8 and b.restore_key is not None
    cm.allocate(b, 2)
    check_contents(cm, fake, b)
    check_holdings(cm, [b])
    cm.free(b)
    check_full(cm)


def test_window_bounds_a_long_sequence_and_hits_without_early_blocks():
    """A sequence much longer than the pool decodes in a 6-token window, holding at most 3 blocks; after the pool
    has evicted its early blocks, a prompt extending it still resumes from the blocks of its window."""
    fake = FakeCache()
    cm = build(True, False, True, fake, window=WINDOW)
    assert cm.peak_blocks(1000, 1) == 3 and cm.peak_blocks(8, 1) == 2 and build(True, False, True, fake).peak_blocks(
        1000, 1) == 250
    a = new_request(1, [0, 1, 2, 1, 0], max_tokens=100)
    cm.match_prefix(a)
    cm.allocate(a, a.num_tokens)
    run_chunk(cm, fake, a, a.num_tokens)
    for t in range(3 * NUM_BLOCKS * BS):  # three times the pool's tokens, one decode step each
        a.append_token(t % 3)
        assert cm.can_allocate(a, 1)
        cm.allocate(a, 1)
        check_window_released(cm, a)
        assert len(a.block_ids) - a.num_released_blocks <= cm.peak_blocks(a.num_tokens, 1)
        run_chunk(cm, fake, a, 1)
        check_contents(cm, fake, a)
        check_holdings(cm, [a])
    cm.free(a)
    b = new_request(2, a.token_ids + [2, 2])  # every early block of `a` was evicted for its later ones
    assert cm.block_pool.lookup(cm.keys(b, 1)[0]) is None
    cm.match_prefix(b)
    assert b.num_computed_tokens == len(a.token_ids) // BS * BS and b.num_released_blocks > 0
    cm.allocate(b, b.num_tokens - b.num_computed_tokens)
    check_contents(cm, fake, b)
    check_holdings(cm, [b])
    cm.free(b)
    check_full(cm)


def test_window_counts_only_blocks_that_really_come_back():
    """A block leaving a request's window that another request still holds (a shared prefix) frees nothing: with the
    pool otherwise full, can_allocate says no (allocate would fail) instead of counting it as returned."""
    fake = FakeCache()
    cm = build(True, False, True, fake, window=WINDOW)
    prompt = [0, 1, 2, 1, 0, 2, 2, 1, 0, 1, 1, 2, 0, 0, 1, 2]
    a, b = new_request(1, prompt), new_request(2, prompt + [2, 2])
    cm.match_prefix(a)
    cm.allocate(a, a.num_tokens)
    run_chunk(cm, fake, a, a.num_tokens)  # publishes A's four blocks
    cm.match_prefix(b)
    cm.allocate(b, 2)
    assert b.num_computed_tokens == 16 and b.block_ids[2:4] == a.block_ids[2:4]  # B holds A's window blocks
    for t in (1, 1, 0, 2):
        a.append_token(t)
    cm.allocate(a, 4)  # gives back A's blocks 0 and 1 (B never took them)
    run_chunk(cm, fake, a, 4)
    filler = new_request(3, [2] * (BS * (cm.block_pool.num_free - 1)))
    cm.allocate(filler, filler.num_tokens)  # all but one free block
    for t in (1, 0, 2, 2, 1):
        a.append_token(t)
    assert cm.block_pool.num_free == 1 and a.num_computed_tokens == 20
    # 5 more tokens need 2 blocks; block 2 leaves A's window but B holds it, so only the one free block is there
    assert not cm.can_allocate(a, 5)
    assert cm.can_allocate(a, 4)
    cm.allocate(a, 4)
    check_window_released(cm, a)
    check_holdings(cm, [a, b, filler])
