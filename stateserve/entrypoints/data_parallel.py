"""`stateserve serve --data-parallel-size N`: N engine replicas (each its own LLMEngine, caches and engine thread)
behind one HTTP front end. `DataParallelEngine` offers the AsyncEngine API the server uses; with N = 1 the server
keeps a plain AsyncEngine.

Routing of a submission (`Router`): the load of a replica is its running + waiting sequences from the snapshot
its engine thread publishes after every loop turn, plus the sequences routed to it that no snapshot shows yet
(a burst spreads instead of piling onto the replica whose snapshot is stale; an accepted submission stops being
counted once a newer snapshot than the one current at its acceptance appears, so it is counted at most one turn
twice, never zero times). Prefix affinity: a prompt with at least one full block gets a key, the hash of its first
min(full blocks, AFFINITY_BLOCKS) blocks of `block_size` token ids; a later submission with the same key goes to
the replica that took the last one (whose prefix cache holds those blocks) unless that replica's load exceeds the
least load by more than max(AFFINITY_SLACK, least load // 2) sequences. Otherwise the least-loaded replica wins,
ties broken round-robin; the key then points at the replica chosen. A replica that refuses (full queue, dead)
passes the submission to the next by load; dead replicas get nothing new.

Aborts go to the replica that holds the group: a stream aborts through its own replica, and `abort(group_ids)`
finds the owner from the group id itself (each replica's ids carry its own prefix), so there is no map to leak.

Threads: the process's ThreadGovernor (platform/cpu_threads.py) decides a team for the whole process (cores
other processes leave free); each replica's engine thread computes on that team // N threads (at least one).
torch.set_num_threads sets the calling thread's OpenMP team (and MKL's thread-local count), so each engine thread
applies its own share."""
from __future__ import annotations

import asyncio
import hashlib
import logging
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from stateserve.entrypoints.async_engine import AsyncEngine, build_off_main_thread
from stateserve.entrypoints.streams import EngineDead, EngineOverloaded, RequestStream
from stateserve.platform.cpu_threads import ThreadGovernor

logger = logging.getLogger("stateserve.server")
AFFINITY_BLOCKS = 4  # blocks of a prompt's start that make its affinity key
AFFINITY_SLACK = 4  # sequences of extra load the affinity replica may carry over the least-loaded one
_MAX_KEYS = 65536  # affinity keys remembered (least recently used dropped)


