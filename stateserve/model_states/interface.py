"""ModelState: the strategy object that owns everything model-kind specific, so the runner stays shared.

The runner is its only caller. It asks the state, in this order: how to profile activation memory (dummy_seq_len,
profile_meta), what caches to plan (uses_kv_cache, uses_state_cache, cache_policy), then hands it the cache manager
(attach_cache); per step it forwards admissions and removals (add_request, remove_request), asks how much of a
prefill may run (chunk_size), builds the layers' metadata (prepare_meta) and reports the step's end (after_step,
on_step_failed). Prompts reach it through the runner too (parse_prompt, prepare_inputs), and decode graphs ask it
for replayable metadata (graph_unsupported_reason, graph_meta)."""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator

import torch

from stateserve.layers.metadata import AttnMetadata, ForwardMeta

if TYPE_CHECKING:
    from stateserve.cache.manager import CacheManager
    from stateserve.config import EngineConfig, ModelConfig
    from stateserve.core.batch import InputBatch
    from stateserve.core.request import Request
    from stateserve.models.base import ModelBase

TokenIdsFn = Callable[[Any], tuple["str | None", list[int]]]  # a prompt -> (its text or None, its token ids)


@dataclass(frozen=True)
class CachePolicy:
    """How this model kind reuses cache across requests, resolved once from the engine options."""

    prefix_caching: bool
    mamba_cache_mode: str = "none"  # recurrent snapshots: none | all | align (docs/prefix_caching.md)
    num_snapshot_slots: int = 0  # state slots set aside for prefix snapshots


@dataclass(frozen=True)
class PoolingSpec:
    """What an embedding model gives and takes, for the engine's checks and the server's answers."""

    modes: tuple[str, ...]
    normalize: bool
    embedding_size: int  # one hidden-size vector per pooling mode, concatenated
    max_len: int  # the longest prompt the encoder takes
    limit_reason: str  # where max_len comes from, for error messages
    matryoshka_dimensions: tuple[int, ...] | None  # only these shorter sizes (None: any, if is_matryoshka)
    is_matryoshka: bool
    source: str  # "sentence-transformers" or "default"


@dataclass(eq=False)
class GraphBuffers:
    """Persistent decode-graph inputs the metadata of a replay views (runner/cuda_graphs.py owns them)."""

    slot_mapping: torch.Tensor  # [M] long
    seq_lens: torch.Tensor  # [M] long
    state_slots: torch.Tensor  # [M] long
    block_tables: torch.Tensor  # [M, W] long
    rows: torch.Tensor  # [M] long, 0..M-1


