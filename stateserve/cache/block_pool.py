"""Allocators for the two kinds of cache memory: KV blocks and recurrent-state slots.

Both are plain free lists with reference counts; storage lives in cache/storage.py."""
from __future__ import annotations

from collections import deque
from typing import Callable


class BlockPool:
    """Reference-counted KV block ids. A block is free when its count is 0 and it holds no cached prefix."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"BlockPool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_ids)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_ids):
            raise RuntimeError(f"BlockPool: asked for {n} blocks, {len(self.free_ids)} free")
        ids = [self.free_ids.popleft() for _ in range(n)]
        for i in ids:
            self.ref_counts[i] = 1
        return ids

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if self.ref_counts[i] <= 0:
                raise RuntimeError(f"BlockPool: block {i} freed twice")
            self.ref_counts[i] -= 1
            if self.ref_counts[i] == 0:
                self.free_ids.append(i)

    def check_integrity(self) -> None:
        free = set(self.free_ids)
        if len(free) != len(self.free_ids):
            raise AssertionError("BlockPool: a block is on the free list twice")
        for i, rc in enumerate(self.ref_counts):
            if rc < 0 or (rc == 0) != (i in free):
                raise AssertionError(f"BlockPool: block {i} has ref count {rc} but free={i in free}")


class SlotPool:
    """Recurrent-state slots, one per running sequence. `zero_slot` is called on every hand-out,
    so a slot never leaks its previous owner's state."""

    def __init__(self, num_slots: int, zero_slot: Callable[[int], None]) -> None:
        if num_slots < 1:
            raise ValueError(f"SlotPool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._zero_slot = zero_slot
        self.free_slots: deque[int] = deque(range(num_slots))
        self.in_use: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def can_allocate(self, n: int = 1) -> bool:
        return n <= len(self.free_slots)

    def allocate(self) -> int:
        if not self.free_slots:
            raise RuntimeError("SlotPool: no free state slot")
        slot = self.free_slots.popleft()
        self.in_use.add(slot)
        self._zero_slot(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self.in_use:
            raise RuntimeError(f"SlotPool: slot {slot} freed but not in use")
        self.in_use.remove(slot)
        self.free_slots.append(slot)

    def check_integrity(self) -> None:
        free = set(self.free_slots)
        if len(free) != len(self.free_slots) or free & self.in_use:
            raise AssertionError("SlotPool: a slot is both free and in use, or free twice")
        if len(free) + len(self.in_use) != self.num_slots:
            raise AssertionError("SlotPool: slots were lost")
