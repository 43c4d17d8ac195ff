"""Cache storage: turns layer specs and a memory budget into tensors, and sizes the pools."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from stateserve.platform import huge_pages
from stateserve.cache.spec import KVCacheSpec, StateSpec

logger = logging.getLogger("stateserve")


@dataclass(frozen=True)
class CachePlan:
    num_blocks: int  # 0 when the model has no attention KV
    num_slots: int  # 0 when the model has no recurrent state
    max_num_seqs: int
    kv_bytes: int
    state_bytes: int
    slots_per_seq: int = 1  # a running sequence's slot plus its spares for speculative rollback

    @property
    def num_running_slots(self) -> int:
        """Slots of the running pool (the rest are snapshot slots and the graph scratch slot)."""
        return self.max_num_seqs * self.slots_per_seq if self.num_slots else 0


def plan_caches(kv_specs: dict[str, KVCacheSpec], state_specs: dict[str, StateSpec], *, budget_bytes: int,
                block_size: int, max_num_seqs: int, max_model_len: int, num_extra_slots: int = 0,
                num_blocks_override: int | None = None, spare_slots_per_seq: int = 0) -> CachePlan:
    """Split one budget: recurrent layers get a slot per running sequence, plus spare_slots_per_seq (the states
    kept while drafts are verified), plus snapshot slots; attention layers get KV blocks from what remains. Block
    size is never inflated to match states.
    num_blocks_override: exactly that many KV blocks, whatever the budget (tests size caches in blocks)."""
    slot_bytes = sum(s.bytes_per_slot() for s in state_specs.values())
    block_bytes = sum(s.bytes_per_block(block_size) for s in kv_specs.values())
    num_slots = 0
    if state_specs:
        # Leave at least half of the budget to KV in hybrids; attention-free models may use all of it.
        state_budget = budget_bytes // 2 if kv_specs else budget_bytes
        fit = state_budget // max(slot_bytes, 1)
        per_seq = 1 + spare_slots_per_seq
        if fit < per_seq:
            raise ValueError(f"cache budget of {budget_bytes} bytes cannot hold one sequence's recurrent-state "
                             f"slots ({per_seq} of {slot_bytes} bytes); raise kv_cache_memory_bytes")
        if fit < max_num_seqs * per_seq:
            lowered = int(fit // per_seq)
            logger.warning("max_num_seqs=%d lowered to %d: the cache budget holds only %d recurrent-state slots "
                           "(%d per sequence)", max_num_seqs, lowered, fit, per_seq)
            max_num_seqs = lowered
        running = max_num_seqs * per_seq
        num_slots = running + min(num_extra_slots, int(fit) - running)
    num_blocks = 0
    if kv_specs:
        blocks_per_seq = math.ceil(max_model_len / block_size)
        remaining = budget_bytes - num_slots * slot_bytes
        num_blocks = min(remaining // block_bytes, max_num_seqs * blocks_per_seq + 1)
        if num_blocks_override is not None:
            num_blocks = num_blocks_override
        if num_blocks < 1:
            raise ValueError(f"cache budget of {budget_bytes} bytes cannot hold one KV block "
                             f"({block_bytes} bytes); raise kv_cache_memory_bytes")
        if num_blocks < max_num_seqs:  # every running sequence holds at least one block
            logger.warning("max_num_seqs=%d lowered to %d: the cache budget holds only %d KV blocks",
                           max_num_seqs, num_blocks, num_blocks)
            max_num_seqs = int(num_blocks)
    return CachePlan(int(num_blocks), int(num_slots), max_num_seqs, int(num_blocks * block_bytes),
                     int(num_slots * slot_bytes), 1 + spare_slots_per_seq)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A cache tensor (one layer's K or V blocks, or a group's state slots), zeroed; on CPU on huge pages where the
    kernel allows (see platform/huge_pages.py)."""
    if device.type == "cpu":
        tensor = huge_pages.zeros(shape, dtype)
        if tensor is not None:
            return tensor
    return torch.zeros(shape, dtype=dtype, device=device)


class CacheStorage:
    """Owns every cache tensor. Layers only ever see views bound by the runner."""

    def __init__(self, kv_specs: dict[str, KVCacheSpec], state_specs: dict[str, StateSpec], plan: CachePlan,
                 block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        # KV is zeroed once: masked attention multiplies unused rows by 0, and 0 * NaN garbage would be NaN.
        # Each spec names its tensors' block shapes: K and V, or a latent (MLA) layer's one tensor (V bound as None).
        self.kv: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for name, s in kv_specs.items():
            k, *v = (_zeros((plan.num_blocks, *shape), s.dtype, device) for shape in s.block_shapes(block_size))
            self.kv[name] = (k, v[0] if v else None)
        # Layers whose state tensors have the same shape and dtype (every Mamba2 layer of a model, say) share one
        # stacked tensor [num_layers, num_slots, *shape]: each layer gets a contiguous view of its own, and
        # handing out, zeroing or copying a slot is one op per group instead of one per layer and tensor.
        groups: dict[tuple, list[tuple[str, str]]] = {}
        for name, s in state_specs.items():
            dtypes = dict(s.dtypes)
            for key, shape in s.shapes:
                groups.setdefault((tuple(shape), dtypes[key]), []).append((name, key))
        self._state_groups: list[torch.Tensor] = []
        self.states: dict[str, dict[str, torch.Tensor]] = {name: {} for name in state_specs}
        for (shape, dtype), members in groups.items():
            stacked = _zeros((len(members), plan.num_slots, *shape), dtype, device)
            self._state_groups.append(stacked)
            for i, (name, key) in enumerate(members):
                self.states[name][key] = stacked[i]
        # Tensor parallelism: the slot writes made outside a forward, in order, for the other ranks to replay
        # before the next step's forward (distributed/driver.py); None when no one listens.
        self.journal: list[tuple[str, int, int]] | None = None

    def zero_slot(self, slot: int) -> None:
        if self.journal is not None:
            self.journal.append(("zero", slot, slot))
        for stacked in self._state_groups:
            stacked[:, slot].zero_()

    def copy_slot(self, src: int, dst: int) -> None:
        if self.journal is not None:
            self.journal.append(("copy", src, dst))
        for stacked in self._state_groups:
            stacked[:, dst].copy_(stacked[:, src])

    def replay(self, journal: list[tuple[str, int, int]]) -> None:
        """Apply another rank's journal of slot writes (zero_slot / copy_slot, in order) to these tensors."""
        for op, a, b in journal:
            if op == "zero":
                self.zero_slot(a)
            else:
                self.copy_slot(a, b)

    def release(self) -> None:
        self.kv.clear()
        self.states.clear()
        self._state_groups.clear()
