"""Hands KV blocks, state slots and prefix-cache hits to requests and takes them back; the scheduler's
only view of memory. Model-kind independent: it knows there may be KV blocks, state slots, and snapshots.

Sliding window (`window`, when every attention layer sees only its last `window` keys): a query at position p reads
keys p - window + 1 .. p, so before a step whose first new token sits at p0 the blocks wholly before p0 - window + 1
are given back (a published one stays findable by its prefix key until evicted). Their block_ids entries become
NO_BLOCK and req.num_released_blocks counts them; a sequence then holds at most about (window + chunk) / block_size
blocks however long it grows, and a prefix hit needs only the blocks of the window before its resume point."""
from __future__ import annotations

from stateserve.cache.block_pool import BlockPool, SlotPool
from stateserve.cache.prefix import SnapshotIndex, block_hashes
from stateserve.core.request import Request

NO_BLOCK = -1  # a block_ids entry whose block a sliding window gave back


def peak_blocks(num_tokens: int, block_size: int, window: int | None, max_chunk: int) -> int:
    """The most blocks one sequence of num_tokens holds at once when it runs in chunks of up to max_chunk tokens: all
    of them, or with a window, those of the window before a chunk plus the chunk's own."""
    blocks = -(-num_tokens // block_size)
    if window is None:
        return blocks
    return min(blocks, -(-(window - 1 + max_chunk) // block_size) + 1)


class CacheManager:
    def __init__(self, block_pool: BlockPool | None, slot_pool: SlotPool | None, block_size: int, *,
                 prefix_caching: bool = False, snapshots: SnapshotIndex | None = None,
                 window: int | None = None) -> None:
        if window is not None and window < 1:
            raise ValueError(f"window={window} must be at least 1")
        self.block_pool, self.slot_pool, self.block_size = block_pool, slot_pool, block_size
        self.window = window if block_pool is not None else None
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
        if self.block_pool is None:
            return True
        # blocks that leave the window come back before the new ones are taken, those no other request holds
        refs = self.block_pool.ref_counts
        released = sum(refs[b] == 1 for b in self._blocks_leaving_window(req))
        return self.block_pool.can_allocate(max(0, self.num_new_blocks(req, num_new_tokens) - released))

    def _first_kept_block(self, first_query_pos: int) -> int:
        """The first block a query at first_query_pos or later still reads (0 without a window)."""
        if self.window is None:
            return 0
        return max(0, first_query_pos - self.window + 1) // self.block_size

    def _blocks_leaving_window(self, req: Request) -> list[int]:
        """req's blocks still held that no query from its next token on reads (none without a window)."""
        first = min(self._first_kept_block(req.num_computed_tokens), len(req.block_ids))
        return req.block_ids[req.num_released_blocks:first]

    def release_outside_window(self, req: Request) -> None:
        """Give back the blocks no query from req's next token on can read."""
        leaving = self._blocks_leaving_window(req)
        if not leaving:
            return
        self.block_pool.free(leaving)
        start = req.num_released_blocks
        req.block_ids[start:start + len(leaving)] = [NO_BLOCK] * len(leaving)
        req.num_released_blocks = start + len(leaving)

    def peak_blocks(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks one sequence of num_tokens holds at once (module function peak_blocks)."""
        return peak_blocks(num_tokens, self.block_size, self.window, max_chunk)

    def allocate(self, req: Request, num_new_tokens: int) -> None:
        if self.slot_pool is not None and req.state_slot is None:
            req.state_slot = self.slot_pool.allocate()  # zeroed
            if req.restore_key is not None and not self.snapshots.restore_into(req.restore_key, req.state_slot):
                raise RuntimeError("prefix hit on a recurrent snapshot that is gone")
            req.restore_key = None
        if self.block_pool is not None:
            if self.window is not None:
                self.release_outside_window(req)
            req.block_ids.extend(self.block_pool.allocate(self.num_new_blocks(req, num_new_tokens)))

    def free(self, req: Request) -> None:
        if self.block_pool is not None and req.block_ids:
            self.block_pool.free(req.block_ids[req.num_released_blocks:])
        req.block_ids = []
        req.num_released_blocks = 0
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
        k = self._longest_resumable_prefix(keys, limit)
        if k == 0:
            return
        if self.block_pool is not None:
            first = self._first_kept_block(k * self.block_size)
            req.block_ids = [NO_BLOCK] * first + [self.block_pool.lookup(h) for h in keys[first:k]]
            for b in req.block_ids[first:]:
                self.block_pool.touch(b)
            req.num_released_blocks = first
            req.num_published_blocks = k
        if self.slot_pool is not None:
            req.restore_key = keys[k - 1]
        req.num_computed_tokens = req.num_cached_tokens = k * self.block_size
        self.num_hit_tokens += k * self.block_size

    def _longest_resumable_prefix(self, keys: list[bytes], limit: int) -> int:
        """The most leading blocks (<= limit) after which a request can resume: every block its next queries read
        is cached (all of them; with a window, those of the window only) and, with recurrent layers, a snapshot
        exists at that block's end."""
        if self.slot_pool is None and self.block_pool is None:
            return 0
        if self.slot_pool is not None and self.snapshots is None:
            return 0  # recurrent layers with no snapshots: no state to resume from
        run = 0  # cached blocks in a row ending at block k - 1
        best = 0
        for k in range(1, limit + 1):
            if self.block_pool is not None:
                run = run + 1 if self.block_pool.lookup(keys[k - 1]) is not None else 0
                if run < k - self._first_kept_block(k * self.block_size):
                    if self.window is None:
                        break  # every later k needs this block too
                    continue
            if self.slot_pool is None or keys[k - 1] in self.snapshots:
                best = k
        return best

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
        for b in range(max(req.num_published_blocks, req.num_released_blocks), full):
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