class ModelState(ABC):
    # which cache kinds this model kind uses; the runner allocates only these
    uses_kv_cache: ClassVar[bool] = True
    uses_state_cache: ClassVar[bool] = False
    supports_generate: ClassVar[bool] = True  # False: a pooling model (pool() instead of logits)
    runs_whole_prompts: ClassVar[bool] = False  # True: a prompt is never split into chunks (encoders)

    def __init__(self, model: "ModelBase", model_config: "ModelConfig", engine_config: "EngineConfig",
                 device: torch.device) -> None:
        self.model = model
        self.model_config = model_config
        self.engine_config = engine_config
        self.device = device
        self.block_size = engine_config.block_size

    # ---- prompts -------------------------------------------------------------------------------
    def parse_prompt(self, prompt: Any, to_token_ids: TokenIdsFn, tokenizer: Any) -> tuple[str | None, list[int],
                                                                                        Any]:
        """One of LLM.generate's prompt forms -> (text, prompt token ids, encoder input or None)."""
        return (*to_token_ids(prompt), None)

    def text_for_tokenizer(self, text: str) -> str:
        """What the tokenizer gets of a text prompt (e.g. lower-cased for a folder that asks for it)."""
        return text

    def prompt_limit(self) -> tuple[int, str]:
        """(the longest prompt this kind takes, where that limit comes from)."""
        return self.model_config.max_model_len, "max_model_len"

    def validate_request(self, req: "Request") -> None:
        """Refuse (ValueError) a request's inputs beyond the token ids that this kind cannot take."""

    def pooling_spec(self) -> PoolingSpec | None:
        """What an embedding model gives and takes; None for a model that generates."""
        return None

    def prepare_inputs(self, prompt_token_ids: list[int], encoder_input: Any) -> tuple[list[int], Any]:
        """The token ids (and encoder input) a request runs with; ValueError for input this kind cannot take."""
        if encoder_input is not None:
            raise ValueError(f"{self.model_config.architecture} has no encoder: encoder inputs are only for "
                             "encoder-decoder models")
        return prompt_token_ids, None

    # ---- caches --------------------------------------------------------------------------------
    def cache_policy(self) -> CachePolicy:
        asked = self.engine_config.enable_prefix_caching
        return CachePolicy(prefix_caching=self.default_prefix_caching() if asked is None else asked)

    def default_prefix_caching(self) -> bool:
        return True

    def attach_cache(self, cache: "CacheManager") -> None:
        """Receive the CacheManager once caches exist (default: not needed)."""

    # ---- activation profile --------------------------------------------------------------------
    def dummy_seq_len(self) -> int | None:
        """Longest dummy sequence this kind can run before caches exist; None: no dummy forward (an estimate)."""
        return self.model_config.max_model_len

    @contextlib.contextmanager
    def profile_meta(self, lens: list[int]) -> Iterator[ForwardMeta]:
        """Metadata of a prefill of sequences of these lengths with nothing cached and no cache to write: attention
        runs without KV, so nothing a request could ever read is touched."""
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        attn = AttnMetadata(query_start_loc=starts, query_lens=list(lens), context_lens=[0] * len(lens),
                            seq_lens=list(lens), is_decode_only=False, causal=self.supports_generate,
                            prefill_seqs=list(range(len(lens))))
        yield ForwardMeta(starts[-1], attn=attn)

    # ---- decode graphs -------------------------------------------------------------------------
    def graph_unsupported_reason(self) -> str | None:
        """Why this kind's decode steps cannot be replayed from persistent buffers; None when they can."""
        return f"{type(self).__name__} builds per-step metadata that a graph cannot replay"

    def graph_meta(self, buffers: GraphBuffers, size: int, width: int) -> ForwardMeta:
        """Metadata of a decode step of `size` sequences whose host values hold for every replay; everything that
        varies is a view of `buffers`. width: tokens a block table row spans (attention reads all, masked)."""
        raise NotImplementedError(f"{type(self).__name__} has no decode graphs")

    # ---- requests and steps --------------------------------------------------------------------
    def add_request(self, req: "Request") -> None:
        """Per-request set-up when a request is admitted (default: nothing)."""

    def remove_request(self, req: "Request") -> None:
        """Per-request teardown when it finishes, is aborted or preempted (default: nothing)."""

    def chunk_size(self, req: "Request", num_tokens: int) -> int:
        """How many of the `num_tokens` the scheduler offers this request may run now."""
        return num_tokens

    @abstractmethod
    def prepare_meta(self, batch: "InputBatch") -> ForwardMeta:
        """Everything the layers need besides token ids and positions, for this step."""

    def rollback(self, req: "Request", step_start: int, num_fed: int, num_kept: int) -> None:
        """Speculative decoding: the last step fed tokens step_start..num_fed-1 of `req` but only the first
        num_kept are committed; make the request's cache hold exactly those (attention KV past them is rewritten
        by later steps, so there is nothing to undo by default)."""

    def pool(self, hidden: torch.Tensor, batch: "InputBatch") -> torch.Tensor:
        """Pooling models: hidden [T, H] of whole sequences -> one vector per sequence [S, D], float32."""
        raise NotImplementedError(f"{type(self).__name__} does not pool")

    def after_step(self, batch: "InputBatch") -> None:
        """Called after the forward (e.g. to publish state snapshots that are now written)."""

    def on_step_failed(self) -> None:
        """The step raised (forward or sampling; after_step did not run): forget anything prepared for publication
        in it. The engine then ends every request of the step (remove_request is called for each)."""

    def release(self) -> None:
        """Drop per-request buffers at shutdown."""
