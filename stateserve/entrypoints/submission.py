"""Adding one submission's requests to the engine all at once or not at all.

A submission (an HTTP request, or one LLM.generate / LLM.embed call) is prepared whole before any part of it is
queued: `LLMEngine.prepare_request` / `prepare_embed` validate a prompt and build its sequences without touching
the engine's queues, so a bad prompt anywhere rejects the submission with nothing queued. `add_prepared` then
queues one group atomically; should it still fail for a later group, the groups this submission queued are
aborted and forgotten, so no sample runs for a request that was answered with an error."""
from __future__ import annotations

from typing import Any

from stateserve.core.request import Request


def add_all(engine: Any, prepared: list[list[Request]]) -> list[str]:
    """Queue every prepared group (the sequences of one prompt); on any error nothing stays queued. Returns the
    group ids in order."""
    added: list[str] = []
    try:
        for children in prepared:
            engine.add_prepared(children)
            added.append(children[0].group_id)
    except BaseException:
        for gid in added:
            discard_group(engine, gid)
        raise
    return added


def discard_group(engine: Any, gid: str) -> None:
    """Abort group `gid` and drop its records (add_prepared queues a group whole, so it is there or not at all)."""
    if gid in engine.groups:
        engine.abort_request(gid)
        engine.pop_output(gid)
