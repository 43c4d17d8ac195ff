"""OpenAI-compatible HTTP server: `stateserve serve MODEL` (FastAPI + uvicorn).

GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST /v1/embeddings,
GET /metrics. An embedding model (an encoder-only architecture, as LLM decides) runs on the pooling engine:
it answers /v1/embeddings, and the text endpoints 400. The engine runs in its own thread (async_engine.py);
this module wires routes, errors in
OpenAI's JSON shape, and a graceful shutdown: on SIGINT/SIGTERM new requests are refused, in-flight ones
get --shutdown-timeout seconds to finish, then are aborted, and the caches are freed. --data-parallel-size N
serves N engine replicas behind the one front end (data_parallel.py, docs/data_parallel.md)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import re
import signal
import socket
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from stateserve.entrypoints.async_engine import AsyncEngine, build_off_main_thread
from stateserve.entrypoints.data_parallel import DataParallelEngine, build_data_parallel
from stateserve.entrypoints.metrics import ServerMetrics
from stateserve.entrypoints.openapi import openapi_document
from stateserve.entrypoints.openai_protocol import (ChatCompletionRequest, CompletionRequest, EmbeddingRequest,
                                                    ModelCard, ModelList)
from stateserve.entrypoints.request_guard import DEFAULT_MAX_REQUEST_BODY_BYTES, BodyLimitMiddleware, StrictJSONRoute
from stateserve.entrypoints.serving import DEFAULT_MAX_SEQUENCES_PER_REQUEST, APIError, OpenAIServing
from stateserve.entrypoints.serving_embedding import EmbeddingServing
from stateserve.entrypoints.serving_responses import ResponsesRequest, ResponsesServing
from stateserve.entrypoints.serving_tokens import DetokenizeRequest, TokenServing, version
from stateserve.entrypoints.tool_parsers import TOOL_CALL_PARSERS

logger = logging.getLogger("stateserve.server")
# The server's default step budget is smaller than the offline engine's (2048), as vLLM's is per usage context:
# requests arrive in bursts, and a 2048-token prefill step on a CPU (0.1-0.3 s) holds up every first token behind
# it. bench/serve.py (64 x 256+128 tokens, 16 in flight, ~35M models, 3 December 2026): with 512 median TTFT fell
# by about half (Llama bfloat16 192 -> 95 ms, Mamba2 411 -> 227 ms) at equal or higher output tokens/s.
SERVER_MAX_NUM_BATCHED_TOKENS = 512


def _error_response(err: APIError) -> JSONResponse:
    if err.status >= 400 and err.status != 499:
        logger.debug("answering %d: %s", err.status, err.message)
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


_TYPE_TAG = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|[A-Z]\w*)$")


def _param_of(error: dict) -> str | None:
    """Dotted field path of a pydantic error, without 'body' and the union-member tags pydantic adds."""
    loc = [str(p) for p in error.get("loc", ()) if p != "body" and not _TYPE_TAG.match(str(p))]
    return ".".join(loc) or None


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"type": "", "loc": (), "msg": "invalid request"}
    param = _param_of(first)
    kind = first.get("type", "")
    if kind != "json_invalid" and sum(_param_of(e) == param for e in errors) > 1:  # no member of a union fit
        got = type(first.get("input")).__name__
        return APIError(400, f"Invalid type for '{param}': got {got}", param=param)
    if kind == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param)
    if kind == "json_invalid":
        return APIError(400, "We could not parse the JSON body of your request. The body must be valid JSON.")
    if kind == "missing":
        if param is None:
            return APIError(400, "The request has no body: send a JSON object.")
        return APIError(400, f"Missing required parameter: '{param}'.", param=param)
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")  # a validator's own message
    return APIError(400, f"Invalid value for '{param}': {msg}" if param else msg, param=param)


def build_app(engine: AsyncEngine | DataParallelEngine, tokenizer: Any | None, served_model_names: list[str], *,
              chat_template: str | None = None, max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST,
              tool_call_parser: str | None = None) -> FastAPI:
    """The ASGI app. The engine thread starts with the app's lifespan and stops (freeing caches) with it."""
    metrics = ServerMetrics(lambda: engine.snapshot,
                            engine.replica_snapshots if isinstance(engine, DataParallelEngine) else None)
    serving = OpenAIServing(engine, tokenizer, list(served_model_names), metrics, chat_template,
                            max_sequences_per_request=max_sequences_per_request, tool_call_parser=tool_call_parser)
    embedding_serving = EmbeddingServing(serving)
    token_serving = TokenServing(serving)
    responses_serving = ResponsesServing(serving)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        serving.draining = True
        serving.inputs.close()
        state = await engine.shutdown()
        logger.info("shutdown complete: caches %s (%s)",
                    "free" if state and state.get("idle_and_full") else "NOT free", state)

    app = FastAPI(title="stateserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.router.route_class = StrictJSONRoute  # bodies parsed by request_guard.parse_json_body
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_body_bytes,
                       on_reject=lambda: metrics.rejected.labels(status="413").inc())
    app.state.serving, app.state.engine, app.state.metrics = serving, engine, metrics

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, exc: APIError) -> JSONResponse:
        metrics.rejected.labels(status=str(exc.status)).inc()
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.rejected.labels(status="400").inc()
        return _error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error_response(APIError(exc.status_code, str(exc.detail), type_, headers=exc.headers))  # 405: Allow

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error")
        return _error_response(APIError(500, f"internal error: {exc!r}", "server_error"))

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            raise APIError(503, "the engine is not running", "server_error", code="engine_dead")
        if serving.draining:  # load balancers should stop sending work here
            raise APIError(503, "the server is shutting down", "server_error", code="shutting_down")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        cards = [ModelCard(id=name, root=engine.engine.config.model, max_model_len=engine.max_model_len)
                 for name in serving.model_names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await serving.completions(body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.chat(body, raw)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> Response:
        return await embedding_serving.create(body)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, raw: Request) -> Response:
        return await responses_serving.create(body, raw)

    @app.post("/tokenize")
    async def tokenize(body: dict[str, Any]) -> JSONResponse:
        return JSONResponse((await token_serving.tokenize(body)).model_dump())

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        return JSONResponse(token_serving.detokenize(body))

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> JSONResponse:
        return JSONResponse(token_serving.tokenizer_info())

    @app.get("/version")
    async def server_version() -> JSONResponse:
        return JSONResponse({"version": version()})

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str) -> JSONResponse:
        return JSONResponse(token_serving.model(model_id, engine.engine.config.model).model_dump())

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    app.openapi = lambda: openapi_document(app)
    return app


