"""Hands KV blocks, state slots and prefix-cache hits to requests and takes them back; the scheduler's
only view of memory. Model-kind independent: it knows there may be KV blocks, state slots, and snapshots."""
from __future__ import annotations

from stateserve.cache.block_pool import BlockPool, SlotPool
from stateserve.cache.prefix import SnapshotIndex, block_hashes
from stateserve.core.request import Request


class CacheManager:
    def __init__(self, block_pool: BlockPool | None, slot_pool: SlotPool | None, block_size: int, *,
                 prefix_caching: bool = False, snapshots: SnapshotIndex | None = None) -> None:
        self.block_pool, self.slot_pool, self.block_size = block_pool, slot_pool, block_size
        self.prefix_caching = prefix_caching
        self.snapshots = snapshots  # None: no recurrent-state reuse (attention-only, or mamba_cache_mode=none)
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    # ---- allocation ----------------------------------------------------------------------------
    def num_new_blocks(self, req: Request, num_new_tokens: int) -> int:
        if self.block_pool is None:
            return 0
        needed = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, needed - len(req.block_ids))

    def can_allocate(self, req: Request, num_new_tokens: int) -> bool:
        if self.slot_pool is not None and req.state_slot is None and not self.slot_pool.can_allocate(1):
            return False
        return self.block_pool is None or self.block_pool.can_allocate(self.num_new_blocks(req, num_new_tokens))

    def allocate(self, req: Request, num_new_tokens: int) -> None:
        if self.slot_pool is not None and req.state_slot is None:
            req.state_slot = self.slot_pool.allocate()  # zeroed
            if req.restore_key is not None and not self.snapshots.restore_into(req.restore_key, req.state_slot):
                raise RuntimeError("prefix hit on a recurrent snapshot that is gone")
            req.restore_key = None
        if self.block_pool is not None:
            req.block_ids.extend(self.block_pool.allocate(self.num_new_blocks(req, num_new_tokens)))

    def free(self, req: Request) -> None:
        if self.block_pool is not None and req.block_ids:
            self.block_pool.free(req.block_ids)
        req.block_ids = []
        req.num_published_blocks = 0
        req.restore_key = None
        req.prefix_matched = False
        if self.slot_pool is not None and req.state_slot is not None:
            self.slot_pool.free(req.state_slot)
        req.state_slot = None

    def trim(self, req: Request) -> None:
        """Give back the blocks past what the request's committed tokens and its next token need (blocks that held
        only rejected drafts' KV)."""
        if self.block_pool is None:
            return
        keep = -(-(req.num_computed_tokens + 1) // self.block_size)
        if len(req.block_ids) > keep:
            self.block_pool.free(req.block_ids[keep:])
            del req.block_ids[keep:]

    # ---- prefix cache --------------------------------------------------------------------------
    def keys(self, req: Request, num_blocks: int) -> list[bytes]:
        if len(req.block_hashes) < num_blocks:
            req.block_hashes = block_hashes(req.token_ids, self.block_size, num_blocks, req.cache_extra,
                                            req.block_hashes)
        return req.block_hashes[:num_blocks]

    def match_prefix(self, req: Request) -> None:
        """Longest cached prefix, in whole blocks, for which every attention layer has its KV blocks and every
        recurrent layer its snapshot; at least one token is always left to compute (its logits are needed)."""
        if not self.prefix_caching or req.prefix_matched or req.num_computed_tokens or req.wants_prompt_logprobs:
            return  # (prompt logprobs need every prompt position computed; the blocks it writes are still published)
        req.prefix_matched = True
        limit = (req.num_tokens - 1) // self.block_size
        keys = self.keys(req, limit)
        self.num_queried_tokens += req.num_tokens
        k = 0
        if self.block_pool is not None:
            while k < limit and self.block_pool.lookup(keys[k]) is not None:
                k += 1
        elif self.snapshots is not None:
            k = limit
        if self.slot_pool is not None:
            if self.snapshots is None:
                k = 0
            while k > 0 and keys[k - 1] not in self.snapshots:
                k -= 1
        if k == 0:
            return
        if self.block_pool is not None:
            req.block_ids = [self.block_pool.lookup(h) for h in keys[:k]]
            for b in req.block_ids:
                self.block_pool.touch(b)
            req.num_published_blocks = k
        if self.slot_pool is not None:
            req.restore_key = keys[k - 1]
        req.num_computed_tokens = req.num_cached_tokens = k * self.block_size
        self.num_hit_tokens += k * self.block_size

    def unmatch(self, req: Request) -> None:
        """Admission failed after match_prefix: give the blocks back, start over next time."""
        if req.prefix_matched and req.state_slot is None:
            if req.num_computed_tokens:
                self.num_hit_tokens -= req.num_computed_tokens
            self.num_queried_tokens -= req.num_tokens
            self.free(req)
            req.num_computed_tokens = req.num_cached_tokens = 0

    def publish_blocks(self, req: Request) -> None:
        """After a step: blocks whose tokens are now all written become findable by their prefix key."""
        if not self.prefix_caching or self.block_pool is None:
            return
        full = min(req.num_computed_tokens // self.block_size, len(req.block_ids))
        if full <= req.num_published_blocks:
            return
        keys = self.keys(req, full)
        for b in range(req.num_published_blocks, full):
            self.block_pool.publish(req.block_ids[b], keys[b])
        req.num_published_blocks = full

    def known_prefix_blocks(self, req: Request) -> int:
        """How many leading blocks of this request some earlier request has already computed (KV index)."""
        if self.block_pool is None:
            return 0
        limit = req.num_tokens // self.block_size
        keys = self.keys(req, limit)
        k = 0
        while k < limit and self.block_pool.lookup(keys[k]) is not None:
            k += 1
        return k

    def reset_prefix_cache(self) -> None:
        if self.block_pool is not None:
            self.block_pool.reset_prefix_cache()
        if self.snapshots is not None:
            self.snapshots.clear()

    # ---- bookkeeping ---------------------------------------------------------------------------
    def max_blocks(self) -> int:
        return self.block_pool.num_blocks if self.block_pool is not None else 0

    def is_idle_and_full(self) -> bool:
        """No block or running slot is held by a request (cached prefixes may stay parked)."""
        blocks_full = self.block_pool is None or self.block_pool.num_free == self.block_pool.num_blocks
        slots_full = self.slot_pool is None or self.slot_pool.num_free == self.slot_pool.num_slots
        return blocks_full and slots_full

    def check_integrity(self) -> None:
        if self.block_pool is not None:
            self.block_pool.check_integrity()
        if self.slot_pool is not None:
            self.slot_pool.check_integrity()
        if self.snapshots is not None:
            self.snapshots.check_integrity()
