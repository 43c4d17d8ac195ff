"""Kimi Linear: a hybrid decoder of Kimi Delta Attention layers (linear attention with a per-channel forget gate,
recurrent state; layers/kda.py) and multi-head latent attention (MLA) layers, with MoE feed-forwards (sigmoid router
with a correction bias and group-limited top-k, a shared expert) after the first `first_k_dense_replace` layers.

Per transformers' KimiLinearForCausalLM: `layer_types` picks each layer's mixer ("linear_attention" is KDA,
"full_attention" MLA) and `mlp_layer_types` its feed-forward ("dense" or "sparse"). MLA here has no rotary embedding
(Kimi Linear's is NoPE): a token's keys are [k_nope of its head | the shared k_rot], all from the compressed latent.

MLA cache: the compressed latent (LatentKVCacheSpec: per token the normed kv latent and the shared k_rot, one
row of kv_lora_rank + qk_rope_head_dim values, paged like K/V), attended with kv_b_proj absorbed into the queries
and the output (layers/latent_attention.py). The same math as transformers' up-projected K/V in another summation
order: float32 results agree to round-off; in bfloat16 the per-head keys are never rounded, as transformers'
are."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from stateserve.layers.kda import KimiDeltaAttention
from stateserve.layers.latent_attention import LatentAttention
from stateserve.layers.metadata import AttnMetadata, ForwardMeta
from stateserve.layers.moe import GatedMLPExpert, SparseMoE
from stateserve.layers.norm import RMSNorm
from stateserve.layers.param_cache import derived
from stateserve.models.base import ModelBase
from stateserve.models.nemotron_h import NemotronHRouter

LAYER_TYPES = ("linear_attention", "full_attention")
MLP_TYPES = ("dense", "sparse")
_GATE_UP = {"gate_proj": 0, "up_proj": 1}
_KDA_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_KDA_CONV = {"q_conv1d": 0, "k_conv1d": 1, "v_conv1d": 2}


class KimiRMSNorm(RMSNorm):
    """KimiLinearRMSNorm: normalise in float32, round to the input dtype, then times the weight: the formula (and
    so the fused kernels) of layers/norm.RMSNorm."""


def layer_types(cfg: Any, family: str = "Kimi Linear") -> list[str]:
    types = list(getattr(cfg, "layer_types", None) or [])[:cfg.num_hidden_layers]
    bad = sorted({str(t) for t in types} - set(LAYER_TYPES))
    if bad:
        raise ValueError(f"{family}: layer_types has unknown layer type(s) {bad}; each layer must be one of "
                         f"{LAYER_TYPES}")
    if len(types) != cfg.num_hidden_layers:
        raise ValueError(f"{family}: layer_types must name {cfg.num_hidden_layers} layers; got {types}")
    return types


def mlp_types(cfg: Any, family: str = "Kimi Linear") -> list[str]:
    types = list(getattr(cfg, "mlp_layer_types", None) or [])[:cfg.num_hidden_layers]
    bad = sorted({str(t) for t in types} - set(MLP_TYPES))
    if bad or len(types) != cfg.num_hidden_layers:
        raise ValueError(f"{family}: mlp_layer_types must name {cfg.num_hidden_layers} layers from {MLP_TYPES}; "
                         f"got {types}")
    return types


class LatentUpProjection(nn.Module):
    """kv_b_proj's weight [H * (nope + v), rank], read whole by the absorbed attention: a module of its own rather
    than an nn.Linear, so the runner's linear replacements (FastLinear, quantization) leave the matrix in place."""

    def __init__(self, rank: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, rank))


