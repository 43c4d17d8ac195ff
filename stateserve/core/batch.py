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
    # sequence index -> offsets into its chunk whose recurrent state must be kept for a later rollback (a draft
    # model's steps); a sequence verifying drafts keeps offsets 1..k without asking
    keep_offsets: dict[int, tuple[int, ...]] = field(default_factory=dict)

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
    logits_indices: torch.Tensor  # [R] rows of the flat batch whose logits are sampled, R >= len(sample_indices)
    # per sample index: draft tokens verified in this step (its last 1 + k rows of logits_indices are its rows)
    num_drafts: list[int] = field(default_factory=list)
    keep_offsets: dict[int, tuple[int, ...]] = field(default_factory=dict)  # see SchedulerOutput
    num_accepted: dict[int, int] = field(default_factory=dict)  # sequence index -> drafts accepted (after sampling)
    # prompt logprobs: per sequence index that asks, the flat rows whose logits predict its next prompt tokens, and
    # those tokens (row p predicts prompt token p + 1)
    prompt_rows: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)

    @property
    def spec_seqs(self) -> list[int]:
        """Sequences verifying drafts in this step."""
        return [i for i, k in zip(self.sample_indices, self.num_drafts) if k]

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
    context_lens, sample_indices, logits_rows, num_drafts = [], [], [], []
    keep = dict(sched.keep_offsets)
    prompt_rows: dict[int, tuple[list[int], list[int]]] = {}
    for i, (req, n) in enumerate(zip(sched.requests, sched.num_new_tokens)):
        c = req.num_computed_tokens
        drafts = req.spec_token_ids
        if drafts and c + n != req.num_tokens + len(drafts):
            raise RuntimeError(f"request {req.request_id}: drafts scheduled without the whole verification chunk")
        tokens = req.token_ids[c:c + n] if not drafts else req.token_ids[c:] + drafts
        ids.extend(tokens)
        positions.extend(range(c, c + n))
        context_lens.append(c)
        starts.append(starts[-1] + n)
        if req.wants_prompt_logprobs and c < req.num_prompt_tokens - 1:
            end = min(c + n, req.num_prompt_tokens - 1)
            prompt_rows[i] = (list(range(starts[-2], starts[-2] + end - c)), req.token_ids[c + 1:end + 1])
        if c + n == req.num_tokens + len(drafts):  # the chunk reaches the last known token: sample the next one
            sample_indices.append(i)  # with drafts: the last 1 + k rows, one per position verified
            logits_rows.extend(range(starts[-1] - 1 - len(drafts), starts[-1]))
            num_drafts.append(len(drafts))
            if drafts:
                keep[i] = tuple(range(1, len(drafts) + 1))
    return InputBatch(
        requests=list(sched.requests), query_lens=list(sched.num_new_tokens), context_lens=context_lens,
        query_start_loc=starts,
        input_ids=torch.tensor(ids, dtype=torch.long).to(device, non_blocking=True),
        positions=torch.tensor(positions, dtype=torch.long).to(device, non_blocking=True),
        sample_indices=sample_indices,
        logits_indices=torch.tensor(logits_rows, dtype=torch.long).to(device, non_blocking=True),
        num_drafts=num_drafts, keep_offsets=keep, prompt_rows=prompt_rows)