class GracefulServer(uvicorn.Server):
    """uvicorn, plus: on shutdown refuse new work at once and abort what is still running after `grace_s`."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, grace_s: float) -> None:
        super().__init__(config)
        self.app, self.grace_s = app, grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.app.state.serving.draining = True
        snap = self.app.state.engine.snapshot
        logger.info("shutting down: %d running and %d waiting sequence(s) get %.1f s to finish",
                    snap.get("running", 0), snap.get("waiting", 0), self.grace_s)

        async def abort_late() -> None:
            await asyncio.sleep(self.grace_s)
            self.app.state.engine.abort_all()

        late = asyncio.ensure_future(abort_late())
        try:
            await super().shutdown(sockets)
        finally:
            late.cancel()


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before loading the model, so the port (also a free one for port 0) is known and held."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def build_engine(config: Any, show_progress: bool = True) -> Any:
    """The engine AsyncEngine drives: one LLMEngine for every model kind (an embedding model pools)."""
    from stateserve.engine.llm_engine import LLMEngine

    return LLMEngine(config, show_progress=show_progress)


def cmd_serve(args: argparse.Namespace) -> int:
    from stateserve import envs
    from stateserve.config import EngineConfig
    from stateserve.models.folder import load_tokenizer
    from stateserve.entrypoints.engine_args import default_model, engine_kwargs

    # SIGTERM behaves like Ctrl+C: uvicorn drains on it, and re-raises it after its own handler is gone
    signal.signal(signal.SIGTERM, _interrupt)
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests must be >= 1, got {args.max_waiting_requests}")
    for flag in ("max_request_body_bytes", "max_sequences_per_request"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json or granite)")
    model = args.model or default_model()
    chat_template = None
    if args.chat_template:
        with open(args.chat_template) as f:
            chat_template = f.read()
    sock = bind_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    try:
        config = EngineConfig.from_kwargs(model=model, **engine_kwargs(args))  # bad arguments raise here
        factory = lambda: build_engine(config, show_progress=not envs.STATESERVE_DISABLE_TQDM)  # noqa: E731
        if args.data_parallel_size > 1 and (config.nnodes > 1 or config.distributed_init_method is not None):
            raise ValueError("--data-parallel-size runs its replicas on this host, each meeting its ranks at a port "
                             "of its own: it cannot be combined with --nnodes or --distributed-init-method yet")
        if args.data_parallel_size == 1:
            llm_engine = build_off_main_thread(factory)
            engine = AsyncEngine(llm_engine, args.max_waiting_requests)
        else:
            engine = build_data_parallel(factory, args.data_parallel_size, args.max_waiting_requests)
            llm_engine = engine.engine
    except KeyboardInterrupt:
        return 130
    app = build_app(engine, load_tokenizer(llm_engine.config), args.served_model_name or [model],
                    chat_template=chat_template, max_request_body_bytes=args.max_request_body_bytes,
                    max_sequences_per_request=args.max_sequences_per_request,
                    tool_call_parser=args.tool_call_parser)
    config = uvicorn.Config(app, log_level=args.uvicorn_log_level, timeout_graceful_shutdown=int(
        args.shutdown_timeout + 10), timeout_keep_alive=5)
    server = GracefulServer(config, app, args.shutdown_timeout)
    url_host = f"[{host}]" if ":" in host else host
    logger.info("serving %s as %s on http://%s:%d", model, ", ".join(args.served_model_name or [model]),
                url_host, port)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # the signal uvicorn re-raises after its graceful shutdown
        pass
    finally:
        sock.close()
    if engine.final_state is None:  # never got to the lifespan shutdown (startup failed or forced exit)
        return 1
    return 0 if engine.final_state.get("integrity_ok") else 1


def _replica_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (the number of engine replicas), got {value}")
    return value


def add_serve_parser(subparsers: Any) -> None:
    from stateserve.entrypoints.engine_args import add_engine_args

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("model", nargs="?", default=None, help="Hugging Face model folder (default: a bundled model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (logged at startup)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in `model`; the first is reported (default: the model path)")
    p.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 503 (Retry-After) when more sequences than this would be waiting")
    p.add_argument("--chat-template", default=None, help="Jinja chat template file (default: the tokenizer's)")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_CALL_PARSERS),
                   help="how tool calls are read out of a chat reply with tool_choice \"auto\" (the format the "
                        "model's chat template teaches: hermes for Hermes/Qwen, llama3_json, granite)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM compatibility: \"auto\" works whenever --tool-call-parser is set")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="answer 413 to a request body larger than this (refused before reading when its "
                        "Content-Length says so, cut off when a chunked body passes it)")
    p.add_argument("--max-sequences-per-request", type=int, default=DEFAULT_MAX_SEQUENCES_PER_REQUEST,
                   help="answer 400 to a request of more than this many prompts x n sequences")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM before they are aborted")
    p.add_argument("--data-parallel-size", type=_replica_count, default=1,
                   help="engine replicas (each a full copy of the model and its caches, on its share of the CPU "
                        "threads) behind this one server; requests go to the least-loaded replica, or to the one "
                        "that served the same prompt start (docs/data_parallel.md)")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    add_engine_args(p)
    p.set_defaults(func=cmd_serve, max_num_batched_tokens=SERVER_MAX_NUM_BATCHED_TOKENS)
