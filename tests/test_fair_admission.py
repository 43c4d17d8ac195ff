"""Admission (issue 32, items 6 and 7): a submission is validated whole before any part of it is queued, and
waiting sequences are admitted fairly between shares (engine/fair_queue.py), so one request with many sequences
cannot starve a small one. The policy is checked against a brute-force model and through the engine API."""
from __future__ import annotations

import random

import pytest

from stateserve import LLM, SamplingParams
from stateserve.cache.manager import CacheManager
from stateserve.core.request import Request, RequestStatus
from stateserve.engine.scheduler import Scheduler
from prefix_models import model_path

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def req(i: int, key: str, n_tokens: int = 4) -> Request:
    return Request(f"r{i}", [3] * n_tokens, GREEDY, i, group_id=key)  # the fairness key defaults to the group


# ---- the policy, against fakes ------------------------------------------------------------------
def expected_next(preempted: list[Request], waiting: list[Request], running: dict[str, int]) -> Request | None:
    """Brute force: a preempted sequence first, else the oldest of the share with the fewest running."""
    if preempted:
        return preempted[0]
    return min(waiting, key=lambda r: (running.get(r.fairness_key, 0), r.arrival_index), default=None)


def test_queue_matches_brute_force_under_random_operations():
    from stateserve.engine.fair_queue import FairWaitingQueue

    rng = random.Random(0)
    q = FairWaitingQueue()
    preempted: list[Request] = []
    waiting: list[Request] = []
    running: list[Request] = []
    counter = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.35:
            r = req(counter, f"k{rng.randrange(6)}")
            counter += 1
            q.add(r)
            waiting.append(r)
        elif op < 0.6 and (preempted or waiting):
            r = q.peek()
            q.started(r)
            (preempted if preempted and preempted[0] is r else waiting).remove(r)
            running.append(r)
        elif op < 0.75 and running:
            r = running.pop(rng.randrange(len(running)))
            q.stopped(r)
        elif op < 0.85 and running:
            r = running.pop(rng.randrange(len(running)))
            q.add_preempted(r)
            preempted.insert(0, r)
        elif waiting or preempted:
            pool = waiting + preempted
            r = pool[rng.randrange(len(pool))]
            assert q.remove(r)
            (waiting if r in waiting else preempted).remove(r)
        counts: dict[str, int] = {}
        for r in running:
            counts[r.fairness_key] = counts.get(r.fairness_key, 0) + 1
        assert q.peek() is expected_next(preempted, waiting, counts)
        assert len(q) == len(preempted) + len(waiting)
        assert set(map(id, q)) == set(map(id, preempted + waiting))
    assert not q.remove(req(10**6, "k0"))


def test_scheduler_admits_a_new_share_at_the_next_free_slot():
    sched = Scheduler(CacheManager(None, None, 16), max_num_seqs=4, max_num_batched_tokens=64)
    big = [req(i, "big") for i in range(20)]
    for r in big:
        sched.add(r)
    assert sched.schedule().admitted == big[:4]
    small = req(100, "small")
    sched.add(small)
    assert sched.schedule().admitted == []  # no free slot
    sched.finish(big[0])
    assert sched.schedule().admitted == [small]  # not big[4]
    sched.finish(big[1])
    assert sched.schedule().admitted == [big[4]]
    # with one share (or only n=1 requests) it stays first-come first-served
    fifo = Scheduler(CacheManager(None, None, 16), max_num_seqs=3, max_num_batched_tokens=64)
    plain = [req(200 + i, f"g{i}") for i in range(5)]
    for r in plain:
        fifo.add(r)
    assert fifo.schedule().admitted == plain[:3]
    fifo.finish(plain[1])
    assert fifo.schedule().admitted == [plain[3]]
    assert plain[4].status == RequestStatus.WAITING and len(fifo.waiting) == 1


# ---- through the engine --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return model_path("llama", tmp_path_factory)


def toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def make_llm(path: str) -> LLM:
    return LLM(path, skip_tokenizer_init=True, max_num_seqs=4, max_num_batched_tokens=64, enforce_eager=True)