class ReplicaTeam:
    """The governor's process-wide team split over `replicas` engine threads; polled by a replica's runners."""

    def __init__(self, governor: ThreadGovernor, replicas: int) -> None:
        self.governor, self.replicas = governor, replicas

    @property
    def threads(self) -> int:
        return max(1, self.governor.threads // self.replicas)

    def poll(self) -> int:
        self.governor.poll()  # re-decides the process's team (and sets it on this thread when it changed)
        share = self.threads
        if torch.get_num_threads() != share:  # this thread's own OpenMP team
            torch.set_num_threads(share)
        return share


def split_threads(engine: Any, replicas: int) -> int | None:
    """Each runner of a replica's engine (model, draft model) computes on its share; returns it (None off CPU). A
    replica of several ranks got its share of the CPUs when it started them (distributed/driver.replica_cpus)."""
    proposer = getattr(getattr(engine, "speculator", None), "proposer", None)
    share = None
    for runner in (getattr(engine, "runner", None), getattr(proposer, "runner", None)):
        team = getattr(runner, "threads", None)
        if getattr(runner, "group", None) is not None and isinstance(team, ThreadGovernor):
            share = team.max_threads  # each rank's threads, already within the replica's CPUs
            continue
        if isinstance(team, ThreadGovernor):
            runner.threads = team = ReplicaTeam(team, replicas)
        if isinstance(team, ReplicaTeam):
            share = team.threads
    return share


@dataclass
class _Pending:
    count: int  # sequences
    seen: dict | None = None  # the replica's snapshot when the submission was accepted


class Router:
    """Picks the replica of each submission (the rule is in the module docstring). `replicas` need only
    `.snapshot` (a dict with running / waiting) and `.is_running`."""

    def __init__(self, replicas: Sequence[Any], block_size: int) -> None:
        self.replicas, self.block_size = replicas, block_size
        self._pending: list[list[_Pending]] = [[] for _ in replicas]
        self._affinity: OrderedDict[bytes, int] = OrderedDict()
        self._next = 0  # where ties start

    def prefix_key(self, token_ids: Sequence[int] | None) -> bytes | None:
        """The affinity key of a prompt's token ids (None: not one full block)."""
        blocks = min(len(token_ids or ()) // self.block_size, AFFINITY_BLOCKS)
        head = ",".join(map(str, token_ids[:blocks * self.block_size])).encode() if blocks else None
        return hashlib.blake2b(head, digest_size=16).digest() if head else None

    def load(self, i: int) -> int:
        snap = self.replicas[i].snapshot
        self._pending[i] = live = [p for p in self._pending[i] if p.seen is None or p.seen is snap]
        return snap.get("running", 0) + snap.get("waiting", 0) + sum(p.count for p in live)

    def choose(self, key: bytes | None) -> list[int]:
        """The replicas to try, best first."""
        n = len(self.replicas)
        alive = [i for i in range(n) if self.replicas[i].is_running] or list(range(n))
        loads = {i: self.load(i) for i in alive}
        order = sorted(alive, key=lambda i: (loads[i], (i - self._next) % n))
        least = loads[order[0]]
        home = self._affinity.get(key)
        if home in loads and loads[home] <= least + max(AFFINITY_SLACK, least // 2):
            order.remove(home)
            order.insert(0, home)
        return order

    def reserve(self, i: int, count: int) -> _Pending:
        self._pending[i].append(pending := _Pending(count))
        return pending

    def accepted(self, i: int, pending: _Pending, key: bytes | None) -> None:
        pending.seen = self.replicas[i].snapshot  # counted until a newer snapshot shows (or has dropped) it
        self._next = (i + 1) % len(self.replicas)
        if key is not None:
            self._affinity[key] = i
            self._affinity.move_to_end(key)
            if len(self._affinity) > _MAX_KEYS:
                self._affinity.popitem(last=False)

    def release(self, i: int, pending: _Pending) -> None:
        if pending in self._pending[i]:
            self._pending[i].remove(pending)


class DataParallelEngine:
    """N AsyncEngines behind the API the server uses from one. `engine` is replica 0's LLMEngine (config, model
    config, pooling: the same in every replica)."""

    def __init__(self, engines: Sequence[Any], max_waiting_requests: int | None = None) -> None:
        if len(engines) < 1:
            raise ValueError("a data-parallel engine needs at least one replica")
        self.replicas = [AsyncEngine(e, max_waiting_requests) for e in engines]  # the queue limit is per replica
        self.threads = [split_threads(e, len(engines)) for e in engines]
        self.engine = engines[0]
        self.max_model_len = self.replicas[0].max_model_len
        self.router = Router(self.replicas, engines[0].config.block_size)
        self._switch_interval = sys.getswitchinterval()

    @property
    def is_running(self) -> bool:
        return all(r.is_running for r in self.replicas)

    def replica_snapshots(self) -> list[dict[str, int]]:
        return [r.snapshot for r in self.replicas]

    @property
    def snapshot(self) -> dict[str, int]:
        """Every replica's numbers summed."""
        total: dict[str, int] = {}
        for snap in self.replica_snapshots():
            for key, value in snap.items():
                total[key] = total.get(key, 0) + value
        return total

    @property
    def final_state(self) -> dict[str, Any] | None:
        """None until every replica stopped; integrity_ok and idle_and_full only if true of every replica."""
        if None in (states := [r.final_state for r in self.replicas]):
            return None
        return {"aborted": sum(s.get("aborted", 0) for s in states),
                "integrity_ok": all(s.get("integrity_ok") for s in states),
                "idle_and_full": all(s.get("idle_and_full") for s in states), "replicas": states}

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        loop = loop or asyncio.get_running_loop()
        self._switch_interval = sys.getswitchinterval()  # each replica saves what the one before set
        for r in self.replicas:
            r.start(loop)

    async def submit(self, prompts: list[tuple[str | None, list[int]]], params: Any,
                     stream_text: bool = False) -> RequestStream:
        key = self.router.prefix_key(prompts[0][1]) if prompts else None
        return await self._route(key, len(prompts) * params.num_samples,
                                 lambda r: r.submit(prompts, params, stream_text))

    async def submit_embed(self, inputs: list[str | list[int]], keep_last: int | None) -> RequestStream:
        first = inputs[0] if inputs else None
        key = self.router.prefix_key(first) if isinstance(first, list) else None
        return await self._route(key, len(inputs), lambda r: r.submit_embed(inputs, keep_last))

    async def _route(self, key: bytes | None, count: int, submit: Callable[[AsyncEngine], Any]) -> RequestStream:
        error: BaseException | None = None
        for i in self.router.choose(key):
            pending = self.router.reserve(i, count)
            try:
                stream = await submit(self.replicas[i])
            except (EngineOverloaded, EngineDead) as e:  # another replica may have room
                self.router.release(i, pending)
                error = e
                continue
            except BaseException:
                self.router.release(i, pending)
                raise
            self.router.accepted(i, pending, key)
            return stream
        raise error

    def abort(self, group_ids: list[str]) -> None:
        """Thread-safe and non-blocking; each id goes to the replica that holds it."""
        for r in self.replicas:
            if mine := [g for g in group_ids if r.owns(g)]:
                r.abort(mine)

    def abort_all(self) -> None:
        for r in self.replicas:
            r.abort_all()

    async def call(self, fn: Callable[[Any], Any], replica: int | None = None) -> Any:
        """fn(engine) on one replica's engine thread, or on each (a list, by replica) when replica is None."""
        if replica is not None:
            return await self.replicas[replica].call(fn)
        return list(await asyncio.gather(*(r.call(fn) for r in self.replicas)))

    def call_sync(self, fn: Callable[[Any], Any], timeout: float = 30.0, replica: int | None = None) -> Any:
        if replica is not None:
            return self.replicas[replica].call_sync(fn, timeout)
        return [r.call_sync(fn, timeout) for r in self.replicas]

    async def shutdown(self, timeout: float = 30.0) -> dict[str, Any] | None:
        await asyncio.gather(*(r.shutdown(timeout) for r in self.replicas))
        sys.setswitchinterval(self._switch_interval)
        return self.final_state


def build_data_parallel(factory: Callable[[], Any], replicas: int,
                        max_waiting_requests: int | None = None) -> DataParallelEngine:
    """Build `replicas` engines one after another, each on a short-lived thread (build_off_main_thread); an
    interrupted or failed start frees the engines already built."""
    engines: list[Any] = []
    try:
        from stateserve.distributed.driver import replica_cpus

        for i in range(replicas):
            with replica_cpus(i, replicas):
                engines.append(build_off_main_thread(factory))
            threads = split_threads(engines[-1], replicas)
            logger.info("data-parallel replica %d/%d ready%s", i, replicas,
                        "" if threads is None else f" ({threads} intra-op thread(s))")
        return DataParallelEngine(engines, max_waiting_requests)
    except BaseException:
        for e in engines:
            e.shutdown()
        raise
