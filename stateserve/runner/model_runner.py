"""ModelRunner: the part every model shares. It loads the model, measures one step's activation memory with a
dummy forward, has cache/ build the caches the model state asks for from the layers' specs and what memory is left,
binds their views to the layers, captures decode graphs on CUDA (runner/cuda_graphs.py), and runs steps.

It is the model state's only caller: the engine reaches the model kind through the runner's request and prompt
methods (update_requests, remove_request, chunk_size, parse_prompt, prepare_inputs)."""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from stateserve import envs
from stateserve.cache.builder import CacheRequest, Caches, build_caches
from stateserve.cache.manager import CacheManager
from stateserve.cache.spec import KVCacheSpec, StateSpec
from stateserve.config import EngineConfig, ModelConfig
from stateserve.core.batch import InputBatch, SchedulerOutput, build_input_batch
from stateserve.core.request import Request
from stateserve.distributed.group import ParallelGroup
from stateserve.distributed.pipeline import split_pipeline, tensor_group_of
from stateserve.layers.attention import Attention
from stateserve.layers.metadata import ForwardMeta
from stateserve.model_states.interface import PoolingSpec
from stateserve.layers.linear import FastLinear, install_fast_linear, make_batch_invariant, prepack_fast_linear
from stateserve.layers.recurrent import StatefulLayer
from stateserve.model_states import init_model_state
from stateserve.platform import cpu_threads, host_allocator, huge_pages
from stateserve.runner import activation_profile, cuda_graphs
from stateserve.runner.model_loading import build_and_load
from stateserve.runner.sampler import SampleResult, Sampler, prompt_logprobs
from stateserve.runner import spec_verify

logger = logging.getLogger("stateserve")
GiB = 1 << 30
CPU_CACHE_SHARE = 0.4  # on CPU the cache takes at most this share of the memory left after activations


