"""A step that raises fails exactly the requests in it and corrupts nothing (issue 32, item 2).

One layer's forward is made to raise on a chosen step (engine/fault_inject.py) after it and the layers before it
have already written their KV rows and advanced their recurrent states in place. Checked for a decoder, an
attention-free Mamba2 and a Bamba hybrid, with prefix caching off and on (mamba_cache_mode all / align): the
step's requests end with finish_reason "error" and a message, every other request finishes with the tokens of a
fault-free run, a retry of a failed prompt gets the fault-free tokens (no half-written state, snapshot or block is
ever served), the pools end full, and faults in several steps in a row stop the engine with EngineDeadError."""
from __future__ import annotations

import random

import pytest

from stateserve import LLM, SamplingParams, envs
from stateserve.engine.fault_inject import FaultInjector, FaultSpec, InjectedFault
from prefix_models import model_path

BS = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
KINDS = ["llama", "mamba2", "bamba"]
MODES = ["off", "all", "align"]
_paths: dict[str, str] = {}


@pytest.fixture(scope="module", params=KINDS)
def kind_path(request, tmp_path_factory):
    if request.param not in _paths:
        _paths[request.param] = model_path(request.param, tmp_path_factory)
    return request.param, _paths[request.param]


def toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


SHARED = toks(2 * BS + 3, 1)
# prompts sharing a prefix (blocks and snapshots get published), a long one prefilled in chunks, short ones
PROMPTS = [SHARED + toks(5, 2), SHARED + toks(9, 3), toks(12, 4), toks(3 * BS + 7, 5), toks(20, 6), toks(7, 7)]


def make_llm(path: str, mode: str, **kw) -> LLM:
    kw.setdefault("max_num_batched_tokens", 24)
    kw.setdefault("max_num_seqs", 3)
    caching = dict(enable_prefix_caching=False) if mode == "off" else dict(enable_prefix_caching=True,
                                                                           mamba_cache_mode=mode)
    # graphs off: a decode graph replay (CUDA) runs no Python hook, so a fault could not be injected in it
    return LLM(path, skip_tokenizer_init=True, block_size=BS, enforce_eager=True, **caching, **kw)


def record_schedules(engine) -> list[list[str]]:
    """Ids of the requests each model-running step scheduled, in step order."""
    log: list[list[str]] = []
    real = engine.scheduler.schedule

    def schedule():
        out = real()
        if out.requests:
            log.append([r.request_id for r in out.requests])
        return out
    engine.scheduler.schedule = schedule
    return log


def drive(engine, prompts: dict[str, list[int]], params: SamplingParams = GREEDY) -> dict:
    for rid, p in prompts.items():
        engine.add_request(rid, p, params)
    while engine.has_unfinished():
        engine.step()
    return {rid: engine.pop_output(rid).outputs[0] for rid in prompts}


def assert_pools_full(engine) -> None:
    engine.check_integrity()
    cache = engine.cache
    assert cache.is_idle_and_full()
    if cache.block_pool is not None:
        assert cache.block_pool.num_free == cache.block_pool.num_blocks
    if cache.slot_pool is not None:
        assert cache.slot_pool.num_free == cache.slot_pool.num_slots
    if cache.snapshots is not None:
        assert not cache.snapshots.pending
    assert not engine.requests and not engine.groups and not engine.has_unfinished()


