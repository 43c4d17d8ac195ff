"""init_model_state routing order, with small fake modules: own hook > cross-attention > encoder-only >
recurrent (hybrid or attention-free) > default."""
from __future__ import annotations

from torch import nn

from stateserve.layers.markers import CrossAttentionMarker, EncoderOnlyAttentionMarker
from stateserve.model_states import resolve_model_state_cls
from stateserve.models.base import ModelBase
from stateserve.model_states.default import DefaultModelState
from stateserve.model_states.interface import ModelState
from stateserve.model_states.mamba_hybrid import MambaHybridModelState


class CrossAttn(CrossAttentionMarker, nn.Module):
    pass


class EncAttn(EncoderOnlyAttentionMarker, nn.Module):
    pass


class Own(ModelState):
    def prepare_meta(self, batch):
        raise NotImplementedError


def model_with(*children, hook=False):
    cls = type("Fake", (ModelBase,), {})
    if hook:
        cls.get_model_state_cls = staticmethod(lambda: Own)
    m = cls(None)
    for i, c in enumerate(children):
        m.add_module(f"m{i}", c)
    return m


def name(model, hybrid=False, af=False):
    return resolve_model_state_cls(model, is_hybrid=hybrid, is_attention_free=af).__name__


def test_order():
    assert name(model_with(CrossAttn(), EncAttn(), hook=True), hybrid=True) == "Own"
    assert name(model_with(CrossAttn(), EncAttn()), hybrid=True) == "EncoderDecoderModelState"
    assert name(model_with(EncAttn()), hybrid=True, af=True) == "EncoderOnlyModelState"
    assert name(model_with(nn.Linear(2, 2)), hybrid=True) == MambaHybridModelState.__name__
    assert name(model_with(nn.Linear(2, 2)), af=True) == MambaHybridModelState.__name__
    assert name(model_with(nn.Linear(2, 2))) == DefaultModelState.__name__


def test_real_models_route_by_class_flags():
    from stateserve.models.llama import LlamaForCausalLM

    assert not LlamaForCausalLM.is_hybrid and not LlamaForCausalLM.is_attention_free
