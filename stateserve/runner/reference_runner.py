"""ReferenceRunner (STATESERVE_RUNNER=reference): the simplest correct path, kept as an oracle.

One request at a time (the engine sets max_num_seqs=1 and turns prefix caching off), and every step that
samples recomputes the whole sequence from position 0 with a zeroed state: no cache reuse across steps."""
from __future__ import annotations

from stateserve.core.batch import InputBatch, SchedulerOutput
from stateserve.runner.model_runner import ModelRunner
from stateserve.runner.sampler import SampleResult


class ReferenceRunner(ModelRunner):
    def execute(self, sched: SchedulerOutput) -> tuple[InputBatch, SampleResult | None]:
        if len(sched.requests) != 1:
            raise RuntimeError("the reference runner runs exactly one request per step")
        req, n = sched.requests[0], sched.num_new_tokens[0]
        total = req.num_computed_tokens + n
        if total < req.num_tokens:  # a non-final prefill chunk: nothing to sample, recompute later
            return _empty(self.device), None
        saved = req.num_computed_tokens
        req.num_computed_tokens = 0
        if req.state_slot is not None:
            self.caches.storage.zero_slot(req.state_slot)
        full = SchedulerOutput()
        full.add(req, total)
        try:
            return super().execute(full)
        finally:
            req.num_computed_tokens = saved


def _empty(device) -> InputBatch:
    import torch

    empty = torch.zeros(0, dtype=torch.long, device=device)
    return InputBatch([], [], [], [0], empty, empty, [], empty)
