"""A bounded schemathesis run against the server's own OpenAPI document (issue 35): a real server on the bundled
llama-demo model, its /openapi.json loaded as is, and every operation sent generated requests, valid (positive) and
invalid (negative) by that document, plus the document's own examples. Each response must not be a server error,
and its status code, content type and body must be ones the document declares for the operation.

schemathesis' pytest integration (`schemathesis.pytest.from_fixture`, needed for a schema served by a fixture's
server) reads `Function._nodeid`, which pytest 9 removed: so this is a plain test that loops over the operations
with schemathesis' own strategies and checks, and lists every failure in one assertion message.

Bounded: at most MAX_EXAMPLES generated requests per operation and mode, derandomized (the same requests on every
run), no example database, no deadline. What a request may cost is bounded by the server's limits, not by
leaving operations out: a 64-token context (so `max_tokens` at most 64, an explicit null included) and 4 sequences
per request (prompts x n). Streamed requests are read whole: schemathesis reads server-sent events, and checks
each event against the schema the document gives the text/event-stream body."""
from __future__ import annotations

import time

import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase

from utils import demo_model, start_server

MAX_EXAMPLES = 60
MAX_MODEL_LEN = 64
MAX_SEQUENCES = 4


@pytest.fixture(scope="module")
def server():
    proc, url, _ = start_server(demo_model("llama-demo"), "--max-model-len", str(MAX_MODEL_LEN),
                                "--max-num-seqs", str(MAX_SEQUENCES),
                                "--max-sequences-per-request", str(MAX_SEQUENCES))
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _checks() -> list:
    from schemathesis import checks

    return [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
            checks.response_schema_conformance]


def _run(strategy, url: str, checks: list, statuses: list[int], max_examples: int) -> None:
    """Send what `strategy` generates (shrinking a failure to its smallest request) and check every response."""
    @hypothesis.settings(max_examples=max_examples, derandomize=True, deadline=None, database=None,
                         phases=[Phase.explicit, Phase.generate, Phase.shrink],
                         suppress_health_check=list(HealthCheck), verbosity=hypothesis.Verbosity.quiet)
    @hypothesis.given(case=strategy)
    def run(case) -> None:
        response = case.call(base_url=url, timeout=60)
        statuses.append(response.status_code)
        case.validate_response(response, checks=checks)

    run()


def test_openapi_document_matches_server(server):
    from schemathesis import GenerationMode
    from schemathesis.config import SchemathesisConfig

    url = server
    # Not a schemathesis.toml found in some folder above (generation is set by _run's settings); failures show the
    # whole request: no "[Filtered]" for fields whose names look secret to schemathesis (`tokens`, `max_tokens`)
    config = SchemathesisConfig.from_dict({"output": {"sanitization": {"enabled": False}}})
    schema = schemathesis.openapi.from_url(url + "/openapi.json", config=config)
    checks = _checks()
    failures, tried, start = [], {}, time.monotonic()
    operations = [result.ok() for result in schema.get_all_operations()]  # an invalid operation raises here
    assert len(operations) >= 12, [op.label for op in operations]
    for op in operations:
        runs = [("positive", op.as_strategy(generation_mode=GenerationMode.POSITIVE), MAX_EXAMPLES),
                ("negative", op.as_strategy(generation_mode=GenerationMode.NEGATIVE), MAX_EXAMPLES)]
        runs += [(f"example {i}", strategy, 1) for i, strategy in enumerate(op.get_strategies_from_examples())]
        for mode, strategy, n in runs:
            statuses: list[int] = []
            try:
                _run(strategy, url, checks, statuses, n)
            except hypothesis.errors.Unsatisfiable:
                # No request breaks the document: an operation without parameters or body (GET /health), or
                # one whose only parameter is any string (GET /v1/models/{model_id})
                assert mode == "negative" and not statuses, (op.label, mode, statuses)
                continue
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # noqa: BLE001 - failed checks (schemathesis' FailureGroup is a
                failures.append(f"{op.label} [{mode}]: {e}")  # BaseExceptionGroup), each with a curl to repeat
            tried[f"{op.label} [{mode}]"] = statuses
    print(f"{sum(map(len, tried.values()))} requests in {time.monotonic() - start:.1f} s:",
          {k: {s: v.count(s) for s in sorted(set(v))} for k, v in tried.items()})
    assert not failures, f"{len(failures)} operation(s) do not answer as the document says:\n\n" + \
        "\n\n".join(failures)
    # The run reached the server's real work, not just its validation: some generated or example requests succeed
    succeeded = {k for k, v in tried.items() if 200 in v}
    for label in ("POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize", "POST /detokenize"):
        assert any(k.startswith(label + " ") for k in succeeded), (label, tried)
