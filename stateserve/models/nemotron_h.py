"""NemotronH: a stack of single-mixer blocks, x += mixer(norm(x)), the mixer of each block picked by the config's
layer pattern (transformers' NemotronHForCausalLM):
  M  Mamba2 mixer (linear_attention)        * attention without rotary embeddings (full_attention)
  -  MLP down(act(up(x))), act = mlp_hidden_act (relu2)
  E  MoE: sigmoid router with a correction bias and group-limited top-k, non-gated relu2 experts (optionally in
     a latent space), plus a shared MLP.
The pattern comes from `layers_block_type` (transformers 5) or the older `hybrid_override_pattern` string.

Transformers details kept on purpose: the attention projections never have a bias (attention_bias is not read),
head_dim is the config's; the Mamba2 dt limit is (time_step_min, inf) whatever time_step_limit says, with the
clamp applied on every path (see `_mixer`); norms multiply by the weight in float32; the router runs in float32
(its weight and bias stay float32 in reduced-precision models, like transformers' _keep_in_fp32_modules);
multi-token-prediction weights (mtp.*) are skipped. Not read by transformers' model either, hence ignored here:
sliding_window, residual_in_fp32, mamba_ssm_cache_dtype (the SSM state is always float32), n_shared_experts.
Weight names are the checkpoints' (backbone.embeddings, backbone.layers.N.{norm, mixer.*}, backbone.norm_f,
lm_head); `model.` (transformers' in-memory prefix) is accepted as well."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from stateserve.layers.mamba2_mixer import Mamba2Mixer
from stateserve.layers.markers import stacked
from stateserve.layers.moe import ExpertMatrices
from stateserve.layers.metadata import ForwardMeta
from stateserve.layers.qkv_attention import QKV_SHARDS, QKVAttention
from stateserve.models.base import ModelBase

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
PATTERN_CHARS = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu2": lambda x: F.relu(x).square(), "relu": F.relu, "silu": F.silu, "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def parse_pattern(pattern: str) -> list[str]:
    bad = sorted(set(pattern) - set(PATTERN_CHARS))
    if bad or not pattern:
        raise ValueError(f"NemotronH hybrid_override_pattern {pattern!r}: unsupported layer character(s) {bad}; "
                         f"supported: M (Mamba2), * (attention), - (MLP), E (MoE)")
    return [PATTERN_CHARS[c] for c in pattern]


def block_types(cfg: Any) -> list[str]:
    types = getattr(cfg, "layers_block_type", None)
    if types is None:
        pattern = getattr(cfg, "hybrid_override_pattern", None)
        if pattern is None:
            raise ValueError("NemotronH config has neither layers_block_type nor hybrid_override_pattern")
        return parse_pattern(pattern)
    types = list(types)
    bad = sorted(set(types) - set(PATTERN_CHARS.values()))
    if bad or not types:
        raise ValueError(f"NemotronH layers_block_type {types}: unsupported block type(s) {bad}; "
                         f"supported: {sorted(PATTERN_CHARS.values())}")
    return types


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"NemotronH: mlp_hidden_act {name!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class NemotronHRMSNorm(nn.Module):
    """RMSNorm whose weight multiply happens in float32 before the cast back (transformers' NemotronHRMSNorm)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


def _mixer(cfg: Any, dtype: torch.dtype) -> Mamba2Mixer:
    # transformers' chunked (prefill) path clamps dt to (time_step_min, inf) and its one-token path does not; we
    # clamp on both (the mixer default), so a sequence's arithmetic never depends on how steps are batched and
    # every chunking reproduces transformers' forward. Its generate() then differs only where softplus(dt) <
    # time_step_min during decode, by at most time_step_min in that head's step size.
    return Mamba2Mixer(
        hidden_size=cfg.hidden_size, num_heads=cfg.mamba_num_heads, head_dim=cfg.mamba_head_dim,
        state_size=cfg.ssm_state_size, n_groups=cfg.n_groups, conv_kernel=cfg.conv_kernel,
        chunk_size=cfg.chunk_size, use_conv_bias=bool(cfg.use_conv_bias), use_bias=bool(cfg.use_bias),
        activation=cfg.mamba_hidden_act, norm_eps=cfg.layer_norm_epsilon,
        time_step_limit=(cfg.time_step_min, float("inf")), clamp_dt_on_decode=True,
        time_step_min=cfg.time_step_min, time_step_max=cfg.time_step_max, time_step_floor=cfg.time_step_floor,
        dtype=dtype)


class NemotronHMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool) -> None:
        super().__init__()
        self.act = activation(act)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class NemotronHRouter(nn.Module):
    """Sigmoid scores; experts chosen by (score + correction bias) within the best `topk_group` of `n_group`
    groups (a group's score is the sum of its two best); weights are the chosen raw scores, optionally
    renormalised, times routed_scaling_factor. Kept in float32 even when the model is cast down."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.num_experts, self.top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scale = bool(cfg.norm_topk_prob), float(cfg.routed_scaling_factor)
        per_group = self.num_experts // max(self.n_group, 1)
        if self.n_group < 1 or self.num_experts % self.n_group or per_group < 2:
            raise ValueError(f"NemotronH MoE: n_routed_experts={self.num_experts} must split into n_group="
                             f"{self.n_group} groups of at least 2 experts")
        if not 0 < self.topk_group <= self.n_group or not 0 < self.top_k <= self.topk_group * per_group:
            raise ValueError(f"NemotronH MoE: topk_group={self.topk_group} must be in 1..n_group and "
                             f"num_experts_per_tok={self.top_k} at most the experts of the chosen groups")
        self.weight = nn.Parameter(torch.zeros(self.num_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts))  # a checkpoint tensor

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        for p in (self.weight, self.e_score_correction_bias):  # device moves apply, dtype casts do not
            p.data = p.data.float()
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] float32, expert ids [T, k])."""
        scores = F.linear(x.float(), self.weight).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias
        if self.topk_group < self.n_group:  # else every group is kept: the mask below would change nothing
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, n_group]
            best_groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
            choice = choice.masked_fill(~keep.repeat_interleave(self.num_experts // self.n_group, dim=1),
                                        float("-inf"))
        ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids


class NemotronHMoE(nn.Module, ExpertMatrices):
    """Routed non-gated experts (tokens grouped by expert: one matmul pair per expert hit) + a shared MLP."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        E, I, H = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        latent = getattr(cfg, "moe_latent_size", None)
        D = latent or H  # the experts' input/output width
        self.num_experts, self.intermediate, self.expert_dim = E, I, D
        self.act = activation(cfg.mlp_hidden_act)
        self.gate = NemotronHRouter(cfg)
        # per-expert checkpoint matrices stacked on dim 0: experts.N.up_proj [I, D], experts.N.down_proj [D, I]
        self.experts_up = stacked(nn.Parameter(torch.empty(E * I, D)), [I] * E)
        self.experts_down = stacked(nn.Parameter(torch.empty(E * D, I)), [D] * E)
        self.init_expert_products()
        self.shared_experts = NemotronHMLP(H, cfg.moe_shared_expert_intermediate_size, cfg.mlp_hidden_act,
                                           bool(cfg.mlp_bias))
        bias = bool(cfg.mlp_bias)
        self.fc1_latent_proj = nn.Linear(H, latent, bias=bias) if latent else nn.Identity()
        self.fc2_latent_proj = nn.Linear(latent, H, bias=bias) if latent else nn.Identity()

    def expert_shapes(self) -> dict[str, tuple[int, int, int]]:
        E, I, D = self.num_experts, self.intermediate, self.expert_dim
        return {"experts_up": (E, I, D), "experts_down": (E, D, I)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        shared = self.shared_experts(x)
        if x.shape[0] == 0:
            return shared
        weights, ids = self.gate(x)  # [T, k]
        routed = self.fc2_latent_proj(self._experts(self.fc1_latent_proj(x), weights, ids))
        return routed + shared

    def _experts(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        # h: [T, D]; the weighted sum is taken in float32 (transformers accumulates in the weights' dtype)
        E, D, k = self.num_experts, self.expert_dim, ids.shape[1]
        matrices = self.expert_matrices()
        flat = ids.flatten()  # [T*k]: assignment a belongs to token a // k
        order = flat.argsort(stable=True)
        grouped = h[order // k]
        out = torch.empty_like(grouped)
        start = 0
        for e, n in enumerate(torch.bincount(flat, minlength=E).tolist()):  # one host sync for group sizes
            if n:
                up = self.expert_linear("experts_up", e, grouped[start:start + n], matrices)
                out[start:start + n] = self.expert_linear("experts_down", e, self.act(up), matrices)
                start += n
        per_assignment = torch.empty_like(out)
        per_assignment[order] = out
        summed = (per_assignment.view(-1, k, D).float() * weights.unsqueeze(-1)).sum(1)
        return summed.to(h.dtype)


class NemotronHBlock(nn.Module):
    def __init__(self, cfg: Any, block_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.block_type = block_type
        self.norm = NemotronHRMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        if block_type == MAMBA:
            self.mixer: nn.Module = _mixer(cfg, dtype)
        elif block_type == ATTENTION:
            self.mixer = QKVAttention.from_config(cfg, dtype)
        elif block_type == MLP:
            self.mixer = NemotronHMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_hidden_act, bool(cfg.mlp_bias))
        else:
            self.mixer = NemotronHMoE(cfg)

    def forward(self, x: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        # x: [T, hidden]
        h = self.norm(x)
        if self.block_type == MAMBA:
            h = self.mixer(h, meta.state)
        elif self.block_type == ATTENTION:
            h = self.mixer(h, meta.attn)
        else:
            h = self.mixer(h)
        return x + h


class NemotronHBackbone(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(NemotronHBlock(cfg, t, dtype) for t in block_types(cfg))
        self.norm_f = NemotronHRMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)


class NemotronHForCausalLM(ModelBase):
    pipeline_layers, pipeline_carry = "backbone.layers", 1
    fused_experts = "non_gated"  # 3-D fused expert tensors load too, split per expert (ModelBase.expand_weight)
    is_hybrid = True

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__(hf_config)
        self.backbone = NemotronHBackbone(hf_config, dtype)
        self.lm_head = nn.Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False)
        if getattr(hf_config, "tie_word_embeddings", False):
            self.tied_params = {"lm_head.weight": "backbone.embeddings.weight"}
            self.tie_weights_()

    @classmethod
    def resolve_flags(cls, hf_config: Any) -> tuple[bool, bool]:
        """(is_attention_free, is_hybrid): a pattern without '*' needs no KV cache, one without 'M' no states."""
        types = set(block_types(hf_config))
        return ATTENTION not in types, MAMBA in types and ATTENTION in types

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        x = self.backbone.embeddings(input_ids)  # [T, hidden]; positions unused: no rotary anywhere
        for layer in self.backbone.layers:
            x = layer(x, meta)
        return self.backbone.norm_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # transformers returns float32 logits

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        if name.startswith("mtp.") or "rotary_emb.inv_freq" in name:
            return None  # multi-token-prediction layers: transformers does not load them either
        if name.startswith("model."):
            name = "backbone." + name[len("model."):]
        parts = name.split(".")
        if len(parts) == 6 and parts[3] == "mixer" and parts[4] in QKV_SHARDS:
            return ".".join(parts[:4] + ["qkv_proj", parts[5]]), QKV_SHARDS[parts[4]]
        # backbone.layers.N.mixer.experts.M.{up,down}_proj.weight
        if len(parts) == 8 and parts[3:5] == ["mixer", "experts"] and parts[6] in ("up_proj", "down_proj"):
            return ".".join(parts[:4] + [f"experts_{parts[6][:-5]}"]), int(parts[5])
        return name, None
