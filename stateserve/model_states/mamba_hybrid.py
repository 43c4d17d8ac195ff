"""MambaHybridModelState: attention-free models (Mamba, Mamba2) and hybrids (attention + recurrent layers).

Recurrent layers read and write one state slot per running sequence; attention layers, if any, use paged KV.
With prefix caching, this state decides where recurrent snapshots are taken (mamba_cache_mode):
  all   - at every block boundary a chunk passes (interior boundaries are emitted by the scan itself);
  align - only at the last block boundary of each chunk, and non-final chunks end on block boundaries
          (or where the prompt stops matching what earlier requests computed, so the shared part gets one).
Snapshots are reserved before the forward and published only after it, so nothing reads a partial state."""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch

from stateserve.core.batch import InputBatch
from stateserve.core.request import Request
from stateserve.layers.metadata import ForwardMeta, StateMetadata
from stateserve.layers.recurrent import StatefulLayer
from stateserve.model_states.default import DefaultModelState, build_paged_attn_metadata, graph_attn_metadata
from stateserve.model_states.interface import CachePolicy, GraphBuffers

logger = logging.getLogger("stateserve")
MAX_SNAPSHOT_SLOTS = 1024
SNAPSHOT_SLOTS_PER_SEQ = 64


class MambaHybridModelState(DefaultModelState):
    uses_state_cache = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # attention-free models have no KV at all; hybrids have both
        self.uses_kv_cache = not self.model_config.is_attention_free
        self.cache = None  # CacheManager, attached by the runner
        self.mode = "none"
        self._post_copies: list[tuple[int, int]] = []  # (running slot, snapshot slot) copied after the forward
        # speculative decoding: per request, position -> a slot holding the state after that many tokens, kept by
        # a step for rollback (spec_decode/; slots of the running pool, which has k spare slots per sequence)
        self._kept: dict[Request, dict[int, int]] = {}
        self._recurrent = [m for m in self.model.modules() if isinstance(m, StatefulLayer)]
        self._apply_ssm_state_dtype()

    def _apply_ssm_state_dtype(self) -> None:
        """mamba_ssm_cache_dtype: a named dtype is kept by each recurrent layer or refused (ValueError); auto is the
        model dtype wherever a layer can keep it (Mamba2-style mixers), float32 elsewhere (Mamba1, gated delta
        net), as vLLM's auto and transformers' caches keep the model dtype."""
        choice = self.engine_config.mamba_ssm_cache_dtype
        dtype = self.model_config.dtype if choice == "auto" else getattr(torch, choice)
        if dtype == torch.float32:
            return
        for m in self._recurrent:
            if choice != "auto" or dtype in m.ssm_state_dtypes:
                m.set_ssm_state_dtype(dtype)

    def cache_policy(self) -> CachePolicy:
        """Snapshots only with prefix caching on; 'all' by default (docs/prefix_caching.md says why)."""
        prefix_caching = super().cache_policy().prefix_caching
        mode = self.engine_config.mamba_cache_mode
        if not prefix_caching:
            if mode not in (None, "none"):
                logger.warning("mamba_cache_mode=%s ignored: prefix caching is off", mode)
            return CachePolicy(prefix_caching=False)
        mode = mode or "all"
        slots = 0 if mode == "none" else min(MAX_SNAPSHOT_SLOTS, self.engine_config.max_num_seqs * SNAPSHOT_SLOTS_PER_SEQ)
        return CachePolicy(prefix_caching=True, mamba_cache_mode=mode, num_snapshot_slots=slots)

    def attach_cache(self, cache) -> None:
        self.cache = cache
        self.mode = self.cache_policy().mamba_cache_mode if cache.snapshots is not None else "none"

    @contextlib.contextmanager
    def profile_meta(self, lens: list[int]) -> Iterator[ForwardMeta]:
        """The attention metadata of the base class, plus a temporary state of one slot per sequence, bound to every
        recurrent layer for the dummy forward and dropped afterwards (the real caches do not exist yet)."""
        with super().profile_meta(lens) as meta:
            state = StateMetadata(query_start_loc=meta.attn.query_start_loc, query_lens=list(lens),
                                  has_initial_state=[False] * len(lens),
                                  slots=torch.arange(len(lens), device=self.device), is_decode_only=False)
            try:
                for m in self._recurrent:
                    spec = m.cache_spec()
                    dtypes = dict(spec.dtypes)
                    m.bind_cache({k: torch.zeros(len(lens), *s, dtype=dtypes[k], device=self.device)
                                  for k, s in spec.shapes})
                yield ForwardMeta(meta.num_tokens, attn=meta.attn, state=state)
            finally:
                for m in self._recurrent:
                    m.bind_cache(None)

    def graph_meta(self, buffers: GraphBuffers, size: int, width: int) -> ForwardMeta:
        attn = graph_attn_metadata(buffers, size, width) if self.uses_kv_cache else None
        state = StateMetadata(query_start_loc=list(range(size + 1)), query_lens=[1] * size,
                              slots=buffers.state_slots[:size], has_initial_state=[True] * size, is_decode_only=True)
        return ForwardMeta(size, attn=attn, state=state)

    def chunk_size(self, req, num_tokens: int) -> int:
        if self.mode != "align" or req.num_computed_tokens + num_tokens >= req.num_tokens:
            return num_tokens
        bs, start = self.block_size, req.num_computed_tokens
        end = start + num_tokens
        known = self.cache.known_prefix_blocks(req) * bs
        if start < known < end:
            return known - start  # end the chunk where sharing with earlier requests stops
        aligned = end // bs * bs - start
        if aligned > 0:
            return aligned
        # less budget than one block this step: wait for a fuller step unless blocks are bigger than any step
        return 0 if self.engine_config.max_num_batched_tokens >= bs else num_tokens

    def _plan_snapshots(self, batch: InputBatch) -> list[tuple[int, int, int]]:
        checkpoints: list[tuple[int, int, int]] = []
        self._post_copies = []
        if self.mode == "none":
            return checkpoints
        bs, snaps = self.block_size, self.cache.snapshots
        speculating = set(batch.spec_seqs)  # their snapshots come from committed state only, in rollback()
        for i, (req, ctx, q) in enumerate(zip(batch.requests, batch.context_lens, batch.query_lens)):
            if i in speculating:
                continue
            first, last = ctx // bs + 1, (ctx + q) // bs
            if last < first:
                continue
            keys = self.cache.keys(req, last)
            for b in (range(first, last + 1) if self.mode == "all" else [last]):
                slot = snaps.reserve(keys[b - 1])
                if slot is None:
                    continue
                offset = b * bs - ctx
                if offset == q:  # state at the chunk's end: a plain copy after the step
                    self._post_copies.append((req.state_slot, slot))
                else:
                    checkpoints.append((i, offset, slot))
        return checkpoints

    def prepare_meta(self, batch: InputBatch) -> ForwardMeta:
        slots = [r.state_slot for r in batch.requests]
        if any(s is None for s in slots):
            raise RuntimeError("a scheduled request of a recurrent model has no state slot")
        state = StateMetadata(
            query_start_loc=batch.query_start_loc, query_lens=batch.query_lens,
            slots=torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True), host_slots=slots,
            has_initial_state=[c > 0 for c in batch.context_lens], is_decode_only=batch.is_decode_only,
            checkpoints=self._plan_snapshots(batch) + self._keep_states(batch), decode_rounds=batch.spec_seqs)
        attn = build_paged_attn_metadata(batch, self.block_size, self.device) if self.uses_kv_cache else None
        return ForwardMeta(batch.num_tokens, attn=attn, state=state)

    def _keep_states(self, batch: InputBatch) -> list[tuple[int, int, int]]:
        """Checkpoints into spare running slots for the offsets a step keeps for rollback (drafts being verified,
        a draft model's steps); recorded per request by position."""
        checkpoints = []
        for i, offsets in batch.keep_offsets.items():
            req, ctx = batch.requests[i], batch.context_lens[i]
            kept = self._kept.setdefault(req, {})
            for off in offsets:
                if ctx + off not in kept:
                    kept[ctx + off] = self.cache.slot_pool.allocate(zeroed=False)  # written whole by the step
                checkpoints.append((i, off, kept[ctx + off]))
        return checkpoints

    def rollback(self, req, step_start: int, num_fed: int, num_kept: int) -> None:
        """The running slot holds the state after num_fed tokens; make it the state after num_kept by taking the
        kept slot of that position in its place (no copy), and snapshot committed block boundaries of the step."""
        kept = self._kept.pop(req, {})
        pool = self.cache.slot_pool
        src = {**kept, num_fed: req.state_slot}
        if num_kept not in src:
            for slot in kept.values():
                pool.free(slot)
            raise RuntimeError(f"request {req.request_id}: no state kept after {num_kept} tokens to roll back to "
                               f"(kept: {sorted(src)})")
        self._snapshot_committed(req, step_start, num_kept, src)
        if num_kept != num_fed:
            kept.pop(num_kept)
            pool.free(req.state_slot)
            req.state_slot = src[num_kept]
        for slot in kept.values():
            pool.free(slot)

    def _snapshot_committed(self, req, step_start: int, num_kept: int, src: dict[int, int]) -> None:
        """Prefix-cache snapshots at the block boundaries a speculative step committed (never past num_kept)."""
        if self.mode == "none":
            return
        bs = self.block_size
        boundaries = [b for b in range(step_start // bs + 1, num_kept // bs + 1) if b * bs in src]
        if self.mode == "align":
            boundaries = boundaries[-1:]
        if not boundaries:
            return
        keys = self.cache.keys(req, boundaries[-1])
        for b in boundaries:
            dst = self.cache.snapshots.reserve(keys[b - 1])
            if dst is not None:
                self.cache.snapshots.copy_slot(src[b * bs], dst)
        self.cache.snapshots.publish_pending()

    def remove_request(self, req) -> None:
        for slot in self._kept.pop(req, {}).values():
            self.cache.slot_pool.free(slot)

    def after_step(self, batch: InputBatch) -> None:
        if self.mode == "none":
            return
        for src, dst in self._post_copies:
            self.cache.snapshots.copy_slot(src, dst)
        self._post_copies = []
        self.cache.snapshots.publish_pending()

    def on_step_failed(self) -> None:
        self._post_copies = []
        if self.cache is not None and self.cache.snapshots is not None:
            self.cache.snapshots.drop_pending()

    def release(self) -> None:
        self.cache = None
