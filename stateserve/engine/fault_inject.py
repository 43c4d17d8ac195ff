"""A test hook that makes one decoder layer's forward raise on chosen steps, to check that a failing step fails
only its own requests and leaves no half-written recurrent state or snapshot behind (tests/test_step_faults.py).

STATESERVE_FAULT_INJECT="layer=L,step=S[,count=C]": layer L (0-based) of the model's decoder-layer list raises
`InjectedFault` right after its own forward has run (so it and every layer before it have already written their
KV blocks and recurrent states) in model forwards S, S+1, ..., S+C-1 (C defaults to 1), counted from 0 from the
first step the engine runs; with the default runner that is engine step S, counting only steps that run the
model. Setting it turns CUDA graphs off (a graph replay runs no Python hooks). Unset (the default) nothing is
installed, so a step pays nothing. Tests may also call `FaultInjector(model, FaultSpec(...))` directly."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn

from stateserve import envs

logger = logging.getLogger("stateserve")
_LAYER_LIST_NAMES = ("layers", "block", "layer")


class InjectedFault(RuntimeError):
    """Raised by the fault-injection hook; never by real code."""


@dataclass(frozen=True)
class FaultSpec:
    layer: int
    step: int
    count: int = 1

    @classmethod
    def parse(cls, text: str) -> "FaultSpec":
        fields: dict[str, int] = {}
        for part in text.split(","):
            key, sep, value = (s.strip() for s in part.partition("="))
            if not sep or key not in ("layer", "step", "count") or key in fields:
                raise ValueError(f"expected 'layer=L,step=S[,count=C]', got {text!r}")
            try:
                fields[key] = int(value)
            except ValueError:
                raise ValueError(f"{key} must be an integer, got {value!r}") from None
        if "layer" not in fields or "step" not in fields:
            raise ValueError(f"both layer and step are needed, got {text!r}")
        spec = cls(**fields)
        if spec.layer < 0 or spec.step < 0 or spec.count < 1:
            raise ValueError(f"layer and step must be >= 0 and count >= 1, got {text!r}")
        return spec


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of decoder layers: its ModuleList named layers / block / layer (the decoder's, where an
    encoder has one too)."""
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and name.rsplit(".", 1)[-1] in _LAYER_LIST_NAMES]
    if not found:
        raise ValueError(f"{type(model).__name__} has no list of layers to inject a fault into")
    decoder = [m for name, m in found if "decoder" in name]
    return (decoder or [m for _, m in found])[0]


class FaultInjector:
    """Counts the model's forwards (a pre-hook on the model) and raises after layer `spec.layer`'s forward in the
    chosen ones (a forward hook on that layer)."""

    def __init__(self, model: nn.Module, spec: FaultSpec) -> None:
        layers = decoder_layers(model)
        if spec.layer >= len(layers):
            raise ValueError(f"fault injection: layer {spec.layer} does not exist, the model has {len(layers)}")
        self.spec = spec
        self.forwards = 0  # model forwards seen so far
        self.fired = 0  # faults raised so far
        self._armed = False
        self._handles = [model.register_forward_pre_hook(self._count),
                         layers[spec.layer].register_forward_hook(self._raise)]

    def _count(self, module: nn.Module, args: tuple) -> None:
        s = self.spec
        self._armed = s.step <= self.forwards < s.step + s.count
        self.forwards += 1

    def _raise(self, module: nn.Module, args: tuple, output: object) -> None:
        if self._armed:
            self._armed = False  # once per forward, even for a layer module the model calls twice
            self.fired += 1
            raise InjectedFault(f"injected fault in layer {self.spec.layer} at step {self.forwards - 1} "
                                "(STATESERVE_FAULT_INJECT)")

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def requested() -> bool:
    return bool(envs.STATESERVE_FAULT_INJECT)


def from_env(model: nn.Module) -> FaultInjector | None:
    """The injector STATESERVE_FAULT_INJECT asks for, installed on `model`; None when the variable is unset."""
    text = envs.STATESERVE_FAULT_INJECT
    if not text:
        return None
    try:
        spec = FaultSpec.parse(text)
    except ValueError as e:
        raise ValueError(f"environment variable STATESERVE_FAULT_INJECT={text!r} is invalid: {e}") from None
    logger.warning("fault injection on (STATESERVE_FAULT_INJECT=%s): layer %d raises in steps %d..%d", text,
                   spec.layer, spec.step, spec.step + spec.count - 1)
    return FaultInjector(model, spec)
