"""Allocators for the two kinds of cache memory: KV blocks and recurrent-state slots.

KV blocks are reference-counted. A block whose tokens are all written may carry the hash of its prefix;
when its last user lets go it is not freed but parked as *evictable* (LRU order), so a later request with
the same prefix can take it back. Allocation uses truly free blocks first, then evicts the oldest parked one."""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"BlockPool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # prefix hash -> block holding exactly that block's K/V
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced, oldest first

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free or evictable)."""
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"BlockPool: asked for {n} blocks, {self.num_free} available")
        ids = []
        for _ in range(n):
            if self.free_ids:
                i = self.free_ids.popleft()
            else:  # evict the least recently used cached block
                i, _ = self.evictable.popitem(last=False)
                self.cached.pop(self.block_hash[i], None)
                self.block_hash[i] = None
            self.ref_counts[i] = 1
            ids.append(i)
        return ids

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if self.ref_counts[i] <= 0:
                raise RuntimeError(f"BlockPool: block {i} freed twice")
            self.ref_counts[i] -= 1
            if self.ref_counts[i] == 0:
                if self.block_hash[i] is not None:
                    self.evictable[i] = None
                else:
                    self.free_ids.append(i)

    # ---- prefix cache ---------------------------------------------------------------------------
    def lookup(self, h: bytes) -> int | None:
        return self.cached.get(h)

    def touch(self, i: int) -> None:
        """Take a reference on a cached block found by lookup."""
        if self.ref_counts[i] == 0:
            self.evictable.pop(i, None)
        self.ref_counts[i] += 1

    def publish(self, i: int, h: bytes) -> None:
        """Record that block i now holds the K/V of prefix hash h (called only after it is written)."""
        if self.block_hash[i] is not None or h in self.cached:
            return  # already published, or another block already holds this prefix
        self.block_hash[i] = h
        self.cached[h] = i

    def reset_prefix_cache(self) -> None:
        for i in list(self.evictable):
            self.free_ids.append(i)
        self.evictable.clear()
        for h, i in list(self.cached.items()):
            self.block_hash[i] = None
        self.cached.clear()

    def check_integrity(self) -> None:
        free = set(self.free_ids)
        if len(free) != len(self.free_ids):
            raise AssertionError("BlockPool: a block is on the free list twice")
        if free & set(self.evictable):
            raise AssertionError("BlockPool: a block is both free and evictable")
        for i, rc in enumerate(self.ref_counts):
            parked = i in free or i in self.evictable
            if rc < 0 or (rc == 0) != parked:
                raise AssertionError(f"BlockPool: block {i} has ref count {rc} but parked={parked}")
            if i in self.evictable and self.block_hash[i] is None:
                raise AssertionError(f"BlockPool: evictable block {i} has no hash")
        for h, i in self.cached.items():
            if self.block_hash[i] != h:
                raise AssertionError(f"BlockPool: hash index points to block {i} holding another prefix")


class SlotPool:
    """Recurrent-state slots over ids [first, first + num_slots). `zero_slot` runs on every hand-out (but to
    snapshot destinations, which are overwritten whole), so a slot never leaks its previous owner's state."""

    def __init__(self, num_slots: int, zero_slot: Callable[[int], None], first: int = 0) -> None:
        if num_slots < 1:
            raise ValueError(f"SlotPool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._zero_slot = zero_slot
        self.free_slots: deque[int] = deque(range(first, first + num_slots))
        self.in_use: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def can_allocate(self, n: int = 1) -> bool:
        return n <= len(self.free_slots)

    def allocate(self, zeroed: bool = True) -> int:
        """A free slot, zeroed unless the caller overwrites every state tensor of it before anyone reads it."""
        if not self.free_slots:
            raise RuntimeError("SlotPool: no free state slot")
        slot = self.free_slots.popleft()
        self.in_use.add(slot)
        if zeroed:
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
