"""Per-choice text for streaming: incremental detokenization, stop-string hold-back, OpenAI logprob shapes."""
from __future__ import annotations

from typing import Any

from stateserve.entrypoints.async_engine import SeqUpdate
from stateserve.entrypoints.openai_protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from stateserve.outputs import Logprob

_MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI clamps the same way


class IncrementalText:
    """Text of a growing token sequence, decoded a few tokens at a time.

    Decoding only the tail keeps each step O(1) in the output length. The tail is decoded together with a few
    tokens before it (the "prefix" window) because many tokenizers render a token differently at the start
    of a string (leading spaces, byte fallback). Text ending in U+FFFD is an incomplete UTF-8 character and
    waits for the next token."""

    def __init__(self, tokenizer: Any | None, skip_special_tokens: bool, hold_back: int = 0) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.hold_back = hold_back  # chars kept back while running: they may be the start of a stop string
        self.token_ids: list[int] = []
        self.text = ""
        self.sent = 0  # chars of `text` already handed out
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        if not ids or self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int]) -> None:
        self.token_ids.extend(new_ids)
        prefix = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.token_ids)

    def delta(self, final_text: str | None = None) -> str:
        """New text since the last call; at the end pass the engine's final text, which is authoritative
        (stop strings already cut), so the concatenated deltas always equal the non-streamed text."""
        if final_text is not None:
            out = final_text[self.sent:]
            self.text, self.sent = final_text, len(final_text)
            return out
        limit = len(self.text) - self.hold_back
        if limit <= self.sent:
            return ""
        out = self.text[self.sent:limit]
        self.sent = limit
        return out


class ChoiceState:
    """Everything one choice (prompt x sample) has produced so far."""

    def __init__(self, tokenizer: Any | None, skip_special_tokens: bool, stops: list[str], echo_text: str = ""):
        hold = max((len(s) for s in stops), default=1) - 1
        self.text = IncrementalText(tokenizer, skip_special_tokens, hold)
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
        self.text.add(seq.new_token_ids)
        delta = self.text.delta(seq.text if seq.finish_reason is not None else None)
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
