"""The fakes and checks tests/test_cache_properties.py and tests/test_scheduler_properties.py share (issue 33, item
6): the cache parts (BlockPool, SlotPool, SnapshotIndex, CacheManager) built small, and a fake runner with no model
and no tensors. The fake records which token each KV block row and each state slot holds (a slot: the tokens it has
consumed), so a prefix hit that hands out the wrong block or snapshot fails too. The checks: the cache holds what a
request computed, the reference counts equal the requests' holdings, and at the end every pool is full."""
from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings, strategies as st

from stateserve.cache.block_pool import BlockPool, SlotPool
from stateserve.cache.prefix import SnapshotIndex
from stateserve.cache.manager import NO_BLOCK, CacheManager
from stateserve.core.request import Request
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
