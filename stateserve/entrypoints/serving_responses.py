"""POST /v1/responses, OpenAI's Responses API for text: `input` (a string, or messages with text content) and
`instructions` become chat messages rendered through the model's template; the reply is one assistant message with
one output_text part, or, streamed, the event sequence the `openai` client assembles (response.created ...
response.output_text.delta ... response.completed). Stateless: `previous_response_id`, tools and stored responses
are refused with a 400."""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import StrictBool, StrictFloat, StrictInt, StrictStr

from stateserve.entrypoints.detok_stream import ChoiceState
from stateserve.entrypoints.errors import APIError
from stateserve.entrypoints.metrics import RequestTimer
from stateserve.entrypoints.openai_protocol import ChatCompletionRequest, _Open
from stateserve.entrypoints.serving import _AbortingStreamingResponse, _Context, _raise_if_failed


class ResponsesRequest(_Open):
    """Fields this server honours; the rest of OpenAI's (metadata, store, user, text, reasoning, ...) are accepted
    and change nothing, except the ones in REFUSED."""

    model: StrictStr | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    stream: StrictBool | None = None


REFUSED = ("previous_response_id", "tools", "conversation", "background", "prompt")


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") not in ("input_text", "output_text", "text") for p in content):
            raise APIError(400, f"{where}: only text content parts are supported", param="input")
        return "".join(str(p.get("text") or "") for p in content)
    raise APIError(400, f"{where}: content must be a string or a list of text parts", param="input")


def chat_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        if item.get("type", "message") != "message" or "role" not in item:
            raise APIError(400, f"input[{i}]: only message items (a role and content) are supported", param="input")
        messages.append({"role": item["role"], "content": _text_of(item.get("content"), f"input[{i}]")})
    if not messages:
        raise APIError(400, "input must not be empty", param="input")
    return messages


class ResponsesServing:
    def __init__(self, serving: Any) -> None:
        self.serving = serving  # entrypoints.serving.OpenAIServing

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        arrival = time.perf_counter()
        serving = self.serving
        model = serving.check_model(req.model)
        serving.check_generates(model, "Responses")
        for name in REFUSED:
            if (req.model_extra or {}).get(name):
                raise APIError(400, f"`{name}` is not supported by this server (responses are not stored)",
                               param=name)
        chat = ChatCompletionRequest(model=req.model, messages=chat_messages(req), max_tokens=req.max_output_tokens,
                                     temperature=req.temperature, top_p=req.top_p, stream=req.stream)
        params = serving._sampling_params(chat, chat.max_tokens, None, 1, {"max_tokens": "max_output_tokens"})
        prompts = await serving._chat_prompt(chat)
        serving._check_context(prompts, chat.max_tokens, True, "input")
        ctx = _Context(f"resp_{uuid.uuid4().hex}", int(time.time()), model, params, prompts, [ChoiceState()],
                       RequestTimer(serving.metrics, arrival), None)
        stream = await serving._submit(prompts, params, bool(req.stream))
        if req.stream:
            return _AbortingStreamingResponse(self._events(stream, ctx, req), stream)
        if await serving._collect(stream, ctx, raw):
            return Response(status_code=499)
        return JSONResponse(self._response(ctx, req, ctx.choices[0].full_text, done=True))

    def _message(self, ctx: _Context, text: str, done: bool) -> dict[str, Any]:
        return {"id": "msg_" + ctx.id.removeprefix("resp_"), "type": "message", "role": "assistant",
                "status": "completed" if done else "in_progress",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if done else []}

    def _response(self, ctx: _Context, req: ResponsesRequest, text: str, done: bool) -> dict[str, Any]:
        choice = ctx.choices[0]
        incomplete = done and choice.finish_reason == "length"
        usage = ctx.usage()
        return {"id": ctx.id, "object": "response", "created_at": ctx.created, "model": ctx.model,
                "status": ("incomplete" if incomplete else "completed") if done else "in_progress",
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "temperature": ctx.params.temperature, "top_p": ctx.params.top_p, "tools": [], "tool_choice": "auto",
                "parallel_tool_calls": False, "metadata": {}, "text": {"format": {"type": "text"}},
                "output": [self._message(ctx, text, True)] if done else [],
                "usage": {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                          "total_tokens": usage.total_tokens,
                          "input_tokens_details": {"cached_tokens": sum(ctx.cached_tokens)},
                          "output_tokens_details": {"reasoning_tokens": 0}} if done else None}

    async def _events(self, stream: Any, ctx: _Context, req: ResponsesRequest) -> AsyncIterator[str]:
        seq = iter(range(1 << 30))
        item_id = "msg_" + ctx.id.removeprefix("resp_")
        where = {"item_id": item_id, "output_index": 0, "content_index": 0}

        def event(kind: str, **fields: Any) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(seq), **fields})}\n\n"

        yield event("response.created", response=self._response(ctx, req, "", done=False))
        yield event("response.output_item.added", output_index=0, item=self._message(ctx, "", done=False))
        yield event("response.content_part.added", **where, part={"type": "output_text", "text": "",
                                                                   "annotations": []})
        try:
            async for update in stream:
                _raise_if_failed(update)
                for _, delta, _ in ctx.apply(update, streaming=True):
                    if delta:
                        yield event("response.output_text.delta", **where, delta=delta, logprobs=[])
        except APIError as e:
            yield event("error", message=e.message, code=e.code)
            return
        text = ctx.choices[0].full_text
        yield event("response.output_text.done", **where, text=text, logprobs=[])
        yield event("response.content_part.done", **where, part={"type": "output_text", "text": text,
                                                                  "annotations": []})
        yield event("response.output_item.done", output_index=0, item=self._message(ctx, text, True))
        final = self._response(ctx, req, text, done=True)
        yield event("response.completed" if final["status"] == "completed" else "response.incomplete",
                    response=final)
