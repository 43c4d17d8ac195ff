"""Decode graphs on CPU: the real DecodeGraphManager with EagerReplayBackend, which re-runs the recorded step on the
same persistent buffers and metadata objects (what a CUDA graph replay computes). Checked: capture sizes and
padding, greedy tokens and logits equal to eager for a decoder, an attention-free model and hybrids, padding rows
never writing a real sequence's cache, ineligible steps running eagerly, shutdown dropping the manager, and
broken variants (stale buffers, padding rows left as they were) failing."""
from __future__ import annotations

import random

import pytest
import torch

from stateserve import LLM, SamplingParams
from stateserve.core.request import Request
from stateserve.core.batch import SchedulerOutput
from stateserve.runner import cuda_graphs
from stateserve.core.batch import build_input_batch
from prefix_models import model_path

KINDS = ["llama", "mamba2", "bamba", "jamba"]


@pytest.fixture
def fake_graphs(monkeypatch):
    """Every engine created in the test captures graphs with one shared EagerReplayBackend."""
    backend = cuda_graphs.EagerReplayBackend()
    monkeypatch.setattr(cuda_graphs, "make_graph_backend", lambda device: backend)
    return backend


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return {kind: model_path(kind, tmp_path_factory) for kind in KINDS}


def _prompts(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 300) for _ in range(n)]} for n in (1, 5, 17, 30, 9)]


def test_capture_sizes_and_padding():
    assert cuda_graphs.capture_sizes(1) == [1]
    assert cuda_graphs.capture_sizes(10) == [1, 2, 4, 8, 10]
    assert cuda_graphs.capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert cuda_graphs.capture_sizes(17) == [1, 2, 4, 8, 16, 17]
    sizes = cuda_graphs.capture_sizes(40)
    assert [cuda_graphs.padded_size(sizes, n) for n in (1, 3, 5, 9, 17, 33, 40)] == [1, 4, 8, 16, 24, 40, 40]
    assert cuda_graphs.padded_size(sizes, 41) is None
    with pytest.raises(ValueError):
        cuda_graphs.capture_sizes(0)


@pytest.mark.parametrize("kind", KINDS)
def test_graphs_match_eager(kind, paths, fake_graphs):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    kw = dict(skip_tokenizer_init=True, max_num_seqs=8, max_num_batched_tokens=32)
    with LLM(paths[kind], enforce_eager=True, **kw) as llm:
        assert llm.llm_engine.runner.graph_manager is None
        eager = llm.generate(_prompts(), params)
    assert fake_graphs.num_replays == 0
    with LLM(paths[kind], **kw) as llm:
        manager = llm.llm_engine.runner.graph_manager
        assert manager is not None and sorted(manager.graphs) == [1, 2, 4, 8]
        graphed = llm.generate(_prompts(), params)
        llm.llm_engine.check_integrity()
    assert fake_graphs.num_replays > 0
    assert set(fake_graphs.replayed_sizes) - {1, 2, 4, 8} == set()
    assert any(s in (4, 8) for s in fake_graphs.replayed_sizes)  # batches of 3, 5... were padded
    for a, b in zip(eager, graphed):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for t in la:
                assert abs(la[t].logprob - lb[t].logprob) < 1e-4


def _start(llm, prompts: list[list[int]]) -> list[Request]:
    """Admit requests and run their prefill eagerly (one step each) so they are ready to decode."""
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    reqs = []
    for i, ids in enumerate(prompts):
        req = Request(f"r{i}", list(ids), SamplingParams(max_tokens=64), arrival_index=i)
        engine.cache.allocate(req, len(ids))
        sched = SchedulerOutput()
        sched.add(req, len(ids))
        _, result = runner.execute(sched)
        req.num_computed_tokens = len(ids)
        req.append_token(result.token_ids[0])
        reqs.append(req)
    return reqs


def _decode_sched(llm, reqs: list[Request]) -> SchedulerOutput:
    sched = SchedulerOutput()
    for req in reqs:
        llm.llm_engine.cache.allocate(req, 1)
        sched.add(req, 1)
    return sched


def _snapshot(storage) -> list[torch.Tensor]:
    return [t.clone() for kv in storage.kv.values() for t in kv] + \
           [t.clone() for layer in storage.states.values() for t in layer.values()]


def _restore(storage, saved: list[torch.Tensor]) -> None:
    live = [t for kv in storage.kv.values() for t in kv] + [t for layer in storage.states.values()
                                                             for t in layer.values()]
    for t, s in zip(live, saved):
        t.copy_(s)


