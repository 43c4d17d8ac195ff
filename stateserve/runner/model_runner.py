"""ModelRunner: the part every model shares. It loads the model, measures one step's activation memory with a
dummy forward, asks the model state which caches the model kind uses, allocates them from the layers' specs and
what memory is left, binds views, captures decode graphs on CUDA (runner/cuda_graphs.py), and runs steps."""
from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import time

import torch

from stateserve import envs
from stateserve.cache.block_pool import BlockPool, SlotPool
from stateserve.cache import huge_pages
from stateserve.cache.spec import KVCacheSpec, StateSpec
from stateserve.cache.storage import CachePlan, CacheStorage, plan_caches
from stateserve.config import EngineConfig, ModelConfig
from stateserve.engine.scheduler import SchedulerOutput
from stateserve.layers.attention import Attention
from stateserve.layers.metadata import AttnMetadata, ForwardMeta, StateMetadata
from stateserve.layers.linear import FastLinear, install_fast_linear, prepack_fast_linear
from stateserve.layers.recurrent import StatefulLayer
from stateserve.model_states import init_model_state
from stateserve.models.loader import init_dummy_weights, iterate_safetensors, load_weights
from stateserve.models.registry import ModelRegistry
from stateserve.runner import cpu_threads, cuda_graphs, host_allocator
from stateserve.runner.peak_rss import PeakRssSampler
from stateserve.runner.input_batch import InputBatch, build_input_batch
from stateserve.runner.sampler import SampleResult, Sampler

