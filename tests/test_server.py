"""OpenAI-compatible server against a real uvicorn on 127.0.0.1, driven by the official `openai` client:
completions and chat (plain and streamed) equal transformers' greedy output, errors in OpenAI's shape, a
32-stream load test with disconnects that leaves every pool full, 503 on a full queue, and graceful
shutdown on SIGTERM/SIGINT in a subprocess."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import threading
import time

import httpx2
import openai
import pytest
import uvicorn
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from stateserve.config import EngineConfig
from stateserve.engine.llm_engine import LLMEngine
from stateserve.models.folder import load_tokenizer
from stateserve.entrypoints.async_engine import AsyncEngine
from stateserve.entrypoints.server import GracefulServer, bind_socket, build_app
from utils import build_hf_model, hf_greedy, save_model, start_server

CFG = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=1)
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
NAME = "tiny-llama"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir):
    hf = build_hf_model(LlamaConfig, LlamaForCausalLM, **CFG)
    out = str(tmp_path_factory.mktemp("llama_chat"))
    save_model(hf, out)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    return hf, out, tok


class ServerThread:
    """uvicorn in a background thread on a free loopback port."""

    def __init__(self, path: str, **engine_kwargs) -> None:
        llm_engine = LLMEngine(EngineConfig.from_kwargs(model=path, **engine_kwargs), show_progress=False)
        self.engine = AsyncEngine(llm_engine)
        self.app = build_app(self.engine, load_tokenizer(llm_engine.config), [NAME])
        self.sock = bind_socket("127.0.0.1", 0)
        self.base_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=5)
        self.server = GracefulServer(config, self.app, grace_s=1.0)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        self.client = openai.OpenAI(base_url=self.base_url + "/v1", api_key="none", max_retries=0, timeout=60)

    def call(self, fn):
        return self.engine.call_sync(fn, timeout=10)

    def wait_idle(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.call(lambda e: e.has_unfinished() or bool(e.groups)):
            assert time.monotonic() < deadline, "engine still busy"
            time.sleep(0.02)
        self.call(lambda e: e.check_integrity())
        assert self.call(lambda e: e.cache.is_idle_and_full())

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


@pytest.fixture(scope="module")
def srv(model_dir):
    s = ServerThread(model_dir[1], max_num_seqs=40, max_num_batched_tokens=64)  # prefix caching on (default)
    yield s
    s.stop()
    assert not s.thread.is_alive()
    assert s.engine.final_state == {"aborted": 0, "integrity_ok": True, "idle_and_full": True}


def greedy_text(model_dir, prompt_ids, n):
    hf, _, tok = model_dir
    ids = hf_greedy(hf, [prompt_ids], n)[0]
    return ids, tok.decode(ids, skip_special_tokens=True)


def test_health_and_models(srv):
    assert httpx2.get(srv.base_url + "/health", timeout=10).status_code == 200
    cards = srv.client.models.list().data
    assert [c.id for c in cards] == [NAME]


def test_completion_equals_transformers(srv, model_dir):
    tok = model_dir[2]
    prompt = "The quick brown fox"
    ref_ids, ref_text = greedy_text(model_dir, tok(prompt).input_ids, 8)
    out = srv.client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert out.choices[0].text == ref_text and out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(tok(prompt).input_ids) and out.usage.completion_tokens == 8
    # several prompts (text and token ids) with n=2 greedy: index = prompt * n + sample
    ids2 = [5, 6, 7, 8]
    out = srv.client.completions.create(model=NAME, prompt=[ids2, tok(prompt).input_ids], max_tokens=8, n=2,
                                        temperature=0, extra_body={"ignore_eos": True}, echo=True)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[2].text == out.choices[3].text == prompt + ref_text
    assert out.choices[0].text == tok.decode(ids2) + greedy_text(model_dir, ids2, 8)[1]
    assert out.usage.completion_tokens == 32


def _stream_text(chunks):
    text, finishes, per_step = {}, {}, []
    for c in chunks:
        for ch in c.choices:
            piece = ch.text if hasattr(ch, "text") else (ch.delta.content or "")
            text[ch.index] = text.get(ch.index, "") + piece
            per_step.append(ch.index)
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    return text, finishes, per_step


def test_streamed_completion_and_stop_strings(srv, model_dir):
    tok = model_dir[2]
    prompt = "Attention reads every"
    ref_ids, ref_text = greedy_text(model_dir, tok(prompt).input_ids, 12)
    chunks = list(srv.client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
    text, finishes, steps = _stream_text(chunks)
    assert text == {0: ref_text} and finishes == {0: "length"}
    assert len(steps) == 12  # one chunk per engine step
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    # a stop string across a token boundary: cut in both modes, and its first half never leaks early
    stop = None
    for k in range(2, len(ref_ids) - 1):
        cut = len(tok.decode(ref_ids[:k]))
        candidate = ref_text[cut - 1:cut + 1]
        if len(candidate) == 2 and ref_text.index(candidate) == cut - 1:
            stop = candidate
            break
    assert stop is not None
    plain = srv.client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stop=[stop],
                                          extra_body={"ignore_eos": True}).choices[0]
    assert plain.finish_reason == "stop" and plain.text == ref_text[:ref_text.index(stop)]
    streamed = srv.client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0,
                                             stop=[stop], stream=True, extra_body={"ignore_eos": True})
    text, finishes, _ = _stream_text(streamed)
    assert text == {0: plain.text} and finishes == {0: "stop"}


def test_chat_plain_and_streamed(srv, model_dir):
    tok = model_dir[2]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "The lazy dog"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    _, ref_text = greedy_text(model_dir, tok(rendered, add_special_tokens=False).input_ids, 10)
    out = srv.client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == ref_text
    assert out.usage.completion_tokens == 10
    chunks = list(srv.client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                                     stream=True, stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text, finishes, steps = _stream_text(chunks)
    assert text == {0: ref_text} and finishes == {0: "length"} and len(steps) == 1 + 10
    assert chunks[-1].usage.total_tokens == out.usage.total_tokens


def test_logprobs(srv):
    out = srv.client.completions.create(model=NAME, prompt=[3, 4, 5], max_tokens=4, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) >= 2 for t in lp.top_logprobs)
    chat = srv.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=3, logprobs=True, top_logprobs=2, temperature=0)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)  # greedy = top-1


def _expect_error(status, fn, code=None, message=None):
    with pytest.raises(openai.APIStatusError) as info:
        fn()
    err = info.value
    assert err.status_code == status, err
    body = err.response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    if code:
        assert body["code"] == code
    if message:
        assert message in body["message"], body
    return body


def test_errors_in_openai_shape(srv):
    c = srv.client
    ok = dict(model=NAME, prompt="hello", max_tokens=2)
    # a stream runs through all the bad requests below and must come out exactly as if alone
    bystander: dict[str, str] = {}
    greedy = dict(model=NAME, prompt=[7, 8, 9], max_tokens=150, temperature=0, extra_body={"ignore_eos": True})

    def run_bystander():
        bystander.update(_stream_text(c.completions.create(**greedy, stream=True))[0])

    thread = threading.Thread(target=run_bystander, daemon=True)
    thread.start()
    body = _expect_error(400, lambda: c.completions.create(**{**ok, "temperature": -1}), message="temperature")
    assert body["type"] == "invalid_request_error" and body["param"] == "temperature"
    _expect_error(400, lambda: c.completions.create(**{**ok, "top_p": 0}), message="top_p")
    _expect_error(400, lambda: c.completions.create(**{**ok, "max_tokens": 600}), code="context_length_exceeded")
    _expect_error(400, lambda: c.completions.create(**{**ok, "prompt": [5, 9999]}), message="vocabulary")
    _expect_error(400, lambda: c.completions.create(**ok, extra_body={"frobnicate": 1}),
                  message="Unrecognized request argument supplied: frobnicate")
    _expect_error(400, lambda: c.chat.completions.create(model=NAME, messages=[{"role": "tool", "content": "x"}]))
    _expect_error(404, lambda: c.completions.create(**{**ok, "model": "gpt-17"}), code="model_not_found")
    _expect_error(400, lambda: c.embeddings.create(model=NAME, input="hi"), message="does not support embeddings")
    raw = httpx2.post(srv.base_url + "/v1/completions", content=b'{"prompt": "x", ',
                      headers={"Content-Type": "application/json"}, timeout=10)
    assert raw.status_code == 400 and set(raw.json()["error"]) == {"message", "type", "param", "code"}
    thread.join(30)
    assert bystander == {0: c.completions.create(**greedy).choices[0].text}
    # none of that disturbed the engine, and the server still answers
    srv.wait_idle()
    assert c.completions.create(**ok).choices[0].finish_reason in ("length", "stop")


def test_load_32_streams_with_disconnects(srv):
    before = srv.call(lambda e: dict(e.stats))
    max_tokens, n_streams, quitters = 20, 32, {3, 11, 19, 27}
    peak = {"running": 0}

    async def one(client, i):
        stream = await client.completions.create(
            model=NAME, prompt=[3 + i, 4, 5 + i % 7], max_tokens=400 if i in quitters else max_tokens,
            temperature=0.8, seed=i, stream=True, extra_body={"ignore_eos": True})
        n = 0
        async for chunk in stream:
            n += len(chunk.choices)
            peak["running"] = max(peak["running"], srv.engine.snapshot["running"])
            if i in quitters and n == 3:
                await stream.close()  # the client goes away mid-stream
                return None
        return n

    async def main():
        async with openai.AsyncOpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0,
                                      timeout=60) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(n_streams))), 60)

    counts = asyncio.run(main())
    assert [c for i, c in enumerate(counts) if i not in quitters] == [max_tokens] * (n_streams - len(quitters))
    assert peak["running"] > 8  # the connections really shared one continuous batch
    srv.wait_idle(timeout=10)
    generated = srv.call(lambda e: e.stats["generation_tokens"]) - before["generation_tokens"]
    # the quitters were aborted soon after leaving, far before their 400 tokens
    assert generated < (n_streams - len(quitters)) * max_tokens + len(quitters) * 100


def test_non_streamed_client_timeout_aborts(srv):
    before = srv.call(lambda e: e.stats["generation_tokens"])
    real_step = srv.call(lambda e: e.step)

    def slow_step():  # at most ~200 steps in a second, however fast the machine: the abort must cut the request
        time.sleep(0.005)
        return real_step()

    srv.call(lambda e: setattr(e, "step", slow_step))
    try:
        with pytest.raises(httpx2.TimeoutException):
            httpx2.post(srv.base_url + "/v1/completions", timeout=0.3,
                        json={"prompt": [4, 5], "max_tokens": 480, "ignore_eos": True})
        srv.wait_idle(timeout=10)
    finally:
        srv.call(lambda e: delattr(e, "step"))
    assert srv.call(lambda e: e.stats["generation_tokens"]) - before < 400


def test_engine_failure_answers_503(model_dir):
    s = ServerThread(model_dir[1], max_num_seqs=4)
    try:
        client = s.client.with_options(timeout=15)
        assert client.completions.create(model=NAME, prompt=[5, 6], max_tokens=2).usage.completion_tokens == 2

        def broken_step():
            raise RuntimeError("boom: the device fell off")

        s.call(lambda e: setattr(e, "step", broken_step))
        body = _expect_error(503, lambda: client.completions.create(model=NAME, prompt=[5, 6], max_tokens=2),
                             code="engine_dead", message="boom")
        assert body["type"] == "server_error"
        assert httpx2.get(s.base_url + "/health", timeout=10).status_code == 503
        _expect_error(503, lambda: client.completions.create(model=NAME, prompt=[5], max_tokens=2))
    finally:
        s.stop()


def test_serve_defaults_to_a_smaller_step_budget_than_generate():
    from stateserve.entrypoints.cli import build_parser, engine_kwargs
    from stateserve.entrypoints.server import SERVER_MAX_NUM_BATCHED_TOKENS

    parser = build_parser()
    serve = engine_kwargs(parser.parse_args(["serve", "some/model"]))
    generate = engine_kwargs(parser.parse_args(["generate", "--prompt", "hi"]))
    assert serve["max_num_batched_tokens"] == SERVER_MAX_NUM_BATCHED_TOKENS == 512
    assert generate["max_num_batched_tokens"] == 2048
    explicit = engine_kwargs(parser.parse_args(["serve", "some/model", "--max-num-batched-tokens", "4096"]))
    assert explicit["max_num_batched_tokens"] == 4096


def test_build_off_main_thread_returns_or_reraises_from_a_thread_of_its_own():
    from stateserve.entrypoints.async_engine import build_off_main_thread

    assert build_off_main_thread(threading.current_thread) is not threading.main_thread()
    with pytest.raises(ZeroDivisionError):
        build_off_main_thread(lambda: 1 / 0)


def test_serve_builds_the_engine_off_the_main_thread(monkeypatch, model_dir):
    """The main thread must not own an OpenMP team (see build_off_main_thread): `stateserve serve` loads and warms
    the engine on a builder thread."""
    import stateserve.engine.llm_engine as llm_engine_module
    from stateserve.entrypoints.cli import build_parser

    built_on = []

    class Stop(Exception):
        pass

    class RecordingEngine:
        def __init__(self, config, show_progress=True):
            built_on.append(threading.current_thread())
            raise Stop  # stop cmd_serve before it serves

    monkeypatch.setattr(llm_engine_module, "LLMEngine", RecordingEngine)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # cmd_serve's SIGTERM handler: not in the test process
    args = build_parser().parse_args(["serve", model_dir[1], "--port", "0"])
    with pytest.raises(Stop):
        args.func(args)
    assert len(built_on) == 1 and built_on[0] is not threading.main_thread()


def test_gil_switch_interval_is_short_while_the_engine_runs_and_restored_after(model_dir):
    from stateserve.entrypoints.async_engine import _GIL_SWITCH_INTERVAL_S

    original = sys.getswitchinterval()  # another engine of this module may have set it already
    sys.setswitchinterval(0.004)
    try:
        s = ServerThread(model_dir[1], max_num_seqs=4)
        try:
            assert sys.getswitchinterval() == _GIL_SWITCH_INTERVAL_S
        finally:
            s.stop()
        assert sys.getswitchinterval() == 0.004
    finally:
        sys.setswitchinterval(original)


def test_metrics(srv):
    text = httpx2.get(srv.base_url + "/metrics", timeout=10).text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_blocks_used", "kv_cache_blocks_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "prompt_tokens_total",
                 "generation_tokens_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket"):
        assert f"stateserve:{name}" in text, name

    def value(name):
        return float(re.search(rf"^stateserve:{name} (\S+)$", text, re.M).group(1))

    assert value("generation_tokens_total") > 100 and value("prompt_tokens_total") > 10
    assert value("prefix_cache_queries_total") > 0
    assert value("time_to_first_token_seconds_count") > 10 and value("inter_token_latency_seconds_count") > 100
    assert value("kv_cache_blocks_used") == 0 and value("kv_cache_blocks_total") > 0


def _start_subprocess(path, *extra):
    return start_server(path, "--served-model-name", NAME, "--no-enable-prefix-caching", "--max-num-batched-tokens",
                        "64", "--uvicorn-log-level", "warning", *extra)


def _metric(url, name):
    text = httpx2.get(url + "/metrics", timeout=5).text
    return float(re.search(rf"^stateserve:{name} (\S+)$", text, re.M).group(1))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_overload_and_graceful_shutdown(model_dir, sig):
    proc, url, lines = _start_subprocess(model_dir[1], "--max-num-seqs", "2", "--max-waiting-requests", "1",
                                         "--shutdown-timeout", "0.05")
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    results: dict[int, object] = {}

    def stream(i):
        try:
            chunks = list(client.completions.create(model=NAME, prompt=[3 + i, 9], max_tokens=480, stream=True,
                                                    extra_body={"ignore_eos": True}))
            results[i] = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
        except Exception as e:  # noqa: BLE001 - recorded for the assertion below
            results[i] = e

    try:
        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while not (_metric(url, "num_requests_running") == 2 and _metric(url, "num_requests_waiting") == 1):
            assert time.monotonic() < deadline, "the three streams never filled the batch and the queue"
            time.sleep(0.02)
        with pytest.raises(openai.APIStatusError) as info:  # 2 running + 1 waiting: the queue is full
            client.completions.create(model=NAME, prompt=[5], max_tokens=2)
        assert info.value.status_code == 503 and "retry-after" in info.value.response.headers
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0, "".join(lines)
        for t in threads:
            t.join(10)
        # every in-flight stream ended cleanly, finished or aborted, none with a transport error
        assert all(isinstance(r, list) and len(r) == 1 and r[0] in ("length", "abort") for r in results.values()), \
            results
        assert len(results) == 3
        # the waiting stream cannot finish 480 tokens after the other two within 0.05 s: it was aborted
        assert any(r == ["abort"] for r in results.values()), results
        assert any("shutdown complete: caches free" in line for line in lines), "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
