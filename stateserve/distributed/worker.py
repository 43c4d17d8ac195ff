"""A tensor-parallel worker: ranks 1..N-1, each a process with its split of the model and its own caches.

A worker does what rank 0's runner does to the weights and caches, and nothing of the engine: it loads and splits
the model (the dummy forward that measures activations runs on every rank together, since its all-reduces need
them all), builds cache storage to rank 0's plan (same block and slot ids, this rank's shapes), then serves rank
0's messages until told to stop:
    ("caches", plan)                      build and bind the storage
    ("step", journal, ids, positions, meta) replay rank 0's slot writes since the last step, run the forward
    ("logits", rows)                      this rank's share of the logits of the last step's rows (rank 0 gathers;
                                          with pipeline stages, only the first stage's ranks take part)
    ("stop",)                             release everything and return
Rank 0 decides every block, slot and snapshot; the journal (cache/storage.py) carries the state-slot writes it made
outside a forward (a fresh slot zeroed, a snapshot restored or taken, ...), so every rank's slots hold the same
sequences' states. Rank 0 samples; with a split vocabulary the workers add their share of the logits."""
from __future__ import annotations

import logging
import os
import sys
from typing import Any

import torch

from stateserve import envs
from stateserve.cache.storage import CacheStorage
from stateserve.distributed.group import ParallelGroup, Rendezvous
from stateserve.distributed.pipeline import stage_of

logger = logging.getLogger("stateserve")


def _setup_process(rank: int, threads: int, cpus: list[int] | None, log_level: int) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(levelname)s %(asctime)s [rank {rank}] %(message)s", "%m-%d %H:%M:%S"))
    logger.handlers[:] = [handler]
    logger.setLevel(log_level)
    logger.propagate = False
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except (AttributeError, OSError):
            pass
    torch.set_num_threads(threads)


def bind_storage(runner: Any, plan: Any) -> CacheStorage:
    """Cache tensors of this rank's layers, to rank 0's plan, bound to the layers."""
    kv_specs, state_specs = runner.cache_specs()
    storage = CacheStorage(kv_specs, state_specs, plan, runner.engine_config.block_size, runner.device)
    modules = dict(runner.model.named_modules())
    for name, (k, v) in storage.kv.items():
        modules[name].bind_cache(k, v)
    for name, states in storage.states.items():
        modules[name].bind_cache(states)
    return storage


def serve(runner: Any, group: ParallelGroup) -> None:
    """Follow rank 0's messages until ("stop",)."""
    storage: CacheStorage | None = None
    hidden = None  # the last step's output: a split vocabulary's logits are taken from it
    with torch.inference_mode():
        while True:
            message = group.recv_object()
            kind = message[0]
            if kind == "stop":
                return
            if kind == "caches":
                storage = bind_storage(runner, message[1])
            elif kind == "step":
                _, journal, input_ids, positions, meta = message
                if storage is not None:
                    storage.replay(journal)
                runner.poll_threads()
                hidden = runner.model(input_ids, positions, meta)
            elif kind == "logits":
                if stage_of(group.rank, runner.tensor_group.size) == 0:  # the first stage's head feeds rank 0
                    runner.tensor_group.all_gather(runner.logits_of(hidden, message[1]).contiguous())
            else:
                raise RuntimeError(f"unknown message from rank 0: {kind!r}")


def worker_main(rank: int, rendezvous: Rendezvous, engine_config: Any, model_config: Any, threads: int,
                cpus: list[int] | None, log_level: int, environ: dict[str, str | None] | None = None) -> None:
    """A worker process's whole life (the target of distributed/driver.py's spawn, or of a headless node).
    environ: the STATESERVE_* settings rank 0 runs with (envs.frozen_environ()); None keeps this process's own (a
    headless node's)."""
    from stateserve.runner.model_runner import ModelRunner

    if environ is not None:
        envs.apply_environ(environ)
    _setup_process(rank, threads, cpus, log_level)
    group = ParallelGroup.connect(rendezvous, rank)
    runner = ModelRunner(engine_config, model_config, torch.device("cpu"), group=group, max_threads=threads)
    try:
        runner.load_model(show_progress=False)
        serve(runner, group)
    except Exception as e:
        # rank 0 sees the closed connection and names this rank; say why here, where the cause is known
        logger.error("tensor-parallel rank %d stops: %s: %s", rank, type(e).__name__, e)
        sys.stderr.flush()
        os._exit(1)
    finally:
        runner.shutdown()
    group.close()
