"""Prefix caching for KV and recurrent state: hits, exactness against a cold run, and the traps
(unpublished snapshots, same-step reuse, zeroed slots, shared part behind a unique suffix, eviction)."""
from __future__ import annotations

import random

import pytest

from stateserve import LLM, SamplingParams
from prefix_models import RECURRENT, model_path

BS = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
_paths: dict[str, str] = {}


@pytest.fixture(scope="module", params=["llama"] + RECURRENT)
def kind_path(request, tmp_path_factory):
    if request.param not in _paths:
        _paths[request.param] = model_path(request.param, tmp_path_factory)
    return request.param, _paths[request.param]


def toks(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def run(llm, prompts, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def engine(path, **kw):
    kw.setdefault("max_num_batched_tokens", 64)
    return LLM(path, skip_tokenizer_init=True, block_size=BS, **kw)


def cold(path, prompts, **kw):
    with engine(path, enable_prefix_caching=False, **kw) as llm:
        return [o.outputs[0].token_ids for o in run(llm, prompts)]


MODES = ["all", "align"]


@pytest.mark.parametrize("mode", MODES)
def test_shared_prefix_hits_and_matches_cold(kind_path, mode):
    kind, path = kind_path
    shared = toks(5 * BS + 3, 1)
    prompts = [shared + toks(9, 2), shared + toks(20, 3), shared + toks(2, 4)]
    ref = cold(path, prompts)
    with engine(path, mamba_cache_mode=mode) as llm:
        outs = [run(llm, [p])[0] for p in prompts]
        assert [o.outputs[0].token_ids for o in outs] == ref
        hits = [o.num_cached_tokens for o in outs]
        assert hits[0] == 0
        if kind == "llama" or mode == "all":
            assert hits[1] == hits[2] == 5 * BS
        else:  # align: the second request ends a chunk where sharing stops, the third gets the hit
            assert hits[2] == 5 * BS
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.cache.is_idle_and_full()
        stats = llm.llm_engine.stats
        assert stats["prefix_cache_hits"] == sum(hits) and stats["prefix_cache_queries"] >= sum(map(len, prompts))


@pytest.mark.parametrize("mode", MODES)
def test_equivalence_around_block_boundaries(kind_path, mode):
    _, path = kind_path
    lengths = [BS - 1, BS, BS + 1, 3 * BS - 3, 3 * BS + 3]
    for budget in (8, 40):
        prompts = [toks(n, 10 + n) for n in lengths]
        ref = cold(path, prompts, max_num_batched_tokens=budget)
        with engine(path, mamba_cache_mode=mode, max_num_batched_tokens=budget) as llm:
            first = [run(llm, [p])[0].outputs[0].token_ids for p in prompts]
            again = [run(llm, [p])[0] for p in prompts]  # the same prompts: maximal hits
            assert first == ref
            assert [o.outputs[0].token_ids for o in again] == ref
            for n, o in zip(lengths, again):
                assert o.num_cached_tokens <= n - 1
            llm.llm_engine.check_integrity()


def test_same_prefix_twice_in_one_batch(kind_path):
    _, path = kind_path
    shared = toks(4 * BS, 5)
    prompts = [shared + toks(5, 6), shared + toks(7, 7)]
    ref = cold(path, prompts)
    with engine(path, max_num_batched_tokens=256) as llm:
        outs = run(llm, prompts)  # both admitted in one step: neither may read the other's unwritten state
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert [o.num_cached_tokens for o in outs] == [0, 0]
        llm.llm_engine.check_integrity()


def test_prompt_equal_to_cached_prefix(kind_path):
    _, path = kind_path
    p = toks(4 * BS, 8)
    ref = cold(path, [p])
    with engine(path) as llm:
        run(llm, [p + toks(10, 9)])
        out = run(llm, [p])[0]  # every block cached: the last token must still be computed
        assert out.outputs[0].token_ids == ref[0]
        assert out.num_cached_tokens == 3 * BS


def test_eviction_under_tiny_budget(kind_path):
    kind, path = kind_path
    prompts = [toks(3 * BS + 2, 20 + i) for i in range(6)]
    ref = cold(path, prompts)
    with engine(path, kv_cache_memory_bytes=200_000, max_num_seqs=2) as llm:
        for _ in range(2):
            assert [run(llm, [p])[0].outputs[0].token_ids for p in prompts] == ref
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.cache.is_idle_and_full()


def test_aborted_prefill_publishes_nothing(kind_path):
    _, path = kind_path
    p = toks(6 * BS + 5, 30)
    ref = cold(path, [p])
    with engine(path, max_num_batched_tokens=BS) as llm:
        eng = llm.llm_engine
        eng.add_request("x", p, GREEDY)
        eng.step()
        eng.step()  # two blocks written and published, the rest not yet computed
        eng.abort_request("x")
        eng.pop_output("x")
        out = run(llm, [p])[0]  # a retry reuses at most what was really written
        assert out.outputs[0].token_ids == ref[0]
        assert out.num_cached_tokens <= 2 * BS
        eng.check_integrity()


def test_failed_step_publishes_no_snapshot(kind_path, monkeypatch):
    kind, path = kind_path
    p = toks(3 * BS + 5, 31)
    ref = cold(path, [p])
    with engine(path) as llm:
        eng = llm.llm_engine
        real = eng.runner.model.forward

        def boom(*a, **k):
            real(*a, **k)  # states written ... then the step fails before it completes
            raise RuntimeError("injected failure")
        monkeypatch.setattr(eng.runner.model, "forward", boom)
        eng.add_request("x", p, GREEDY)
        assert eng.step() == ["x"]  # the step fails its request, not the engine
        monkeypatch.setattr(eng.runner.model, "forward", real)
        failed = eng.pop_output("x").outputs[0]
        assert failed.finish_reason == "error" and "injected failure" in failed.error
        if eng.cache.snapshots is not None:
            assert not eng.cache.snapshots.index and not eng.cache.snapshots.pending
        out = run(llm, [p])[0]
        assert out.outputs[0].token_ids == ref[0] and out.num_cached_tokens == 0
        eng.check_integrity()


def test_reused_slot_is_zeroed(kind_path):
    kind, path = kind_path
    if kind == "llama":
        pytest.skip("no recurrent state")
    with engine(path, max_num_seqs=1, enable_prefix_caching=False) as llm:
        a, b = toks(30, 40), toks(25, 41)
        ref_b = run(llm, [b])[0].outputs[0].token_ids
        run(llm, [a])
        assert run(llm, [b])[0].outputs[0].token_ids == ref_b  # b's slot was a's: its state must not leak
        storage = llm.llm_engine.runner.caches.storage
        slot = llm.llm_engine.cache.slot_pool.allocate()
        assert all(float(t[slot].abs().sum()) == 0 for layer in storage.states.values() for t in layer.values())
        llm.llm_engine.cache.slot_pool.free(slot)


def test_multi_turn_chat_hit_rate(kind_path):
    _, path = kind_path
    with engine(path, max_num_batched_tokens=256) as llm:
        history = toks(40, 50)
        for turn in range(4):
            out = run(llm, [history], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
            if turn:
                # everything up to the previous prompt's last full block is a hit
                assert out.num_cached_tokens >= (prev_len - 1) // BS * BS
            prev_len = len(history)
            history = history + out.outputs[0].token_ids + toks(9, 60 + turn)
