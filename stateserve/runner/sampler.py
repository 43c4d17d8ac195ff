"""Batched sampling on the logits' device: penalties, logit bias, min_tokens, structured-output masks, greedy, temperature, top-k/top-p/min-p,
per-request seeds, top-N logprobs. Python loops touch only rows that need per-request work
(a request's own seed, penalties); everything else is one tensor op over the batch."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from stateserve.core.request import Request
from stateserve.runner import structured


@dataclass
class SampleResult:
    token_ids: list[int]
    # raw log-probabilities of the sampled tokens, their ranks and the top-N, only for rows that asked
    sampled_logprobs: list[float | None]
    sampled_ranks: list[int | None]
    top_logprobs: list[tuple[list[int], list[float]] | None]
    # speculative steps: tokens per sampled sequence (the lists above run over all of them in order); None: one each
    num_emitted: list[int] | None = None
    # sequence index -> (prompt token, its logprob, its rank, top ids, top logprobs) per prompt position of the step
    prompt_logprobs: dict[int, list[tuple[int, float, int, list[int], list[float]]]] | None = None


def _apply_penalties(logits: torch.Tensor, reqs: list[Request]) -> None:
    rows = [i for i, r in enumerate(reqs) if r.params.uses_penalties]
    if not rows:
        return
    vocab = logits.shape[1]
    for i in rows:  # counts need each request's own token history
        p = reqs[i].params
        out_ids = torch.tensor(reqs[i].output_token_ids, dtype=torch.long, device=logits.device)
        out_ids = out_ids[(out_ids >= 0) & (out_ids < vocab)]
        counts = torch.bincount(out_ids, minlength=vocab).to(logits.dtype)
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            seen[torch.tensor(reqs[i].token_ids, dtype=torch.long, device=logits.device).clamp(0, vocab - 1)] = True
            penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row = torch.where(seen, penalised, row)
        row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(row.dtype)
        logits[i] = row


def _apply_logit_bias(logits: torch.Tensor, reqs: list[Request]) -> None:
    vocab = logits.shape[1]
    for i, r in enumerate(reqs):
        bias = r.params.logit_bias
        if bias:  # ids past the vocabulary were refused when the request was added
            ids = torch.tensor([t for t in bias if t < vocab], dtype=torch.long, device=logits.device)
            vals = torch.tensor([bias[t] for t in bias if t < vocab], dtype=logits.dtype, device=logits.device)
            logits[i].index_add_(0, ids, vals)


def _mask_stop_tokens_before_min(logits: torch.Tensor, reqs: list[Request]) -> None:
    for i, r in enumerate(reqs):
        if r.num_output_tokens < r.params.min_tokens:
            ids = [t for t in r.params._all_stop_token_ids if t < logits.shape[1]]
            if ids:
                logits[i, ids] = float("-inf")


def _filter_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                              min_p: torch.Tensor) -> torch.Tensor:
    # logits: [B, V] already divided by temperature; top_k 0 = off
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    drop = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    cum = probs.cumsum(-1)
    drop |= (cum - probs) > top_p[:, None]  # keep the smallest prefix whose mass reaches top_p
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.device = device

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> SampleResult:
        logits = logits.float()
        want_lp = [r.params.logprobs is not None for r in reqs]
        raw_logprobs = logits.log_softmax(-1) if any(want_lp) else None
        _apply_penalties(logits, reqs)
        _apply_logit_bias(logits, reqs)
        _mask_stop_tokens_before_min(logits, reqs)
        structured.mask_rows(logits, [getattr(r, "constraint", None) for r in reqs])

        temps = torch.tensor([r.params.temperature for r in reqs], device=logits.device)
        greedy = temps < 1e-5
        tokens = logits.argmax(-1)
        if not bool(greedy.all()):
            tokens = torch.where(greedy, tokens, self._sample_random(logits, reqs, temps, greedy))
        token_list = tokens.tolist()

        n = len(reqs)
        lps: list[float | None] = [None] * n
        ranks: list[int | None] = [None] * n
        tops: list[tuple[list[int], list[float]] | None] = [None] * n
        if raw_logprobs is not None:
            rows = [i for i in range(n) if want_lp[i]]
            sel = raw_logprobs[rows]
            chosen = sel.gather(1, tokens[rows, None]).squeeze(1)
            rank = (sel > chosen[:, None]).sum(-1) + 1
            max_n = max(reqs[i].params.logprobs for i in rows)
            top_v, top_i = sel.topk(max_n, dim=-1) if max_n > 0 else (sel[:, :0], sel[:, :0].long())
            for j, i in enumerate(rows):
                lps[i], ranks[i] = float(chosen[j]), int(rank[j])
                k = reqs[i].params.logprobs
                tops[i] = (top_i[j, :k].tolist(), top_v[j, :k].tolist())
        return SampleResult(token_list, lps, ranks, tops)

    def _sample_random(self, logits: torch.Tensor, reqs: list[Request], temps: torch.Tensor,
                       greedy: torch.Tensor) -> torch.Tensor:
        scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
        if any(r.params.top_k > 0 or r.params.top_p < 1 or r.params.min_p > 0 for r in reqs):
            dev = logits.device
            top_k = torch.tensor([r.params.top_k for r in reqs], device=dev)
            top_p = torch.tensor([r.params.top_p for r in reqs], device=dev, dtype=torch.float32)
            min_p = torch.tensor([r.params.min_p for r in reqs], device=dev, dtype=torch.float32)
            scaled = _filter_top_k_top_p_min_p(scaled, top_k, top_p, min_p)
        probs = scaled.softmax(-1)
        # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws from p exactly.
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, r in enumerate(reqs):
            if r.generator is not None:  # a request's own seed: same tokens whatever else is batched
                noise[i].exponential_(generator=r.generator)
        return (probs / noise).argmax(-1)


PROMPT_LOGPROB_ROWS = 256  # rows of [rows, vocab] float32 log-softmax at a time (a 2048-token chunk would be 0.25 GB)


def prompt_logprobs(logits_of, rows: dict[int, tuple[list[int], list[int]]], top_n: dict[int, int]
                    ) -> dict[int, list[tuple[int, float, int, list[int], list[float]]]]:
    """Each asking sequence's prompt positions: the raw log-probability and rank of the next prompt token and the
    top `top_n[i]`. logits_of(flat rows) -> [n, vocab] logits of those rows of the step."""
    out: dict[int, list] = {}
    for i, (flat, targets) in rows.items():
        entries = out[i] = []
        for start in range(0, len(flat), PROMPT_LOGPROB_ROWS):
            lp = logits_of(flat[start:start + PROMPT_LOGPROB_ROWS]).float().log_softmax(-1)
            target = torch.tensor(targets[start:start + PROMPT_LOGPROB_ROWS], device=lp.device)
            chosen = lp.gather(1, target[:, None]).squeeze(1)
            rank = (lp > chosen[:, None]).sum(-1) + 1
            k = top_n[i]
            top_v, top_i = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
            for t, c, r, ids, vals in zip(target.tolist(), chosen.tolist(), rank.tolist(), top_i.tolist(),
                                          top_v.tolist()):
                entries.append((t, c, r, ids, vals))
    return out
