"""Prefix-cache keys and the recurrent-state snapshot index.

A block's key is a chained hash: key_i = H(key_{i-1}, tokens of block i, extra), so equal keys mean equal
whole prefixes (and equal `extra`, e.g. an encoder input). A recurrent snapshot is the state of every
recurrent layer after exactly (i+1)·block_size tokens, stored under key_i in a slot of its own budget."""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Callable

from stateserve.cache.block_pool import SlotPool


def block_hashes(token_ids: list[int], block_size: int, num_blocks: int, extra: bytes = b"",
                 known: list[bytes] | None = None) -> list[bytes]:
    """Keys of the first `num_blocks` full blocks; `known` (a prefix of the answer) is reused, not recomputed."""
    out = list(known or [])
    prev = out[-1] if out else hashlib.blake2b(extra, digest_size=16).digest()
    for b in range(len(out), num_blocks):
        tokens = array("q", token_ids[b * block_size:(b + 1) * block_size]).tobytes()
        prev = hashlib.blake2b(prev + tokens, digest_size=16).digest()
        out.append(prev)
    return out


class SnapshotIndex:
    """key -> snapshot slot, LRU-evicted. Snapshots are written into a reserved slot first and published
    only after the step that writes them has finished, so no one can read a partial state."""

    def __init__(self, slots: SlotPool, copy_slot: Callable[[int, int], None]) -> None:
        self.slots = slots
        self.copy_slot = copy_slot
        self.index: OrderedDict[bytes, int] = OrderedDict()  # published, oldest first
        self.pending: dict[int, bytes] = {}  # reserved slot -> key, not readable yet

    def __contains__(self, key: bytes) -> bool:
        return key in self.index

    def reserve(self, key: bytes) -> int | None:
        """A slot to write the snapshot for `key` into during the coming step (None: already have it)."""
        if key in self.index or key in self.pending.values():
            return None
        if not self.slots.can_allocate(1):
            if not self.index:
                return None
            _, old = self.index.popitem(last=False)
            self.slots.free(old)
        # no zeroing: the step writes every state tensor of a reserved slot before it is published
        slot = self.slots.allocate(zeroed=False)
        self.pending[slot] = key
        return slot

    def publish_pending(self) -> None:
        for slot, key in self.pending.items():
            self.index[key] = slot
        self.pending.clear()

    def drop_pending(self) -> None:
        """The step failed: the reserved slots may hold partial states, never publish them."""
        for slot in self.pending:
            self.slots.free(slot)
        self.pending.clear()

    def restore_into(self, key: bytes, dst: int) -> bool:
        slot = self.index.get(key)
        if slot is None:
            return False
        self.index.move_to_end(key)
        self.copy_slot(slot, dst)
        return True

    def clear(self) -> None:
        for slot in self.index.values():
            self.slots.free(slot)
        self.index.clear()

    def check_integrity(self) -> None:
        self.slots.check_integrity()
        used = set(self.index.values()) | set(self.pending)
        if used != self.slots.in_use:
            raise AssertionError("SnapshotIndex: snapshot slots in use do not match the index")
