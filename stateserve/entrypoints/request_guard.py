"""What stands between a client's bytes and the request handlers: a body-size limit (413) and a strict JSON parser.

`BodyLimitMiddleware` reads each HTTP request body itself, up to `max_bytes`: a body whose Content-Length is over
the limit is refused before any of it is read, and one sent in chunks is cut off as soon as it passes the limit;
either way the answer is a 413 in OpenAI's error shape and the connection is closed. A body within the limit is
handed to the app in one piece.

`StrictJSONRoute` parses JSON request bodies before FastAPI does, so that what Python's `json` module would let
through never reaches a handler: the literals NaN, Infinity and -Infinity (not JSON), lone UTF-16 surrogates (a
`"\\ud800"` escape, or the bytes of an encoded surrogate, which `json.loads` lets through and every tokenizer then
fails on), bytes that are not UTF-8, integers of more than 4300 digits and nesting too deep to parse; each is a 400
in OpenAI's error shape."""
from __future__ import annotations

import json
import re
from typing import Any, Awaitable, Callable

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from stateserve.entrypoints.errors import APIError

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024


class BodyLimitMiddleware:
    """Pure ASGI middleware; `on_reject()` is called for each 413 (metrics)."""

    def __init__(self, app: Any, max_bytes: int, on_reject: Callable[[], None] | None = None) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.app, self.max_bytes, self.on_reject = app, max_bytes, on_reject

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, receive, send, f"{declared} bytes")
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending: nobody to answer
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, f"more than {self.max_bytes} bytes")
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        pending: dict | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        del chunks

        async def replay() -> dict:
            nonlocal pending
            if pending is not None:
                message, pending = pending, None
                return message
            return await receive()  # after the body: http.disconnect when the client leaves

        await self.app(scope, replay, send)

    async def _refuse(self, scope: dict, receive: Any, send: Any, size: str) -> None:
        if self.on_reject is not None:
            self.on_reject()
        err = APIError(413, f"The request body ({size}) is larger than this server's limit of {self.max_bytes} "
                            "bytes (--max-request-body-bytes).", code="request_too_large")
        # Connection: close, so the rest of the body is never read
        await JSONResponse(err.body(), status_code=413, headers={"Connection": "close"})(scope, receive, send)


def _content_length(scope: dict) -> int | None:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


# ---- strict JSON -------------------------------------------------------------------------------
class _NonFiniteLiteral(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NonFiniteLiteral(name)


# a `\uD800`-`\uDFFF` escape, or the UTF-8 bytes of a surrogate (json.loads decodes bytes with 'surrogatepass')
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _find_surrogate(value: Any) -> tuple[str, str] | None:
    """(dotted path, the surrogate) of the first string (or object key) holding a lone surrogate."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if m := _SURROGATE.search(item):
                return path, m.group()
        elif isinstance(item, list):
            stack.extend((f"{path}.{i}" if path else str(i), x) for i, x in enumerate(item))
        elif isinstance(item, dict):
            for key, x in item.items():
                sub = f"{path}.{key}" if path else str(key)
                if _SURROGATE.search(key):
                    return sub, _SURROGATE.search(key).group()
                stack.append((sub, x))
    return None


def parse_json_body(body: bytes) -> Any:
    """json.loads, with everything it accepts but JSON does not refused as an APIError (400)."""
    try:
        value = json.loads(body, parse_constant=_refuse_constant)
    except _NonFiniteLiteral as e:
        raise APIError(400, f"We could not parse the JSON body of your request: {e} is not a JSON value (NaN and "
                            "Infinity are not valid JSON numbers).") from None
    except UnicodeDecodeError:
        raise APIError(400, "We could not parse the JSON body of your request: it is not valid UTF-8.") from None
    except json.JSONDecodeError:
        raise APIError(400, "We could not parse the JSON body of your request. The body must be valid "
                            "JSON.") from None
    except (ValueError, RecursionError) as e:  # an integer of more than 4300 digits; nesting too deep
        raise APIError(400, f"We could not parse the JSON body of your request: {str(e) or type(e).__name__}"
                       ) from None
    if _MAYBE_SURROGATE.search(body) and (found := _find_surrogate(value)):
        path, char = found
        raise APIError(400, f"Invalid Unicode in '{path or 'body'}': the lone surrogate U+{ord(char):04X} is not a "
                            "character (text must be valid UTF-8 / well-formed UTF-16 escapes).",
                       param=path or None)
    return value


class _ParsedRequest(Request):
    """A Request whose json() is parse_json_body's, parsed once."""

    _parsed: Any = None
    _has_parsed = False

    async def json(self) -> Any:
        if not self._has_parsed:
            self._parsed = parse_json_body(await self.body())
            self._has_parsed = True
        return self._parsed


def _wants_json(request: Request) -> bool:
    kind = request.headers.get("content-type")
    return kind is None or "json" in kind.lower()


class StrictJSONRoute(APIRoute):
    """Parses a JSON body with parse_json_body before FastAPI reads it: FastAPI turns any error it meets while
    parsing into a generic 400, so ours (naming the problem) are raised here, outside its parser."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            request = _ParsedRequest(request.scope, request.receive)
            if request.method in ("POST", "PUT", "PATCH") and _wants_json(request) and await request.body():
                await request.json()  # raises APIError; FastAPI's own read then gets the parsed value
            return await handler(request)

        return route
