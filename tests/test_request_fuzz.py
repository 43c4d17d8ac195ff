"""Property-based fuzz of the request schema (hypothesis) against one real `stateserve serve` on the bundled llama
demo: bodies for /v1/completions and /v1/chat/completions built from the schema's fields with plausible values,
edge values and junk of any type (huge and non-finite numbers, booleans, nulls, nested lists and objects, lone
surrogates, token ids outside the vocabulary, unknown fields, truncated JSON). Properties: never a 5xx, every 4xx
in OpenAI's error shape, every 200 a complete answer; afterwards /health is 200, nothing is left running and the
control completion is byte-identical to the one before. Bounded: 150 examples, at most ~60 s of requests."""
from __future__ import annotations

import collections
import json
import time

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from test_server_hardening import MODEL, NAME, VOCAB, Server  # noqa: E402

pytestmark = pytest.mark.skipif(MODEL is None, reason="the bundled llama demo model is missing")
BUDGET_S = 60.0
SEEN: collections.Counter = collections.Counter()  # status code -> how many examples got it
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def srv():
    # a short context and few sequences per request keep every accepted example quick
    s = Server("--max-model-len", "128", "--max-sequences-per-request", "8", "--max-num-seqs", "8")
    s.fuzz_started = time.monotonic()
    yield s
    s.stop()


SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([2**63, 2**64, -(2**63), 10**30, -1, 0, 1e29, -1e29, 1e-300, NAN, INF, -INF, 0.5]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["\ud800", "a\udfffb", "", "NaN", "1", "true", "\x00", "\u202e"]))
JUNK = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                         max_size=3), max_leaves=8)


ID = st.integers(0, VOCAB - 1)
BAD_ID = st.sampled_from([-1, VOCAB, 10**30, -(10**30), 2**63])
TEXT = st.text(max_size=30)
# Values a well-behaved client sends (interactions may still refuse some: min_tokens > max_tokens, ...)
VALID_SAMPLING = {
    "n": st.integers(1, 2), "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 0.5), "seed": st.integers(0, 2**64 - 3), "stop": st.lists(st.text(min_size=1, max_size=4),
                                                                                    max_size=3),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "min_tokens": st.integers(0, 2), "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(ID, max_size=3), "skip_special_tokens": st.booleans(), "stream": st.booleans(),
    "user": st.text(max_size=8),
}
# Edges and beyond, per field (and JUNK of any type, see body_for)
WILD_SAMPLING = {
    "n": st.integers(-1, 200),
    "temperature": st.one_of(st.floats(-0.5, 2.5), st.sampled_from([0, 1e29, NAN, INF, -INF, 100, 101, 1e-300])),
    "top_p": st.one_of(st.floats(-0.2, 1.2), st.sampled_from([0, NAN, 1e-300])),
    "top_k": st.one_of(st.integers(-3, VOCAB + 3), st.sampled_from([2**63, 2**64, 2**63 - 1, -(2**63)])),
    "min_p": st.floats(-0.2, 1.2),
    "seed": st.one_of(st.integers(-3, 2**64 + 3), st.sampled_from([2**64 - 1, 2**64 - 2, -(2**63)])),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=70), st.just("x" * 1025),
                      st.just(["x" * 1024] * 64)),
    "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.one_of(st.floats(-0.5, 3), st.sampled_from([1e29, 1e-300, 0.005, 0.01, 100])),
    "min_tokens": st.integers(-2, 300), "stop_token_ids": st.lists(st.one_of(ID, BAD_ID), max_size=4),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                          "continuous_usage_stats": st.booleans()}),
    "logit_bias": st.dictionaries(st.text(max_size=3), st.floats(allow_nan=True), max_size=2),
}
PROMPT = st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=2), st.lists(ID, min_size=1, max_size=8),
                   st.lists(st.lists(ID, min_size=1, max_size=5), min_size=1, max_size=2))
COMPLETION = ({**VALID_SAMPLING, "max_tokens": st.integers(1, 12), "logprobs": st.integers(0, 5),
               "echo": st.booleans()},
              {**WILD_SAMPLING, "max_tokens": st.one_of(st.integers(-2, 130), st.sampled_from([10**30, 2**63])),
               "logprobs": st.integers(-2, 22), "best_of": st.integers(0, 3), "suffix": st.text(max_size=3),
               "prompt": st.one_of(
                   st.lists(st.one_of(ID, BAD_ID), max_size=8), st.lists(st.lists(st.one_of(ID, BAD_ID), max_size=5),
                                                                         max_size=3),
                   st.lists(TEXT, max_size=12), st.sampled_from(["\ud800", "x\udc00", "", "<|endoftext|>"]))})
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "developer"]),
                                 "content": TEXT})
