"""Exceptions the engine raises that callers (LLM.generate, the HTTP server) are meant to recognise."""
from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine stopped for good: too many consecutive steps failed (STATESERVE_MAX_CONSECUTIVE_STEP_FAILURES).
    Every later `step()` / `add_request()` raises it again; `abort_request`, `pop_output` and `shutdown` still
    work so callers can clean up. The cause (the last step's exception) is chained as `__cause__`."""


class FatalStepError(RuntimeError):
    """A step failure after which no later step can run (a tensor-parallel rank died): the engine stops at once
    instead of counting it among STATESERVE_MAX_CONSECUTIVE_STEP_FAILURES."""
