"""`stateserve serve --data-parallel-size N` (entrypoints/data_parallel.py): one server subprocess with two replicas
of the bundled default model, driven by the `openai` client and httpx (work reaches both replicas, an abort on
one leaves the other's stream untouched, prefix affinity, per-replica metrics, thread split, graceful shutdown),
and the router, the thread split and the metrics labels as units."""
from __future__ import annotations

import asyncio
import re
import signal
import threading
import time

import httpx2
import openai
import pytest
import torch

from stateserve.entrypoints.data_parallel import AFFINITY_BLOCKS, AFFINITY_SLACK, ReplicaTeam, Router
from stateserve.entrypoints.metrics import ServerMetrics
from stateserve.platform.cpu_threads import ThreadGovernor
from utils import start_server

NAME = "dp-demo"


@pytest.fixture(scope="module")
def server():
    from stateserve.assets import default_model_path

    # 2 threads for the process: each replica's engine thread must compute on 1
    proc, url, lines = start_server(default_model_path(), "--data-parallel-size", "2", "--served-model-name", NAME,
                                    "--kv-cache-memory-bytes", str(16 << 20), "--shutdown-timeout", "1",
                                    "--uvicorn-log-level", "warning", env={"STATESERVE_NUM_THREADS": "2"})
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    try:
        yield client, url, lines
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    # graceful shutdown of both replicas: exit 0 only when every replica's caches passed the integrity check
    assert rc == 0, "".join(lines)
    assert any("shutdown complete: caches free" in line and "'replicas'" in line for line in lines), "".join(lines)


