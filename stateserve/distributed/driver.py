"""Rank 0 of tensor parallelism: the engine's runner, which starts the other ranks and leads them.

The engine, scheduler, cache manager and sampler exist once, here. `TensorParallelRunner` is a ModelRunner that
also spawns the worker processes of this host (distributed/worker.py; one per rank, each with its share of the
cores), joins them in a gloo group, and before each forward broadcasts the step (inputs, positions, metadata and
the journal of state-slot writes since the last step), so that every rank runs the same forward on its split of
the weights; the row-parallel products sum over ranks inside it. Rank 0 alone computes logits and samples.

Failure: a dead rank closes its connections, so the next collective raises at once; the runner then names the
rank (and its exit code), stops the others and raises `RankFailedError`, which the engine treats as fatal. Any
other error after a step was sent is fatal too: the ranks could no longer agree on which collective comes next.
A headless node (`--node-rank` > 0) runs only workers: `run_worker_node`."""
from __future__ import annotations

import contextlib
import logging
import multiprocessing
import time
from typing import Any, Iterator

import torch

from stateserve import envs
from stateserve.distributed.group import ParallelGroup, Rendezvous
from stateserve.engine.errors import FatalStepError
from stateserve.distributed.sharding import TensorParallelError
from stateserve.distributed.worker import worker_main
from stateserve.platform import cpu_threads

logger = logging.getLogger("stateserve")
_JOIN_TIMEOUT_S = 10.0  # how long a stopped worker gets to exit before it is killed


class RankFailedError(FatalStepError):
    """A tensor-parallel rank died or the ranks fell out of step; the engine cannot go on."""


def local_ranks(config: Any) -> range:
    """The ranks this node runs (node k: ranks k * N / nnodes ...)."""
    per_node = config.world_size // config.nnodes
    return range(config.node_rank * per_node, (config.node_rank + 1) * per_node)


_replica: tuple[int, int] | None = None  # (index, count) of the data-parallel replica being built in this process


@contextlib.contextmanager
def replica_cpus(index: int, count: int) -> Iterator[None]:
    """While data-parallel replica `index` of `count` is built (one after another, entrypoints/data_parallel.py):
    the ranks it starts share only its slice of this host's CPUs, so replicas of several ranks do not overlap."""
    global _replica
    _replica = (index, count)
    try:
        yield
    finally:
        _replica = None