@pytest.mark.parametrize("kind", ["llama", "mamba2", "bamba"])
def test_decode_logits_equal_eager(kind, paths, fake_graphs):
    with LLM(paths[kind], skip_tokenizer_init=True, max_num_seqs=8, enable_prefix_caching=False) as llm:
        runner = llm.llm_engine.runner
        reqs = _start(llm, [p["prompt_token_ids"] for p in _prompts(1)])
        with torch.inference_mode():
            for _ in range(3):  # a few steps, so buffers hold earlier steps' values
                batch = build_input_batch(_decode_sched(llm, reqs), runner.device)
                meta = runner.model_state.prepare_meta(batch)
                assert runner.graph_manager.can_run(batch, meta)
                saved = _snapshot(runner.caches.storage)
                replays = fake_graphs.num_replays
                graphed, _ = runner.forward_logits(batch, meta)
                assert fake_graphs.num_replays == replays + 1
                after_graph = _snapshot(runner.caches.storage)
                _restore(runner.caches.storage, saved)
                hidden = runner.model(batch.input_ids, batch.positions, meta)
                eager = runner.model.compute_logits(hidden[batch.logits_indices])
                torch.testing.assert_close(graphed, eager, atol=1e-5, rtol=1e-5)
                tokens = eager.argmax(-1).tolist()
                assert graphed.argmax(-1).tolist() == tokens
                # the caches of real sequences end up the same either way
                scratch = _scratch_rows(runner)
                for g, e, rows in zip(after_graph, _snapshot(runner.caches.storage), scratch):
                    keep = torch.ones(g.shape[0], dtype=torch.bool)
                    keep[rows] = False
                    torch.testing.assert_close(g[keep], e[keep], atol=1e-5, rtol=1e-5)
                for req, t in zip(reqs, tokens):
                    req.num_computed_tokens += 1
                    req.append_token(t)
                reqs = reqs[:-1]  # the next step pads a smaller batch, over rows real sequences used before


def _scratch_rows(runner) -> list[list[int]]:
    """Per cache tensor of _snapshot: the rows reserved for graph padding."""
    m = runner.graph_manager
    return [[m.scratch_block] for kv in runner.caches.storage.kv.values() for _ in kv] + \
           [[m.scratch_slot] for layer in runner.caches.storage.states.values() for _ in layer.values()]


def _foreign_rows_changed(runner, reqs, step) -> bool:
    """Run `step()` and report whether any cache row outside the scheduled requests' own blocks/slots and the
    scratch rows changed."""
    owned_blocks = {b for r in reqs for b in r.block_ids} | {runner.graph_manager.scratch_block}
    owned_slots = {r.state_slot for r in reqs} | {runner.graph_manager.scratch_slot}
    before = _snapshot(runner.caches.storage)
    step()
    after = _snapshot(runner.caches.storage)
    num_kv = 2 * len(runner.caches.storage.kv)
    for j, (b, a) in enumerate(zip(before, after)):
        owned = owned_blocks if j < num_kv else owned_slots
        for row in range(b.shape[0]):
            if row not in owned and not torch.equal(b[row], a[row]):
                return True
    return False


@pytest.mark.parametrize("kind", ["llama", "bamba"])
@pytest.mark.parametrize("broken", [False, True])
def test_padding_rows_never_touch_real_caches(kind, broken, paths, fake_graphs, monkeypatch):
    with LLM(paths[kind], skip_tokenizer_init=True, max_num_seqs=8, enable_prefix_caching=False) as llm:
        runner = llm.llm_engine.runner
        reqs = _start(llm, [[7, 8, 9], [10, 11], [12, 13, 14, 15], [16]])
        with torch.inference_mode():
            runner.execute(_decode_sched(llm, reqs))  # 4 real rows fill the size-4 graph
            if broken:  # padding rows keep the previous step's (real) slots and tables
                monkeypatch.setattr(cuda_graphs.DecodeGraphManager, "_reset_padding", lambda self, a, b: None)
            live, dropped = reqs[:3], reqs[3]
            # mark the dropped sequence's cache: a stale padding row would recompute and overwrite it
            for k, v in runner.caches.storage.kv.values():
                k[dropped.block_ids] = 0.5
                v[dropped.block_ids] = 0.5
            for layer in runner.caches.storage.states.values():
                for t in layer.values():
                    t[dropped.state_slot] = 0.5
            changed = _foreign_rows_changed(runner, live, lambda: runner.execute(_decode_sched(llm, live)))
    assert changed == broken