def replica_metrics(url: str, name: str) -> dict[str, float]:
    """{"": total, "0": replica 0, "1": replica 1} of one engine metric."""
    text = httpx2.get(url + "/metrics", timeout=10).text
    found = {m.group(2) or "": float(m.group(3))
             for m in re.finditer(rf'^stateserve:{name}(\{{replica="(\d+)"\}})? (\S+)$', text, re.M)}
    assert set(found) == {"", "0", "1"}, text
    return found


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def wait_idle(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while replica_metrics(url, "num_requests_running")[""] or replica_metrics(url, "num_requests_waiting")[""]:
        assert time.monotonic() < deadline, "the replicas are still busy"
        time.sleep(0.05)


def test_each_replica_logs_ready_on_its_share_of_the_threads(server):
    lines = "".join(server[2])
    for i in range(2):
        assert f"data-parallel replica {i}/2 ready (1 intra-op thread(s))" in lines, lines


def test_concurrent_streams_reach_both_replicas(server):
    client, url, _ = server
    wait_idle(url)
    before = replica_metrics(url, "prompt_tokens_total")

    async def one(aclient, prompt):
        stream = await aclient.completions.create(model=NAME, prompt=prompt, max_tokens=32, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
        pieces, finish = [], None
        async for chunk in stream:
            for choice in chunk.choices:
                pieces.append(choice.text)
                finish = choice.finish_reason or finish
        return "".join(pieces), finish

    async def main():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60) as aclient:
            return await asyncio.gather(one(aclient, [5, 6, 7]), one(aclient, [8, 9, 10, 11]))

    results = asyncio.run(main())
    assert [finish for _, finish in results] == ["length", "length"] and all(text for text, _ in results)
    got = delta(replica_metrics(url, "prompt_tokens_total"), before)
    assert got == {"": 7, "0": 3, "1": 4} or got == {"": 7, "0": 4, "1": 3}, got  # one request on each replica


def test_abort_on_one_replica_leaves_the_other_stream_alone(server):
    client, url, _ = server
    survivor = dict(model=NAME, prompt=[20, 21, 22], max_tokens=160, temperature=0, extra_body={"ignore_eos": True})
    reference = client.completions.create(**survivor).choices[0].text  # greedy, alone
    wait_idle(url)
    before = {name: replica_metrics(url, name) for name in ("prompt_tokens_total", "generation_tokens_total")}
    out: dict[str, object] = {}

    def quitter():
        stream = client.completions.create(model=NAME, prompt=[30, 31, 32, 33, 34], max_tokens=4000, stream=True,
                                           extra_body={"ignore_eos": True})
        for n, _ in enumerate(stream, 1):
            if n == 3:
                stream.close()  # the client goes away mid-stream
                out["quit"] = time.monotonic()
                return

    def survive():
        chunks = list(client.completions.create(stream=True, **survivor))
        out["text"] = "".join(c.choices[0].text for c in chunks if c.choices)
        out["finish"] = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        out["done"] = time.monotonic()

    threads = [threading.Thread(target=survive), threading.Thread(target=quitter)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out["finish"] == "length" and out["text"] == reference
    assert out["quit"] < out["done"]  # the abort came while the survivor was still streaming
    wait_idle(url)
    prompts = delta(replica_metrics(url, "prompt_tokens_total"), before["prompt_tokens_total"])
    assert sorted([prompts["0"], prompts["1"]]) == [3, 5], prompts  # the two requests ran on different replicas
    quitter_replica = "0" if prompts["0"] == 5 else "1"
    generated = delta(replica_metrics(url, "generation_tokens_total"), before["generation_tokens_total"])
    assert generated[quitter_replica] < 1000, generated  # aborted long before its 4000 tokens


def test_requests_sharing_a_prompt_prefix_land_on_the_same_replica(server):
    client, url, _ = server
    wait_idle(url)
    before = {name: replica_metrics(url, name) for name in ("prompt_tokens_total", "prefix_cache_hits_total")}
    shared = list(range(40, 120))  # 80 tokens: 5 blocks of 16
    for tail in ([200, 201], [210, 211, 212]):  # one after the other: with no load, plain routing alternates
        out = client.completions.create(model=NAME, prompt=shared + tail, max_tokens=2, temperature=0)
        assert out.usage.completion_tokens == 2
    prompts = delta(replica_metrics(url, "prompt_tokens_total"), before["prompt_tokens_total"])
    hits = delta(replica_metrics(url, "prefix_cache_hits_total"), before["prefix_cache_hits_total"])
    home = "0" if prompts["0"] else "1"
    assert prompts[home] == 82 + 83 and prompts["1" if home == "0" else "0"] == 0, prompts
    assert hits[home] > 0, hits  # the second request reused the first one's prefix cache there


# ---- units -----------------------------------------------------------------------------------------------------

class FakeReplica:
    def __init__(self, running: int = 0, waiting: int = 0) -> None:
        self.snapshot = {"running": running, "waiting": waiting}
        self.is_running = True

    def step(self, running: int, waiting: int = 0) -> None:
        """The engine thread published a new snapshot."""
        self.snapshot = {"running": running, "waiting": waiting}


def route(router: Router, count: int = 1, key: bytes | None = None) -> int:
    """What DataParallelEngine does with a submission the chosen replica accepts."""
    i = router.choose(key)[0]
    router.accepted(i, router.reserve(i, count), key)
    return i


def test_router_sends_work_to_the_least_loaded_replica_and_counts_what_snapshots_do_not_show_yet():
    replicas = [FakeReplica(running=5, waiting=3), FakeReplica(running=4), FakeReplica(running=6)]
    router = Router(replicas, block_size=16)
    assert router.choose(None) == [1, 2, 0]
    # a burst before any snapshot moves: each routed sequence counts, so it spreads instead of piling onto 1
    assert [route(router, count=2) for _ in range(4)] == [1, 2, 1, 2]  # ties round-robin
    assert [router.load(i) for i in range(3)] == [8, 8, 10]
    # a newer snapshot shows what replica 1 was sent (and one finished): no longer counted twice
    replicas[1].step(running=7)
    assert router.load(1) == 7 and router.load(2) == 10
    # a dead replica gets nothing
    replicas[2].is_running = False
    assert router.choose(None) == [1, 0]
    # a submission that is refused (full queue) stops counting at once
    pending = router.reserve(0, 50)
    assert router.load(0) == 58
    router.release(0, pending)
    assert router.load(0) == 8


def test_router_breaks_ties_round_robin():
    router = Router([FakeReplica(), FakeReplica(), FakeReplica()], block_size=16)
    for _ in range(2):
        picked = []
        for _ in range(3):
            picked.append(route(router))
            for r in router.replicas:  # the work finished before the next request
                r.step(running=0)
        assert picked == [0, 1, 2]


def test_router_prefix_affinity_holds_until_a_clear_load_margin():
    replicas = [FakeReplica(), FakeReplica()]
    router = Router(replicas, block_size=16)
    shared = list(range(100, 100 + 16 * AFFINITY_BLOCKS))
    key = router.prefix_key(shared + [1, 2, 3])
    assert key == router.prefix_key(shared + [7]) != router.prefix_key([0] + shared)
    assert router.prefix_key(list(range(15))) is None  # not one full block: nothing cached to share
    assert router.prefix_key(list(range(20))) == router.prefix_key(list(range(16)) + [99])  # whole blocks only
    assert route(router, key=key) == 0
    replicas[0].step(running=AFFINITY_SLACK)  # the home replica is busier, but not by a clear margin
    assert route(router, key=key) == 0
    replicas[0].step(running=1 + AFFINITY_SLACK)  # now by more than the slack: the least-loaded one wins
    assert route(router, key=key) == 1
    replicas[0].step(running=0)
    replicas[1].step(running=1)
    assert route(router, key=key) == 1  # and the key follows it there
    assert route(router, key=router.prefix_key(list(range(500, 600)))) == 0  # another prefix: by load
    # the margin grows with the load: half the least-loaded replica's
    replicas[0].step(running=40)
    replicas[1].step(running=40 + 40 // 2)
    assert route(router, key=key) == 1
    replicas[1].step(running=40 + 40 // 2 + 1)
    assert route(router, key=key) == 0


def test_replica_team_splits_the_process_team_per_engine_thread():
    governor = ThreadGovernor(2, adaptive=False)
    seen = {}

    def engine_thread(name: str, replicas: int) -> None:
        team = ReplicaTeam(governor, replicas)
        seen[name] = (team.poll(), torch.get_num_threads())

    threads = [threading.Thread(target=engine_thread, args=(f"dp{i}", 2)) for i in range(2)]
    threads.append(threading.Thread(target=engine_thread, args=("single", 1)))
    main_threads = torch.get_num_threads()
    for t in threads:
        t.start()
        t.join()
    assert seen == {"dp0": (1, 1), "dp1": (1, 1), "single": (2, 2)}
    assert torch.get_num_threads() == main_threads  # a thread's team size is its own
    assert ReplicaTeam(ThreadGovernor(1, adaptive=False), 2).threads == 1  # never below one thread


def test_metrics_label_replicas_only_with_data_parallelism():
    snaps = [{"running": 1, "waiting": 0, "prompt_tokens": 10}, {"running": 2, "waiting": 1, "prompt_tokens": 5}]
    total = {k: snaps[0][k] + snaps[1][k] for k in snaps[0]}
    plain = ServerMetrics(lambda: total).render().decode()
    assert "replica=" not in plain and re.search(r"^stateserve:num_requests_running 3\.0$", plain, re.M)
    labelled = ServerMetrics(lambda: total, lambda: snaps).render().decode()
    for line in ('stateserve:num_requests_running 3.0', 'stateserve:num_requests_running{replica="0"} 1.0',
                 'stateserve:num_requests_running{replica="1"} 2.0', 'stateserve:prompt_tokens_total 15.0',
                 'stateserve:prompt_tokens_total{replica="0"} 10.0',
                 'stateserve:num_requests_waiting{replica="1"} 1.0'):
        assert re.search("^" + re.escape(line) + "$", labelled, re.M), labelled


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_data_parallel_size_below_one_is_a_clear_error(value, capsys):
    from stateserve.entrypoints.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve"]).data_parallel_size == 1
    assert parser.parse_args(["serve", "--data-parallel-size", "3"]).data_parallel_size == 3
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["serve", "--data-parallel-size", value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --data-parallel-size: " in err and ">= 1" in err and value in err, err


def test_replicas_of_two_tensor_parallel_ranks_each_answer_like_one_engine():
    """`--data-parallel-size 2 --tensor-parallel-size 2`: two replicas, each rank 0 here plus a worker process on
    the replica's own slice of the CPUs; concurrent completions land on both and equal one plain engine's greedy
    text; a clean shutdown stops every rank."""
    from stateserve import LLM, SamplingParams
    from stateserve.assets import default_model_path

    model = default_model_path()
    prompts = ["The cat", "Once upon a time"]
    with LLM(model, kv_cache_memory_bytes=1 << 24) as llm:
        expected = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))]
    proc, url, lines = start_server(model, "--data-parallel-size", "2", "--tensor-parallel-size", "2",
                                    "--served-model-name", NAME, "--kv-cache-memory-bytes", str(16 << 20),
                                    "--uvicorn-log-level", "warning")
    try:
        async def main():
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
                done = await asyncio.gather(*(c.completions.create(model=NAME, prompt=p, max_tokens=12,
                                                                   temperature=0) for p in prompts))
                return [d.choices[0].text for d in done]

        assert asyncio.run(main()) == expected
        served = replica_metrics(url, "prompt_tokens_total")
        assert served["0"] > 0 and served["1"] > 0, served
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    log = "".join(lines)
    assert rc == 0, log
    assert log.count("Tensor parallelism: 2 ranks (gloo over loopback)") == 2, log
    assert all(f"data-parallel replica {i}/2 ready" in log for i in range(2)), log


def test_data_parallel_with_several_nodes_is_refused(capsys):
    from stateserve.entrypoints.cli import main

    rc = main(["serve", "--data-parallel-size", "2", "--tensor-parallel-size", "2", "--nnodes", "2",
               "--node-rank", "0", "--distributed-init-method", "tcp://127.0.0.1:29555", "--port", "0"])
    assert rc != 0
    assert "cannot be combined with --nnodes or --distributed-init-method" in capsys.readouterr().err


def test_each_replica_starts_its_ranks_on_its_own_slice_of_the_cpus(monkeypatch):
    """distributed/driver.replica_cpus: while replica i of n is built, its ranks divide only CPUs
    [i * C / n, (i + 1) * C / n) among themselves; outside a build they divide all of them."""
    from stateserve.distributed import driver

    monkeypatch.setattr(driver.cpu_threads, "usable_cpus", lambda: frozenset(range(8)))
    monkeypatch.setattr("stateserve.envs.STATESERVE_NUM_THREADS", 0, raising=False)
    assert driver._cpu_shares(2) == (4, [[0, 1, 2, 3], [4, 5, 6, 7]])
    with driver.replica_cpus(1, 2):
        assert driver._cpu_shares(2) == (2, [[4, 5], [6, 7]])
    with driver.replica_cpus(0, 4):
        assert driver._cpu_shares(2) == (1, [[0], [1]])
    assert driver._replica is None
