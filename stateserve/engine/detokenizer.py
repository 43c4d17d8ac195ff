"""Turns output token ids into text, and finds stop strings (which are not included in the text)."""
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


def find_stop_string(text: str, stops: list[str], search_from: int) -> tuple[int, str] | None:
    """Earliest stop string that ends after `search_from`; returns (index where it starts, the string)."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, max(0, search_from - len(s) + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best
