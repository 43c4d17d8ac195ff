"""The one place cache memory is created: from the layers' specs and a byte budget, plan the split, allocate the
tensors, and build the pools, the snapshot index and the CacheManager that hands them out.

The runner calls build_caches once, binds the storage's views to the layers and gives the manager to the engine's
scheduler and to the model state; nothing else allocates cache memory or builds a pool."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from stateserve.cache.block_pool import BlockPool, SlotPool
from stateserve.cache.manager import CacheManager, peak_blocks
from stateserve.cache.prefix import SnapshotIndex
from stateserve.cache.spec import KVCacheSpec, StateSpec
from stateserve.cache.storage import CachePlan, CacheStorage, plan_caches

logger = logging.getLogger("stateserve")
GiB = 1 << 30


@dataclass(frozen=True)
class CacheRequest:
    """What the runner asks of the cache, besides the layers' specs."""

    budget_bytes: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    prefix_caching: bool
    num_snapshot_slots: int = 0  # recurrent-state snapshots for prefix caching (0: none)
    graph_scratch: bool = False  # keep one KV block and one state slot back for CUDA-graph padding rows
    num_blocks_override: int | None = None  # exactly this many KV blocks, whatever the budget (tests)
    spare_slots_per_seq: int = 0  # speculative decoding: states kept per sequence while drafts are verified
    max_chunk_tokens: int | None = None  # the most tokens of one sequence in a step (None: max_model_len)


@dataclass(eq=False)
class Caches:
    plan: CachePlan
    storage: CacheStorage
    manager: CacheManager
    graph_scratch: bool = False  # a scratch block/slot is kept back: decode graphs can be captured
    scratch_block: int | None = None  # None: no graph padding, or no KV
    scratch_slot: int | None = None  # None: no graph padding, or no recurrent state

    def release(self) -> None:
        self.storage.release()


def _reserve_scratch(plan: CachePlan, has_kv: bool, has_state: bool
                     ) -> tuple[CachePlan, int | None, int | None] | None:
    """Take the last KV block and the last state slot for graph padding rows; None when the plan is too small."""
    scratch_block = scratch_slot = None
    if has_state:
        if plan.num_slots <= plan.num_running_slots:  # no slot past the running ones: give up one sequence's
            if plan.max_num_seqs == 1:
                return None
            plan = dataclasses.replace(plan, max_num_seqs=plan.max_num_seqs - 1)
        scratch_slot = plan.num_slots - 1
    if has_kv:
        if plan.num_blocks < 2:
            return None
        scratch_block = plan.num_blocks - 1
        plan = dataclasses.replace(plan, max_num_seqs=min(plan.max_num_seqs, plan.num_blocks - 1))
    return plan, scratch_block, scratch_slot


def common_window(kv_specs: dict[str, KVCacheSpec]) -> int | None:
    """The sliding window every attention layer shares, if they all have the same one (else None: a layer that
    reads every key keeps every block; LFM3 mixes such layers with windowed ones)."""
    windows = {getattr(spec, "sliding_window", None) for spec in kv_specs.values()}
    return windows.pop() if len(windows) == 1 else None


def build_caches(kv_specs: dict[str, KVCacheSpec], state_specs: dict[str, StateSpec], req: CacheRequest,
                 device: torch.device, own_specs: tuple[dict, dict] | None = None) -> Caches:
    """own_specs: a pipeline stage's own layers' (kv, state) specs, the only tensors allocated here; the plan (block
    and slot counts every stage shares) is made over all layers' specs, kv_specs and state_specs."""
    graph_scratch = req.graph_scratch
    window = common_window(kv_specs)
    # what one sequence's blocks span at most, for the planner's cap
    tokens_per_seq = peak_blocks(req.max_model_len, req.block_size, window,
                                 req.max_chunk_tokens or req.max_model_len) * req.block_size
    num_blocks = req.num_blocks_override
    if num_blocks is not None and graph_scratch and kv_specs:
        num_blocks += 1  # the scratch block of graph padding comes on top: the override counts usable blocks
    plan = plan_caches(kv_specs, state_specs, budget_bytes=req.budget_bytes, block_size=req.block_size,
                       max_num_seqs=req.max_num_seqs, max_model_len=tokens_per_seq,
                       num_extra_slots=req.num_snapshot_slots + (1 if graph_scratch and state_specs else 0),
                       num_blocks_override=num_blocks, spare_slots_per_seq=req.spare_slots_per_seq)
    scratch_block = scratch_slot = None
    if graph_scratch:
        reserved = _reserve_scratch(plan, bool(kv_specs), bool(state_specs))
        if reserved is None:
            logger.warning("CUDA graphs off: the cache is too small to spare a scratch block and state slot")
            graph_scratch = False
        else:
            plan, scratch_block, scratch_slot = reserved
    if kv_specs or state_specs:  # a model that keeps nothing between steps (an encoder) has nothing to report
        logger.info("Available KV cache memory: %.4f GiB; %d KV blocks of %d tokens (%.4f GiB), %d state slots "
                    "(%.4f GiB)", req.budget_bytes / GiB, plan.num_blocks, req.block_size, plan.kv_bytes / GiB,
                    plan.num_slots, plan.state_bytes / GiB)
    storage = CacheStorage(*(own_specs or (kv_specs, state_specs)), plan, req.block_size, device)
    block_pool = slot_pool = snapshots = None
    if kv_specs:
        block_pool = BlockPool(plan.num_blocks - (scratch_block is not None))
    if state_specs:
        slot_pool = SlotPool(plan.num_running_slots, storage.zero_slot)
        num_snapshot_slots = plan.num_slots - plan.num_running_slots - (scratch_slot is not None)
        if req.num_snapshot_slots and num_snapshot_slots > 0:  # leftovers are no snapshots when none were asked
            snapshot_pool = SlotPool(num_snapshot_slots, storage.zero_slot, first=plan.num_running_slots)
            snapshots = SnapshotIndex(snapshot_pool, storage.copy_slot)
    manager = CacheManager(block_pool, slot_pool, req.block_size, prefix_caching=req.prefix_caching,
                           snapshots=snapshots, window=window)
    return Caches(plan, storage, manager, graph_scratch, scratch_block, scratch_slot)
