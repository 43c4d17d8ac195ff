"""Turns output token ids into text, whole or incrementally, and finds stop strings (not included in the text)."""
from __future__ import annotations

from typing import Any


class Detokenizer:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None or not token_ids:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def decode_token(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])


class IncrementalDetokenizer:
    """Text of a growing output, decoded a few tokens at a time (the engine keeps one per request that has stop
    strings or streams its text: stop strings are then looked for in the new text only, and a stream's deltas
    come from here, so the server decodes nothing).

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


def find_stop_string(text: str, stops: list[str], search_from: int) -> tuple[int, str] | None:
    """Earliest stop string that ends after `search_from`; returns (index where it starts, the string)."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, max(0, search_from - len(s) + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best