def reference(path: str, mode: str) -> tuple[dict, list[list[str]]]:
    with make_llm(path, mode) as llm:
        log = record_schedules(llm.llm_engine)
        outs = drive(llm.llm_engine, {f"r{i}": p for i, p in enumerate(PROMPTS)})
        return {rid: o.token_ids for rid, o in outs.items()}, log


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fault_step", [1, 3])
def test_fault_fails_only_its_step(kind_path, mode, fault_step):
    kind, path = kind_path
    if kind == "llama" and mode == "align":
        pytest.skip("no recurrent state: align is the same as all")
    ref, ref_log = reference(path, mode)
    with make_llm(path, mode) as llm:
        eng = llm.llm_engine
        log = record_schedules(eng)
        injector = FaultInjector(eng.runner.model, FaultSpec(layer=1, step=fault_step))
        prompts = {f"r{i}": p for i, p in enumerate(PROMPTS)}
        outs = drive(eng, prompts)
        assert injector.fired == 1
        in_step = set(log[fault_step])
        assert log[:fault_step + 1] == ref_log[:fault_step + 1]  # the same schedule up to the fault
        assert in_step and in_step != set(prompts)
        for rid, out in outs.items():
            if rid in in_step:
                assert out.finish_reason == "error", rid
                assert "InjectedFault" in out.error and "injected fault in layer 1" in out.error
                assert out.token_ids == ref[rid][:len(out.token_ids)]  # tokens from before the fault are kept
            else:
                assert out.finish_reason == "length" and out.error is None, rid
                assert out.token_ids == ref[rid], f"{rid} was not in the failed step but its tokens changed"
        assert_pools_full(eng)
        # the failed prompts again: nothing half-written (state slot, snapshot, KV block) may be served
        retry = drive(eng, {f"again-{rid}": prompts[rid] for rid in sorted(in_step)})
        for rid in sorted(in_step):
            assert retry[f"again-{rid}"].token_ids == ref[rid], f"a retry of {rid} got other tokens"
            assert retry[f"again-{rid}"].finish_reason == "length"
        assert_pools_full(eng)


def test_fault_in_the_sampler_publishes_nothing(kind_path, monkeypatch):
    """The forward completed but sampling raised: the step's snapshots and blocks are not published either."""
    kind, path = kind_path
    p = toks(3 * BS + 5, 31)
    with make_llm(path, "off") as llm:
        ref = drive(llm.llm_engine, {"x": p})["x"].token_ids
    with make_llm(path, "all", max_num_batched_tokens=256) as llm:
        eng = llm.llm_engine
        real = eng.runner.sampler.__class__.__call__

        def boom(self, *a, **k):
            raise RuntimeError("sampler fault")
        monkeypatch.setattr(eng.runner.sampler.__class__, "__call__", boom)
        eng.add_request("x", p, GREEDY)
        assert eng.step() == ["x"]
        out = eng.pop_output("x").outputs[0]
        assert out.finish_reason == "error" and "sampler fault" in out.error and out.token_ids == []
        monkeypatch.setattr(eng.runner.sampler.__class__, "__call__", real)
        if eng.cache.snapshots is not None:
            assert not eng.cache.snapshots.index and not eng.cache.snapshots.pending
        if eng.cache.block_pool is not None:
            assert not eng.cache.block_pool.cached
        assert_pools_full(eng)
        again = drive(eng, {"y": p})["y"]
        assert again.token_ids == ref


@pytest.fixture
def fault_env(monkeypatch):
    """Set STATESERVE_* variables for the engines of one test (the engine freezes them when it starts)."""
    names = []

    def set_env(**values):
        for name, value in values.items():
            monkeypatch.setenv(name, value)
            names.append(name)
        envs.disable_envs_cache()
    yield set_env
    for name in names:
        monkeypatch.delenv(name, raising=False)
    envs.disable_envs_cache()


