"""SparseMoE: the grouped-by-expert forward against a naive per-token reference, and against transformers'
Qwen3-Next / Jamba / GraniteMoeHybrid MoE blocks with weights loaded by the strict loader from the names
transformers 5.24 writes (per-expert matrices, or GraniteMoe's fused 3-D tensors)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stateserve.layers.moe import SparseMoE, activation_fn
from stateserve.models.base import ModelBase
from stateserve.models.loader import WeightLoadError, load_weights

H, I, E = 32, 24, 6


def _randomise(module: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            fan_in = p.shape[-1]
            p.copy_(torch.randn(p.shape, generator=gen) * 1.5 / fan_in ** 0.5)


def _naive(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """One token at a time, straight from the definitions."""
    act = activation_fn(moe.activation)
    gate_up = moe.experts_gate_up.view(moe.num_experts, 2 * moe.intermediate_size, moe.hidden_size)
    down = moe.experts_down.view(moe.num_experts, moe.hidden_size, moe.intermediate_size)
    rows = []
    for t in range(x.shape[0]):
        logits = moe.router(x[t])
        if moe.router_mode == "topk_softmax":
            top, ids = logits.topk(moe.top_k)
            weights = top.softmax(-1)
        else:
            weights, ids = logits.softmax(-1).topk(moe.top_k)
            if moe.norm_topk_prob:
                weights = weights / weights.sum()
        y = torch.zeros(moe.hidden_size)
        for w, e in zip(weights, ids.tolist()):
            g, u = (gate_up[e] @ x[t]).chunk(2)
            y = y + w * (down[e] @ (act(g) * u))
        if moe.shared_expert is not None:
            gw, uw = moe.shared_expert.gate_up_proj.weight.chunk(2)
            s = moe.shared_expert.down_proj.weight @ (act(gw @ x[t]) * (uw @ x[t]))
            if moe.shared_expert_gate is not None:
                s = torch.sigmoid(moe.shared_expert_gate.weight @ x[t]) * s
            y = y + s
        rows.append(y)
    return torch.stack(rows) if rows else x.new_zeros(0, moe.hidden_size)


VARIANTS = {
    "qwen_next": dict(top_k=2, norm_topk_prob=True, shared_intermediate_size=16, shared_expert_gate=True),
    "jamba": dict(top_k=2, norm_topk_prob=False),
    "granite": dict(top_k=3, norm_topk_prob=True, router_mode="topk_softmax", shared_intermediate_size=8,
                    checkpoint_format="fused"),
    "gelu_all_experts": dict(top_k=E, norm_topk_prob=False, activation="gelu_pytorch_tanh"),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("num_tokens", [0, 1, 37])
def test_matches_naive_reference(variant, num_tokens):
    kwargs = VARIANTS[variant]
    moe = SparseMoE(E, hidden_size=H, intermediate_size=I, **kwargs)
    _randomise(moe)
    x = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, ref = moe(x), _naive(moe, x)
    assert ours.shape == (num_tokens, H)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    if num_tokens > 1 and kwargs["top_k"] < E:  # routing really is sparse: tokens disagree on their experts
        _, ids = moe.route(x)
        assert len({tuple(sorted(r)) for r in ids.tolist()}) > 1


def test_tokens_all_on_one_expert():
    moe = SparseMoE(E, 1, H, I, norm_topk_prob=True)
    _randomise(moe)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[4].fill_(1.0)
    x = torch.rand(9, H) + 0.1  # positive inputs: expert 4 wins for every token
    with torch.no_grad():
        assert moe.route(x)[1].unique().tolist() == [4]
        torch.testing.assert_close(moe(x), _naive(moe, x), atol=1e-5, rtol=1e-5)


class _Wrapper(ModelBase):
    """A model around one MoE block, so the real strict loader fills it from checkpoint-style names."""

    def __init__(self, moe: SparseMoE, rename: dict[str, str] | None = None) -> None:
        super().__init__(None)
        self.moe, self.rename = moe, rename or {}

    def map_weight_name(self, name: str):
        for old, new in self.rename.items():
            name = name.replace(old, new)
        target = self.moe.map_weight_name(name)
        return None if target is None else (f"moe.{target[0]}", target[1])


def _per_expert_names(gate_up: torch.Tensor, down: torch.Tensor, prefix: str = "experts") -> dict:
    """How transformers 5.24 saves Qwen3-Next / Jamba experts: one [I, H] / [H, I] matrix per expert."""
    inter = gate_up.shape[1] // 2
    out = {}
    for e in range(gate_up.shape[0]):
        out[f"{prefix}.{e}.gate_proj.weight"] = gate_up[e, :inter]
        out[f"{prefix}.{e}.up_proj.weight"] = gate_up[e, inter:]
        out[f"{prefix}.{e}.down_proj.weight"] = down[e]
    return out


def _hf_block(kind: str):
    if kind == "qwen3_next":
        from transformers import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock
        cfg = Qwen3NextConfig(hidden_size=H, num_experts=E, num_experts_per_tok=2, moe_intermediate_size=I,
                              shared_expert_intermediate_size=16, norm_topk_prob=True)
        block = Qwen3NextSparseMoeBlock(cfg)
    elif kind == "jamba":
        from transformers import JambaConfig
        from transformers.models.jamba.modeling_jamba import JambaSparseMoeBlock
        cfg = JambaConfig(hidden_size=H, num_experts=E, num_experts_per_tok=2, intermediate_size=I)
        block = JambaSparseMoeBlock(cfg)
    else:
        from transformers import GraniteMoeHybridConfig
        from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (GraniteMoeHybridMLP,
                                                                                     GraniteMoeHybridMoE)
        cfg = GraniteMoeHybridConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=2, intermediate_size=I,
                                     shared_intermediate_size=16, num_attention_heads=4, mamba_n_heads=4,
                                     mamba_d_head=16, layer_types=["attention"], num_hidden_layers=1)
        block = torch.nn.ModuleDict({"moe": GraniteMoeHybridMoE(cfg), "shared_mlp": GraniteMoeHybridMLP(cfg)})
    block.eval()
    block._config = cfg
    _randomise(block, seed=3)
    return block


def _checkpoint_and_ours(kind: str):
    block = _hf_block(kind)
    sd = {k: v.detach().clone() for k, v in block.state_dict().items()}
    if kind == "qwen3_next":
        ckpt = {"gate.weight": sd["gate.weight"], "shared_expert_gate.weight": sd["shared_expert_gate.weight"],
                **{k: v for k, v in sd.items() if k.startswith("shared_expert.")},
                **_per_expert_names(sd["experts.gate_up_proj"], sd["experts.down_proj"])}
        ours = SparseMoE(E, 2, H, I, norm_topk_prob=True, shared_intermediate_size=16, shared_expert_gate=True)
        rename = None
        hf_forward = lambda x: block(x[None])[0]  # noqa: E731
    elif kind == "jamba":
        ckpt = {"router.weight": sd["router.weight"],
                **_per_expert_names(sd["experts.gate_up_proj"], sd["experts.down_proj"])}
        ours = SparseMoE(E, 2, H, I, norm_topk_prob=False)
        rename = None
        hf_forward = lambda x: block(x[None])[0]  # noqa: E731
    else:  # GraniteMoeHybrid: fused experts under block_sparse_moe, the shared MLP beside it
        ckpt = {"block_sparse_moe.router.layer.weight": sd["moe.router.weight"],
                "block_sparse_moe.input_linear.weight": sd["moe.experts.gate_up_proj"],
                "block_sparse_moe.output_linear.weight": sd["moe.experts.down_proj"],
                "shared_mlp.input_linear.weight": sd["shared_mlp.input_linear.weight"],
                "shared_mlp.output_linear.weight": sd["shared_mlp.output_linear.weight"]}
        ours = SparseMoE(E, 2, H, I, norm_topk_prob=True, router_mode="topk_softmax", shared_intermediate_size=16,
                         checkpoint_format="fused")
        rename = {"block_sparse_moe.": "", "shared_mlp.": "shared_expert."}
        hf_forward = lambda x: block["moe"](x[None])[0] + block["shared_mlp"](x)  # noqa: E731
    return ckpt, _Wrapper(ours, rename), hf_forward


@pytest.mark.parametrize("kind", ["qwen3_next", "jamba", "granitemoehybrid"])
def test_matches_transformers_block_from_checkpoint_names(kind):
    ckpt, model, hf_forward = _checkpoint_and_ours(kind)
    load_weights(model, iter(ckpt.items()))
    x = torch.randn(29, H, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(model.moe(x), hf_forward(x), atol=1e-5, rtol=1e-5)


def test_missing_expert_matrix_is_named():
    ckpt, model, _ = _checkpoint_and_ours("qwen3_next")
    ckpt.pop("experts.3.up_proj.weight")
    with pytest.raises(WeightLoadError, match=r"experts_gate_up\[shard 7\]"):
        load_weights(model, iter(ckpt.items()))


def test_fused_names_rejected_by_per_expert_layout():
    _, model, _ = _checkpoint_and_ours("jamba")
    with pytest.raises(WeightLoadError, match="experts.gate_up_proj"):
        load_weights(model, iter({"experts.gate_up_proj": torch.zeros(E, 2 * I, H)}.items()))


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        SparseMoE(4, 5, H, I, norm_topk_prob=True)
    with pytest.raises(ValueError, match="activation"):
        SparseMoE(4, 2, H, I, norm_topk_prob=True, activation="nope")
    assert F.silu is activation_fn("silu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_sized_expert_products_take_the_few_row_kernel(dtype):
    """After install_fast_linear, an expert's products of up to `max_rows` rows (a decode step's tokens per expert)
    go to the few-row kernel, more to F.linear, and the result matches the naive reference either way. Without the
    route the products fall back to F.linear silently (~60 us a call in bfloat16), which only a spy can see."""
    from stateserve.layers.linear import install_fast_linear
    from stateserve.platform import kernels

    routes = kernels.table().linear(dtype)
    if routes is None or routes.few_row is None:
        pytest.skip(f"no few-row kernel for {dtype} here")
    moe = SparseMoE(E, hidden_size=H, intermediate_size=I, **VARIANTS["jamba"])
    _randomise(moe)
    moe = moe.to(dtype)
    rows_seen = []

    def spy(x, w, b):
        rows_seen.append(x.shape[0])
        return routes.few_row(x, w, b)

    install_fast_linear(moe, dtype, torch.device("cpu"))
    assert moe.few_row_product is routes.few_row and moe.few_row_rows == routes.max_rows
    moe.few_row_product = spy
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.no_grad():
        out = moe(x)
        if dtype == torch.float32:
            torch.testing.assert_close(out, _naive(moe, x), atol=1e-5, rtol=1e-5)
    assert rows_seen and max(rows_seen) <= 3  # every expert product of this decode-sized step
    rows_seen.clear()
    with torch.no_grad():
        moe(torch.randn(8 * routes.max_rows, H).to(dtype))
    assert all(n <= routes.max_rows for n in rows_seen)  # bigger groups went to F.linear
