"""The activation memory of one max_num_batched_tokens step, measured with a dummy forward before the caches exist
(the cache budget is what is left after weights and activations): on CUDA the growth of max_memory_allocated, on
CPU the peak growth of resident memory, sampled."""
from __future__ import annotations

import logging
from typing import Any

import torch

from stateserve.platform import host_allocator
from stateserve.platform.peak_rss import PeakRssSampler

logger = logging.getLogger("stateserve")
GiB = 1 << 30
# The CPU profile runs at most this many tokens and scales the peak linearly to max_num_batched_tokens (a full
# 2048-token forward costs more than engine start itself); its result is kept per process and model config.
CPU_PROFILE_MAX_TOKENS = 256
_cpu_profiles: dict[tuple, int] = {}


def dummy_forward(runner: Any, num_tokens: int, seq_len: int) -> None:
    """A prefill of `num_tokens` tokens (sequences of at most `seq_len`) with nothing cached, on metadata the
    model state builds for it (no cache a request could read is written: the real caches do not exist yet)."""
    device, model, state = runner.device, runner.model, runner.model_state
    lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    with state.profile_meta(lens) as meta:
        hidden = model(ids, positions, meta)  # [T, hidden]
        if state.supports_generate:  # the sampled rows' logits and the sampler's sort of them
            rows = hidden[-min(num_tokens, runner.engine_config.max_num_seqs):]
            model.compute_logits(rows).float().softmax(-1).sort(dim=-1)


def measure(runner: Any) -> tuple[int, str]:
    """(peak activation bytes of a max_num_batched_tokens step, how they were found: measured | estimated ...)."""
    device, model_config, engine_config = runner.device, runner.model_config, runner.engine_config
    total = engine_config.max_num_batched_tokens
    estimate = total * model_config.vocab_size * 4 * 2  # a fallback: float32 logits, twice
    seq_len = runner.model_state.dummy_seq_len()
    if seq_len is None:
        return estimate, "estimated (no dummy forward for this kind)"
    num_tokens = total if device.type == "cuda" else min(total, CPU_PROFILE_MAX_TOKENS)
    seq_len = max(1, min(seq_len, num_tokens))
    key = (model_config.architecture, model_config.hf_config.to_json_string(), model_config.dtype, num_tokens,
           seq_len, engine_config.max_num_seqs)
    try:
        with torch.inference_mode():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
                dummy_forward(runner, num_tokens, seq_len)
                torch.cuda.synchronize(device)
                peak = torch.cuda.max_memory_allocated(device) - before
            elif key in _cpu_profiles and runner.group is None:  # the ranks of a group run it together
                peak = _cpu_profiles[key]
            else:
                host_allocator.release_free_memory()  # so the forward cannot reuse memory RSS already counts
                with PeakRssSampler() as sampler:
                    dummy_forward(runner, num_tokens, seq_len)
                peak = _cpu_profiles[key] = sampler.growth
    except Exception as e:  # a model the dummy inputs do not suit must still start
        if runner.group is not None:  # a rank gone, or ranks out of step: nothing to estimate around
            raise
        logger.warning("activation profiling failed (%s: %s); using an estimate", type(e).__name__, e)
        return estimate, "estimated (dummy forward failed)"
    activation_bytes = int(peak * total / num_tokens)
    logger.info("Activation memory: %.4f GiB peak for %d tokens (dummy forward of %d tokens, %s)",
                activation_bytes / GiB, total, num_tokens,
                "max_memory_allocated" if device.type == "cuda" else "sampled resident memory")
    return activation_bytes, "measured"
