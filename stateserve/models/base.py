"""What every model class provides to the runner, and every optional hook a model class may override.

A model: forward(input_ids [T], positions [T], meta) -> hidden [T, hidden]; compute_logits(hidden [n, hidden])
-> [n, vocab]; class flags is_attention_free / is_hybrid; map_weight_name for checkpoint names.
Layers that need a cache expose cache_spec()/bind_cache(); the model never allocates one. Every hook the engine,
the runner or a model state may consult is declared here with its default, so none is found by probing."""
from __future__ import annotations

from typing import Any, ClassVar, Iterable

import torch
from torch import nn

from stateserve.layers.metadata import ForwardMeta
from stateserve.layers.moe import split_fused_experts


class ModelBase(nn.Module):
    is_attention_free: ClassVar[bool] = False
    is_hybrid: ClassVar[bool] = False
    # param name -> the param it shares storage with (tied embeddings); not read from checkpoints
    tied_params: ClassVar[dict[str, str]] = {}
    # embedding models: a pooling head instead of an LM head, and the pooling mode without a pooling config
    is_pooling_model: ClassVar[bool] = False
    default_pooling_mode: ClassVar[str] = "cls"
    # dynamic NTK rope reads host-side sequence lengths each step (no decode graphs); set by models that have it
    dynamic_rope: bool = False
    # why the forward reads other host-side step values a replayed decode graph would freeze (None: it reads none)
    graph_blocker: str | None = None
    # encoder-decoder models: the decoder's start token, and whether it is put before a decoder prompt given
    # without it (transformers' generate does for BART and T5, not for Whisper)
    decoder_start_token_id: int | None = None
    prepends_decoder_start: ClassVar[bool] = True
    # MoE families whose experts load per expert: the layout ("gated" or "non_gated") of the 3-D fused expert
    # tensors that expand_weight splits into per-expert names (None: no fused expert tensors are split)
    fused_experts: ClassVar[str | None] = None
    # pipeline parallelism (distributed/pipeline.py): the submodule path of the layer list whose loop is the whole
    # forward between the embeddings and the final norm (None: no pipeline split), and how many values one layer
    # hands the next (1: the hidden rows; 2: hidden rows and the residual stream, returned as a tuple)
    pipeline_layers: ClassVar[str | None] = None
    pipeline_carry: ClassVar[int] = 1

    # ---- class hooks: routing and limits -------------------------------------------------------
    @classmethod
    def get_model_state_cls(cls) -> type | None:
        """A ModelState class of the model's own (a plug-in model kind); None: the router decides."""
        return None

    @classmethod
    def resolve_flags(cls, hf_config: Any) -> tuple[bool, bool]:
        """(is_attention_free, is_hybrid) of this config (a hybrid family's config may be all attention)."""
        return cls.is_attention_free, cls.is_hybrid

    @classmethod
    def max_positions(cls, hf_config: Any) -> int | None:
        """The longest sequence the model can position (None: unbounded, e.g. a recurrent model)."""
        return getattr(hf_config, "max_position_embeddings", None)

    @classmethod
    def max_encoder_len(cls, hf_config: Any) -> int | None:
        """Encoder-only models: the longest prompt the encoder takes (None: max_model_len)."""
        return None

    # ---- encoder-decoder hooks (model_states/encoder_decoder.py calls them) ---------------------
    def prepare_encoder_input(self, raw: dict[str, Any], model_path: str, max_len: int) -> tuple[dict, int]:
        """The user's encoder input -> (validated model-ready data, encoder output length); ValueError if bad."""
        raise NotImplementedError

    def encode(self, inputs: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Encoder outputs, each [L_i, hidden]."""
        raise NotImplementedError

    def cross_kv(self, encoder_hidden: torch.Tensor) -> list[Any]:
        """Per decoder layer, the cross-attention (k, v), each [KH, L, D], of one encoder output [L, hidden]."""
        raise NotImplementedError

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.config = hf_config

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        """Checkpoint tensor name -> (parameter name, shard index or None); None skips the tensor."""
        return name, None

    def expand_weight(self, name: str, tensor: Any) -> Iterable[tuple[str, Any]]:
        """One checkpoint tensor -> the (name, tensor) pairs the loader then places one by one with
        map_weight_name; called on every tensor before map_weight_name. For a tensor no single (parameter, shard)
        holds: one that fills several parameters or shards (re-emitted in pieces under names map_weight_name
        knows), or several that together fill shards they do not line up with (a model may keep pieces back and
        emit the regrouped tensors once the last one arrives; an incomplete group then shows as missing shards).
        The default splits the 3-D fused expert tensors of a `fused_experts` family (layers/moe.py,
        split_fused_experts) and passes every other tensor through unchanged."""
        if self.fused_experts is not None and isinstance(tensor, torch.Tensor):
            split = split_fused_experts(name, tensor, self.fused_experts)
            if split is not None:
                return split
        return ((name, tensor),)

    def add_lm_head(self, cfg: Any, embed_param: str = "model.embed_tokens.weight", tie_default: bool = False) -> None:
        """The output projection, sharing the embedding matrix when the config ties them."""
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if getattr(cfg, "tie_word_embeddings", tie_default):
            self.tied_params = {"lm_head.weight": embed_param}
            self.tie_weights_()

    def tie_weights_(self) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        for dst, src in self.tied_params.items():
            module_name, _, attr = dst.rpartition(".")
            setattr(self.get_submodule(module_name), attr, params[src])

    def release_caches(self) -> None:
        """Drop module-level caches (rotary tables) and cache views; called at shutdown."""
        for m in self.modules():
            if m is not self and callable(getattr(m, "release", None)):
                m.release()


def multiplier(cfg: Any, name: str) -> float:
    """A scalar multiplier from the config; a missing or null one means 1."""
    value = getattr(cfg, name, None)
    return 1.0 if value is None else float(value)
