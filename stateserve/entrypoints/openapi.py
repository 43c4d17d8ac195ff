"""The server's OpenAPI document: FastAPI's, made to say what the server does (tests/test_openapi_schemathesis.py
holds the server to it with schemathesis)."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from stateserve.entrypoints.openai_protocol import ErrorResponse, ModelCard, ModelList
from stateserve.entrypoints.serving_tokens import version


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, made to say what the server does (tests/test_openapi_schemathesis.py holds the server
    to it): refused requests get 400 in OpenAI's error shape (never FastAPI's 422), an unknown `model` 404, a body
    over --max-request-body-bytes 413, a full queue or a stopping server 503; successes have their bodies' schemas,
    streams are server-sent events, /metrics is Prometheus text; prompts, inputs, messages and stop strings are not
    empty, token ids lie in the vocabulary, `model` is a served name; each request body has a working example."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from stateserve.entrypoints.openai_protocol import (ChatCompletionChunk, ChatCompletionResponse,
                                                        CompletionResponse, EmbeddingResponse)
    from stateserve.entrypoints.serving_tokens import (TokenizeChatRequest, TokenizeCompletionRequest,
                                                       TokenizeResponse)

    schema = get_openapi(title=app.title, version=version(), routes=app.routes)
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    ref = _OpenAPIModels(schemas).ref
    serving = getattr(app.state, "serving", None)
    names = list(getattr(serving, "model_names", None) or [])
    vocab = getattr(serving, "vocab_size", None)
    token_id: dict[str, Any] = {"type": "integer", "minimum": 0, **({"maximum": vocab - 1} if vocab else {})}

    def error(why: str) -> dict[str, Any]:
        return {"description": why, "content": {"application/json": {"schema": ref(ErrorResponse)}}}

    def obj(**props: dict[str, Any]) -> dict[str, Any]:
        return {"type": "object", "properties": props, "required": list(props)}

    string, integer = {"type": "string"}, {"type": "integer"}
    events = {"type": "object", "required": ["data"], "description": "one server-sent event",
              "properties": {"event": string, "data": {**string, "description": "a JSON object (the shape of the "
                                                        "JSON body, as a chunk), or [DONE] at the end"}}}
    bodies = {  # path -> the 200 body as JSON, and whether `stream: true` makes it server-sent events instead
        "/health": (obj(status={"const": "ok"}), False),
        "/v1/models": (ref(ModelList), False),
        "/v1/models/{model_id}": (ref(ModelCard), False),
        "/v1/completions": (ref(CompletionResponse), True),
        "/v1/chat/completions": (ref(ChatCompletionResponse), True),
        "/v1/embeddings": (ref(EmbeddingResponse), False),
        "/v1/responses": (obj(id=string, object={"const": "response"}, status=string, model=string), True),
        "/tokenize": (ref(TokenizeResponse), False),
        "/detokenize": (obj(prompt=string), False),
        "/tokenizer_info": (obj(tokenizer_class=string, vocab_size=integer, model_max_length=integer), False),
        "/version": (obj(version=string), False),
    }
    ref(ChatCompletionChunk)  # what a chat stream's events carry
    examples = {
        "/v1/completions": {"prompt": "The quick brown fox", "max_tokens": 4},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4},
        "/v1/responses": {"input": "Hello", "max_output_tokens": 4},
        "/v1/embeddings": {"input": "Hello"},
        "/tokenize": {"prompt": "Hello"},
        "/detokenize": {"tokens": [1, 2, 3]},
    }
    generates = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings")
    for path, operations in schema["paths"].items():
        for op in operations.values():
            responses = op.setdefault("responses", {})
            body = op.get("requestBody", {}).get("content", {}).get("application/json")
            if path == "/tokenize" and body is not None:  # one route, two shapes (`messages` tells which)
                body["schema"] = {"anyOf": [ref(TokenizeCompletionRequest, request=True),
                                            ref(TokenizeChatRequest, request=True)]}
            # FastAPI's 422 becomes 400, except for a path parameter that any string satisfies (/v1/models/{id})
            if (responses.pop("422", None) is not None and "{" not in path) or body is not None:
                responses["400"] = error("invalid request, in OpenAI's error shape")
            if body is not None:
                responses["413"] = error("the body is larger than --max-request-body-bytes")
                if path in examples:
                    body["examples"] = {"text": {"value": examples[path]}}
                    if bodies.get(path, (None, False))[1]:
                        body["examples"]["streamed"] = {"value": {**examples[path], "stream": True}}
            if path.startswith("/v1/models/") or (body is not None and _openapi_has_model(body["schema"], schemas)):
                responses["404"] = error("no such model")
            if path in generates or path == "/health":
                responses["503"] = error("the queue is full (with Retry-After), the server is stopping, or its "
                                         "engine is dead")
            ok = responses.get("200")
            if ok is not None and path in bodies:
                json_body, streams = bodies[path]
                ok["content"] = {"application/json": {"schema": json_body}}
                if streams:
                    ok["content"]["text/event-stream"] = {"schema": events}
            elif ok is not None and path == "/metrics":
                ok["content"] = {"text/plain": {"schema": string}}
    for name in ("CompletionRequest", "EmbeddingRequest"):  # prompt-like fields: checked by hand, untyped
        field = "prompt" if name == "CompletionRequest" else "input"
        props = schemas.get(name, {}).get("properties", {})
        if field in props:
            props[field] = _openapi_text_or_ids(props[field], token_id)
    for name, props in ((n, s.get("properties", {})) for n, s in schemas.items() if n.endswith("Request")):
        for key, value in props.items():
            if key == "model" and names:
                _openapi_map_type(value, "string", lambda s: {**s, "enum": names})
            elif key == "messages":
                _openapi_map_type(value, "array", lambda s: {**s, "minItems": 1})
            elif key == "stop":
                _openapi_map_type(value, "string", lambda s: {**s, "minLength": 1})
                _openapi_map_type(value, "array", lambda s: {**s, "items": {**s.get("items", {}), "minLength": 1}})
            elif key == "guided_choice":
                _openapi_map_type(value, "array", lambda s: {**s, "minItems": 1})
            elif key in ("tokens", "stop_token_ids"):
                _openapi_map_type(value, "array", lambda s: {**s, "items": token_id})
            elif key == "logit_bias":
                _openapi_map_type(value, "object", lambda s: {
                    **s, "propertyNames": {"pattern": "^[0-9]+$"},
                    "additionalProperties": {**s.get("additionalProperties", {}), "minimum": -100, "maximum": 100}})
    app.openapi_schema = schema
    return app.openapi_schema


class _OpenAPIModels:
    """Adds pydantic models (and the models they use) to the document's components; `ref` gives the $ref."""

    def __init__(self, schemas: dict[str, Any]) -> None:
        self.schemas = schemas

    def ref(self, model: Any, request: bool = False) -> dict[str, Any]:
        body = model.model_json_schema(ref_template="#/components/schemas/{model}",
                                       mode="validation" if request else "serialization")
        for name, definition in {**body.pop("$defs", {}), model.__name__: body}.items():
            kept = self.schemas.setdefault(name, definition)  # FastAPI's own where a request uses it already
            if _openapi_shape(kept) != _openapi_shape(definition):  # two models of one name: the document would lie
                raise ValueError(f"two different schemas are named {name} in the OpenAPI document")
        return {"$ref": f"#/components/schemas/{model.__name__}"}


