"""Hostile requests against a real `stateserve serve` subprocess on the bundled llama demo model (issue 32): every
numeric sampling field is range-checked with a 400 naming it (NaN/Infinity, booleans, absurd values), top_k = 2^63
no longer reaches the sampler, invalid Unicode and out-of-vocabulary echo ids are 400s not 500s, a request that is
refused queues nothing (n=2 with an overflowing seed), stop strings and prompts x n are capped, a body over the
limit is a 413 (by Content-Length before reading, chunked when it passes the limit), and a 20 MB prompt is refused
in milliseconds without stalling another client or leaving the process GB-large. After every abusive request
/health answers 200 and a greedy control completion is byte-identical to the one before."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import threading
import time

import httpx2
import pytest
from utils import start_server

from stateserve.assets import bundled_models
from stateserve.sampling_params import SamplingParams

NAME = "demo"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = bundled_models().get("llama-demo")
VOCAB = 2048  # the llama demo's vocabulary
pytestmark = pytest.mark.skipif(MODEL is None, reason="the bundled llama demo model is missing")
CONTROL = {"model": NAME, "prompt": "The for statement", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
           "logprobs": 2}


class Server:
    """`stateserve serve` on the llama demo in a subprocess (stateserve logs on stdout, uvicorn on stderr: both are
    read, in one stream, for the port and for the report if it fails)."""

    def __init__(self, *extra: str) -> None:
        self.proc, self.url, self.lines = start_server(MODEL, "--served-model-name", NAME,
                                                       "--max-num-batched-tokens", "128", "--uvicorn-log-level",
                                                       "warning", *extra, timeout_s=300)
        self.port = int(self.url.rsplit(":", 1)[1])
        self.http = httpx2.Client(base_url=self.url, timeout=60)
        self.control_before = self.control()

    def post(self, body: dict | bytes | str, endpoint: str = "completions", **kw) -> httpx2.Response:
        if isinstance(body, dict):
            return self.http.post(f"/v1/{endpoint}", json=body, **kw)
        return self.http.post(f"/v1/{endpoint}", content=body, headers={"Content-Type": "application/json"}, **kw)

    def control(self) -> bytes:
        """The greedy control completion: the server's response bytes but for its id and creation time."""
        resp = self.post(CONTROL)
        assert resp.status_code == 200, resp.text
        return re.sub(rb'^{"id":"cmpl-[0-9a-f]+","object":"text_completion","created":\d+,', b"", resp.content)

    def metric(self, name: str) -> float:
        """A sample's value; 0 for a labelled sample not yet seen."""
        text = self.http.get("/metrics").text
        found = re.search(rf"^stateserve:{re.escape(name)} (\S+)$", text, re.M)
        assert found or "{" in name, name
        return float(found.group(1)) if found else 0.0

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) / 1024

    def assert_unharmed(self) -> None:
        """/health is 200 and the control completion is byte-identical to the one before the abuse."""
        health = self.http.get("/health")
        assert health.status_code == 200, (health.text, "".join(self.lines[-30:]))
        assert self.control() == self.control_before

    def stop(self) -> None:
        self.http.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            assert self.proc.wait(timeout=30) == 0, "".join(self.lines[-40:])
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        assert "Traceback" not in "".join(self.lines), "".join(self.lines)  # no 500 was ever logged


@pytest.fixture(scope="module")
def srv():
    s = Server()
    yield s
    s.stop()


def abuse(srv: Server, body: dict | bytes | str, endpoint: str = "completions", **kw) -> httpx2.Response:
    """Send one (abusive) request; then /health must answer 200 and the control completion be byte-identical."""
    resp = srv.post(body, endpoint, **kw)
    srv.assert_unharmed()
    return resp


def expect_error(resp: httpx2.Response, status: int, param: str | None = None, *words: str) -> dict:
    """An OpenAI-shaped error: status, the four keys, `param` naming the field, the message saying `words`."""
    assert resp.status_code == status, (resp.status_code, resp.text[:500])
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["type"] == "invalid_request_error", err
    if param is not None:  # a list item's error names the item: stop_token_ids.0
        assert err["param"] == param or err["param"].startswith(param + "."), err
    for w in words:
        assert w in err["message"], (w, err)
    return err


