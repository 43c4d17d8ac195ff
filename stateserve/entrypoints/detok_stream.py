"""Per-choice state of a response (the text deltas come from the engine's incremental detokenizer, which holds
back what may be the start of a stop string), and OpenAI's logprob shapes."""
from __future__ import annotations

from typing import Callable

from stateserve.entrypoints.streams import SeqUpdate
from stateserve.entrypoints.openai_protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from stateserve.outputs import Logprob

_MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI clamps the same way


class ChoiceState:
    """Everything one choice (prompt x sample) has produced so far."""

    def __init__(self, echo_text: str = ""):
        self.echo_text = echo_text
        self.echo_pending = bool(echo_text)
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.final_text: str | None = None
        self.text_offset = len(echo_text)  # for completion logprobs' text_offset

    def apply(self, seq: SeqUpdate, streaming: bool) -> str:
        """Record an update; when streaming, return the text delta it brings (with echo on the first)."""
        self.token_ids.extend(seq.new_token_ids)
        if seq.new_logprobs:
            self.logprobs.extend(seq.new_logprobs)
        if seq.finish_reason is not None:
            self.finish_reason, self.stop_reason, self.final_text = seq.finish_reason, seq.stop_reason, seq.text
        if not streaming:
            return ""
        delta = seq.new_text or ""
        if self.echo_pending:
            self.echo_pending = False
            delta = self.echo_text + delta
        return delta

    @property
    def full_text(self) -> str:
        return self.echo_text + (self.final_text or "")


def _clamp(x: float) -> float:
    return max(float(x), _MIN_LOGPROB)


def _sampled(token_id: int, entry: dict[int, Logprob]) -> Logprob:
    return entry.get(token_id) or Logprob(_MIN_LOGPROB, None, None)


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]],
                        text_offset: int) -> tuple[CompletionLogprobs, int]:
    """Legacy completions shape; returns it and the text offset after these tokens."""
    out = CompletionLogprobs()
    for tid, entry in zip(token_ids, entries):
        tok = _sampled(tid, entry).decoded_token or ""
        out.tokens.append(tok)
        out.token_logprobs.append(_clamp(_sampled(tid, entry).logprob))
        ranked = sorted(entry.values(), key=lambda lp: lp.rank if lp.rank is not None else 1 << 30)
        out.top_logprobs.append({(lp.decoded_token or ""): _clamp(lp.logprob) for lp in ranked})
        out.text_offset.append(text_offset)
        text_offset += len(tok)
    return out, text_offset


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], top_n: int) -> ChatLogprobs:
    content = []
    for tid, entry in zip(token_ids, entries):
        sampled = _sampled(tid, entry)
        tok = sampled.decoded_token or ""
        top = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= top_n),
                     key=lambda lp: lp.rank)
        content.append(ChatTokenLogprob(
            token=tok, logprob=_clamp(sampled.logprob), bytes=list(tok.encode("utf-8")),
            top_logprobs=[TopLogprob(token=lp.decoded_token or "", logprob=_clamp(lp.logprob),
                                     bytes=list((lp.decoded_token or "").encode("utf-8"))) for lp in top]))
    return ChatLogprobs(content=content)


def echo_logprobs(prompt_ids: list[int], entries: list[dict[int, Logprob] | None] | None,
                  generated: CompletionLogprobs, decode: Callable[[int], str]) -> CompletionLogprobs:
    """echo with logprobs: the prompt's tokens lead, the first without a logprob (nothing predicts it), as OpenAI and
    vLLM send them; the generated tokens' offsets already start after the echoed text."""
    entries = entries or [None] * len(prompt_ids)
    out, offset = CompletionLogprobs(), 0
    for tid, entry in zip(prompt_ids, entries):
        tok = entry[tid].decoded_token if entry is not None and tid in entry else decode(tid)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            out.token_logprobs.append(_clamp(entry[tid].logprob))
            ranked = sorted(entry.values(), key=lambda lp: lp.rank if lp.rank is not None else 1 << 30)
            out.top_logprobs.append({(lp.decoded_token or ""): _clamp(lp.logprob) for lp in ranked})
        out.tokens.append(tok or "")
        out.text_offset.append(offset)
        offset += len(tok or "")
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        getattr(out, field).extend(getattr(generated, field))
    return out


def best_of_choices(choices: list[ChoiceState], width: int, n: int) -> list[tuple[int, ChoiceState]]:
    """(prompt index, choice) of what a completion returns: per prompt its `width` samples, or with best_of the n
    with the highest cumulative logprob (the engine tracks the sampled logprobs of best_of samples)."""
    def cumulative(ch: ChoiceState) -> float:
        return sum(e[t].logprob for t, e in zip(ch.token_ids, ch.logprobs) if t in e)

    out = []
    for p in range(len(choices) // width):
        group = choices[p * width:(p + 1) * width]
        if width > n:
            group = sorted(group, key=cumulative, reverse=True)[:n]
        out += [(p, ch) for ch in group]
    return out
