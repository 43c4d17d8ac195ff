"""CUDA graphs for decode steps: the whole model forward (and the LM head) of a step in which every sequence adds
one token, captured once per padded batch size and replayed on persistent input buffers.

What makes a step replayable: every value that changes between steps lives in a persistent tensor that the
replay reads (token ids, positions, KV slot mapping, block tables, sequence lengths, state slots); the host-side
parts of the metadata (Python lists, ints) are fixed per padded size. Attention therefore reads the full width of
the block table (every block a sequence could own at max_model_len), masked by the sequence lengths, instead of
the width of this step's longest sequence.

Padding rows (a batch of 5 replays the graph for 8) write their K/V to a scratch KV block and their recurrent
state to a scratch state slot that the runner reserves and never hands out; they read only that scratch block.

The manager talks to the device through a GraphBackend, so its logic runs on CPU in tests: `CudaGraphBackend`
captures torch.cuda.CUDAGraph objects in one shared memory pool, `EagerReplayBackend` records the captured
callable and re-runs it on the same persistent buffers and metadata objects (what a replay computes)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from stateserve.core.batch import InputBatch
from stateserve.layers.metadata import ForwardMeta
from stateserve.model_states.interface import GraphBuffers

logger = logging.getLogger("stateserve")

_SMALL_SIZES = (1, 2, 4, 8)
_SIZE_STEP = 8  # past 8, one graph every 8 sequences: 16, 24, 32, ...


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, 16, 24, ... below max_num_seqs, then max_num_seqs itself."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in _SMALL_SIZES if s < max_num_seqs]
    sizes += list(range(2 * _SIZE_STEP, max_num_seqs, _SIZE_STEP))
    return sizes + [max_num_seqs]


def padded_size(sizes: list[int], num_seqs: int) -> int | None:
    """The smallest captured size that holds `num_seqs` sequences; None when none does."""
    return next((s for s in sizes if s >= num_seqs), None)


@dataclass(eq=False)
class CapturedStep:
    size: int
    step: Callable[[], torch.Tensor]  # runs the forward on the persistent buffers -> logits [size, vocab]
    output: torch.Tensor  # [size, vocab]: what the last capture/replay produced
    meta: ForwardMeta  # kept alive and unchanged: the graph baked its host-side values
    graph: object | None = None  # torch.cuda.CUDAGraph for the real backend


class GraphBackend(Protocol):
    def capture(self, captured: CapturedStep) -> None: ...

    def replay(self, captured: CapturedStep) -> torch.Tensor: ...

    def release(self) -> None: ...


class CudaGraphBackend:
    """torch.cuda.CUDAGraph per size, all sharing one private memory pool (captured largest first, so smaller
    graphs reuse the larger ones' memory; only one graph runs at a time)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, captured: CapturedStep) -> None:
        # Warm-up outside the graph: lazy allocations (rotary tables, cuBLAS workspaces) must not land in the
        # pool, and a step that synchronises with the host (.item(), .tolist(), a pageable copy) cannot be
        # captured; sync-debug mode "error" turns those into a clear exception here.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        previous = torch.cuda.get_sync_debug_mode()
        with torch.cuda.stream(side):
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(2):
                    captured.step()
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            captured.output = captured.step()
        captured.graph = graph

    def replay(self, captured: CapturedStep) -> torch.Tensor:
        captured.graph.replay()
        return captured.output

    def release(self) -> None:
        self.pool = None


class EagerReplayBackend:
    """CPU stand-in for tests: 'capture' runs the step once, 'replay' runs the recorded callable again on the same
    persistent buffers and the same metadata objects, so stale buffers or baked host values show up as wrong
    outputs exactly as they would with a real graph."""

    def __init__(self) -> None:
        self.num_captures = 0
        self.num_replays = 0
        self.replayed_sizes: list[int] = []

    def capture(self, captured: CapturedStep) -> None:
        captured.output = captured.step()
        self.num_captures += 1

    def replay(self, captured: CapturedStep) -> torch.Tensor:
        self.num_replays += 1
        self.replayed_sizes.append(captured.size)
        captured.output = captured.step()
        return captured.output

    def release(self) -> None:
        pass


def make_graph_backend(device: torch.device) -> GraphBackend | None:
    """The backend for this device, or None when graphs do not apply (tests replace this function)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return CudaGraphBackend(device)
    return None


class DecodeGraphInputs(GraphBuffers):
    """Persistent device buffers for the largest captured size; graphs of size B read the first B rows."""

    def __init__(self, max_size: int, max_blocks_per_seq: int, device: torch.device) -> None:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.long, device=device)

        self.input_ids, self.positions = zeros(max_size), zeros(max_size)  # [M]
        self.slot_mapping, self.seq_lens, self.state_slots = zeros(max_size), zeros(max_size), zeros(max_size)
        self.block_tables = zeros(max_size, max_blocks_per_seq)  # [M, W]
        self.rows = torch.arange(max_size, dtype=torch.long, device=device)  # decode row i is sequence i


class DecodeGraphManager:
    """Owns the captured decode graphs of one runner and their persistent inputs."""

    def __init__(self, model: torch.nn.Module, backend: GraphBackend,
                 graph_meta: Callable[[GraphBuffers, int, int], ForwardMeta], *, uses_kv_cache: bool,
                 uses_state_cache: bool, max_num_seqs: int, max_model_len: int, block_size: int,
                 scratch_block: int | None, scratch_slot: int | None, device: torch.device) -> None:
        if uses_kv_cache and scratch_block is None:
            raise ValueError("decode graphs of a model with KV cache need a scratch KV block for padding rows")
        if uses_state_cache and scratch_slot is None:
            raise ValueError("decode graphs of a recurrent model need a scratch state slot for padding rows")
        self.model, self.backend = model, backend
        self.graph_meta = graph_meta  # the model state's: metadata of one padded size over the buffers
        self.uses_kv_cache, self.uses_state_cache = uses_kv_cache, uses_state_cache
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.scratch_block, self.scratch_slot = scratch_block, scratch_slot
        self.sizes = capture_sizes(max_num_seqs)
        self.inputs = DecodeGraphInputs(self.sizes[-1], self.max_blocks_per_seq, device)
        self.graphs: dict[int, CapturedStep] = {}
        self._reset_padding(0, self.sizes[-1])  # capture runs with every row a padding row

    # ---- capture -------------------------------------------------------------------------------
    def capture_all(self) -> None:
        """Capture every size, largest first (shared pool). Runs only padding rows: touches scratch caches only."""
        for size in sorted(self.sizes, reverse=True):
            meta = self.graph_meta(self.inputs, size, self.max_blocks_per_seq * self.block_size)
            ids, positions = self.inputs.input_ids[:size], self.inputs.positions[:size]

            def step(ids=ids, positions=positions, meta=meta) -> torch.Tensor:
                hidden = self.model(ids, positions, meta)  # [size, hidden]
                return self.model.compute_logits(hidden)  # [size, vocab]

            captured = CapturedStep(size=size, step=step, output=torch.empty(0), meta=meta)
            self.backend.capture(captured)
            self.graphs[size] = captured
        logger.info("Captured decode graphs for batch sizes %s", sorted(self.graphs))

    # ---- replay --------------------------------------------------------------------------------
    def can_run(self, batch: InputBatch, meta: ForwardMeta) -> bool:
        """A step replays when every sequence adds one token to a cached context and nothing else is asked."""
        num_seqs = len(batch.requests)
        if not num_seqs or num_seqs > self.sizes[-1] or not batch.is_decode_only or meta.extra:
            return False
        if self.uses_kv_cache:
            attn = meta.attn
            if attn is None or not attn.is_decode_only or attn.decode_block_tables.shape[1] > self.max_blocks_per_seq:
                return False
        if self.uses_state_cache:
            state = meta.state
            if state is None or state.checkpoints or not all(state.has_initial_state):
                return False
        return True

    def run(self, batch: InputBatch, meta: ForwardMeta) -> torch.Tensor:
        """Copy this step's inputs into the buffers, replay the padded graph -> logits [padded size, vocab]
        (rows past len(batch.requests) are padding). The tensor is overwritten by the next replay."""
        num_seqs = len(batch.requests)
        size = padded_size(self.sizes, num_seqs)
        buf = self.inputs
        buf.input_ids[:num_seqs].copy_(batch.input_ids)
        buf.positions[:num_seqs].copy_(batch.positions)
        if self.uses_kv_cache:
            attn = meta.attn
            buf.slot_mapping[:num_seqs].copy_(attn.slot_mapping)
            buf.seq_lens[:num_seqs].copy_(attn.decode_seq_lens)
            width = attn.decode_block_tables.shape[1]
            # columns past a sequence's blocks point at block 0 (finite K/V), masked out by seq_lens
            buf.block_tables[:num_seqs, width:].zero_()
            buf.block_tables[:num_seqs, :width].copy_(attn.decode_block_tables)
        if self.uses_state_cache:
            buf.state_slots[:num_seqs].copy_(meta.state.slots)
        self._reset_padding(num_seqs, size)
        return self.backend.replay(self.graphs[size])

    def _reset_padding(self, start: int, end: int) -> None:
        """Rows [start, end) are padding: rewritten every step, so a row that held a real sequence in an earlier
        step never writes into that sequence's cache again."""
        if start >= end:
            return
        buf = self.inputs
        buf.input_ids[start:end].zero_()
        buf.positions[start:end].zero_()
        if self.uses_kv_cache:
            buf.slot_mapping[start:end].fill_(self.scratch_block * self.block_size)
            buf.seq_lens[start:end].fill_(1)  # one key (the scratch row just written): no empty softmax
            buf.block_tables[start:end].fill_(self.scratch_block)
        if self.uses_state_cache:
            buf.state_slots[start:end].fill_(self.scratch_slot)

    # ---- lifecycle -----------------------------------------------------------------------------
    def release(self) -> None:
        """Drop graphs, their outputs (pool memory) and the persistent buffers."""
        for captured in self.graphs.values():
            if captured.graph is not None and hasattr(captured.graph, "reset"):
                captured.graph.reset()
            captured.graph = captured.output = captured.meta = captured.step = None
        self.graphs.clear()
        self.backend.release()
        self.inputs = None
        self.model = None
