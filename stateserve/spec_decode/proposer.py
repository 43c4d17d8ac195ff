"""What the Speculator asks of a proposer (prompt lookup, a draft model, or a test's own)."""
from __future__ import annotations

from stateserve.core.request import Request


class Proposer:
    cache_bytes = 0  # cache memory it holds, taken off the engine's budget (a draft model's)

    def propose(self, wanted: list[tuple[Request, int]]) -> None:
        """Set `req.spec_token_ids` (at most k tokens, maybe none) for each (request, k) that may draft now."""
        raise NotImplementedError

    def remove(self, req: Request) -> None:
        """The request ended or was preempted: drop whatever is kept for it."""

    def shutdown(self) -> None:
        """Release everything (the engine shuts down)."""
