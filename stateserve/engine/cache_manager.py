"""Hands KV blocks and state slots to requests and takes them back; the scheduler's only view of memory."""
from __future__ import annotations

from stateserve.cache.block_pool import BlockPool, SlotPool
from stateserve.engine.request import Request


class CacheManager:
    def __init__(self, block_pool: BlockPool | None, slot_pool: SlotPool | None, block_size: int) -> None:
        self.block_pool, self.slot_pool, self.block_size = block_pool, slot_pool, block_size

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
            req.state_slot = self.slot_pool.allocate()
        if self.block_pool is not None:
            req.block_ids.extend(self.block_pool.allocate(self.num_new_blocks(req, num_new_tokens)))

    def free(self, req: Request) -> None:
        if self.block_pool is not None and req.block_ids:
            self.block_pool.free(req.block_ids)
        req.block_ids = []
        if self.slot_pool is not None and req.state_slot is not None:
            self.slot_pool.free(req.state_slot)
        req.state_slot = None

    def max_blocks(self) -> int:
        return self.block_pool.num_blocks if self.block_pool is not None else 0

    def is_idle_and_full(self) -> bool:
        blocks_full = self.block_pool is None or self.block_pool.num_free == self.block_pool.num_blocks
        slots_full = self.slot_pool is None or self.slot_pool.num_free == self.slot_pool.num_slots
        return blocks_full and slots_full

    def check_integrity(self) -> None:
        if self.block_pool is not None:
            self.block_pool.check_integrity()
        if self.slot_pool is not None:
            self.slot_pool.check_integrity()
