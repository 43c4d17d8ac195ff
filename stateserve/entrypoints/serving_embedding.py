"""/v1/embeddings: request -> inputs (text or token ids) -> one embedding request per input in the engine (through
AsyncEngine's thread; they share steps with every other request) -> vectors, as float lists or base64
(little-endian float32 bytes, as OpenAI sends them), optionally shortened to `dimensions` on a Matryoshka model,
with usage counting the tokens that ran."""
from __future__ import annotations

import base64

import numpy as np
from fastapi.responses import JSONResponse, Response

from stateserve.entrypoints.openai_protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from stateserve.entrypoints.serving import APIError, OpenAIServing, _raise_if_failed
from stateserve.entrypoints.streams import EngineDead, EngineOverloaded
from stateserve.model_states.interface import PoolingSpec


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


def resolve_dimensions(spec: PoolingSpec, dimensions: int | None) -> int:
    """The vector size to answer with; ValueError unless the model can give it."""
    full = spec.embedding_size
    if dimensions is None or dimensions == full:
        return full
    if dimensions < 1:
        raise ValueError(f"dimensions must be at least 1, got {dimensions}")
    if not spec.is_matryoshka:
        raise ValueError(f"this model does not support matryoshka representation, so its {full}-dimensional "
                         f"vectors cannot be shortened: dimensions must be omitted or {full}, got {dimensions}")
    if spec.matryoshka_dimensions is not None and dimensions not in spec.matryoshka_dimensions:
        raise ValueError(f"this model supports dimensions {list(spec.matryoshka_dimensions)} (or {full}), "
                         f"got {dimensions}")
    if dimensions > full:
        raise ValueError(f"dimensions must be at most this model's size {full}, got {dimensions}")
    return dimensions


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
        llm_engine = self.engine.engine
        spec = llm_engine.pooling
        if spec is None:
            raise APIError(400, f"The model `{model}` does not support embeddings.", param="model",
                           code="model_not_supported")
        try:  # both read only the model's fixed config, so they may run here on the event loop
            keep_last = llm_engine.resolve_truncation(req.truncate_prompt_tokens)
        except ValueError as e:
            raise APIError(400, str(e), param="truncate_prompt_tokens") from e
        try:
            dimensions = resolve_dimensions(spec, req.dimensions)
        except ValueError as e:
            raise APIError(400, f"Model `{model}`: {e}", param="dimensions") from e
        if self.serving.draining:
            raise APIError(503, "the server is shutting down", "server_error", code="shutting_down",
                           headers={"Retry-After": "5"})
        inputs = _inputs(req.input)
        vectors: list[np.ndarray | None] = [None] * len(inputs)
        num_tokens = 0
        try:  # tokenizing and validating run on the engine thread; the prompts then join the engine's steps
            stream = await self.engine.submit_embed(inputs, keep_last)
        except EngineOverloaded as e:
            raise APIError(503, str(e), "server_error", code="overloaded", headers={"Retry-After": "1"}) from e
        except EngineDead as e:
            raise APIError(503, str(e), "server_error", code="engine_dead") from e
        except ValueError as e:  # an input the encoder cannot take: token ids outside the vocabulary, too long
            raise APIError(400, str(e), param="input") from e
        try:
            async for update in stream:
                _raise_if_failed(update)
                if update.finished:
                    vectors[update.prompt_index] = update.embedding
                    num_tokens += update.num_prompt_tokens
        except EngineDead as e:
            raise APIError(503, str(e), "server_error", code="engine_dead") from e
        finally:
            stream.abort()  # a client gone mid-way (or an error) leaves nothing queued
        data = [EmbeddingData(index=i, embedding=_encode(_shorten(v, dimensions, spec.normalize),
                                                         req.encoding_format))
                for i, v in enumerate(vectors)]
        return JSONResponse(EmbeddingResponse(data=data, model=model, usage=EmbeddingUsage(
            prompt_tokens=num_tokens, total_tokens=num_tokens)).model_dump())
