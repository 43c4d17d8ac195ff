"""Verification of drafts: every position of a speculating sequence is sampled by the ordinary sampler, as if the
drafts before it had been generated, and the drafts are accepted while they equal what was sampled.

Why this is exact: drafts here are deterministic given the context (prompt lookup, or a draft model's greedy
choice), i.e. the proposal is a point mass q = 1{d}. Rejection sampling then accepts d with probability p(d) and
otherwise samples from p with d taken out, renormalised; "sample t ~ p, accept iff t = d, else emit t" draws
from exactly that, so every emitted token has the target's distribution given the tokens before it (greedy: the
argmax, as plain decoding). Penalties, min_tokens and logprobs see each row's own history (drafts included)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from stateserve.core.batch import InputBatch
from stateserve.core.request import Request
from stateserve.runner.sampler import SampleResult


@dataclass(eq=False)
class RowView:
    """What the sampler reads of a request, as of one verification row: the drafts before it count as output."""

    params: Any
    output_token_ids: list[int]
    token_ids: list[int]
    generator: torch.Generator | None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def row_requests(batch: InputBatch) -> list[Request | RowView]:
    """One entry per row of batch.logits_indices: the request itself, or for a speculating one 1 + k views."""
    rows: list[Request | RowView] = []
    for i, k in zip(batch.sample_indices, batch.num_drafts):
        req = batch.requests[i]
        if not k:
            rows.append(req)
            continue
        drafts = req.spec_token_ids
        for j in range(k + 1):
            rows.append(RowView(req.params, req.output_token_ids + drafts[:j], req.token_ids + drafts[:j],
                                req.generator))
    return rows


def accept(batch: InputBatch, rows: SampleResult) -> SampleResult:
    """Per-row samples -> the tokens each sequence emits, in order (accepted drafts, then the first sampled token
    that differs from its draft or the bonus token after all k); records batch.num_accepted. The result's lists
    run over emitted tokens; `num_emitted[j]` of them belong to sample index j."""
    token_ids, lps, ranks, tops, emitted = [], [], [], [], []
    r = 0
    for i, k in zip(batch.sample_indices, batch.num_drafts):
        drafts = batch.requests[i].spec_token_ids
        a = 0
        while a < k and rows.token_ids[r + a] == drafts[a]:
            a += 1
        take = range(r, r + a + 1)
        token_ids += [rows.token_ids[t] for t in take]
        lps += [rows.sampled_logprobs[t] for t in take]
        ranks += [rows.sampled_ranks[t] for t in take]
        tops += [rows.top_logprobs[t] for t in take]
        emitted.append(a + 1)
        if k:
            batch.num_accepted[i] = a
        r += k + 1
    return SampleResult(token_ids, lps, ranks, tops, emitted)
