"""Chat messages and tool calling for /v1/chat/completions: the request's `tools` and `tool_choice` -> a ToolPlan
(what the template sees, which grammar constrains the reply, how the reply is read back), the message history
(tool results, earlier calls) -> what chat templates expect, and the reply -> `tool_calls`, whole or as deltas.

tool_choice (the default is "auto" when tools are given, else "none"):
- "none": the tools are still rendered (vLLM does the same); the reply is plain content.
- "auto": the server's --tool-call-parser reads calls out of the free reply (a 400 without one).
- "required": the reply is constrained to a JSON list of {"name", "parameters"} of the given tools (at least one,
  exactly one without parallel_tool_calls), so the arguments always parse; no parser needed.
- {"type": "function", "function": {"name": N}}: the reply is constrained to N's parameters schema and is the
  call's arguments."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from stateserve.entrypoints.errors import APIError
from stateserve.entrypoints.openai_protocol import (ChatCompletionRequest, DeltaFunctionCall, DeltaToolCall,
                                                    FunctionCall, ToolCallItem)
from stateserve.entrypoints.tool_parsers import JsonArrayParser, ToolCall, ToolCallStream, ToolParser

_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
_ANY_OBJECT = {"type": "object"}


def _text_content(content: Any, where: str) -> str:
    if isinstance(content, list):
        if any(part["type"] != "text" for part in content):
            raise APIError(400, "only text content parts are supported", param=f"{where}.content")
        return "\n".join(part.get("text") or "" for part in content)
    return content or ""


def _history_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's earlier `tool_calls`, arguments turned into objects (templates write them as JSON)."""
    if not isinstance(calls, list):
        raise APIError(400, f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls.{j}"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(400, f"{at} must be {{\"type\": \"function\", \"id\": ..., \"function\": {{\"name\": ..., "
                                "\"arguments\": ...}}}", param=at)
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except ValueError as e:
                raise APIError(400, f"{at}.function.arguments is not valid JSON: {e}",
                               param=f"{at}.function.arguments") from e
        if not isinstance(args, dict):
            raise APIError(400, f"{at}.function.arguments must be a JSON object", param=f"{at}.function.arguments")
        out.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def chat_messages(req: Any) -> list[dict[str, Any]]:
    """The request's messages as chat templates take them: developer -> system, text parts joined, tool results
    and earlier calls kept (arguments as objects)."""
    if not req.messages:
        raise APIError(400, "messages must not be empty", param="messages")
    messages = []
    for i, m in enumerate(req.messages):
        where, extra = f"messages.{i}", m.model_extra or {}
        role = "system" if m.role == "developer" else m.role
        if role not in ("system", "user", "assistant", "tool"):
            raise APIError(400, f"messages[{i}].role {m.role!r} is not supported (system, developer, user, "
                                "assistant, tool)", param=f"{where}.role")
        if extra.get("function_call"):
            raise APIError(400, "function_call messages are not supported; use tool_calls", param=where)
        msg: dict[str, Any] = {"role": role, "content": _text_content(m.content, where)}
        if m.name:
            msg["name"] = m.name
        if extra.get("tool_calls"):
            if role != "assistant":
                raise APIError(400, f"only assistant messages carry tool_calls, not {m.role!r}",
                               param=f"{where}.tool_calls")
            msg["tool_calls"] = _history_calls(extra["tool_calls"], where)
        if role == "tool":
            call_id = extra.get("tool_call_id")
            if not isinstance(call_id, str):
                raise APIError(400, f"messages[{i}] (a tool result) needs tool_call_id, a string",
                               param=f"{where}.tool_call_id")
            msg["tool_call_id"] = call_id
        messages.append(msg)
    return messages


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none", "auto", "required" or "named"
    template_tools: list[dict[str, Any]] | None  # what the chat template renders
    structured: dict[str, Any] | None = None  # the grammar of "required" / "named" (SamplingParams.structured_outputs)
    parser: ToolParser | None = None  # reads "auto" and "required" replies
    function: str | None = None  # the "named" function
    parallel: bool = True

    @property
    def parses(self) -> bool:
        return self.mode != "none"


def _checked_tools(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> parameters schema, after checking each tool's shape."""
    schemas: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        at = f"tools.{i}"
        fn = tool.get("function")
        if tool.get("type") != "function" or not isinstance(fn, dict):
            raise APIError(400, f"{at} must be {{\"type\": \"function\", \"function\": {{...}}}}", param=at)
        name = fn.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
            raise APIError(400, f"{at}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
                           param=f"{at}.function.name")
        params = fn.get("parameters", _ANY_OBJECT)
        if not isinstance(params, dict):
            raise APIError(400, f"{at}.function.parameters must be a JSON schema object",
                           param=f"{at}.function.parameters")
        if not isinstance(fn.get("description", ""), str):
            raise APIError(400, f"{at}.function.description must be a string", param=f"{at}.function.description")
        if name in schemas:
            raise APIError(400, f"two tools are named {name!r}", param=f"{at}.function.name")
        schemas[name] = params
    return schemas


def plan_tools(req: ChatCompletionRequest, parser_name: str | None) -> ToolPlan:
    tools, choice = req.tools or None, req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools:
        if choice != "none":
            raise APIError(400, f"tool_choice {choice!r} needs tools", param="tool_choice")
        return ToolPlan("none", None)
    schemas = _checked_tools(tools)
    parallel = req.parallel_tool_calls is not False
    if choice == "none":
        return ToolPlan("none", tools)
    if req.structured_outputs_params() is not None and choice != "auto":
        raise APIError(400, "a forced tool_choice cannot be combined with response_format or structured outputs",
                       param="tool_choice")
    if choice == "auto":
        if parser_name is None:
            raise APIError(400, "\"auto\" tool choice needs the server started with --tool-call-parser "
                                "(hermes, llama3_json or granite); \"required\" and a named function work without",
                           param="tool_choice")
        from stateserve.entrypoints.tool_parsers import get_tool_parser
        return ToolPlan("auto", tools, parser=get_tool_parser(parser_name), parallel=parallel)
    if choice == "required":
        one_of = [{"type": "object", "properties": {"name": {"const": name}, "parameters": params},
                   "required": ["name", "parameters"], "additionalProperties": False}
                  for name, params in schemas.items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
        if not parallel:
            schema["maxItems"] = 1
        return ToolPlan("required", tools, {"json": schema}, JsonArrayParser(), parallel=parallel)
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(400, "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                            "\"function\": {\"name\": ...}}", param="tool_choice")
    if fn["name"] not in schemas:
        raise APIError(400, f"tool_choice names the function {fn['name']!r}, which is not among the tools",
                       param="tool_choice")
    return ToolPlan("named", tools, {"json": schemas[fn["name"]]}, function=fn["name"])


def _items(calls: list[ToolCall]) -> list[ToolCallItem]:
    return [ToolCallItem(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]


def tool_reply(plan: ToolPlan, text: str, finish_reason: str | None
               ) -> tuple[str | None, list[ToolCallItem] | None, str | None]:
    """A whole reply -> (content, tool_calls, finish_reason)."""
    if plan.mode == "named":
        return None, _items([ToolCall(plan.function or "", text)]), finish_reason
    content, calls = plan.parser.parse(text) if plan.parser is not None else (text, [])
    calls = calls if plan.parallel else calls[:1]
    if not calls:
        return content, None, finish_reason
    return content, _items(calls), "tool_calls" if finish_reason == "stop" else finish_reason


class ToolDeltas:
    """One streamed choice of a request with tools: text deltas -> (content delta, tool-call deltas); each call is
    sent whole when complete, except a named function's arguments, which stream as they are written."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.stream = ToolCallStream(plan.parser) if plan.parser is not None else None
        self.sent = 0  # calls sent
        self.named_id = f"call_{uuid.uuid4().hex[:24]}"

    def feed(self, delta: str, finish_reason: str | None) -> tuple[str | None, list[DeltaToolCall] | None, str | None]:
        finished = finish_reason is not None
        if self.plan.mode == "named":
            first = self.sent == 0
            self.sent = 1
            fn = DeltaFunctionCall(name=self.plan.function if first else None, arguments=delta)
            call = DeltaToolCall(index=0, id=self.named_id if first else None, type="function" if first else None,
                                 function=fn)
            return None, [call] if first or delta else None, finish_reason
        assert self.stream is not None
        content, calls = self.stream.feed(delta, finished)
        if not self.plan.parallel:
            calls = calls[:max(0, 1 - self.sent)]
        deltas = [DeltaToolCall(index=self.sent + k, id=c.id, type="function",
                                function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
                  for k, c in enumerate(calls)]
        self.sent += len(deltas)
        if finish_reason == "stop" and self.sent:
            finish_reason = "tool_calls"
        return content, deltas or None, finish_reason
