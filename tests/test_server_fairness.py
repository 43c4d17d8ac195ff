"""One client's share through a real server (issue 32, item 7): a request of many sequences arrives first, then
another client's single short request; with room for 4 sequences at a time, the short one is admitted at the next
free slot (fair admission between submissions), not after every sequence of the big one."""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx2
import pytest
from utils import start_server

from stateserve.assets import bundled_models

MODEL = bundled_models().get("llama-demo")
pytestmark = pytest.mark.skipif(MODEL is None, reason="the bundled llama demo model is missing")


def test_a_small_request_is_not_starved_by_a_big_one():
    proc, url, lines = start_server(MODEL, "--served-model-name", "demo", "--max-num-seqs", "4",
                                    "--uvicorn-log-level", "warning")
    finished_big: list[float] = []  # when each of the big request's sequences finished

    def big() -> None:
        body = {"model": "demo", "prompt": [f"The {w} statement" for w in ("for", "while", "with", "try")],
                "n": 16, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx2.Client(base_url=url, timeout=300) as http, \
                http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        if choice.get("finish_reason"):
                            finished_big.append(time.monotonic())

    try:
        worker = threading.Thread(target=big)
        worker.start()
        with httpx2.Client(base_url=url, timeout=300) as http:
            deadline = time.monotonic() + 60
            while not finished_big and time.monotonic() < deadline:  # the big request holds every slot by now
                time.sleep(0.01)
            resp = http.post("/v1/completions", json={"model": "demo", "prompt": "The import statement",
                                                      "max_tokens": 8, "temperature": 0, "ignore_eos": True})
            small_done = time.monotonic()
            assert resp.status_code == 200, resp.text
        worker.join(timeout=300)
        assert len(finished_big) == 64
        before_small = sum(t <= small_done for t in finished_big)
        # first come, first served would finish ~60 of the 64 first; a fair turn lets the small one in after the
        # next free slot (and its 8 tokens run beside at most 3 big sequences that finish meanwhile)
        assert before_small <= 12, f"{before_small} of 64 big sequences finished before the small request"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
