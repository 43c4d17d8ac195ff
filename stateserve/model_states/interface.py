"""ModelState: the strategy object that owns everything model-kind specific, so the runner stays shared."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

from stateserve.layers.metadata import ForwardMeta

if TYPE_CHECKING:
    from stateserve.config import EngineConfig, ModelConfig
    from stateserve.engine.request import Request
    from stateserve.models.base import ModelBase
    from stateserve.runner.input_batch import InputBatch


class ModelState(ABC):
    # which cache kinds this model kind uses; the runner allocates only these
    uses_kv_cache: ClassVar[bool] = True
    uses_state_cache: ClassVar[bool] = False
    supports_generate: ClassVar[bool] = True

    def __init__(self, model: "ModelBase", model_config: "ModelConfig", engine_config: "EngineConfig",
                 device: torch.device) -> None:
        self.model = model
        self.model_config = model_config
        self.engine_config = engine_config
        self.device = device
        self.block_size = engine_config.block_size

    def add_request(self, req: "Request") -> None:
        """Per-request set-up when a request is admitted (default: nothing)."""

    def remove_request(self, req: "Request") -> None:
        """Per-request teardown when it finishes, is aborted or preempted (default: nothing)."""

    def chunk_size(self, req: "Request", num_tokens: int) -> int:
        """How many of the `num_tokens` the scheduler offers this request may run now."""
        return num_tokens

    def default_prefix_caching(self) -> bool:
        return True

    @abstractmethod
    def prepare_meta(self, batch: "InputBatch") -> ForwardMeta:
        """Everything the layers need besides token ids and positions, for this step."""

    def after_step(self, batch: "InputBatch") -> None:
        """Called after the forward (e.g. to publish state snapshots that are now written)."""

    def attach_cache(self, cache, mamba_cache_mode: str) -> None:
        """Receive the engine's CacheManager once caches exist (default: not needed)."""

    def on_step_failed(self) -> None:
        """The step raised (forward or sampling; after_step did not run): forget anything prepared for publication
        in it. The engine then ends every request of the step (remove_request is called for each)."""

    def release(self) -> None:
        """Drop per-request buffers at shutdown."""
