"""The flat inputs of one step, built from the scheduler's choice: token ids, positions, per-sequence
offsets, and which rows of the output are sampled."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stateserve.core.request import Request


@dataclass
class SchedulerOutput:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)  # moved from waiting to running in this step

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def add(self, req: Request, n: int) -> None:
        self.requests.append(req)
        self.num_new_tokens.append(n)


@dataclass
class InputBatch:
    requests: list[Request]
    query_lens: list[int]  # [S] new tokens of each sequence in this step
    context_lens: list[int]  # [S] tokens already computed before this step
    query_start_loc: list[int]  # [S + 1]
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    sample_indices: list[int]  # sequences (indices into requests) that sample a token this step
    logits_indices: torch.Tensor  # [len(sample_indices)] rows of the flat batch whose logits are sampled

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens) and all(c > 0 for c in self.context_lens)

    @property
    def seq_lens(self) -> list[int]:
        return [c + q for c, q in zip(self.context_lens, self.query_lens)]


def build_input_batch(sched: SchedulerOutput, device: torch.device) -> InputBatch:
    ids: list[int] = []
    positions: list[int] = []
    starts = [0]
    context_lens, sample_indices, logits_rows = [], [], []
    for i, (req, n) in enumerate(zip(sched.requests, sched.num_new_tokens)):
        c = req.num_computed_tokens
        ids.extend(req.token_ids[c:c + n])
        positions.extend(range(c, c + n))
        context_lens.append(c)
        starts.append(starts[-1] + n)
        if c + n == req.num_tokens:  # the chunk reaches the last known token: sample the next one
            sample_indices.append(i)
            logits_rows.append(starts[-1] - 1)
    return InputBatch(
        requests=list(sched.requests), query_lens=list(sched.num_new_tokens), context_lens=context_lens,
        query_start_loc=starts,
        input_ids=torch.tensor(ids, dtype=torch.long).to(device, non_blocking=True),
        positions=torch.tensor(positions, dtype=torch.long).to(device, non_blocking=True),
        sample_indices=sample_indices,
        logits_indices=torch.tensor(logits_rows, dtype=torch.long).to(device, non_blocking=True))
