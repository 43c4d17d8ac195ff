"""A failing engine step through a real server (issue 32, item 2): STATESERVE_FAULT_INJECT makes one layer of the
bundled hybrid demo (attention + Mamba2 layers, so recurrent state is at stake) raise in one step. The request in
that step fails with a 500 (or an error event in its stream) that says so; the server keeps serving, and the same
request afterwards gets byte for byte the completion it got before the fault (no half-advanced state reused)."""
from __future__ import annotations

import json
import re
import signal

import httpx2
import pytest
from utils import start_server

from stateserve.assets import bundled_models

MODEL = bundled_models().get("hybrid-demo")
pytestmark = pytest.mark.skipif(MODEL is None, reason="the bundled hybrid demo model is missing")
BODY = {"model": "demo", "prompt": "The with statement is used to", "max_tokens": 16, "temperature": 0,
        "ignore_eos": True}
FAULT_STEP = 20  # the first request runs forwards 0-15, the second 16-31: the fault lands in its 5th


def _completion(http: httpx2.Client) -> bytes:
    resp = http.post("/v1/completions", json=BODY)
    assert resp.status_code == 200, resp.text
    return re.sub(rb'^{"id":"cmpl-[0-9a-f]+","object":"text_completion","created":\d+,', b"", resp.content)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_failing_step_fails_its_request_and_the_server_serves_on(stream):
    proc, url, lines = start_server(MODEL, "--served-model-name", "demo", "--uvicorn-log-level", "warning",
                                    env={"STATESERVE_FAULT_INJECT": f"layer=0,step={FAULT_STEP}"})
    try:
        with httpx2.Client(base_url=url, timeout=60) as http:
            before = _completion(http)
            if stream:
                with http.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as resp:
                    assert resp.status_code == 200
                    events = [ln[len("data: "):] for ln in resp.iter_lines() if ln.startswith("data: ")]
                errors = [json.loads(e)["error"] for e in events if e != "[DONE]" and "error" in json.loads(e)]
                assert len(errors) == 1 and errors[0]["code"] == "engine_step_failed", events
                assert "InjectedFault" in errors[0]["message"], errors
            else:
                resp = http.post("/v1/completions", json=BODY)
                assert resp.status_code == 500, resp.text
                error = resp.json()["error"]
                assert error["code"] == "engine_step_failed" and "InjectedFault" in error["message"], error
            assert http.get("/health").status_code == 200
            assert _completion(http) == before  # the same prompt again: the fault-free completion
            metrics = http.get("/metrics").text
            assert re.search(r"^stateserve:num_requests_running 0", metrics, re.M), metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    assert rc == 0, "".join(lines[-40:])