BASE = {"model": NAME, "prompt": "hello", "max_tokens": 4}
NAN, INF = float("nan"), float("inf")
# (field, value, param) -> 400 naming param; NaN/Infinity go out as the JSON literals Python's json accepts
BAD_NUMBERS = [
    ("temperature", NAN, None), ("temperature", INF, None), ("temperature", -INF, None),
    ("temperature", 1e29, "temperature"), ("temperature", -1, "temperature"), ("temperature", True, "temperature"),
    ("temperature", "1", "temperature"), ("top_p", 0, "top_p"), ("top_p", 1.5, "top_p"), ("top_p", True, "top_p"),
    ("min_p", -0.1, "min_p"), ("min_p", 2, "min_p"), ("presence_penalty", 2.5, "presence_penalty"),
    ("frequency_penalty", -1e10, "frequency_penalty"), ("repetition_penalty", NAN, None),
    ("repetition_penalty", INF, None), ("repetition_penalty", 0, "repetition_penalty"),
    ("repetition_penalty", 1e29, "repetition_penalty"), ("repetition_penalty", -1, "repetition_penalty"),
    ("repetition_penalty", False, "repetition_penalty"), ("top_k", -2, "top_k"), ("top_k", 1.5, "top_k"),
    ("top_k", True, "top_k"), ("max_tokens", 0, "max_tokens"), ("max_tokens", -1, "max_tokens"),
    ("max_tokens", 1.0, "max_tokens"), ("max_tokens", True, "max_tokens"), ("max_tokens", 10**30, "max_tokens"),
    ("min_tokens", -1, "min_tokens"), ("min_tokens", 5, "min_tokens"), ("min_tokens", True, "min_tokens"),
    ("n", 0, "n"), ("n", 129, "n"), ("n", True, "n"), ("n", 2.0, "n"), ("seed", -1, "seed"),
    ("seed", 2**64, "seed"), ("seed", 1.5, "seed"), ("seed", True, "seed"), ("logprobs", 21, "logprobs"),
    ("logprobs", -1, "logprobs"), ("logprobs", True, "logprobs"), ("stop_token_ids", [-1], "stop_token_ids"),
    ("stop_token_ids", [10**30], "stop_token_ids"), ("stop_token_ids", [VOCAB], "stop_token_ids"),
    ("stop_token_ids", [True], "stop_token_ids"), ("echo", 1, "echo"), ("ignore_eos", "yes", "ignore_eos"),
    ("stream", 0, "stream"),
]


def test_every_numeric_field_is_range_checked_and_named(srv):
    for field, value, param in BAD_NUMBERS:
        body = json.dumps({**BASE, field: value})  # allow_nan: NaN / Infinity / -Infinity literals
        err = expect_error(abuse(srv, body), 400, param)
        if param is None:  # a non-finite literal: refused by the JSON parser, which says why
            assert "not valid JSON" in err["message"], err
        else:
            assert param in err["message"], err
    # the chat endpoint names its own fields
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    expect_error(abuse(srv, {**chat, "logprobs": True, "top_logprobs": 21}, "chat/completions"), 400, "top_logprobs")
    expect_error(abuse(srv, {**chat, "max_completion_tokens": 0}, "chat/completions"), 400, "max_completion_tokens")
    expect_error(abuse(srv, {**chat, "temperature": 1e29}, "chat/completions"), 400, "temperature")
    # null means the default
    ok = abuse(srv, {**BASE, "temperature": None, "top_p": None, "n": None, "min_tokens": None, "top_k": None,
                   "seed": None, "repetition_penalty": None, "ignore_eos": None, "echo": None, "stream": None})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 1, ok.text
    srv.assert_unharmed()