WILD_MESSAGE = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "tool", "bogus", "function"]), JUNK),
     "content": st.one_of(TEXT, JUNK, st.lists(st.fixed_dictionaries(
         {"type": st.sampled_from(["text", "image_url"]), "text": st.one_of(TEXT, JUNK)}), max_size=2))},
    optional={"name": st.one_of(st.text(max_size=5), JUNK), "tool_calls": JUNK})
CHAT = ({**VALID_SAMPLING, "max_completion_tokens": st.integers(1, 8), "logprobs": st.booleans(),
         "add_generation_prompt": st.booleans()},
        {**WILD_SAMPLING, "max_tokens": st.one_of(st.integers(-2, 130), st.just(10**30)),
         "max_completion_tokens": st.integers(-1, 130), "top_logprobs": st.integers(-2, 22),
         "messages": st.one_of(st.lists(WILD_MESSAGE, max_size=3), JUNK),
         "chat_template_kwargs": st.dictionaries(st.text(max_size=8), JUNK, max_size=2),
         "tools": JUNK, "tool_choice": JUNK, "response_format": JUNK, "metadata": JUNK, "modalities": JUNK})


def body_for(fields: tuple[dict, dict], required: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """A body with its required fields and a few well-behaved optional ones, then up to two fields (any known
    one) set to an edge value or to junk of any type, and now and then unknown fields or a junk `model`."""
    valid, wild = fields

    @st.composite
    def build(draw):
        body = {k: draw(v) for k, v in required.items()}
        for key in draw(st.lists(st.sampled_from(sorted(valid)), max_size=4, unique=True)):
            body[key] = draw(valid[key])
        for key in draw(st.lists(st.sampled_from(sorted(wild)), max_size=2, unique=True)):
            body[key] = draw(st.one_of(wild[key], wild[key], JUNK, st.none()))
        if draw(st.integers(0, 9)) == 0:
            body.update(draw(st.dictionaries(st.text(max_size=8), JUNK, min_size=1, max_size=2)))
        body["model"] = NAME if draw(st.integers(0, 9)) else draw(JUNK)
        return body

    return build()


REQUESTS = st.one_of(
    st.tuples(st.just("completions"), body_for(COMPLETION, {"prompt": PROMPT})),
    st.tuples(st.just("chat/completions"),
              body_for(CHAT, {"messages": st.lists(MESSAGE, min_size=1, max_size=3),
                              "max_tokens": st.integers(1, 8)})))
DAMAGE = st.sampled_from(["none"] * 12 + ["truncate", "raw-surrogate", "not-utf8", "not-an-object"])


def encode(body: dict, damage: str) -> bytes:
    raw = json.dumps(body, allow_nan=True).encode()  # NaN / Infinity literals; surrogates as \\udXXX escapes
    if damage == "truncate":
        return raw[: len(raw) // 2]
    if damage == "raw-surrogate":
        return raw.replace(b'"model"', b'"mo\xed\xa0\x80del"', 1)
    if damage == "not-utf8":
        return raw.replace(b'"model"', b'"mo\xffdel"', 1)
    if damage == "not-an-object":
        return b"[" + raw + b"]"
    return raw


def check_response(resp, streamed: bool) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text[:500])
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"] and err["type"] == "invalid_request_error", err
        assert err["param"] is None or isinstance(err["param"], str), err
        return
    assert resp.status_code == 200, resp.text[:500]
    if streamed:
        events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", resp.text[-500:]
        assert all("error" not in json.loads(e) for e in events[:-1]), resp.text[-500:]
    else:
        assert resp.json()["choices"], resp.text[:500]


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example,
                                 HealthCheck.function_scoped_fixture])
@given(request=REQUESTS, damage=DAMAGE)
def test_no_request_gets_a_5xx(srv, request, damage):
    if time.monotonic() - srv.fuzz_started > BUDGET_S:
        return  # the time budget is spent: the remaining examples are not sent
    endpoint, body = request
    resp = srv.post(encode(body, damage), endpoint, timeout=60)
    SEEN[resp.status_code] += 1
    check_response(resp, streamed=body.get("stream") is True and resp.headers.get("content-type", "").startswith(
        "text/event-stream"))
    srv.assert_unharmed()  # /health 200, and the control completion byte-identical, after every example


def test_the_engine_is_unharmed_after_the_fuzz(srv):
    """Runs after the fuzz (same module, file order): health, nothing left running, the same control answer."""
    deadline = time.monotonic() + 10
    while srv.metric("num_requests_running") or srv.metric("num_requests_waiting"):
        assert time.monotonic() < deadline, "requests left running after the fuzz"
        time.sleep(0.05)
    assert srv.metric("kv_cache_blocks_used") == 0
    srv.assert_unharmed()
    print("fuzz answers by status:", dict(SEEN))
    # the fuzz reached both sides: requests that ran and requests refused
    assert SEEN[200] >= 10 and sum(v for k, v in SEEN.items() if 400 <= k < 500) >= 50, SEEN
