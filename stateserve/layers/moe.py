"""Sparse mixture-of-experts feed-forward shared by the MoE models (Qwen3-Next, Jamba, GraniteMoeHybrid).

Router -> top-k experts per token -> gated MLP experts -> weighted sum, plus an optional shared expert
(optionally scaled by a sigmoid gate). A step's tokens are grouped by expert (sort by expert id), so the
work is one matmul pair per expert that received tokens, never a loop over tokens.

Checkpoint layouts (transformers 5.24 `save_pretrained`, which writes the original format):
  per_expert  Qwen3-Next / Jamba / Qwen2-MoE: `experts.N.gate_proj.weight` [I, H], `experts.N.up_proj.weight`,
              `experts.N.down_proj.weight` [H, I]; Mixtral spells them w1 / w3 / w2.
  fused       GraniteMoe(Hybrid): `input_linear.weight` [E, 2I, H] (gate rows first), `output_linear.weight`
              [E, H, I]; transformers' in-memory names `experts.gate_up_proj` / `experts.down_proj` are the same.
  3-D fused  transformers 5.24's in-memory layout, which save_pretrained(save_original_format=False) writes and some
              hub checkpoints carry, for the per_expert families too: `<block>.experts.gate_up_proj` [E, 2I, H]
              (its conversion stacks experts on dim 0, then concatenates gate then up on dim 1; forward chunks
              the product gate-first), `<block>.experts.down_proj` [E, H, I]; non-gated experts (NemotronH)
              `<block>.experts.up_proj` [E, I, H]. split_fused_experts cuts them back into per-expert names at load
              (ModelBase.expand_weight), so they land in the per_expert storage.
The strict loader narrows stacked shards on dim 0 only, so the storage follows the layout: per_expert keeps
[E * 2I, H] / [E * H, I] with one shard per expert matrix, fused keeps [E, 2I, H] / [E, H, I]; `forward`
views both as [E, 2I, H] / [E, H, I]."""
from __future__ import annotations

import re
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from stateserve.layers.markers import stacked
from stateserve.layers.norm import silu_and_mul

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
ROUTER_MODES = ("softmax_topk", "topk_softmax")
CHECKPOINT_FORMATS = ("per_expert", "fused")

# per-expert checkpoint matrices: name -> (which stacked parameter, row shard within the expert)
_PER_EXPERT = {"gate_proj": ("experts_gate_up", 0), "w1": ("experts_gate_up", 0),
               "up_proj": ("experts_gate_up", 1), "w3": ("experts_gate_up", 1),
               "down_proj": ("experts_down", 0), "w2": ("experts_down", 0)}
_PER_EXPERT_RE = re.compile(r"^experts\.(\d+)\.(\w+)\.weight$")
_FUSED = {"input_linear.weight": "experts_gate_up", "experts.gate_up_proj": "experts_gate_up",
          "output_linear.weight": "experts_down", "experts.down_proj": "experts_down"}

# 3-D fused expert tensor suffix -> the per-expert projections it holds, cut in equal parts on dim 1 in this order
FUSED_EXPERT_LAYOUTS: dict[str, dict[str, tuple[str, ...]]] = {
    "gated": {"experts.gate_up_proj": ("gate_proj", "up_proj"), "experts.down_proj": ("down_proj",)},
    "non_gated": {"experts.up_proj": ("up_proj",), "experts.down_proj": ("down_proj",)},
}

_ROUTER = {"gate.weight": "router.weight", "router.weight": "router.weight", "router.layer.weight": "router.weight",
           "router.bias": "router.bias"}
_SHARED_PER_EXPERT = {"gate_proj.weight": ("shared_expert.gate_up_proj.weight", 0),
                      "up_proj.weight": ("shared_expert.gate_up_proj.weight", 1),
                      "down_proj.weight": ("shared_expert.down_proj.weight", None)}
_SHARED_FUSED = {"input_linear.weight": "shared_expert.gate_up_proj.weight",
                 "output_linear.weight": "shared_expert.down_proj.weight"}


