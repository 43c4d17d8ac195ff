"""Model-kind strategies and the router that picks one per model."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from stateserve.layers.markers import CrossAttentionMarker, EncoderOnlyAttentionMarker

if TYPE_CHECKING:
    from stateserve.model_states.interface import ModelState
    from stateserve.models.base import ModelBase


_STATES = {
    "default": "stateserve.model_states.default:DefaultModelState",
    "mamba_hybrid": "stateserve.model_states.mamba_hybrid:MambaHybridModelState",
    "encoder_only": "stateserve.model_states.encoder_only:EncoderOnlyModelState",
    "encoder_decoder": "stateserve.model_states.encoder_decoder:EncoderDecoderModelState",
}


def _load(key: str) -> type:
    module, cls = _STATES[key].split(":")
    return getattr(importlib.import_module(module), cls)


def resolve_model_state_cls(model: "ModelBase", *, is_hybrid: bool, is_attention_free: bool) -> type["ModelState"]:
    """Route in a fixed order; the first match wins:
    model's own get_model_state_cls() -> cross-attention -> encoder-only attention -> recurrent -> default."""
    own = type(model).get_model_state_cls()
    if own is not None:
        return own
    modules = list(model.modules())
    if any(isinstance(m, CrossAttentionMarker) for m in modules):
        return _load("encoder_decoder")
    if any(isinstance(m, EncoderOnlyAttentionMarker) for m in modules):
        return _load("encoder_only")
    if is_hybrid or is_attention_free:
        return _load("mamba_hybrid")
    return _load("default")


def init_model_state(model, model_config, engine_config, device) -> "ModelState":
    cls = resolve_model_state_cls(model, is_hybrid=model_config.is_hybrid,
                                  is_attention_free=model_config.is_attention_free)
    return cls(model, model_config, engine_config, device)
