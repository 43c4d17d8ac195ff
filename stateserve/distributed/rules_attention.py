"""Tensor-parallel split rules of the attention blocks and dense MLPs (Megatron's layout).

Attention: each rank keeps num_heads / N query heads and their K/V heads: num_kv_heads / N of them when they
divide, else (fewer KV heads than ranks) the one KV head its query heads read, replicated on the ranks that share
it. qkv_proj is column-parallel part by part, o_proj row-parallel: one all-reduce per attention block. Each rank's
paged cache then holds only its KV heads (the layer's cache spec shrinks with it). OLMo Hybrid's q/k norms over all
heads become SplitRMSNorms (their squares summed over the ranks); RecurrentGemma's local attention and MLP keep
q/k/v and gate/up as separate matrices, split the same way.
MLP: gate/up column-parallel, down row-parallel: one all-reduce."""
from __future__ import annotations

from torch import nn

from stateserve.distributed.group import ParallelGroup
from stateserve.distributed.sharding import (SplitRMSNorm, column_parallel, head_rows, rank_share, row_parallel,
                                             share_or_replica, split_rule)
from stateserve.layers.decoder_layer import DecoderAttention, GatedMLP
from stateserve.layers.qkv_attention import QKVAttention


def split_qkv_attention(layer: nn.Module, group: ParallelGroup) -> None:
    """Any attention block with qkv_proj (stacked q, k, v), o_proj, num_heads, num_kv_heads, head_dim, sizes and
    an `attn` Attention. The q part may carry more rows per head than head_dim, grouped per head (Qwen3-Next's
    [q | gate] of 2 x head_dim)."""
    d = layer.head_dim
    per_head = layer.sizes[0] // layer.num_heads  # q rows of one head
    heads = rank_share(layer.num_heads, group, "num_attention_heads")
    kv = share_or_replica(layer.num_kv_heads, group, "num_key_value_heads")  # the KV heads its query heads read
    kv_rows = head_rows(kv, d)
    column_parallel(layer.qkv_proj, [head_rows(heads, per_head), kv_rows, kv_rows], list(layer.sizes))
    layer.o_proj = row_parallel(layer.o_proj, group, head_rows(heads, d))
    layer.num_heads, layer.num_kv_heads = heads.stop - heads.start, kv.stop - kv.start
    layer.sizes = [layer.num_heads * per_head, layer.num_kv_heads * d, layer.num_kv_heads * d]
    layer.attn.num_heads, layer.attn.num_kv_heads = layer.num_heads, layer.num_kv_heads


def split_lfm_attention(layer: nn.Module, group: ParallelGroup) -> None:
    """LFM2/LFM3 attention: the qkv layout, plus LFM3's per-head sigmoid gate g_proj (one row per head)."""
    heads = rank_share(layer.num_heads, group, "num_attention_heads")
    split_qkv_attention(layer, group)
    if layer.g_proj is not None:
        column_parallel(layer.g_proj, [heads])


def split_gated_mlp(mlp: nn.Module, group: ParallelGroup) -> None:
    """gate_up_proj ([gate; up] stacked) column-parallel, down_proj row-parallel."""
    inter = mlp.down_proj.in_features
    share = rank_share(inter, group, "intermediate_size")
    column_parallel(mlp.gate_up_proj, [share, share], [inter, inter])
    mlp.down_proj = row_parallel(mlp.down_proj, group, share)


def split_olmo_hybrid_attention(layer: nn.Module, group: ParallelGroup) -> None:
    """OLMo Hybrid: the qkv layout, with q and k each RMS-normed over all heads at once: SplitRMSNorm (one all-reduce
    each; KV heads replicated over ranks count once)."""
    d, num_heads, num_kv = layer.head_dim, layer.num_heads, layer.num_kv_heads
    heads = rank_share(num_heads, group, "num_attention_heads")
    kv = share_or_replica(num_kv, group, "num_key_value_heads")
    split_qkv_attention(layer, group)
    q_norm, k_norm = layer.q_norm, layer.k_norm
    layer.q_norm = SplitRMSNorm(q_norm.weight.data[head_rows(heads, d)], num_heads * d, q_norm.eps, group,
                                weight_first=True)
    layer.k_norm = SplitRMSNorm(k_norm.weight.data[head_rows(kv, d)], num_kv * d, k_norm.eps, group,
                                replicas=max(1, group.size // num_kv), weight_first=True)


def split_separate_qkv_attention(layer: nn.Module, group: ParallelGroup) -> None:
    """An attention block with separate q_proj, k_proj, v_proj (RecurrentGemma's local attention): their rows of
    the rank's query and KV heads, o_proj row-parallel."""
    d = layer.head_dim
    heads = rank_share(layer.num_heads, group, "num_attention_heads")
    kv = share_or_replica(layer.num_kv_heads, group, "num_key_value_heads")
    column_parallel(layer.q_proj, [head_rows(heads, d)])
    column_parallel(layer.k_proj, [head_rows(kv, d)])
    column_parallel(layer.v_proj, [head_rows(kv, d)])
    layer.o_proj = row_parallel(layer.o_proj, group, head_rows(heads, d))
    layer.num_heads, layer.num_kv_heads = heads.stop - heads.start, kv.stop - kv.start
    layer.attn.num_heads, layer.attn.num_kv_heads = layer.num_heads, layer.num_kv_heads


def split_separate_gated_mlp(mlp: nn.Module, group: ParallelGroup,
                             names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> None:
    """The gate and up projections as two matrices (RecurrentGemma's MLP, xLSTM's feed-forward: `names` are the
    gate, up and down projections' attributes) column-parallel, the down projection row-parallel."""
    gate, up, down = (getattr(mlp, name) for name in names)
    share = rank_share(down.in_features, group, "intermediate_size")
    column_parallel(gate, [share])
    column_parallel(up, [share])
    setattr(mlp, names[2], row_parallel(down, group, share))


def _register_model_classes() -> None:
    from stateserve.layers.moe import GatedMLPExpert
    from stateserve.models.bamba import BambaMLP  # same layout: gate_up_proj [gate; up], down_proj
    from stateserve.models.lfm2 import LfmAttention
    from stateserve.models.olmo_hybrid import OlmoHybridAttention
    from stateserve.models.recurrent_gemma import GemmaMLP, LocalAttention
    from stateserve.models.qwen3_next import Qwen3NextAttention

    split_rule(GatedMLP, BambaMLP, GatedMLPExpert)(split_gated_mlp)
    # attention blocks of the qkv layout whose per-head norms (q_norm / k_norm over head_dim) need nothing more
    split_rule(DecoderAttention, QKVAttention, Qwen3NextAttention)(split_qkv_attention)
    split_rule(LfmAttention)(split_lfm_attention)
    split_rule(OlmoHybridAttention)(split_olmo_hybrid_attention)
    split_rule(LocalAttention)(split_separate_qkv_attention)
    split_rule(GemmaMLP)(split_separate_gated_mlp)


_register_model_classes()
