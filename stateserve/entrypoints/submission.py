"""Adding one HTTP request's prompts to the engine all at once or not at all (engine thread only).

A request is validated whole before any part of it is queued: every prompt (`LLMEngine.validate_prompt`, by the
caller, AsyncEngine._do_add, before it checks the queue's room), and its SamplingParams were checked when built (seed + n - 1 included, since sample i is seeded with seed + i). If adding
still fails half-way (a prompt after the first, or a sample after the first of a prompt), everything this
submission queued is aborted and forgotten, so no sample runs for a request that was answered with an error."""
from __future__ import annotations

from typing import Any

from stateserve.sampling_params import SamplingParams


def add_all(engine: Any, group_ids: list[str], prompts: list[tuple[str | None, list[int]]],
            params: SamplingParams) -> None:
    """Queue `prompts[i]` as group `group_ids[i]` (n samples each) after the caller validated every prompt; on any
    error nothing stays queued."""
    tried: list[str] = []
    try:
        for gid, (text, ids) in zip(group_ids, prompts):
            tried.append(gid)  # before the call: a group it leaves half-added is cleaned up too
            # one share of the engine's admission for the whole submission, however many prompts it has
            engine.add_request(gid, ids, params, prompt=text, fairness_key=group_ids[0])
    except BaseException:
        for gid in tried:
            discard_group(engine, gid)
        raise


def discard_group(engine: Any, gid: str) -> None:
    """Abort group `gid` and drop its records, including a group that `add_request` left half-added (some of
    its samples queued before it raised, so it never reached `engine.groups`). The ids are this server's own
    (unique per submission), so no other request's group can be hit."""
    if gid not in engine.groups:
        leftovers = [r for r in getattr(engine, "requests", {}).values() if getattr(r, "group_id", None) == gid]
        if not leftovers:
            return
        engine.groups[gid] = leftovers
    engine.abort_request(gid)
    engine.pop_output(gid)