logger = logging.getLogger("stateserve")
GiB = 1 << 30
CPU_CACHE_SHARE = 0.4  # on CPU the cache takes at most this share of the memory left after activations
# The CPU profile runs at most this many tokens and scales the peak linearly to max_num_batched_tokens (a full
# 2048-token forward costs more than engine start itself); its result is kept per process and model config.
CPU_PROFILE_MAX_TOKENS = 256
_cpu_profiles: dict[tuple, int] = {}


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
        self.graph_manager: cuda_graphs.DecodeGraphManager | None = None  # released first at shutdown
        self.activation_bytes = 0  # peak activation memory of one max_num_batched_tokens step
        self.activation_source = "none"  # measured | estimated | skipped reason, for logs and tests
        self.threads = cpu_threads.governor() if device.type == "cpu" else None  # team size per step

    # ---- loading -------------------------------------------------------------------------------
    def load_model(self, show_progress: bool = True) -> None:
        start = time.perf_counter()
        self.poll_threads()
        if self.device.type == "cpu":
            host_allocator.tune()
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
        self._apply_ssm_state_dtype()
        if self.device.type == "cpu":
            huge_pages.move_parameters(self.model)
            self.poll_threads()
            self._prepack_linears()
        used = self._allocated_bytes() - before
        if self.device.type == "cpu":
            used = sum(p.numel() * p.element_size() for p in model.parameters())
        logger.info("Model loading took %.4f GiB memory and %.2f seconds", used / GiB, time.perf_counter() - start)
        self.model_state = init_model_state(self.model, self.model_config, self.engine_config, self.device)
        self.poll_threads()
        self.profile_activations()

    def poll_threads(self) -> None:
        """Fit the intra-op team to the cores other processes leave free (CPU; runner/cpu_threads.py)."""
        if self.threads is not None:
            self.threads.poll()

    def _prepack_linears(self) -> None:
        """A second copy of the linear weights in the panel kernel's layout (batched decode 15-75% faster than
        oneDNN at 3-64 rows), unless switched off or the copy would take over a quarter of free memory."""
        if not envs.STATESERVE_PACK_LINEARS:
            return
        linear_bytes = sum(m.weight.numel() * m.weight.element_size() for m in self.model.modules()
                           if isinstance(m, FastLinear))
        if linear_bytes > _available_host_memory() // 4:
            logger.info("Linear weight packing skipped: the copy (%.2f GiB) would take over a quarter of free memory",
                        linear_bytes / GiB)
            return
        added = prepack_fast_linear(self.model)
        if added:
            logger.info("Linear weight packing: %.2f GiB of linear weights copied into 48-column panels", added / GiB)

    def _apply_ssm_state_dtype(self) -> None:
        """mamba_ssm_cache_dtype: a named dtype is kept by each recurrent layer or refused (ValueError); auto is the
        model dtype wherever a layer can keep it (Mamba2-style mixers), float32 elsewhere (Mamba1, gated delta
        net), as vLLM's auto and transformers' caches keep the model dtype."""
        choice = self.engine_config.mamba_ssm_cache_dtype
        dtype = self.model_config.dtype if choice == "auto" else getattr(torch, choice)
        if dtype == torch.float32:
            return
        for m in self.model.modules():
            if isinstance(m, StatefulLayer) and (choice != "auto" or dtype in m.ssm_state_dtypes):
                m.set_ssm_state_dtype(dtype)

    def _allocated_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    # ---- activation profile --------------------------------------------------------------------
    def _dummy_seq_len(self) -> int | None:
        """Longest dummy sequence this model kind can run before caches exist; None: no dummy forward."""
        from stateserve.model_states.default import DefaultModelState
        from stateserve.model_states.encoder_only import EncoderOnlyModelState
        from stateserve.model_states.mamba_hybrid import MambaHybridModelState

        kind = type(self.model_state)
        if kind is EncoderOnlyModelState:
            limit = getattr(type(self.model), "max_encoder_len", None)
            return limit(self.model_config.hf_config) if limit else self.model_config.max_model_len
        if kind in (DefaultModelState, MambaHybridModelState):
            return self.model_config.max_model_len
        # Encoder-decoder models (and model states of their own) are skipped: a decoder step needs the cross
        # K/V that only the model state builds from a real encoder input; they get the logits-based estimate.
        return None

    def _dummy_forward(self, num_tokens: int, seq_len: int) -> None:
        """A prefill of `num_tokens` tokens (sequences of at most `seq_len`) with nothing cached. Recurrent layers
        get a temporary state of one slot per sequence, dropped afterwards; attention runs without KV, so no
        cache a request could ever read is written (the real caches do not exist yet)."""
        lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
        starts = [0, *itertools.accumulate(lens)]
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        recurrent = [m for m in self.model.modules() if isinstance(m, StatefulLayer)]
        causal = self.model_state.supports_generate
        attn = AttnMetadata(query_start_loc=starts, query_lens=lens, context_lens=[0] * len(lens), seq_lens=lens,
                            is_decode_only=False, causal=causal, prefill_seqs=list(range(len(lens))))
        state = None
        if recurrent:
            state = StateMetadata(query_start_loc=starts, query_lens=lens, has_initial_state=[False] * len(lens),
                                  slots=torch.arange(len(lens), device=self.device), is_decode_only=False)
        try:
            for m in recurrent:
                spec = m.cache_spec()
                dtypes = dict(spec.dtypes)
                m.bind_cache({k: torch.zeros(len(lens), *s, dtype=dtypes[k], device=self.device)
                              for k, s in spec.shapes})
            hidden = self.model(ids, positions, ForwardMeta(num_tokens, attn=attn, state=state))  # [T, hidden]
            if causal:  # the sampled rows' logits and the sampler's sort of them
                rows = hidden[-min(num_tokens, self.engine_config.max_num_seqs):]
                self.model.compute_logits(rows).float().softmax(-1).sort(dim=-1)
        finally:
            for m in recurrent:
                m.bind_cache(None)

    def profile_activations(self) -> None:
        """Peak activation memory of a max_num_batched_tokens step, measured with a dummy forward: on CUDA the
        growth of torch.cuda.max_memory_allocated; on CPU the peak growth of resident memory (sampled)."""
        total = self.engine_config.max_num_batched_tokens
        estimate = total * self.model_config.vocab_size * 4 * 2  # a fallback: float32 logits, twice
        seq_len = self._dummy_seq_len()
        if seq_len is None:
            self.activation_bytes, self.activation_source = estimate, "estimated (no dummy forward for this kind)"
            return
        num_tokens = total if self.device.type == "cuda" else min(total, CPU_PROFILE_MAX_TOKENS)
        seq_len = max(1, min(seq_len, num_tokens))
        key = (self.model_config.architecture, self.model_config.hf_config.to_json_string(),
               self.model_config.dtype, num_tokens, seq_len, self.engine_config.max_num_seqs)
        try:
            with torch.inference_mode():
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                    torch.cuda.reset_peak_memory_stats(self.device)
                    before = torch.cuda.memory_allocated(self.device)
                    self._dummy_forward(num_tokens, seq_len)
                    torch.cuda.synchronize(self.device)
                    peak = torch.cuda.max_memory_allocated(self.device) - before
                elif key in _cpu_profiles:
                    peak = _cpu_profiles[key]
                else:
                    host_allocator.release_free_memory()  # so the forward cannot reuse memory RSS already counts
                    with PeakRssSampler() as sampler:
                        self._dummy_forward(num_tokens, seq_len)
                    peak = _cpu_profiles[key] = sampler.growth
        except Exception as e:  # a model the dummy inputs do not suit must still start
            logger.warning("activation profiling failed (%s: %s); using an estimate", type(e).__name__, e)
            self.activation_bytes, self.activation_source = estimate, "estimated (dummy forward failed)"
            return
        self.activation_bytes = int(peak * total / num_tokens)
        self.activation_source = "measured"
        logger.info("Activation memory: %.4f GiB peak for %d tokens (dummy forward of %d tokens, %s)",
                    self.activation_bytes / GiB, total, num_tokens,
                    "max_memory_allocated" if self.device.type == "cuda" else "sampled resident memory")

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
        """kv_cache_memory_bytes if given; else what is left of the device budget after weights and activations."""
        if self.engine_config.kv_cache_memory_bytes is not None:
            return self.engine_config.kv_cache_memory_bytes
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            # total - free: weights, the CUDA context and anything else on the device
            return int(total * self.engine_config.gpu_memory_utilization - (total - free) - self.activation_bytes)
        # CPU: the configured space, but at most a share of the memory left after this step's activations
        room = _available_host_memory() - self.activation_bytes
        return int(min(envs.STATESERVE_CPU_KV_CACHE_SPACE * GiB, CPU_CACHE_SHARE * max(room, 0)))

    def _graph_backend(self) -> cuda_graphs.GraphBackend | None:
        if self.engine_config.enforce_eager or type(self).execute is not ModelRunner.execute:
            return None  # a runner with a step of its own (the reference runner) stays eager
        backend = cuda_graphs.make_graph_backend(self.device)
        reason = cuda_graphs.unsupported_reason(self.model, self.model_state) if backend is not None else None
        if reason is not None:
            logger.info("CUDA graphs off: %s", reason)
            return None
        return backend

    @staticmethod
    def _reserve_scratch(plan: CachePlan, has_kv: bool, has_state: bool
                         ) -> tuple[CachePlan, int | None, int | None] | None:
        """Take the last KV block and the last state slot for graph padding rows; None when the plan is too small."""
        scratch_block = scratch_slot = None
        if has_state:
            if plan.num_slots <= plan.max_num_seqs:  # no slot past the running ones: give up one running slot
                if plan.max_num_seqs == 1:
                    return None
                plan = dataclasses.replace(plan, max_num_seqs=plan.max_num_seqs - 1)
            scratch_slot = plan.num_slots - 1
        if has_kv:
            if plan.num_blocks < 2:
                return None
            scratch_block = plan.num_blocks - 1
            plan = dataclasses.replace(plan, max_num_seqs=min(plan.max_num_seqs, plan.num_blocks - 1))
        return plan, scratch_block, scratch_slot

    def initialize_caches(self, max_num_seqs: int, num_extra_slots: int = 0) -> CachePlan:
        kv_specs, state_specs = self.cache_specs()
        budget = self.cache_budget_bytes()
        backend = self._graph_backend()
        plan = plan_caches(kv_specs, state_specs, budget_bytes=budget, block_size=self.engine_config.block_size,
                           max_num_seqs=max_num_seqs, max_model_len=self.model_config.max_model_len,
                           num_extra_slots=num_extra_slots + (1 if backend is not None and state_specs else 0))
        scratch_block = scratch_slot = None
        if backend is not None:
            reserved = self._reserve_scratch(plan, bool(kv_specs), bool(state_specs))
            if reserved is None:
                logger.warning("CUDA graphs off: the cache is too small to spare a scratch block and state slot")
                backend = None
            else:
                plan, scratch_block, scratch_slot = reserved
        logger.info("Available KV cache memory: %.4f GiB; %d KV blocks of %d tokens (%.4f GiB), %d state slots "
                    "(%.4f GiB)", budget / GiB, plan.num_blocks, self.engine_config.block_size,
                    plan.kv_bytes / GiB, plan.num_slots, plan.state_bytes / GiB)
        self.storage = CacheStorage(kv_specs, state_specs, plan, self.engine_config.block_size, self.device)
        modules = dict(self.model.named_modules())
        for name, (k, v) in self.storage.kv.items():
            modules[name].bind_cache(k, v)
        for name, states in self.storage.states.items():
            modules[name].bind_cache(states)
        if kv_specs:
            self.block_pool = BlockPool(plan.num_blocks - (scratch_block is not None))
        if state_specs:
            self.slot_pool = SlotPool(plan.max_num_seqs, self.storage.zero_slot)
            num_snapshot_slots = plan.num_slots - plan.max_num_seqs - (scratch_slot is not None)
            if num_snapshot_slots > 0:
                self.snapshot_pool = SlotPool(num_snapshot_slots, self.storage.zero_slot, first=plan.max_num_seqs)
        if backend is not None:
            self._capture_graphs(backend, plan, scratch_block, scratch_slot)
        return plan

    def _capture_graphs(self, backend: cuda_graphs.GraphBackend, plan: CachePlan, scratch_block: int | None,
                        scratch_slot: int | None) -> None:
        manager = cuda_graphs.DecodeGraphManager(
            self.model, backend, uses_kv_cache=self.block_pool is not None, uses_state_cache=self.slot_pool is not None,
            max_num_seqs=plan.max_num_seqs, max_model_len=self.model_config.max_model_len,
            block_size=self.engine_config.block_size, scratch_block=scratch_block, scratch_slot=scratch_slot,
            device=self.device)
        try:
            with torch.inference_mode():
                manager.capture_all()
        except Exception as e:  # e.g. a layer that syncs with the host (MoE group sizes): stay eager
            logger.warning("CUDA graph capture failed, decode steps run eagerly: %s: %s", type(e).__name__, e)
            manager.release()
            return
        self.graph_manager = manager

    # ---- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[InputBatch, SampleResult | None]:
        if self.model is None:
            raise RuntimeError("the model runner has been shut down")
        self.poll_threads()
        batch = build_input_batch(sched, self.device)
        meta = self.model_state.prepare_meta(batch)
        logits = self.forward_logits(batch, meta)  # [len(sample_indices), vocab] or None
        result = None if logits is None else self.sampler(logits, [batch.requests[i] for i in batch.sample_indices])
        self.model_state.after_step(batch)  # last: a step that raises anywhere publishes nothing
        return batch, result

    def forward_logits(self, batch: InputBatch, meta: ForwardMeta) -> torch.Tensor | None:
        """The forward of one step (a graph replay when it qualifies) -> logits of the sampled rows, or None."""
        if self.graph_manager is not None and self.graph_manager.can_run(batch, meta):
            padded = self.graph_manager.run(batch, meta)  # [padded size, vocab]; row i is sequence i
            return padded[batch.logits_indices] if batch.sample_indices else None
        hidden = self.model(batch.input_ids, batch.positions, meta)  # [T, hidden]
        if not batch.sample_indices:
            return None
        return self.model.compute_logits(hidden[batch.logits_indices])  # [n, vocab]

    # ---- lifecycle -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Release in dependency order: graphs, caches, model state, weights; then collect. Idempotent."""
        if self.device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize(self.device)
        if self.graph_manager is not None:  # graphs first: they hold pool memory and views of the caches
            self.graph_manager.release()
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
        host_allocator.release_free_memory()
