"""Which model runner an engine gets, and the config it runs with: one process (`ModelRunner`), rank 0 of tensor or
pipeline parallelism (`distributed/driver.py`, which spawns the other ranks' worker processes) or the full-recompute
oracle (`ReferenceRunner`, STATESERVE_RUNNER=reference).

The engine owns what `build_runner` returns: it must call the runner's `shutdown()` if its own construction fails
afterwards, or a parallel runner's worker processes outlive it."""
from __future__ import annotations

import dataclasses

import torch

from stateserve import envs
from stateserve.config import EngineConfig, ModelConfig
from stateserve.engine import fault_inject
from stateserve.runner.model_runner import ModelRunner


def uses_reference_runner() -> bool:
    """Whether STATESERVE_RUNNER asks for the reference runner; ValueError for a value that names no runner."""
    if envs.STATESERVE_RUNNER not in ("default", "reference"):
        raise ValueError(f"STATESERVE_RUNNER must be default or reference, got {envs.STATESERVE_RUNNER!r}")
    return envs.STATESERVE_RUNNER == "reference"


def runner_config(config: EngineConfig, reference: bool) -> EngineConfig:
    """`config` as the runner (and so the engine, which keeps this one) must run it; ValueError where this process
    cannot run an engine with it."""
    if reference:  # one request at a time, full recompute, no cache reuse
        config = dataclasses.replace(config, max_num_seqs=1, enable_prefix_caching=False)
    if fault_inject.requested() and not config.enforce_eager:  # a CUDA graph replay runs no Python hook
        config = dataclasses.replace(config, enforce_eager=True)
    if config.node_rank > 0:
        raise ValueError(f"node_rank={config.node_rank} runs only tensor-parallel workers, no engine: start it with "
                         "`stateserve serve|generate --node-rank N ...` (node 0 runs the engine)")
    if config.world_size > 1 and reference:
        raise ValueError("STATESERVE_RUNNER=reference runs on one rank: tensor_parallel_size and "
                         "pipeline_parallel_size must be 1")
    return config


def build_runner(config: EngineConfig, model_config: ModelConfig, device: torch.device, reference: bool) -> ModelRunner:
    """The runner for `config` (as `runner_config` returned it), constructed but with no model loaded yet."""
    if config.world_size > 1:  # imported lazily: the driver is only needed with several ranks
        from stateserve.distributed.driver import make_runner

        return make_runner(config, model_config, device)
    if reference:
        from stateserve.runner.reference_runner import ReferenceRunner

        return ReferenceRunner(config, model_config, device)
    return ModelRunner(config, model_config, device)