def test_huge_top_k_is_clamped_and_never_reaches_the_sampler(srv):
    for top_k in (2**63, 2**63 - 1, 10**30, VOCAB + 1):
        resp = abuse(srv, {**BASE, "top_k": top_k, "temperature": 1.0, "seed": 5})
        assert resp.status_code == 200, resp.text
    # clamped to the vocabulary = no top-k: the same tokens as without it
    same = [abuse(srv, {**BASE, "max_tokens": 8, "temperature": 1.0, "seed": 5, **extra}).json()["choices"][0]["text"]
            for extra in ({"top_k": 2**63}, {})]
    assert same[0] == same[1]
    srv.assert_unharmed()


def test_a_refused_request_queues_nothing(srv):
    """n=2 with seed 2^64-1: sample 1 would be seeded with 2^64. Refused before sample 0 is queued."""
    for _ in range(3):
        resp = abuse(srv, {**BASE, "n": 2, "seed": 2**64 - 1, "max_tokens": 900, "ignore_eos": True})
        expect_error(resp, 400, "seed", "2^64")
        for _ in range(5):  # nothing running or waiting, and no cache held, however soon we look
            assert srv.metric("num_requests_running") == 0 and srv.metric("num_requests_waiting") == 0
            assert srv.metric("kv_cache_blocks_used") == 0
            time.sleep(0.02)
    assert abuse(srv, {**BASE, "n": 2, "seed": 2**64 - 2}).status_code == 200  # the largest seed that fits
    srv.assert_unharmed()


def test_invalid_unicode_and_out_of_vocabulary_ids_are_400s(srv):
    surrogate = b'{"model": "demo", "max_tokens": 4, "prompt": "abc \\ud800 def"}'
    expect_error(abuse(srv, surrogate), 400, "prompt", "surrogate")
    encoded = b'{"model": "demo", "max_tokens": 4, "prompt": "abc \xed\xa0\x80 def"}'  # UTF-8 bytes of U+D800
    expect_error(abuse(srv, encoded), 400, "prompt", "surrogate")
    not_utf8 = b'{"model": "demo", "max_tokens": 4, "prompt": "abc \xff\xfe def"}'
    expect_error(abuse(srv, not_utf8), 400, None, "UTF-8")
    chat = b'{"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": "\\udfff"}]}'
    expect_error(abuse(srv, chat, "chat/completions"), 400, "messages.0.content", "surrogate")
    expect_error(abuse(srv, b'{"model": "\\ud800", "prompt": "x"}'), 400, "model")
    expect_error(abuse(srv, b'{"\\ud800": 1, "prompt": "x"}'), 400)
    expect_error(abuse(srv, b'{"model": "demo", "input": "\\ud800"}', "embeddings"), 400, "input")
    # a surrogate pair is a character, not an error
    assert abuse(srv, b'{"model": "demo", "max_tokens": 2, "prompt": "\\ud83d\\ude00"}').status_code == 200
    for ids in ([10**30], [-1], [5, VOCAB], [[5, 6], [-(10**30)]]):
        for echo in (True, False):
            expect_error(abuse(srv, {**BASE, "prompt": ids, "echo": echo}), 400, "prompt", "vocabulary")
    srv.assert_unharmed()


def test_stop_strings_and_sequences_per_request_are_capped(srv):
    expect_error(abuse(srv, {**BASE, "stop": [f"s{i}" for i in range(65)]}), 400, "stop", "64")
    expect_error(abuse(srv, {**BASE, "stop": [f"s{i}" for i in range(10_000)]}), 400, "stop", "64")
    expect_error(abuse(srv, {**BASE, "stop": "x" * 1025}), 400, "stop", "1024")
    assert abuse(srv, {**BASE, "stop": [f"s{i}" for i in range(64)]}).status_code == 200
    err = expect_error(abuse(srv, {**BASE, "prompt": ["a", "b", "c"], "n": 100}), 400, "n",
                       "--max-sequences-per-request")
    assert "300" in err["message"] and "256" in err["message"]
    expect_error(abuse(srv, {**BASE, "prompt": [[5]] * 257}), 400, "prompt", "--max-sequences-per-request")
    assert abuse(srv, {**BASE, "prompt": [[5]] * 4, "n": 2, "max_tokens": 1}).status_code == 200
    srv.assert_unharmed()


