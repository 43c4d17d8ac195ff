"""ModelRunner: the part every model shares. It loads the model, asks the model state which caches
the model kind uses, allocates them from the layers' specs, binds views, and runs one step at a time."""
from __future__ import annotations

import gc
import logging
import time

import torch

from stateserve import envs
from stateserve.cache.block_pool import BlockPool, SlotPool
from stateserve.cache.spec import KVCacheSpec, StateSpec
from stateserve.cache.storage import CachePlan, CacheStorage, plan_caches
from stateserve.config import EngineConfig, ModelConfig
from stateserve.engine.scheduler import SchedulerOutput
from stateserve.layers.attention import Attention
from stateserve.layers.linear import install_fast_linear
from stateserve.layers.recurrent import StatefulLayer
from stateserve.model_states import init_model_state
from stateserve.models.loader import init_dummy_weights, iterate_safetensors, load_weights
from stateserve.models.registry import ModelRegistry
from stateserve.runner.input_batch import InputBatch, build_input_batch
from stateserve.runner.sampler import SampleResult, Sampler

logger = logging.getLogger("stateserve")
GiB = 1 << 30


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: do not cap


class ModelRunner:
    def __init__(self, engine_config: EngineConfig, model_config: ModelConfig, device: torch.device) -> None:
        self.engine_config, self.model_config, self.device = engine_config, model_config, device
        self.model = None
        self.model_state = None
        self.storage: CacheStorage | None = None
        self.block_pool: BlockPool | None = None
        self.slot_pool: SlotPool | None = None
        self.snapshot_pool: SlotPool | None = None  # slots past the running ones hold prefix snapshots
        self.sampler = Sampler(engine_config.seed, device)
        self.graph_manager = None  # CUDA graphs (see issue on lifecycle); released first at shutdown

    # ---- loading -------------------------------------------------------------------------------
    def load_model(self, show_progress: bool = True) -> None:
        start = time.perf_counter()
        before = self._allocated_bytes()
        cls = ModelRegistry.resolve(self.model_config.architecture)
        torch.manual_seed(self.engine_config.seed)
        with torch.device(self.device):
            model = cls(self.model_config.hf_config, self.model_config.dtype)
        model = model.to(dtype=self.model_config.dtype)
        fmt = self.engine_config.load_format
        if fmt == "dummy":
            init_dummy_weights(model, self.engine_config.seed)
        else:
            load_weights(model, iterate_safetensors(self.model_config.path, show_progress))
        self.model = model.eval().requires_grad_(False)
        install_fast_linear(self.model, self.model_config.dtype, self.device)
        used = self._allocated_bytes() - before
        if self.device.type == "cpu":
            used = sum(p.numel() * p.element_size() for p in model.parameters())
        logger.info("Model loading took %.4f GiB memory and %.2f seconds", used / GiB, time.perf_counter() - start)
        self.model_state = init_model_state(self.model, self.model_config, self.engine_config, self.device)

    def _allocated_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    # ---- caches --------------------------------------------------------------------------------
    def cache_specs(self) -> tuple[dict[str, KVCacheSpec], dict[str, StateSpec]]:
        kv, state = {}, {}
        for name, m in self.model.named_modules():
            if isinstance(m, Attention) and self.model_state.uses_kv_cache:
                spec = m.cache_spec()
                if spec is not None:
                    kv[name] = spec
            elif isinstance(m, StatefulLayer) and self.model_state.uses_state_cache:
                state[name] = m.cache_spec()
        return kv, state

    def cache_budget_bytes(self) -> int:
        if self.engine_config.kv_cache_memory_bytes is not None:
            return self.engine_config.kv_cache_memory_bytes
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            # headroom for activations of one max_num_batched_tokens step
            activation_bytes = self.engine_config.max_num_batched_tokens * self.model_config.vocab_size * 4 * 2
            return int(total * self.engine_config.gpu_memory_utilization - used - activation_bytes)
        # CPU: the configured space, but never more than 40% of the memory still available
        return int(min(envs.STATESERVE_CPU_KV_CACHE_SPACE * GiB, 0.4 * _available_host_memory()))

    def initialize_caches(self, max_num_seqs: int, num_extra_slots: int = 0) -> CachePlan:
        kv_specs, state_specs = self.cache_specs()
        budget = self.cache_budget_bytes()
        plan = plan_caches(kv_specs, state_specs, budget_bytes=budget, block_size=self.engine_config.block_size,
                           max_num_seqs=max_num_seqs, max_model_len=self.model_config.max_model_len,
                           num_extra_slots=num_extra_slots)
        logger.info("Available KV cache memory: %.4f GiB; %d KV blocks of %d tokens (%.4f GiB), %d state slots "
                    "(%.4f GiB)", budget / GiB, plan.num_blocks, self.engine_config.block_size,
                    plan.kv_bytes / GiB, plan.num_slots, plan.state_bytes / GiB)
        self.storage = CacheStorage(kv_specs, state_specs, plan, self.engine_config.block_size, self.device)
        modules = dict(self.model.named_modules())
        for name, (k, v) in self.storage.kv.items():
            modules[name].bind_cache(k, v)
        for name, states in self.storage.states.items():
            modules[name].bind_cache(states)
        self.block_pool = BlockPool(plan.num_blocks) if kv_specs else None
        if state_specs:
            self.slot_pool = SlotPool(plan.max_num_seqs, self.storage.zero_slot)
            num_snapshot_slots = plan.num_slots - plan.max_num_seqs
            if num_snapshot_slots > 0:
                self.snapshot_pool = SlotPool(num_snapshot_slots, self.storage.zero_slot, first=plan.max_num_seqs)
        return plan

    # ---- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[InputBatch, SampleResult | None]:
        if self.model is None:
            raise RuntimeError("the model runner has been shut down")
        batch = build_input_batch(sched, self.device)
        meta = self.model_state.prepare_meta(batch)
        hidden = self.model(batch.input_ids, batch.positions, meta)  # [T, hidden]
        self.model_state.after_step(batch)
        if not batch.sample_indices:
            return batch, None
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # [n, vocab]
        return batch, self.sampler(logits, [batch.requests[i] for i in batch.sample_indices])

    # ---- lifecycle -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Release in dependency order: graphs, caches, model state, weights; then collect. Idempotent."""
        if self.device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize(self.device)
        self.graph_manager = None
        if self.model is not None:
            self.model.release_caches()
        if self.storage is not None:
            self.storage.release()
        self.storage = self.block_pool = self.slot_pool = self.snapshot_pool = None
        if self.model_state is not None:
            self.model_state.release()
        self.model_state = None
        self.model = None
        gc.collect()
        if self.device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.empty_cache()
