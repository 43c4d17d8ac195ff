"""Qwen3.5 text models: Qwen3_5ForCausalLM (dense) and Qwen3_5MoeForCausalLM, as transformers 5.24 defines them.

The decoder is Qwen3-Next's (models/qwen3_next.py owns it: Gated DeltaNet and gated full attention layers, (1 + w)
RMSNorms, per-head q/k norms, partial rotary); what differs is owned here:
- the delta net's checkpoint keeps its input projections apart (in_proj_qkv [q | k | v over all heads], in_proj_z,
  in_proj_b, in_proj_a) instead of Qwen3-Next's per-key-head grouping: GatedDeltaNet's "flat" layout;
- Qwen3.5's feed-forward is a dense gated MLP on every layer; Qwen3.5-MoE's is a sparse MoE with a sigmoid-gated
  shared expert on every layer, top-k weights always renormalised (its config has no decoder_sparse_step,
  mlp_only_layers or norm_topk_prob);
- rotary: transformers rotates with interleaved multimodal rope (mrope_section over T/H/W position axes); a text
  prompt has the same position on all three axes, where that is ordinary rope over the first
  partial_rotary_factor (default 0.25) of each head, so the shared RotaryEmbedding serves it.
Checkpoint names are those of the ForCausalLM classes; a `model.language_model.` prefix (how the vision-language
checkpoints store the text model, which transformers strips too) is accepted, and `model.visual.*` and `mtp.*`
tensors are skipped. A vision-language config (Qwen3_5Config with a vision_config) is refused: see
`require_text_config`."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stateserve.layers.delta_rule import FLAT_PROJECTION_SHARDS
from stateserve.layers.moe import GatedMLPExpert, SparseMoE
from stateserve.models.qwen3_next import Qwen3NextForCausalLM

_TEXT_PREFIX = "model.language_model."
_SKIPPED_PREFIXES = ("model.visual.", "mtp.")


def require_text_config(hf_config: Any, arch: str) -> None:
    """A composite vision-language config (text_config + vision_config) is not a text model's config: fail with
    what to do rather than an AttributeError deep in the build."""
    if getattr(hf_config, "vision_config", None) is not None or getattr(hf_config, "text_config", None) is not None:
        raise ValueError(
            f"{arch}: this config ({type(hf_config).__name__}, model_type {getattr(hf_config, 'model_type', '?')!r}) "
            "is a vision-language model with a vision tower (vision_config); stateserve serves only the text model. "
            "To serve its text part, use a config.json made of its text_config with architectures "
            f"[{arch!r}] (its model.language_model.* tensor names are accepted; model.visual.* is skipped).")


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    projection_layout = "flat"

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        require_text_config(hf_config, type(self).__name__)
        super().__init__(hf_config, dtype)

    @classmethod
    def resolve_flags(cls, hf_config: Any) -> tuple[bool, bool]:
        require_text_config(hf_config, cls.__name__)  # the first hook the engine calls on a config
        return super().resolve_flags(hf_config)

    @classmethod
    def build_mlp(cls, cfg: Any, index: int) -> nn.Module:
        return GatedMLPExpert(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, fused_checkpoint=False)

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        if name.startswith(_TEXT_PREFIX):
            name = "model." + name[len(_TEXT_PREFIX):]
        if name.startswith(_SKIPPED_PREFIXES):
            return None
        parts = name.split(".")
        # model.layers.N.linear_attn.in_proj_{qkv,z,b,a}.weight -> a shard of the fused projections
        if len(parts) == 6 and parts[3] == "linear_attn" and parts[4] in FLAT_PROJECTION_SHARDS:
            fused, shard = FLAT_PROJECTION_SHARDS[parts[4]]
            return ".".join(parts[:4] + [fused, parts[5]]), shard
        return super().map_weight_name(name)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Experts load from the per-expert names transformers 5.24 saves (experts.N.{gate,up,down}_proj.weight) or from
    the 3-D fused tensors of its in-memory layout (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]),
    which expand_weight (ModelBase, `fused_experts` inherited from Qwen3-Next) splits per expert."""

    @classmethod
    def build_mlp(cls, cfg: Any, index: int) -> nn.Module:
        return SparseMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                         norm_topk_prob=True, activation=cfg.hidden_act,
                         shared_intermediate_size=cfg.shared_expert_intermediate_size, shared_expert_gate=True)