def _openapi_shape(schema: dict[str, Any]) -> tuple[list[str], list[str]]:
    return sorted(schema.get("properties", {})), sorted(schema.get("required", []))


def _openapi_has_model(body: dict[str, Any], schemas: dict[str, Any]) -> bool:
    """Whether a request body (a $ref, or anyOf $refs) has a `model` field: check_model answers 404 to an unknown."""
    refs = [body] + body.get("anyOf", [])
    return any("model" in schemas.get(r.get("$ref", "").rsplit("/", 1)[-1], {}).get("properties", {}) for r in refs)


def _openapi_map_type(field: dict[str, Any], kind: str, edit: Any) -> None:
    """Apply `edit` to the branch of type `kind` of a field (itself, or a member of its anyOf), in place."""
    for i, branch in enumerate(field.get("anyOf", [])):
        if branch.get("type") == kind:
            field["anyOf"][i] = edit(branch)
    if field.get("type") == kind:
        field.update(edit(field))


def _openapi_text_or_ids(field: dict[str, Any], token_id: dict[str, Any]) -> dict[str, Any]:
    """openai_protocol.check_text_or_ids, said as a schema (the server refuses an empty prompt, text or id list)."""
    text = {"type": "string", "minLength": 1}
    ids = {"type": "array", "items": token_id, "minItems": 1}
    shapes = [text, {"type": "array", "items": text, "minItems": 1}, ids, {"type": "array", "items": ids,
                                                                          "minItems": 1}]
    return {k: v for k, v in field.items() if k in ("title", "description")} | {"anyOf": shapes}