@dataclass
class PoolingResult:
    vectors: torch.Tensor  # [S, D] float32 on the CPU: one per sequence of the step, in the batch's order


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
    def __init__(self, engine_config: EngineConfig, model_config: ModelConfig, device: torch.device,
                 spare_slots_per_seq: int | None = None, group: ParallelGroup | None = None,
                 max_threads: int | None = None) -> None:
        """group: all ranks of this engine (distributed/), each holding a split of the model or a pipeline stage of
        it; max_threads: this runner's own thread budget (a rank's share of the host) instead of the process's."""
        self.engine_config, self.model_config, self.device = engine_config, model_config, device
        self.group = group if group is not None and group.size > 1 else None
        # the ranks this one splits its layers with: its pipeline stage's (the whole group without stages)
        self.tensor_group = tensor_group_of(self.group, engine_config)
        self._plan_specs: tuple[dict, dict] | None = None  # pipeline stages: all layers' specs (cache_specs: own)
        self.vocab_split = False  # tensor parallelism: each rank holds its share of the head's logits
        spec = engine_config.speculative_config
        # speculative decoding keeps the state after each of a sequence's k drafts until they are verified
        self._spare_slots = spare_slots_per_seq if spare_slots_per_seq is not None else \
            spec.num_speculative_tokens if spec is not None else 0
        self.model = None
        self.model_state = None
        self.caches: Caches | None = None  # built by cache/ in initialize_caches
        self.sampler = Sampler(engine_config.seed, device)
        self.graph_manager: cuda_graphs.DecodeGraphManager | None = None  # released first at shutdown
        self.activation_bytes = 0  # peak activation memory of one max_num_batched_tokens step
        self.model_bytes = 0  # the weights' bytes once loaded, as the load log says
        self.activation_source = "none"  # measured | estimated | skipped reason, for logs and tests
        self.threads = None if device.type != "cpu" else cpu_threads.governor() if max_threads is None else \
            cpu_threads.ThreadGovernor(max_threads, adaptive=envs.STATESERVE_ADAPTIVE_THREADS)  # team size per step

    # ---- loading -------------------------------------------------------------------------------
    def load_model(self, show_progress: bool = True) -> None:
        start = time.perf_counter()
        self.poll_threads()
        if self.device.type == "cpu":
            host_allocator.tune()
        before = self._allocated_bytes()
        loaded = build_and_load(self.engine_config, self.model_config, self.device, self.group, show_progress,
                                self.tensor_group)
        model, quantized, source, self.vocab_split = loaded.model, loaded.quantized, loaded.source, loaded.vocab_split
        self.model = model.eval().requires_grad_(False)
        if self.device.type != "cpu" and self.engine_config.batch_invariant:
            raise ValueError("batch_invariant=True: the batch-invariant linears are the CPU kernels' (device "
                             f"{self.device}); leave it unset on a GPU")
        install_fast_linear(self.model, self.model_config.dtype, self.device)
        if self.device.type == "cpu":
            huge_pages.move_parameters(self.model)
            # the weights' old copies go back to the kernel before the panel copies are made (the tuned malloc
            # would keep them in its heap: a load peak of one more model)
            host_allocator.release_free_memory()
            self.poll_threads()
            self._prepack_linears()
        used = self._allocated_bytes() - before
        if self.device.type == "cpu":
            used = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta) + \
                (quantized.weight_bytes if quantized is not None else 0)
        self.model_bytes = used
        logger.info("Model loading took %.4f GiB memory and %.2f seconds%s%s", used / GiB, time.perf_counter() - start,
                    source, f"; {quantized.describe()}" if quantized is not None else "")
        self.model_state = init_model_state(self.model, self.model_config, self.engine_config, self.device)
        if self.group is not None and self.engine_config.pipeline_parallel_size > 1:
            self._plan_specs = self.cache_specs()  # every stage's, for the plan all ranks share
            # (which refuses a model without a layer list)
            split_pipeline(self.model, self.group, self.engine_config.tensor_parallel_size)
        self.poll_threads()
        self.profile_activations()

    def poll_threads(self) -> None:
        """Fit the intra-op team to the cores other processes leave free (CPU; platform/cpu_threads.py)."""
        if self.threads is not None:
            self.threads.poll()

    def _prepack_linears(self) -> None:
        """A second copy of the linear weights in the panel kernel's layout (batched decode 15-75% faster than
        oneDNN at 3-64 rows), unless switched off or the copy would take over a quarter of free memory; in the
        few-row kernel's summation order when the engine is batch-invariant."""
        invariant = self.engine_config.batch_invariant_linears
        if envs.STATESERVE_PACK_LINEARS:
            linear_bytes = sum(m.weight.numel() * m.weight.element_size() for m in self.model.modules()
                               if isinstance(m, FastLinear) and not m.weight.is_meta)
            if linear_bytes > _available_host_memory() // 4:
                logger.info("Linear weight packing skipped: the copy (%.2f GiB) would take over a quarter of free "
                            "memory", linear_bytes / GiB)
            else:
                added = prepack_fast_linear(self.model, lane_order=invariant)
                if added:
                    logger.info("Linear weight packing: %.2f GiB of linear weights copied into 48-column panels",
                                added / GiB)
        if invariant:
            make_batch_invariant(self.model, "on" if self.engine_config.batch_invariant else
                                 "on for speculative decoding")

    def _allocated_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    # ---- activation profile --------------------------------------------------------------------
    def profile_activations(self) -> None:
        """Peak activation memory of a max_num_batched_tokens step (runner/activation_profile.py)."""
        self.activation_bytes, self.activation_source = activation_profile.measure(self)

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
        reason = self.model_state.graph_unsupported_reason() if backend is not None else None
        if reason is not None:
            logger.info("CUDA graphs off: %s", reason)
            return None
        return backend

    def initialize_caches(self, reserved_bytes: int = 0) -> CacheManager:
        """Have cache/ build the caches the model state's policy asks for, bind them to the layers, hand the
        manager to the model state, and capture decode graphs where they apply; returns the manager.
        reserved_bytes: taken off the budget first (a draft model's caches)."""
        kv_specs, state_specs = self._plan_specs or self.cache_specs()
        policy = self.model_state.cache_policy()
        backend = self._graph_backend()
        cfg = self.engine_config
        self.caches = build_caches(kv_specs, state_specs, CacheRequest(
            budget_bytes=self.cache_budget_bytes() - reserved_bytes, block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
            max_model_len=self.model_config.max_model_len, prefix_caching=policy.prefix_caching,
            num_snapshot_slots=policy.num_snapshot_slots, graph_scratch=backend is not None,
            num_blocks_override=cfg.num_gpu_blocks_override, spare_slots_per_seq=self.spare_slots_per_seq(),
            max_chunk_tokens=cfg.max_num_batched_tokens),
            self.device, own_specs=self.cache_specs() if self._plan_specs else None)
        modules = dict(self.model.named_modules())
        for name, (k, v) in self.caches.storage.kv.items():
            modules[name].bind_cache(k, v)
        for name, states in self.caches.storage.states.items():
            modules[name].bind_cache(states)
        self.model_state.attach_cache(self.caches.manager)
        if backend is not None and self.caches.graph_scratch:
            self._capture_graphs(backend)
        return self.caches.manager

    def spare_slots_per_seq(self) -> int:
        return self._spare_slots if self.model_state.uses_state_cache else 0

    @property
    def max_num_seqs(self) -> int:
        """Sequences that may run at once: max_num_seqs, or fewer when the cache cannot hold that many."""
        return self.caches.plan.max_num_seqs

    def _capture_graphs(self, backend: cuda_graphs.GraphBackend) -> None:
        caches = self.caches
        manager = cuda_graphs.DecodeGraphManager(
            self.model, backend, self.model_state.graph_meta, uses_kv_cache=caches.manager.block_pool is not None,
            uses_state_cache=caches.manager.slot_pool is not None, max_num_seqs=caches.plan.max_num_seqs,
            max_model_len=self.model_config.max_model_len, block_size=self.engine_config.block_size,
            scratch_block=caches.scratch_block, scratch_slot=caches.scratch_slot, device=self.device)
        try:
            with torch.inference_mode():
                manager.capture_all()
        except Exception as e:  # e.g. a layer that syncs with the host (MoE group sizes): stay eager
            logger.warning("CUDA graph capture failed, decode steps run eagerly: %s: %s", type(e).__name__, e)
            manager.release()
            return
        self.graph_manager = manager

    # ---- the model kind, for the engine ----------------------------------------------------------
    @property
    def supports_generate(self) -> bool:
        return self.model_state.supports_generate

    @property
    def runs_whole_prompts(self) -> bool:
        return self.model_state.runs_whole_prompts

    def pooling_spec(self) -> PoolingSpec | None:
        return self.model_state.pooling_spec()

    def prompt_limit(self) -> tuple[int, str]:
        return self.model_state.prompt_limit()

    def text_for_tokenizer(self, text: str) -> str:
        return self.model_state.text_for_tokenizer(text)

    def validate_request(self, req: Request) -> None:
        self.model_state.validate_request(req)

    def parse_prompt(self, prompt: Any, to_token_ids, tokenizer: Any) -> tuple[str | None, list[int], Any]:
        return self.model_state.parse_prompt(prompt, to_token_ids, tokenizer)

    def prepare_inputs(self, prompt_token_ids: list[int], encoder_input: Any) -> tuple[list[int], Any]:
        return self.model_state.prepare_inputs(prompt_token_ids, encoder_input)

    def chunk_size(self, req: Request, num_tokens: int) -> int:
        return self.model_state.chunk_size(req, num_tokens)

    def update_requests(self, sched: SchedulerOutput) -> None:
        """The scheduler's preemptions and admissions of this step, before it runs."""
        for req in sched.preempted:
            self.model_state.remove_request(req)
        for req in sched.admitted:
            self.model_state.add_request(req)

    def remove_request(self, req: Request) -> None:
        self.model_state.remove_request(req)

    # ---- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[InputBatch, SampleResult | PoolingResult | None]:
        if self.model is None:
            raise RuntimeError("the model runner has been shut down")
        self.poll_threads()
        try:
            batch = build_input_batch(sched, self.device)
            meta = self.model_state.prepare_meta(batch)
            if self.model_state.supports_generate:
                logits, prompt_lps = self.forward_logits(batch, meta)  # [R, vocab] (a row per verified position)
                result = None if logits is None else self._sample(logits, batch)
                if prompt_lps:
                    result = result or SampleResult([], [], [], [])
                    result.prompt_logprobs = prompt_lps
            else:  # whole prompts: every sequence of the step is pooled
                hidden = self.run_model(batch.input_ids, batch.positions, meta)  # [T, hidden]
                result = PoolingResult(self.model_state.pool(hidden, batch).float().cpu())  # [S, D]
            self.model_state.after_step(batch)  # last: a step that raises anywhere publishes nothing
        except BaseException:
            self._step_failed()
            raise
        return batch, result

    def _sample(self, logits: torch.Tensor, batch: InputBatch) -> SampleResult:
        if not any(batch.num_drafts):
            return self.sampler(logits, [batch.requests[i] for i in batch.sample_indices])
        return spec_verify.accept(batch, self.sampler(logits, spec_verify.row_requests(batch)))

    def rollback(self, req: Request, step_start: int, num_fed: int, num_kept: int) -> None:
        """After a step that ran tokens step_start..num_fed-1 of `req`, only the first num_kept are committed:
        the model state puts the request's recurrent state back to that point (KV past it is simply rewritten)."""
        self.model_state.rollback(req, step_start, num_fed, num_kept)

    def _step_failed(self) -> None:
        try:
            self.model_state.on_step_failed()
        except Exception:
            logger.exception("on_step_failed raised; going on with the failed step's clean-up")

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        """The model's forward over one step's tokens -> [T, hidden] (the tensor-parallel driver first sends the
        step to the other ranks)."""
        return self.model(input_ids, positions, meta)

    def forward_logits(self, batch: InputBatch, meta: ForwardMeta) -> tuple[torch.Tensor | None, dict | None]:
        """The forward of one step (a graph replay when it qualifies) -> (logits of the sampled rows or None, the
        prompt logprobs of the sequences that ask for them or None)."""
        if not batch.prompt_rows and self.graph_manager is not None and self.graph_manager.can_run(batch, meta):
            padded = self.graph_manager.run(batch, meta)  # [padded size, vocab]; row i is sequence i
            return (padded[batch.logits_indices] if batch.sample_indices else None), None
        hidden = self.run_model(batch.input_ids, batch.positions, meta)  # [T, hidden]
        prompt_lps = None
        if batch.prompt_rows:
            rows_of = lambda rows: self.logits_of(hidden, torch.tensor(rows, device=hidden.device))  # noqa: E731
            prompt_lps = prompt_logprobs(rows_of, batch.prompt_rows,
                                         {i: batch.requests[i].params.prompt_logprobs for i in batch.prompt_rows})
        if not batch.sample_indices:
            return None, prompt_lps
        return self.logits_of(hidden, batch.logits_indices), prompt_lps  # [n, vocab]

    def logits_of(self, hidden: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """Logits of hidden's `rows` (None: all) -> [n, vocab] (a vocabulary split over ranks is gathered)."""
        return self.model.compute_logits(hidden if rows is None else hidden[rows])

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
        if self.caches is not None:
            self.caches.release()
        self.caches = None
        if self.model_state is not None:
            self.model_state.release()
        self.model_state = None
        self.model = None
        gc.collect()
        if self.device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.empty_cache()
        host_allocator.release_free_memory()