class ExpertMatrices:
    """What the MoE layers share about their stacked expert matrices: `expert_shapes()` names each parameter and
    its [E, N, K] shape, and quantization (quantization/__init__.py) may replace some or all of them by one product
    module per expert (a QuantLinear each: the float matrix is freed; a matrix whose K fits no format stays float);
    `expert_linear` is x @ W_e.T either way. A layer calls `init_expert_products()` in its __init__."""

    # The few-row kernel (csrc/linear.cpp) for float expert products of at most `few_row_rows` rows, set at load by
    # layers/linear.install_fast_linear: a decode step gives each expert a few tokens, which F.linear multiplies at
    # ~60 us a call in bfloat16 (Kimi Linear's experts). batch_invariant raises the limit to every row count, so an
    # expert's rows are summed in one order whatever number of tokens it gets (F.linear's order depends on it).
    few_row_product: Callable[..., torch.Tensor] | None = None
    few_row_rows: int = 0

    def init_expert_products(self) -> None:
        self.expert_products: nn.ModuleDict | None = None

    def expert_shapes(self) -> dict[str, tuple[int, int, int]]:
        raise NotImplementedError

    def expert_matrices(self) -> dict[str, torch.Tensor]:
        """[E, N, K] views of the expert matrices still held in float (not replaced by products)."""
        replaced = self.expert_products or {}
        return {name: getattr(self, name).view(shape) for name, shape in self.expert_shapes().items()
                if name not in replaced}

    def replace_expert_matrices(self, products: dict[str, list[nn.Module]]) -> None:
        self.expert_products = nn.ModuleDict({name: nn.ModuleList(mods) for name, mods in products.items()})
        for name in products:
            delattr(self, name)

    def expert_linear(self, name: str, e: int, x: torch.Tensor, matrices: dict[str, torch.Tensor]) -> torch.Tensor:
        """x [n, K] @ W_e.T -> [n, N]; matrices: expert_matrices() (the float ones)."""
        if self.expert_products is not None and name in self.expert_products:
            return self.expert_products[name][e](x)
        weight = matrices[name][e]
        if self.few_row_product is not None and x.shape[0] <= self.few_row_rows and x.dtype == weight.dtype \
                and not torch.is_grad_enabled():
            return self.few_row_product(x, weight, None)
        return F.linear(x, weight)


def split_fused_experts(name: str, tensor: torch.Tensor, layout: str) -> Iterable[tuple[str, torch.Tensor]] | None:
    """A 3-D fused expert tensor (`<block>.experts.gate_up_proj` [E, 2I, H] ...; FUSED_EXPERT_LAYOUTS[layout]) ->
    its per-expert matrices as `<block>.experts.N.{gate,up,down}_proj.weight` [I, H] / [H, I], the names
    transformers 5.24's save_pretrained writes for the same weights; None when `name` is no such tensor."""
    for suffix, projs in FUSED_EXPERT_LAYOUTS[layout].items():
        if name == suffix or name.endswith("." + suffix):
            break
    else:
        return None
    if tensor.dim() != 3 or tensor.shape[1] % len(projs):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; a fused expert tensor is "
                         f"[num_experts, {' + '.join(projs)} rows, in_features] (3-D, rows splitting evenly)")
    prefix = name[:-len(suffix)] + "experts."
    return [(f"{prefix}{e}.{proj}.weight", part)
            for e, matrix in enumerate(tensor.unbind(0))
            for proj, part in zip(projs, matrix.chunk(len(projs), dim=0))]


