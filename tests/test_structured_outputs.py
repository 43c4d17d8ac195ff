"""SamplingParams(structured_outputs=...) (issue 35): JSON schema, any JSON object, regex, choice and Lark grammar,
for a decoder, an attention-free model and a hybrid (the trained demo models, whose tokenizers are real); outputs
parse and validate; constrained and free requests share batches; a bad constraint is a ValueError naming it."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from stateserve import LLM, SamplingParams
from stateserve.sampling_params import SamplingParamsError
from utils import demo_model

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "kind": {"enum": ["list", "dict", "set"]}}, "required": ["name", "age", "kind"], "additionalProperties": False}
PROMPTS = ["The with statement is used to", "A list comprehension consists of"]


@pytest.fixture(scope="module", params=["llama-demo", "mamba2-demo", "hybrid-demo"])
def llm(request):
    with LLM(demo_model(request.param), enable_prefix_caching=False) as engine:
        yield engine


def _gen(llm: LLM, so: dict, prompts=PROMPTS, **kw):
    params = SamplingParams(max_tokens=96, temperature=kw.pop("temperature", 0.0), structured_outputs=so, **kw)
    return [c for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]


def test_json_schema(llm):
    for out in _gen(llm, {"json": SCHEMA}) + _gen(llm, {"json": json.dumps(SCHEMA)}, temperature=1.0, seed=1):
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_json_object_regex_choice_and_grammar(llm):
    # any object: a small model may write one string until max_tokens; every object it closes must parse
    closed = [o for o in _gen(llm, {"json_object": True}, n=4, temperature=1.0, seed=3) if o.finish_reason == "stop"]
    assert closed and all(isinstance(json.loads(o.text), dict) for o in closed)
    for out in _gen(llm, {"regex": r"[0-9]{3}-[0-9]{4}"}):
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", out.text), out.text
    for out in _gen(llm, {"choice": ["yes", "no", "perhaps not"]}, temperature=1.0, seed=2):
        assert out.text in ("yes", "no", "perhaps not")
    grammar = 'start: ("hello" | "bye") " " NAME "!"\nNAME: /[a-z]{1,8}/'
    for out in _gen(llm, {"grammar": grammar}):
        assert re.fullmatch(r"(hello|bye) [a-z]{1,8}!", out.text), out.text


def test_constrained_and_free_requests_share_a_batch(llm):
    free = SamplingParams(max_tokens=20, temperature=0)
    alone = llm.generate(PROMPTS, free, use_tqdm=False)
    mixed = llm.generate(PROMPTS + PROMPTS, [free, free] + [SamplingParams(
        max_tokens=96, temperature=0, structured_outputs={"json": SCHEMA})] * 2, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    for o in mixed[2:]:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)


def test_bad_constraints_are_refused(llm):
    with pytest.raises(SamplingParamsError, match="exactly one of"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["b"]})
    with pytest.raises(SamplingParamsError, match="unexpected keyword"):
        SamplingParams(structured_outputs={"schema": {}})
    with pytest.raises(ValueError, match="structured_outputs"):
        _gen(llm, {"json": {"type": "bogus"}})
    with pytest.raises(ValueError, match="structured_outputs"):
        _gen(llm, {"json": "{not json"})
    with pytest.raises(ValueError, match="structured_outputs"):
        _gen(llm, {"grammar": "start: ("})