def _raw_http(port: int, head: bytes, body_chunks=(), read_timeout: float = 10.0) -> bytes:
    """Send a request head and body pieces on a fresh connection; return whatever the server answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=read_timeout) as sock:
        sock.sendall(head)
        for chunk in body_chunks:
            sock.sendall(chunk)
        out = b""
        while True:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            out += data
        return out


def _status_and_json(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        body = body.split(b"\r\n", 1)[1].rsplit(b"\r\n0\r\n", 1)[0]
    return status, json.loads(body)


def test_request_body_limit(srv):
    limit = 8 * 1024 * 1024  # the default --max-request-body-bytes
    rejected = srv.metric('request_rejected_total{status="413"}')
    # a Content-Length over the limit is refused before one byte of the body is sent
    t0 = time.monotonic()
    raw = _raw_http(srv.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Length: 20000000\r\n\r\n")
    status, body = _status_and_json(raw)
    assert status == 413 and body["error"]["code"] == "request_too_large", raw[:300]
    assert set(body["error"]) == {"message", "type", "param", "code"} and time.monotonic() - t0 < 2
    srv.assert_unharmed()
    # a chunked body is cut off once it passes the limit (the client sends a little more than the limit only)
    piece = b"x" * (1024 * 1024)
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece)] * (limit // len(piece) + 1)
    raw = _raw_http(srv.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Transfer-Encoding: chunked\r\n\r\n", chunks)
    status, body = _status_and_json(raw)
    assert status == 413 and "--max-request-body-bytes" in body["error"]["message"], raw[:300]
    srv.assert_unharmed()
    # 20 MB of JSON with the bulk in a field that is never used: 413, fast, through an ordinary client
    big = json.dumps({**BASE, "user": "u" * 20_000_000}).encode()
    t0 = time.monotonic()
    expect_error(abuse(srv, big), 413)
    assert time.monotonic() - t0 < 5
    # just under the limit is parsed (and refused for what it says, not for its size)
    expect_error(abuse(srv, json.dumps({**BASE, "user": "u" * (limit - 200), "n": 0}).encode()), 400, "n")
    assert srv.metric('request_rejected_total{status="413"}') == rejected + 3
    srv.assert_unharmed()


def test_a_20_mb_prompt_is_refused_quickly_without_stalling_others():
    """A 20 MB prompt string (under a raised body limit): 400 by its length in characters, in well under a
    second, while other clients' small requests keep being answered, exactly; the server's memory does not stay
    GB-high."""
    srv = Server("--max-request-body-bytes", str(64 * 1024 * 1024))
    try:
        rss_before = srv.rss_mb()
        control_text = srv.post(CONTROL).json()["choices"][0]["text"]

        async def main():
            async with httpx2.AsyncClient(base_url=srv.url, timeout=120) as client:
                done = asyncio.Event()

                async def huge():
                    t0 = time.monotonic()
                    resp = await client.post("/v1/completions", content=json.dumps(
                        {**BASE, "prompt": "word " * 4_000_000}).encode(), headers={"Content-Type": "application/json"})
                    done.set()
                    return resp, time.monotonic() - t0

                async def small():  # one small request after another, for as long as the huge one is in flight
                    answers = []
                    while not done.is_set() or len(answers) < 3:
                        t0 = time.monotonic()
                        resp = await client.post("/v1/completions", json=CONTROL)
                        answers.append((time.monotonic() - t0, resp.json()["choices"][0]["text"]))
                    return answers

                return await asyncio.gather(huge(), small())

        (resp, took), answers = asyncio.run(main())
        slowest = max(t for t, _ in answers)
        print(f"20 MB prompt answered in {took:.2f} s; {len(answers)} small requests meanwhile, the slowest "
              f"{slowest:.2f} s; RSS {rss_before:.0f} MB before, {srv.rss_mb():.0f} MB after")
        err = expect_error(resp, 400, "prompt", "characters")
        assert err["code"] == "context_length_exceeded" and took < 3, (took, err)
        assert all(text == control_text for _, text in answers) and slowest < 2, answers
        time.sleep(0.5)
        assert srv.rss_mb() < rss_before + 400, (rss_before, srv.rss_mb())
        srv.assert_unharmed()
    finally:
        srv.stop()


@pytest.mark.parametrize("kwargs,param", [
    ({"top_k": 2**63}, "top_k"), ({"top_k": True}, "top_k"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"), ({"temperature": 1e29}, "temperature"),
    ({"top_p": float("nan")}, "top_p"), ({"min_p": float("nan")}, "min_p"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"), ({"repetition_penalty": 1e29}, "repetition_penalty"),
    ({"presence_penalty": float("nan")}, "presence_penalty"), ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"n": True}, "n"), ({"n": 2.0}, "n"), ({"max_tokens": True}, "max_tokens"), ({"min_tokens": -1}, "min_tokens"),
    ({"seed": -1}, "seed"), ({"seed": 2**64}, "seed"), ({"seed": 2**64 - 1, "n": 2}, "seed"),
    ({"seed": True}, "seed"), ({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs"),
    ({"stop": ["s"] * 65}, "stop"), ({"stop": "x" * 1025}, "stop"), ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop_token_ids": [2**63]}, "stop_token_ids"),
])
def test_offline_sampling_params_refuse_the_same(kwargs, param):
    with pytest.raises(ValueError, match=param) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_offline_sampling_params_accept_the_edges():
    SamplingParams(seed=2**64 - 2, n=2)
    SamplingParams(top_k=2**63 - 1, temperature=100, repetition_penalty=100, stop=["s"] * 64, logprobs=20)
    SamplingParams(stop="x" * 1024, top_k=-1, max_tokens=None, min_tokens=10**6)


def test_tokenizing_runs_off_the_event_loop_and_long_text_is_refused_before_it():
    from stateserve.entrypoints.errors import APIError
    from stateserve.entrypoints.prompt_input import PromptInput

    threads = []

    class Tok:
        chat_template = "x"

        def get_vocab(self):
            return {"a": 0, "abcd": 1}

        def __call__(self, text, add_special_tokens=True):
            threads.append(threading.current_thread().name)
            return type("Enc", (), {"input_ids": [0] * len(text)})()

    inputs = PromptInput(Tok(), max_model_len=10, vocab_size=2)
    assert inputs.max_chars == 40  # 10 tokens x the longest vocabulary string (4 characters)
    try:
        out = asyncio.run(inputs.completion(["ab", "c"]))
        assert [ids for _, ids in out] == [[0, 0], [0]]
        assert threads and all(name.startswith("stateserve-tokenize") for name in threads)
        with pytest.raises(APIError, match="41 characters"):
            asyncio.run(inputs.completion("x" * 41))
        assert len(threads) == 2  # refused before the tokenizer saw it
        with pytest.raises(APIError, match="vocabulary"):
            asyncio.run(inputs.completion([0, 2]))
    finally:
        inputs.close()


def test_a_submission_that_fails_half_way_leaves_nothing_queued():
    """The server's own guarantee: prompt 0 is queued, queueing prompt 1 fails (add_prepared queues a group whole
    or not at all); prompt 0's samples are aborted and forgotten, and the error goes on up."""
    from types import SimpleNamespace

    from stateserve.entrypoints.submission import add_all

    class FailingEngine:
        def __init__(self):
            self.groups, self.requests, self.aborted = {}, {}, []

        def add_prepared(self, children):
            if children[0].group_id == "g1":
                raise ValueError("g1 cannot be added")
            self.groups[children[0].group_id] = children
            self.requests.update((c.request_id, c) for c in children)

        def abort_request(self, gid):
            self.aborted += [r.request_id for r in self.groups[gid]]

        def pop_output(self, gid):
            for r in self.groups.pop(gid):
                self.requests.pop(r.request_id)

    def group(gid):
        return [SimpleNamespace(request_id=f"{gid}#{i}", group_id=gid) for i in range(2)]

    engine = FailingEngine()
    with pytest.raises(ValueError, match="g1 cannot"):
        add_all(engine, [group("g0"), group("g1"), group("g2")])
    assert engine.groups == {} and engine.requests == {}
    assert sorted(engine.aborted) == ["g0#0", "g0#1"]