def _cpu_shares(count: int) -> tuple[int, list[list[int]]]:
    """Threads per rank and each local rank's CPUs when `count` ranks share this host's usable CPUs (a replica's
    slice of them while one is built; at most STATESERVE_NUM_THREADS threads each, when it is set)."""
    cpus = sorted(cpu_threads.usable_cpus())
    if _replica is not None:
        index, replicas = _replica
        per_replica = max(1, len(cpus) // replicas)
        cpus = cpus[index * per_replica:(index + 1) * per_replica] or cpus
    per = max(1, len(cpus) // count)
    threads = min(per, envs.STATESERVE_NUM_THREADS) if envs.STATESERVE_NUM_THREADS > 0 else per
    return threads, [cpus[i * per:(i + 1) * per] or cpus for i in range(count)]


def _rendezvous(config: Any) -> tuple[Rendezvous, Any]:
    """Where the ranks meet, and rank 0's listening store (None on other nodes)."""
    import datetime

    import torch.distributed as dist

    size = config.world_size
    if config.distributed_init_method is None:  # one host: a free port on loopback
        store = dist.TCPStore("127.0.0.1", 0, size, True, datetime.timedelta(seconds=300), wait_for_workers=False)
        return Rendezvous("127.0.0.1", store.port, size, True), store
    rdv = Rendezvous.parse(config.distributed_init_method, size, config.nnodes == 1)
    if rdv.host in ("127.0.0.1", "localhost", "::1"):  # every node on this host (tests, or a trial run)
        rdv = Rendezvous(rdv.host, rdv.port, size, True)
    store = None
    if config.node_rank == 0:
        store = dist.TCPStore(rdv.host, rdv.port, size, True, datetime.timedelta(seconds=300),
                              wait_for_workers=False)
    return rdv, store


def _spawn_workers(config: Any, model_config: Any, rdv: Rendezvous, ranks: range,
                   first_local: int) -> tuple[int, list[tuple[int, Any]]]:
    """Start this node's worker processes (ranks other than 0). Returns (threads per rank, [(rank, process)])."""
    threads, shares = _cpu_shares(len(ranks))
    ctx = multiprocessing.get_context("spawn")  # never fork a process that holds OpenMP and gloo threads
    procs = []
    for rank in ranks:
        if rank == 0:
            continue
        proc = ctx.Process(target=worker_main, name=f"stateserve-tp{rank}", daemon=True,
                           args=(rank, rdv, config, model_config, threads, shares[rank - first_local],
                                 logger.getEffectiveLevel(), envs.frozen_environ()))
        proc.start()
        procs.append((rank, proc))
    return threads, procs


def _await_workers(store: Any, procs: list[tuple[int, Any]], timeout_s: float = 300.0) -> None:
    """Rank 0, before joining the group: wait until every worker this host started has reached the store, and fail
    at once, naming it, when one exits first (joining the group would wait out its whole timeout for it)."""
    from stateserve.distributed.group import joined_key

    deadline = time.monotonic() + timeout_s
    waiting = dict(procs)
    while waiting and time.monotonic() < deadline:  # past the deadline the group's own join reports the timeout
        for rank, proc in list(waiting.items()):
            if store.check([joined_key(rank)]):
                del waiting[rank]
            elif not proc.is_alive():
                raise RankFailedError(
                    f"rank {rank} exited (code {proc.exitcode}) before it joined the group; its error is above. A "
                    "script that starts tensor- or pipeline-parallel ranks must guard its top level with `if __name__ "
                    "== \"__main__\":`: each rank is a spawned process, which imports the script again")
        time.sleep(0.05)


def _stop(procs: list[tuple[int, Any]]) -> None:
    deadline = time.monotonic() + _JOIN_TIMEOUT_S
    for _, proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for _, proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(_JOIN_TIMEOUT_S)


def run_worker_node(config: Any) -> int:
    """`stateserve serve|generate --node-rank K` (K > 0): run this node's ranks until rank 0 stops them."""
    from stateserve.models.folder import build_model_config

    model_config = build_model_config(config, torch.device("cpu"))
    ranks = local_ranks(config)
    rdv, _ = _rendezvous(config)
    logger.info("node %d of %d: running tensor-parallel ranks %d-%d for %s (rendezvous %s:%d)", config.node_rank,
                config.nnodes, ranks.start, ranks.stop - 1, config.model, rdv.host, rdv.port)
    _, procs = _spawn_workers(config, model_config, rdv, ranks, ranks.start)
    for _, proc in procs:
        proc.join()
    failed = [(rank, proc.exitcode) for rank, proc in procs if proc.exitcode]
    for rank, code in failed:
        logger.error("tensor-parallel rank %d exited with code %s", rank, code)
    return 1 if failed else 0


def make_runner(config: Any, model_config: Any, device: torch.device) -> Any:
    """Rank 0's runner for tensor_parallel_size > 1 (class built here so the runner module is imported lazily)."""
    from stateserve.runner.model_runner import ModelRunner

    class TensorParallelRunner(ModelRunner):
        def __init__(self) -> None:
            ranks = local_ranks(config)
            rdv, store = _rendezvous(config)
            threads, self._procs = _spawn_workers(config, model_config, rdv, ranks, 0)
            self._journal: list | None = None
            self._failure: str | None = None
            self._loaded = False  # the workers reach their message loop only past load_model's collectives
            try:
                if store is not None:
                    _await_workers(store, self._procs)
                group = ParallelGroup.connect(rdv, 0, store)
            except BaseException:
                _stop(self._procs)
                raise
            super().__init__(config, model_config, device, group=group, max_threads=threads)
            tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
            kind = "Tensor x pipeline" if tp > 1 and pp > 1 else "Pipeline" if pp > 1 else "Tensor"
            logger.info("%s parallelism: %d ranks%s (gloo over %s), %d thread(s) per rank on this host", kind,
                        group.size, f" ({pp} stages of {tp} tensor-parallel ranks)" if tp > 1 and pp > 1 else "",
                        "loopback" if rdv.single_host else f"{rdv.host}:{rdv.port}", threads)

        def load_model(self, show_progress: bool = True) -> None:
            self._guard(lambda: super(TensorParallelRunner, self).load_model(show_progress))
            self._loaded = True

        def cache_budget_bytes(self) -> int:
            """The ranks of this host share its memory: each plans with its part of the default budget. A plan is
            for every layer, and pipeline stages split it by layers: so the budget is shared only by the tensor-
            parallel ranks of a stage (their heads' shares of each layer)."""
            budget = super().cache_budget_bytes()
            if self.engine_config.kv_cache_memory_bytes is not None:
                return budget  # given per rank (as vLLM's is per device)
            sharing = len(local_ranks(self.engine_config)) // self.engine_config.pipeline_parallel_size
            return budget // max(1, sharing)

        def initialize_caches(self, reserved_bytes: int = 0) -> Any:
            manager = super().initialize_caches(reserved_bytes)
            self._guard(lambda: self.group.send_object(("caches", self.caches.plan)))
            self._journal = self.caches.storage.journal = []
            return manager

        def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> torch.Tensor:
            if self._failure is not None:
                raise RankFailedError(self._failure)
            journal = self._journal[:]
            self._journal.clear()
            return self._guard(lambda: self._step(input_ids, positions, meta, journal), any_error=True)

        def logits_of(self, hidden: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
            """With the vocabulary split, every rank of the first stage computes its share of these rows' logits
            (later stages ignore the message); rank 0 gathers."""
            if not self.vocab_split:
                return super().logits_of(hidden, rows)
            return self._guard(lambda: self._gathered_logits(hidden, rows), any_error=True)

        def _gathered_logits(self, hidden: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
            self.group.send_object(("logits", rows))
            local = super(TensorParallelRunner, self).logits_of(hidden, rows)  # [n, padded vocab / N]
            return torch.cat(self.tensor_group.all_gather(local), dim=-1)[:, :self.model_config.vocab_size]

        def _step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any, journal: list) -> torch.Tensor:
            self.group.send_object(("step", journal, input_ids, positions, meta))
            return super(TensorParallelRunner, self).run_model(input_ids, positions, meta)

        def _guard(self, fn: Any, any_error: bool = False) -> Any:
            """Run fn; when a rank died (or, with any_error, on any error once the ranks may be out of step),
            stop the group and raise RankFailedError naming the rank."""
            try:
                return fn()
            except TensorParallelError:  # a size that does not split: every rank refuses the model alike
                self._fail("the model cannot be split", quiet=True)
                raise
            except Exception as e:
                dead = self._dead_ranks()
                if not dead and not any_error:
                    raise
                reason = (f"tensor-parallel rank(s) {', '.join(dead)} died" if dead else
                          f"a tensor-parallel step failed on rank 0 after it was sent to the other ranks, which can "
                          f"no longer follow ({type(e).__name__}: {e})")
                self._fail(reason)
                raise RankFailedError(reason) from e

        def _dead_ranks(self) -> list[str]:
            for _, proc in self._procs:  # a killed peer's exit status may land just after its sockets close
                if proc.is_alive():
                    proc.join(0.5)
            return [f"{rank} (exit code {proc.exitcode})" for rank, proc in self._procs if proc.exitcode is not None]

        def _fail(self, reason: str, quiet: bool = False) -> None:
            self._failure = reason
            if not quiet:
                logger.error("%s; stopping the other ranks", reason)
            for _, proc in self._procs:
                if proc.is_alive():
                    proc.kill()
            _stop(self._procs)

        def shutdown(self) -> None:
            if self.group is not None and self._failure is None and self.group.is_open and self._loaded:
                try:
                    self.group.send_object(("stop",))
                except Exception as e:  # a rank already gone: the others are killed below
                    logger.warning("tensor-parallel stop message failed: %s", e)
            elif not self._loaded:  # the engine stopped before rank 0 loaded: the workers wait in a load collective
                for _, proc in self._procs:
                    if proc.is_alive():
                        proc.kill()
            _stop(self._procs)
            if self.group is not None:
                self.group.close()
            super().shutdown()

    return TensorParallelRunner()