class KimiMLA(nn.Module):
    """Multi-head latent attention without rotary: q from q_proj (or the q_a -> norm -> q_b low-rank path), the
    compressed kv latent (normed) and the shared k_rot from kv_a_proj_with_mqa; kv_b_proj's key and value halves
    are absorbed into the query and the output (layers/latent_attention.py), so the cache keeps the latent row."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        if (cfg.num_key_value_heads or self.num_heads) != self.num_heads:
            raise ValueError(f"Kimi Linear MLA: num_key_value_heads={cfg.num_key_value_heads} must equal "
                             f"num_attention_heads={self.num_heads} (kv_b_proj makes one K/V per query head)")
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.qk_dim, self.rank = self.nope + self.rope, cfg.kv_lora_rank
        self.q_lora_rank = cfg.q_lora_rank
        bias = bool(getattr(cfg, "attention_bias", False))
        H, hidden = self.num_heads, cfg.hidden_size
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, H * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = KimiRMSNorm(self.q_lora_rank)
            self.q_b_proj = nn.Linear(self.q_lora_rank, H * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = KimiRMSNorm(self.rank)
        self.kv_b_proj = LatentUpProjection(self.rank, H * (self.nope + self.v_dim))
        self.o_proj = nn.Linear(H * self.v_dim, hidden, bias=bias)
        # the score scale stays transformers' 1 / sqrt(qk_head_dim), whatever width the absorbed queries have
        self.attn = LatentAttention(H, self.rank + self.rope, self.rank, self.qk_dim ** -0.5, dtype)

    def encode_positions(self, q_rope: torch.Tensor, k_rot: torch.Tensor,
                         positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """q_rope [T, H, rope], k_rot [T, rope] as the cache and scores take them: Kimi's MLA is NoPE, so as they
        are (Bailing Hybrid's subclass rotates them)."""
        return q_rope, k_rot

    def gate_heads(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], out [T, H, v] before o_proj: no output gate here (Bailing Hybrid has one per head)."""
        return out

    def forward(self, x: torch.Tensor, meta: AttnMetadata, positions: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]; positions [T] for subclasses with a rotary part
        T, H = x.shape[0], self.num_heads
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(T, H, self.qk_dim).split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        q_rope, k_rot = self.encode_positions(q_rope, k_rot, positions)
        rows = torch.cat([self.kv_a_layernorm(latent), k_rot], dim=-1)  # [T, rank + rope]: what the cache keeps
        w_k, w_v = self.absorbed_weights()  # float32 [H, nope, rank], [H, rank, v]
        # q_nope . (W_k c) == (q_nope W_k) . c; float32 products of the (exact) upcast operands rounded once, as a
        # bfloat16 matmul rounds (PyTorch's bfloat16 bmm of these shapes took ~100 us a decode call)
        q_latent = self._per_head(q_nope, w_k, meta).to(x.dtype)  # [T, H, rank]
        out = self.attn(torch.cat([q_latent, q_rope], dim=-1), rows, meta)  # [T, H, rank]
        out = self._per_head(out, w_v, meta).to(x.dtype)  # [T, H, v]
        out = self.gate_heads(x, out)
        return self.o_proj(out.reshape(T, H * self.v_dim))

    def _per_head(self, x: torch.Tensor, w: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        """x [T, H, a] times each head's w [H, a, b] -> float32 [T, H, b]. A bmm's sums depend on its row count, so
        batch-invariant each sequence's rows are multiplied alone (as many rows whatever the batch holds)."""
        if not self.attn.batch_invariant or len(meta.query_lens) < 2:
            return torch.bmm(x.transpose(0, 1).float(), w).transpose(0, 1)
        out = x.new_empty(x.shape[0], x.shape[1], w.shape[-1], dtype=torch.float32)
        for start, n in zip(meta.query_start_loc[:-1], meta.query_lens):
            out[start:start + n] = torch.bmm(x[start:start + n].transpose(0, 1).float(), w).transpose(0, 1)
        return out

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's key half [H, nope, rank] and transposed value half [H, rank, v], float32 and contiguous for
        bmm; made once per version of the weight."""
        weight = self.kv_b_proj.weight

        def make() -> tuple[torch.Tensor, torch.Tensor]:
            w = weight.detach().float().view(self.num_heads, self.nope + self.v_dim, self.rank)
            return w[:, :self.nope].contiguous(), w[:, self.nope:].transpose(1, 2).contiguous()
        return derived(self, "absorbed", (weight,), make)


class KimiMoE(SparseMoE):
    """Routed gated experts (stacked per-expert matrices, SparseMoE's grouping) chosen by a DeepSeek-style sigmoid
    router (NemotronHRouter: correction bias, group-limited top-k, routed_scaling_factor), plus a shared expert."""

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                         norm_topk_prob=bool(cfg.norm_topk_prob), activation=cfg.hidden_act,
                         shared_intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts or None)
        del self.router  # replaced by the sigmoid router below (checkpoint name `gate`)
        self.gate = NemotronHRouter(SimpleNamespace(
            n_routed_experts=cfg.num_local_experts, num_experts_per_tok=cfg.num_experts_per_tok,
            n_group=cfg.n_group, topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor, hidden_size=cfg.hidden_size))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = self.gate(x)  # [T, k] float32, [T, k]
        return weights.to(x.dtype), ids

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        if name.startswith("gate."):
            return name, None
        if name.startswith("shared_experts."):  # Kimi's plural; SparseMoE knows `shared_expert.`
            name = "shared_expert." + name[len("shared_experts."):]
        return super().map_weight_name(name)


class KimiDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, layer_type: str, mlp_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.self_attn: nn.Module = KimiDeltaAttention(
                cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim,
                cfg.rms_norm_eps, cfg.hidden_act, dtype)
        else:
            self.self_attn = KimiMLA(cfg, dtype)
        self.mlp = KimiMoE(cfg) if mlp_type == "sparse" else GatedMLPExpert(
            cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, fused_checkpoint=False)
        self.input_layernorm = KimiRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = KimiRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.self_attn(h, meta.state if self.layer_type == "linear_attention" else meta.attn)
        h, x = self.post_attention_layernorm.add_forward(h, x)  # x += h (x is this forward's own stream), norm
        return x + self.mlp(h)


class KimiLinearModel(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(KimiDecoderLayer(cfg, t, m, dtype)
                                    for t, m in zip(layer_types(cfg), mlp_types(cfg)))
        self.norm = KimiRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class KimiLinearForCausalLM(ModelBase):
    fused_experts = "gated"  # 3-D fused expert tensors load too, split per expert (ModelBase.expand_weight)
    is_hybrid = True
    family = "Kimi Linear"  # names the model in config errors (Bailing Hybrid's subclass has its own)

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__(hf_config)
        self.model = KimiLinearModel(hf_config, dtype)
        self.add_lm_head(hf_config)

    @classmethod
    def resolve_flags(cls, hf_config: Any) -> tuple[bool, bool]:
        """(is_attention_free, is_hybrid): a config may use only one kind of mixer."""
        types = set(layer_types(hf_config, cls.family))
        return "full_attention" not in types, types == set(LAYER_TYPES)

    @classmethod
    def max_positions(cls, hf_config: Any) -> int | None:
        return getattr(hf_config, "max_position_embeddings", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        # positions are unused: no layer of Kimi Linear has a position encoding (KDA is recurrent, MLA is NoPE)
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        for layer in self.model.layers:
            x = layer(x, meta)
        return self.model.norm(x)

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        """The checkpoint names transformers 5.24 saves (the original layout: block_sparse_moe, experts.N.w1/w2/w3,
        q/k/v_conv1d, f_a_proj on self_attn) and its in-memory ones (mlp, forget_gate.*, conv1d)."""
        name = name.replace(".block_sparse_moe.", ".mlp.").replace(".self_attn.forget_gate.", ".self_attn.")
        parts = name.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"]:
            return name, None
        layer = self.model.layers[int(parts[2])]
        prefix, rest = ".".join(parts[:4]), ".".join(parts[4:])
        if parts[3] == "mlp":
            if isinstance(layer.mlp, KimiMoE):
                target = layer.mlp.map_weight_name(rest)
                return None if target is None else (f"{prefix}.{target[0]}", target[1])
            if parts[4] in _GATE_UP:
                return f"{prefix}.gate_up_proj.{parts[-1]}", _GATE_UP[parts[4]]
            return name, None
        if parts[3] == "self_attn" and layer.layer_type == "linear_attention":
            if parts[4] in _KDA_QKV:
                return f"{prefix}.qkv_proj.weight", _KDA_QKV[parts[4]]
            if parts[4] in _KDA_CONV:
                return f"{prefix}.conv1d.weight", _KDA_CONV[parts[4]]
        return name, None
