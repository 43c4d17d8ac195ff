"""Logits of every position of a fixed token sequence through the real engine: its caches, its chunking, its
kernels (prefill for chunks, decode for one token at a time). What tests compare with transformers and the
quantization benchmark compares between formats; nothing is sampled and nothing stays cached."""
from __future__ import annotations

import torch


def teacher_forced_logits(llm, token_ids: list[int], chunk: int) -> torch.Tensor:
    """Feed `token_ids` through `llm`'s engine in chunks of `chunk` tokens -> float32 logits [len(token_ids), V]."""
    from stateserve.core.batch import SchedulerOutput, build_input_batch
    from stateserve.core.request import Request
    from stateserve.sampling_params import SamplingParams

    engine = llm.llm_engine
    runner = engine.runner
    req = Request("teacher-forced", list(token_ids), SamplingParams(max_tokens=1), arrival_index=0)
    rows = []
    try:
        with torch.inference_mode():
            while req.num_computed_tokens < len(token_ids):
                n = min(chunk, len(token_ids) - req.num_computed_tokens)
                engine.cache.allocate(req, n)
                sched = SchedulerOutput()
                sched.add(req, n)
                batch = build_input_batch(sched, runner.device)
                meta = runner.model_state.prepare_meta(batch)
                hidden = runner.run_model(batch.input_ids, batch.positions, meta)  # [T, hidden]
                rows.append(runner.logits_of(hidden, None).float())
                req.num_computed_tokens += n
    finally:
        engine.cache.free(req)
    return torch.cat(rows)
