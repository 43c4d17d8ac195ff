"""/v1/embeddings: request -> inputs (text or token ids) -> the pooling engine, through AsyncEngine's thread and
PoolingLoop (pooling_loop.py) -> vectors, as float lists or base64 (little-endian float32 bytes, as OpenAI sends
them), optionally shortened to `dimensions` on a Matryoshka model, with usage counting the tokens that ran."""
from __future__ import annotations

import asyncio
import base64

import numpy as np
from fastapi.responses import JSONResponse, Response

from stateserve.entrypoints.async_engine import EngineDead
from stateserve.entrypoints.openai_protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from stateserve.entrypoints.pooling_loop import EmbedResult, is_pooling
from stateserve.entrypoints.serving import APIError, OpenAIServing


def _inputs(raw: str | list) -> list[str | list[int]]:
    """One item per vector; EmbeddingRequest has checked the types and that nothing is empty."""
    if isinstance(raw, str) or isinstance(raw[0], int):
        return [raw]
    return list(raw)


def _shorten(vector: np.ndarray, dimensions: int, normalize: bool) -> np.ndarray:
    """Matryoshka: the first `dimensions` values, L2-normalised again when the model normalises its vectors."""
    if dimensions >= vector.shape[0]:
        return vector
    vector = vector[:dimensions]
    return vector / max(float(np.linalg.norm(vector)), 1e-12) if normalize else vector


def _encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    vector = vector.astype("<f4", copy=False)
    if encoding_format == "base64":
        return base64.b64encode(vector.tobytes()).decode("ascii")
    return vector.tolist()


class EmbeddingServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.engine = serving.engine

    async def create(self, req: EmbeddingRequest) -> Response:
        model = self.serving.check_model(req.model)
        loop_engine = self.engine.engine
        if not is_pooling(loop_engine):
            raise APIError(400, f"The model `{model}` does not support embeddings.", param="model",
                           code="model_not_supported")
        try:  # both read only the model's fixed config, so they may run here on the event loop
            keep_last = loop_engine.resolve_truncation(req.truncate_prompt_tokens)
        except ValueError as e:
            raise APIError(400, str(e), param="truncate_prompt_tokens") from e
        try:
            dimensions = loop_engine.resolve_dimensions(req.dimensions)
        except ValueError as e:
            raise APIError(400, f"Model `{model}`: {e}", param="dimensions") from e
        if self.serving.draining:
            raise APIError(503, "the server is shutting down", "server_error", code="shutting_down",
                           headers={"Retry-After": "5"})
        inputs = _inputs(req.input)
        try:  # tokenizing and validating run on the engine thread, then the future waits for the batch
            future = await self.engine.call(lambda e: e.submit(inputs, keep_last))
            result: EmbedResult = await asyncio.wrap_future(future)
        except EngineDead as e:
            raise APIError(503, str(e), "server_error", code="engine_dead") from e
        except ValueError as e:  # an input the encoder cannot take: token ids outside the vocabulary, too long
            raise APIError(400, str(e), param="input") from e
        data = [EmbeddingData(index=i, embedding=_encode(_shorten(v, dimensions, loop_engine.normalize),
                                                         req.encoding_format))
                for i, v in enumerate(result.vectors)]
        num_tokens = sum(result.num_tokens)
        return JSONResponse(EmbeddingResponse(data=data, model=model, usage=EmbeddingUsage(
            prompt_tokens=num_tokens, total_tokens=num_tokens)).model_dump())
