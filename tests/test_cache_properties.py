"""The cache parts on their own (issue 33, item 6): BlockPool, SlotPool, SnapshotIndex, CacheManager and the Scheduler
driven by hypothesis through random add / allocate / prefix hit / step / preempt / abort / finish sequences, against a
fake runner: no model, no tensors. The fake records which token each KV block row and each state slot holds (a slot:
the tokens it has consumed), so a prefix hit that hands out the wrong block or snapshot fails too. After every rule
`check_integrity()` holds and the reference counts equal the requests' holdings; at the end every pool is full."""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from stateserve.cache.block_pool import BlockPool, SlotPool
from stateserve.cache.prefix import SnapshotIndex, block_hashes
from stateserve.cache.manager import NO_BLOCK, CacheManager
from stateserve.core.request import Request, RequestStatus
from stateserve.engine.scheduler import Scheduler
from stateserve.sampling_params import SamplingParams

BS, NUM_BLOCKS, NUM_SLOTS, NUM_SNAPSHOTS, MAX_LEN = 4, 10, 3, 4, 16  # a request of MAX_LEN tokens fits alone
# derandomize: the same examples on every run and machine, so the suite cannot go red by chance (run it with
# derandomize off to search further)
SETTINGS = settings(max_examples=100, stateful_step_count=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
WINDOW = 6  # sliding-window configs: a query reads its last 6 keys, so blocks before them are given back
# (KV blocks, state slots, prefix caching[, window]); state slots with prefix caching come with a SnapshotIndex
CONFIGS = {"kv": (True, False, False), "kv-prefix": (True, False, True), "hybrid": (True, True, False),
           "hybrid-prefix": (True, True, True), "state": (False, True, False), "state-prefix": (False, True, True),
           "kv-window": (True, False, False, WINDOW), "kv-window-prefix": (True, False, True, WINDOW),
           "hybrid-window-prefix": (True, True, True, WINDOW)}


class FakeCache:
    def __init__(self) -> None:
        self.kv: dict[tuple[int, int], int] = {}  # (block, row) -> token written there
        self.state: dict[int, tuple] = {}  # slot -> tokens it has consumed

    def zero_slot(self, slot: int) -> None:
        self.state[slot] = ()

    def copy_slot(self, src: int, dst: int) -> None:
        self.state[dst] = self.state[src]


def build(blocks: bool, slots: bool, prefix: bool, fake: FakeCache, window: int | None = None) -> CacheManager:
    snaps = SnapshotIndex(SlotPool(NUM_SNAPSHOTS, fake.zero_slot, first=NUM_SLOTS), fake.copy_slot) \
        if slots and prefix else None
    return CacheManager(BlockPool(NUM_BLOCKS) if blocks else None,
                        SlotPool(NUM_SLOTS, fake.zero_slot) if slots else None, BS,
                        prefix_caching=prefix, snapshots=snaps, window=window)


def check_contents(cm: CacheManager, fake: FakeCache, req: Request) -> None:
    """The cache holds exactly req's computed tokens (after a hit too) that its next queries can read (with a
    window: the last WINDOW - 1; the blocks wholly before them may have been given back), and room for what is
    scheduled next."""
    n = req.num_computed_tokens
    if cm.block_pool is not None:
        readable = 0 if cm.window is None else max(0, n - cm.window + 1)
        assert req.num_released_blocks * BS <= readable, f"{req.request_id}: a block still in the window was freed"
        assert req.block_ids[:req.num_released_blocks] == [NO_BLOCK] * req.num_released_blocks
        for p in range(readable, n):
            assert fake.kv.get((req.block_ids[p // BS], p % BS)) == req.token_ids[p], f"{req.request_id} row {p}"
    if cm.slot_pool is not None and req.state_slot is not None:
        assert fake.state[req.state_slot] == tuple(req.token_ids[:n]), f"{req.request_id}: wrong state"


def run_chunk(cm: CacheManager, fake: FakeCache, req: Request, n: int, fail: bool = False) -> None:
    """The fake runner: one step over req's next n tokens (mamba_cache_mode "all": a snapshot at every block
    boundary reached), then what the engine does after it. A failed step writes garbage and publishes nothing."""
    ctx, pending = req.num_computed_tokens, {}
    assert cm.block_pool is None or len(req.block_ids) * BS >= ctx + n
    first, last = ctx // BS + 1, (ctx + n) // BS
    if cm.snapshots is not None and last >= first:
        keys = cm.keys(req, last)
        for b in range(first, last + 1):
            slot = cm.snapshots.reserve(keys[b - 1])
            if slot is not None:
                pending[slot] = tuple(req.token_ids[:b * BS])
    written = [-1] * n if fail else req.token_ids[ctx:ctx + n]
    if cm.block_pool is not None:
        for p, t in zip(range(ctx, ctx + n), written):
            fake.kv[(req.block_ids[p // BS], p % BS)] = t
    if cm.slot_pool is not None:
        fake.state[req.state_slot] = ("garbage",) if fail else tuple(req.token_ids[:ctx + n])
    if fail:
        fake.state.update(dict.fromkeys(pending, ("garbage",)))
        if cm.snapshots is not None:
            cm.snapshots.drop_pending()
        return
    fake.state.update(pending)
    if cm.snapshots is not None:
        cm.snapshots.publish_pending()
    req.num_computed_tokens += n
    cm.publish_blocks(req)


def check_window_released(cm: CacheManager, req: Request) -> None:
    """After allocate, a windowed request holds no block wholly before its window (they went back to the pool)."""
    if cm.window is not None:
        assert req.num_released_blocks == max(0, req.num_computed_tokens - cm.window + 1) // BS, \
            f"{req.request_id}: blocks that left the window are still held"


def check_holdings(cm: CacheManager, live: list[Request]) -> None:
    """check_integrity, and every reference and slot in use is held by a live request (no leak, no double free)."""
    cm.check_integrity()
    if cm.block_pool is not None:
        refs = Counter(b for r in live for b in r.block_ids if b != NO_BLOCK)
        assert cm.block_pool.ref_counts == [refs[i] for i in range(NUM_BLOCKS)], "ref counts != holdings"
        assert cm.block_pool.num_used == len(refs)
    if cm.slot_pool is not None:
        assert cm.slot_pool.in_use == {r.state_slot for r in live if r.state_slot is not None}


def check_full(cm: CacheManager) -> None:
    """Every request is freed: every pool is back to full, and to truly free after the prefix cache is reset."""
    cm.check_integrity()
    assert cm.is_idle_and_full()
    bp, sp, snaps = cm.block_pool, cm.slot_pool, cm.snapshots
    assert bp is None or (bp.num_free == bp.num_blocks and not any(bp.ref_counts))
    cm.reset_prefix_cache()
    cm.check_integrity()
    assert bp is None or (len(bp.free_ids) == bp.num_blocks and not bp.evictable and not bp.cached)
    assert sp is None or (sp.num_free == NUM_SLOTS and not sp.in_use)
    assert snaps is None or (snaps.slots.num_free == NUM_SNAPSHOTS and not snaps.index and not snaps.pending)


def new_request(i: int, prompt: list[int], max_tokens: int = 4, key: str = "") -> Request:
    return Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), i, fairness_key=key)


SHARED = [[], [0, 1, 2, 0], [0, 1, 2, 0, 2, 2, 1, 0], [1, 1, 0, 2, 0]]  # system prompts; the vocabulary is small too
prompts = st.builds(lambda head, tail: (head + tail)[:MAX_LEN - 2] or [0], st.sampled_from(SHARED),
                    st.lists(st.integers(0, 2), max_size=8))


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