@pytest.mark.parametrize("shape", ["one prompt x n=32", "32 prompts, one client"])
def test_small_request_is_not_starved(llama_path, shape):
    big_prompts = [toks(20, 1)] if shape.startswith("one") else [toks(12 + i % 9, 10 + i) for i in range(32)]
    big_params = SamplingParams(n=32, max_tokens=8, temperature=0, ignore_eos=True) if len(big_prompts) == 1 \
        else GREEDY
    small_prompt = toks(9, 99)
    with make_llm(llama_path) as llm:  # each alone
        big_ref = [[c.token_ids for c in o.outputs] for o in
                   llm.generate([{"prompt_token_ids": p} for p in big_prompts], big_params)]
        small_ref = llm.generate([{"prompt_token_ids": small_prompt}], GREEDY)[0].outputs[0].token_ids
    with make_llm(llama_path) as llm:
        eng = llm.llm_engine
        big_ids = [f"big{i}" for i in range(len(big_prompts))]
        # one prompt x n: one request group, a share of its own by default; 32 prompts: one client's share
        share = {} if len(big_prompts) == 1 else {"fairness_key": "client-a"}
        for rid, p in zip(big_ids, big_prompts):
            eng.add_request(rid, p, big_params, **share)
        eng.step()
        eng.add_request("small", small_prompt, GREEDY)
        step, small_start, finished_at = 1, None, {}
        while eng.has_unfinished():
            for gid in eng.step():
                finished_at.setdefault(gid, step)
            if small_start is None and any(r.request_id == "small" for r in eng.scheduler.running):
                small_start = step
            step += 1
        big_done = max(finished_at[g] for g in big_ids)
        # the first big sequences end after 8 tokens; the small request takes the first slot that frees
        assert small_start is not None and small_start <= 10, f"small request first ran at step {small_start}"
        assert finished_at["small"] <= 20 and big_done >= 50, (finished_at["small"], big_done)
        assert eng.pop_output("small").outputs[0].token_ids == small_ref
        assert [[c.token_ids for c in eng.pop_output(g).outputs] for g in big_ids] == big_ref
        eng.check_integrity()
        assert eng.cache.is_idle_and_full()


# ---- whole submissions ---------------------------------------------------------------------------
def overflowing_seed(n: int) -> SamplingParams:
    """n samples seeded seed, seed + 1, ...: the last one past torch's largest seed (set past any validation)."""
    p = SamplingParams(n=n, max_tokens=4, temperature=1.0)
    object.__setattr__(p, "seed", (1 << 64) - 1)
    return p


def assert_untouched(eng) -> None:
    assert not eng.has_unfinished() and not eng.requests and not eng.groups
    assert eng.cache.is_idle_and_full()


def test_add_request_is_atomic(llama_path):
    with make_llm(llama_path) as llm:
        eng = llm.llm_engine
        with pytest.raises(ValueError, match="seed"):
            eng.add_request("x", toks(5, 1), overflowing_seed(3))
        assert_untouched(eng)
        with pytest.raises(TypeError, match="SamplingParams"):
            eng.add_request("x", toks(5, 1), {"max_tokens": 3})
        assert_untouched(eng)
        eng.add_request("x", toks(5, 1), GREEDY)
        with pytest.raises(ValueError, match="already in use"):
            eng.add_request("x", toks(5, 2), SamplingParams(n=2))
        assert list(eng.requests) == ["x"] and len(eng.scheduler.waiting) == 1


def test_generate_validates_every_prompt_before_adding(llama_path, monkeypatch):
    good = {"prompt_token_ids": toks(5, 1)}
    with make_llm(llama_path) as llm:
        eng = llm.llm_engine
        with pytest.raises(ValueError, match="seed"):
            llm.generate([good, good], [GREEDY, overflowing_seed(2)])
        assert_untouched(eng)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate([good, {"prompt_token_ids": [5, 10**9]}], GREEDY)
        assert_untouched(eng)
        # adding fails half-way anyway (here: injected): what was added is taken out again
        real, calls = eng.add_prepared, []

        def flaky(children):
            calls.append(children)
            if len(calls) == 2:
                raise RuntimeError("add failed")
            real(children)
        monkeypatch.setattr(eng, "add_prepared", flaky)
        with pytest.raises(RuntimeError, match="add failed"):
            llm.generate([good, good, good], GREEDY)
        assert_untouched(eng)
        monkeypatch.undo()
        assert llm.generate([good], GREEDY)[0].outputs[0].finish_reason == "length"
