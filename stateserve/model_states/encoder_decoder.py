"""EncoderDecoderModelState: models with cross-attention (BART, T5, Whisper)."""
from __future__ import annotations

from stateserve.layers.metadata import ForwardMeta
from stateserve.model_states.interface import ModelState
from stateserve.runner.input_batch import InputBatch


class EncoderDecoderModelState(ModelState):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        raise NotImplementedError("encoder-decoder models (cross-attention) are not supported yet")

    def prepare_meta(self, batch: InputBatch) -> ForwardMeta:
        raise NotImplementedError("encoder-decoder models (cross-attention) are not supported yet")
