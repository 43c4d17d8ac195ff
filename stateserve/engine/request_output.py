"""A request group's user-facing result (vLLM's RequestOutput / EmbeddingRequestOutput) from its sequences, and the
logprob entries it carries."""
from __future__ import annotations

from typing import Callable

from stateserve.core.request import Request
from stateserve.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, RequestMetrics,
                                RequestOutput)


def logprob_entry(token: int, value: float, rank: int, ids: list[int], vals: list[float],
                  decode: Callable[[int], str]) -> dict[int, Logprob]:
    """One position's logprobs as vLLM returns them: the top ones by rank, and the chosen token with its own rank."""
    entry = {t: Logprob(v, r + 1, decode(t)) for r, (t, v) in enumerate(zip(ids, vals))}
    entry[token] = Logprob(value, rank, decode(token))
    return entry


def spec_metrics(reqs: list[Request]) -> RequestMetrics:
    """Speculative decoding counters summed over a group's samples."""
    metrics = RequestMetrics()
    for r in reqs:
        if r.spec is not None:
            metrics.num_draft_tokens += r.spec.num_draft_tokens
            metrics.num_accepted_tokens += r.spec.num_accepted_tokens
            metrics.num_verify_steps += r.spec.num_verify_steps
    return metrics


def make_output(group_id: str, reqs: list[Request], speculating: bool) -> RequestOutput | EmbeddingRequestOutput:
    first = reqs[0]
    if first.is_pooling:
        vector = first.embedding.tolist() if first.embedding is not None else []
        return EmbeddingRequestOutput(request_id=group_id, prompt_token_ids=list(first.prompt_token_ids),
                                      outputs=EmbeddingOutput(embedding=vector, error=first.error),
                                      finished=first.is_finished, prompt=first.prompt)
    shown = reqs
    if first.params.num_samples > first.params.n and all(r.is_finished for r in reqs):  # best_of: the n best
        shown = sorted(reqs, key=lambda r: r.cumulative_logprob, reverse=True)[:first.params.n]
    hide = first.params._hide_logprobs
    outs = [CompletionOutput(index=i, text=r.output_text, token_ids=list(r.output_token_ids),
                             cumulative_logprob=None if r.logprobs is None or hide else r.cumulative_logprob,
                             logprobs=None if hide else r.logprobs, finish_reason=r.finish_reason,
                             stop_reason=r.stop_reason, error=r.error)
            for i, r in enumerate(shown)]
    return RequestOutput(request_id=group_id, prompt=first.prompt, prompt_token_ids=list(first.prompt_token_ids),
                         outputs=outs, finished=all(r.is_finished for r in reqs),
                         num_cached_tokens=first.num_cached_tokens, prompt_logprobs=first.prompt_logprobs,
                         metrics=spec_metrics(reqs) if speculating else None)