def test_stale_buffers_give_wrong_tokens(paths, fake_graphs, monkeypatch):
    """A manager that forgets to copy the block tables replays with the ones from capture: outputs change."""
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    kw = dict(skip_tokenizer_init=True, max_num_seqs=8)
    with LLM(paths["llama"], **kw) as llm:
        good = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params)]
    original = cuda_graphs.DecodeGraphManager.run

    def run_without_tables(self, batch, meta):
        saved = self.inputs.block_tables.clone()
        out_tables = meta.attn.decode_block_tables
        meta.attn.decode_block_tables = saved[:len(batch.requests), :out_tables.shape[1]]
        try:
            return original(self, batch, meta)
        finally:
            meta.attn.decode_block_tables = out_tables

    monkeypatch.setattr(cuda_graphs.DecodeGraphManager, "run", run_without_tables)
    with LLM(paths["llama"], **kw) as llm:
        stale = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params)]
    assert stale != good


def test_ineligible_steps_run_eagerly(paths, fake_graphs):
    with LLM(paths["mamba2"], skip_tokenizer_init=True, max_num_seqs=4) as llm:
        runner = llm.llm_engine.runner
        manager = runner.graph_manager
        reqs = _start(llm, [[5, 6, 7], [8, 9]])
        replays = fake_graphs.num_replays
        assert replays == 0  # prefill steps never replay
        batch = build_input_batch(_decode_sched(llm, reqs), runner.device)
        meta = runner.model_state.prepare_meta(batch)
        assert manager.can_run(batch, meta)
        meta.state.checkpoints = [(0, 1, runner.caches.manager.snapshots.slots.allocate())]  # a snapshot asked for: eager
        assert not manager.can_run(batch, meta)
        meta.state.checkpoints = []
        meta.state.has_initial_state = [False, True]
        assert not manager.can_run(batch, meta)
        # a step mixing a prefill chunk with a decode
        late = Request("late", [3, 4, 5], SamplingParams(max_tokens=4), arrival_index=9)
        llm.llm_engine.cache.allocate(late, 3)
        sched = _decode_sched(llm, reqs[:1])
        sched.add(late, 3)
        mixed = build_input_batch(sched, runner.device)
        assert not manager.can_run(mixed, runner.model_state.prepare_meta(mixed))
    # more sequences than the largest graph
    with LLM(paths["llama"], skip_tokenizer_init=True, max_num_seqs=4) as llm:
        manager = llm.llm_engine.runner.graph_manager
        reqs = _start(llm, [[5, 6], [7], [8, 9, 10], [11]])
        batch = build_input_batch(_decode_sched(llm, reqs), llm.llm_engine.runner.device)
        meta = llm.llm_engine.runner.model_state.prepare_meta(batch)
        assert manager.can_run(batch, meta)
        manager.sizes = [1, 2]  # as if only small graphs existed
        assert not manager.can_run(batch, meta)


def test_reference_runner_and_enforce_eager_capture_nothing(paths, fake_graphs, monkeypatch):
    from stateserve import envs

    with LLM(paths["llama"], skip_tokenizer_init=True, enforce_eager=True) as llm:
        assert llm.llm_engine.runner.graph_manager is None
    monkeypatch.setenv("STATESERVE_RUNNER", "reference")
    envs.disable_envs_cache()
    try:
        with LLM(paths["llama"], skip_tokenizer_init=True) as llm:
            assert llm.llm_engine.runner.graph_manager is None
    finally:
        monkeypatch.delenv("STATESERVE_RUNNER")
        envs.disable_envs_cache()
    assert fake_graphs.num_captures == 0


def test_scratch_rows_are_reserved(paths, fake_graphs):
    with LLM(paths["bamba"], skip_tokenizer_init=True, max_num_seqs=4) as llm:
        runner = llm.llm_engine.runner
        m = runner.graph_manager
        assert m.scratch_block == runner.caches.manager.block_pool.num_blocks  # one past what the pool hands out
        assert m.scratch_slot not in set(runner.caches.manager.slot_pool.free_slots)
        if runner.caches.manager.snapshots.slots is not None:
            assert m.scratch_slot not in set(runner.caches.manager.snapshots.slots.free_slots)
        assert m.scratch_slot == runner.caches.storage.states[next(iter(runner.caches.storage.states))]["ssm"].shape[0] - 1


def test_shutdown_drops_the_manager(paths, fake_graphs):
    llm = LLM(paths["bamba"], skip_tokenizer_init=True, max_num_seqs=4)
    runner = llm.llm_engine.runner
    manager = runner.graph_manager
    llm.generate(_prompts()[:2], SamplingParams(max_tokens=3))
    llm.shutdown()
    assert runner.graph_manager is None
    assert manager.graphs == {} and manager.inputs is None and manager.model is None
    llm.shutdown()  # idempotent
