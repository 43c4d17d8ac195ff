"""Prompt-lookup drafting: the longest suffix of a request's tokens (prompt_lookup_max down to prompt_lookup_min
tokens) is looked for earlier in its own prompt and output; the tokens that followed its latest earlier occurrence
are the drafts. Costs no model: a search in C (bytes.rfind over the token ids as 4-byte words) per request."""
from __future__ import annotations

from array import array

from stateserve.core.request import Request
from stateserve.config import SpeculativeConfig
from stateserve.spec_decode.proposer import Proposer

_WORD = 4  # bytes per token id in the search buffer


def lookup(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix, or []."""
    if len(tokens) < lo + 1:
        return []
    buf = array("i", tokens).tobytes()
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        needle = buf[-n * _WORD:]
        end = len(buf) - _WORD  # the match must end before the last token: something follows it
        while True:
            pos = buf.rfind(needle, 0, end)
            if pos < 0:
                break
            if pos % _WORD == 0:  # a whole-token match, not one across token boundaries
                return _continue(tokens, pos // _WORD + n, k)
            end = pos + len(needle) - 1
    return []


def _continue(tokens: list[int], start: int, k: int) -> list[int]:
    """k tokens copied from `start` on; past the end the copy reads its own drafts, so a loop of period p drafts k
    tokens rather than p."""
    out: list[int] = []
    for idx in range(start, start + k):
        out.append(tokens[idx] if idx < len(tokens) else out[idx - len(tokens)])
    return out


class NgramProposer(Proposer):
    def __init__(self, spec: SpeculativeConfig) -> None:
        self.lo, self.hi = spec.prompt_lookup_min, spec.prompt_lookup_max

    def propose(self, requests: list[tuple[Request, int]]) -> None:
        for req, k in requests:
            req.spec_token_ids = lookup(req.token_ids, k, self.lo, self.hi)