def test_repeated_faults_stop_the_engine(kind_path, fault_env):
    from stateserve.engine.errors import EngineDeadError

    kind, path = kind_path
    fault_env(STATESERVE_FAULT_INJECT="layer=0,step=1,count=3")  # the default limit is 3 failed steps in a row
    with make_llm(path, "all", max_num_seqs=2) as llm:
        eng = llm.llm_engine
        assert eng.fault_injector is not None and eng.max_step_failures == 3
        for i in range(8):
            eng.add_request(f"r{i}", toks(10 + i, 40 + i), GREEDY)
        eng.step()  # step 0 runs
        eng.step()  # step 1 fails its requests, the engine goes on
        eng.step()  # step 2 fails too
        failed = [rid for rid in eng.groups if eng.groups[rid][0].finish_reason == "error"]
        assert len(failed) == 4
        with pytest.raises(EngineDeadError, match="3 failed steps in a row") as info:
            eng.step()
        assert isinstance(info.value.__cause__, InjectedFault)
        with pytest.raises(EngineDeadError):
            eng.step()
        with pytest.raises(EngineDeadError):
            eng.add_request("late", toks(5, 1), GREEDY)
        with pytest.raises(EngineDeadError):
            llm.generate([{"prompt_token_ids": toks(5, 1)}], GREEDY)
        for rid in list(eng.groups):  # what is left can still be aborted and its records dropped
            eng.abort_request(rid)
            eng.pop_output(rid)
        assert_pools_full(eng)


def test_faults_below_the_limit_do_not_stop_the_engine(kind_path, fault_env):
    kind, path = kind_path
    fault_env(STATESERVE_FAULT_INJECT="layer=0,step=1,count=2", STATESERVE_MAX_CONSECUTIVE_STEP_FAILURES="3")
    prompts = [toks(10 + i, 40 + i) for i in range(8)]
    with make_llm(path, "all", max_num_seqs=2) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        reasons = [o.outputs[0].finish_reason for o in outs]
        assert reasons.count("error") == 4 and reasons.count("length") == 4
        assert_pools_full(llm.llm_engine)
        again = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)  # the engine keeps serving
        assert [o.outputs[0].finish_reason for o in again] == ["length"] * 8
    fault_env(STATESERVE_FAULT_INJECT="")
    with make_llm(path, "all", max_num_seqs=2) as llm:
        ref = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in ref]
    for o, r in zip(outs, ref):
        if o.outputs[0].finish_reason == "length":
            assert o.outputs[0].token_ids == r.outputs[0].token_ids


def test_generate_returns_failed_requests_and_runs_the_rest(kind_path):
    kind, path = kind_path
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    with make_llm(path, "all") as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    with make_llm(path, "all") as llm:
        FaultInjector(llm.llm_engine.runner.model, FaultSpec(layer=0, step=2))
        outs = llm.generate(prompts, GREEDY)
        assert len(outs) == len(prompts) and all(o.finished for o in outs)
        failed = [i for i, o in enumerate(outs) if o.outputs[0].finish_reason == "error"]
        assert failed and len(failed) < len(prompts)
        for i, o in enumerate(outs):
            if i in failed:
                assert "injected fault" in o.outputs[0].error
            else:
                assert o.outputs[0].token_ids == ref[i]
        assert_pools_full(llm.llm_engine)


def test_generate_raises_when_the_engine_dies(kind_path, fault_env):
    from stateserve.engine.errors import EngineDeadError

    kind, path = kind_path
    fault_env(STATESERVE_MAX_CONSECUTIVE_STEP_FAILURES="1")
    with make_llm(path, "all") as llm:
        FaultInjector(llm.llm_engine.runner.model, FaultSpec(layer=0, step=1))
        with pytest.raises(EngineDeadError, match="1 failed steps in a row"):
            llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
        assert_pools_full(llm.llm_engine)  # the call aborted what was left and dropped every record


def test_fault_spec_parsing(fault_env):
    assert FaultSpec.parse("layer=2,step=5") == FaultSpec(2, 5, 1)
    assert FaultSpec.parse(" layer = 0 , step=1, count=4") == FaultSpec(0, 1, 4)
    for bad in ["layer=1", "step=1", "layer=x,step=1", "layer=1,step=1,count=0", "layer=-1,step=0",
                "layer=1,step=1,what=2", "layer=1,layer=2,step=1"]:
        with pytest.raises(ValueError):
            FaultSpec.parse(bad)
    fault_env(STATESERVE_FAULT_INJECT="layer=1")
    from stateserve.engine import fault_inject
    with pytest.raises(ValueError, match="STATESERVE_FAULT_INJECT"):
        fault_inject.from_env(None)