def gated_activation(name: str, act: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = [gate | up] -> act(gate) * up [..., I], rounded as PyTorch rounds the two ops (silu: one
    kernel call instead of three dispatches, which a decode step's small experts notice)."""
    if name == "silu":
        return silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return act(gate) * up


def activation_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class GatedMLPExpert(nn.Module):
    """act(x W_gate^T) * (x W_up^T) W_down^T with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, fused_checkpoint: bool) -> None:
        super().__init__()
        self.activation, self.act = activation, activation_fn(activation)
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        if not fused_checkpoint:  # loaded from separate gate_proj / up_proj tensors
            stacked(self.gate_up_proj.weight, [intermediate_size, intermediate_size])
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_activation(self.activation, self.act, self.gate_up_proj(x)))


class SparseMoE(nn.Module, ExpertMatrices):
    """Top-k routed experts over the flat tokens of a step: forward(x [T, H]) -> [T, H].

    router_mode "softmax_topk": softmax over all experts, keep the top k (renormalised when norm_topk_prob);
    "topk_softmax": top k of the raw logits, softmax over those k (GraniteMoe)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *,
                 norm_topk_prob: bool, activation: str = "silu", router_mode: str = "softmax_topk",
                 shared_intermediate_size: int | None = None, shared_expert_gate: bool = False,
                 checkpoint_format: str = "per_expert", router_bias: bool = False) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in 1..num_experts={num_experts}")
        if router_mode not in ROUTER_MODES:
            raise ValueError(f"router_mode {router_mode!r} is not one of {ROUTER_MODES}")
        if checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(f"checkpoint_format {checkpoint_format!r} is not one of {CHECKPOINT_FORMATS}")
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.norm_topk_prob, self.router_mode = norm_topk_prob, router_mode
        self.checkpoint_format = checkpoint_format
        self.activation, self.act = activation, activation_fn(activation)
        self.router = nn.Linear(hidden_size, num_experts, bias=router_bias)
        E, I, H = num_experts, intermediate_size, hidden_size
        if checkpoint_format == "fused":
            self.experts_gate_up = nn.Parameter(torch.empty(E, 2 * I, H))
            self.experts_down = nn.Parameter(torch.empty(E, H, I))
        else:
            self.experts_gate_up = stacked(nn.Parameter(torch.empty(E * 2 * I, H)), [I] * (2 * E))
            self.experts_down = stacked(nn.Parameter(torch.empty(E * H, I)), [H] * E)
        self.init_expert_products()
        self.shared_expert = (GatedMLPExpert(H, shared_intermediate_size, activation, checkpoint_format == "fused")
                              if shared_intermediate_size else None)
        self.shared_expert_gate = nn.Linear(H, 1, bias=False) if shared_expert_gate and self.shared_expert else None

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        """Checkpoint name relative to the MoE block -> (parameter name relative to this module, shard), with
        the loader's conventions: None skips the tensor; a name that is not ours comes back unchanged so the
        strict loader reports it. Routers: `gate` (Qwen), `router` (Jamba), `router.layer` (GraniteMoe);
        shared expert: `shared_expert.{gate,up,down}_proj` or fused `input_linear` / `output_linear` (a model
        whose shared MLP sits elsewhere, like GraniteMoeHybrid's `shared_mlp`, renames it first)."""
        if name in _ROUTER:
            return _ROUTER[name], None
        if name.startswith("shared_expert"):
            if self.shared_expert is None:
                return None  # configured without one (size 0): transformers still saves empty tensors
            if name == "shared_expert_gate.weight":
                return name, None
            proj = name[len("shared_expert."):]
            if self.checkpoint_format == "per_expert" and proj in _SHARED_PER_EXPERT:
                return _SHARED_PER_EXPERT[proj]
            if self.checkpoint_format == "fused" and proj in _SHARED_FUSED:
                return _SHARED_FUSED[proj], None
            return name, None
        return self.map_expert_weight(name) or (name, None)

    def map_expert_weight(self, name: str) -> tuple[str, int] | tuple[str, None] | None:
        """Expert matrices only: `experts.N.gate_proj.weight` ... or the fused 3-D names; None if not one."""
        m = _PER_EXPERT_RE.match(name)
        if m and m.group(2) in _PER_EXPERT and self.checkpoint_format == "per_expert":
            expert, (param, row_shard) = int(m.group(1)), _PER_EXPERT[m.group(2)]
            if expert >= self.num_experts:
                return None
            return param, 2 * expert + row_shard if param == "experts_gate_up" else expert
        if name in _FUSED and self.checkpoint_format == "fused":
            return _FUSED[name], None
        return None

    def expert_shapes(self) -> dict[str, tuple[int, int, int]]:
        E, I, H = self.num_experts, self.intermediate_size, self.hidden_size
        return {"experts_gate_up": (E, 2 * I, H), "experts_down": (E, H, I)}

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] in x's dtype, expert ids [T, k])."""
        logits = self.router(x)  # [T, E]
        if self.router_mode == "topk_softmax":
            top_logits, ids = logits.float().topk(self.top_k, dim=-1)
            return top_logits.softmax(dim=-1).to(x.dtype), ids
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        num_tokens = x.shape[0]
        out = self._routed(x) if num_tokens else torch.zeros_like(x)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)  # [T, k]
        matrices = self.expert_matrices()
        if x.shape[0] == 1:  # one token (a decode step): its k experts in turn, no grouping
            expert_out = x.new_empty(self.top_k, self.hidden_size)
            for j, e in enumerate(ids[0].tolist()):
                expert_out[j] = self._expert(e, x, matrices)[0]
            return self._weighted_sum(expert_out, weights)
        flat_ids = ids.flatten()  # [T*k]: assignment a belongs to token a // k
        order = flat_ids.argsort(stable=True)
        token_of = order // self.top_k
        # one host sync for the group sizes; each expert then sees a contiguous slice of the sorted rows
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        grouped = x[token_of]  # [T*k, H]
        expert_out = torch.empty_like(grouped)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            expert_out[start:start + n] = self._expert(e, grouped[start:start + n], matrices)
            start += n
        # back to assignment order ([T, k] rows); a gather rather than index_add_ keeps the sum deterministic (and
        # index_add_ is slow on CPU)
        per_assignment = torch.empty_like(expert_out)
        per_assignment[order] = expert_out
        return self._weighted_sum(per_assignment, weights)

    def _expert(self, e: int, rows: torch.Tensor, matrices: dict[str, torch.Tensor]) -> torch.Tensor:
        """Expert e's gated MLP of rows [n, H] -> [n, H]."""
        gate_up = self.expert_linear("experts_gate_up", e, rows, matrices)  # [n, 2I]
        return self.expert_linear("experts_down", e, gated_activation(self.activation, self.act, gate_up), matrices)

    def _weighted_sum(self, per_assignment: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """per_assignment [T*k, H] in [T, k] order, weights [T, k] -> each token's weighted sum over its k experts
        [T, H] (one formula for every T, so a token's output does not depend on the tokens beside it)."""
        per_assignment = per_assignment.view(weights.shape[0], self.top_k, self.hidden_size)
        return (per_assignment * weights.unsqueeze(-1)).sum(dim=1)
