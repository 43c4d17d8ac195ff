"""Tensor-parallel split rules of Kimi Linear's and Bailing Hybrid's mixers (see distributed/sharding.py).

- KimiDeltaAttention (KDA): heads, with their q/k/v rows and conv channels, forget-gate rows and dt biases, A_log,
  beta rows; the low-rank gates' first projections (hidden -> head_dim) stay whole; the per-head norm is local;
  o_proj row-parallel (one all-reduce).
- KimiMLA / BailingMLA: heads, with their query rows and their rows of the absorbed up-projection kv_b_proj; the
  latent row a token caches (kv_a_proj_with_mqa's output) is shared by every head, so it stays whole and every
  rank keeps the whole latent cache (as vLLM's MLA does under tensor parallelism); o_proj row-parallel. Bailing's
  per-head output gate keeps its heads' rows."""
from __future__ import annotations

from torch import nn

from stateserve.distributed.group import ParallelGroup
from stateserve.distributed.sharding import (column_parallel, conv_channels, head_rows, rank_share, row_parallel,
                                             set_param, split_rule)
from stateserve.layers.kda import KimiDeltaAttention


@split_rule(KimiDeltaAttention)
def split_kda(layer: KimiDeltaAttention, group: ParallelGroup) -> None:
    heads = rank_share(layer.num_heads, group, "KDA num_heads")
    channels, width = head_rows(heads, layer.head_dim), layer.qkv_dim
    column_parallel(layer.qkv_proj, [channels] * 3, [width] * 3)
    conv_channels(layer.conv1d, [width] * 3, [channels] * 3)
    if layer.low_rank_gates:
        column_parallel(layer.f_b_proj, [channels])
        column_parallel(layer.g_b_proj, [channels])
        set_param(layer, "A_log", layer.A_log.data[:, :, heads])  # [1, 1, H, 1]
    else:
        column_parallel(layer.f_proj, [channels])
        column_parallel(layer.g_proj, [channels])
        set_param(layer, "A_log", layer.A_log.data[heads])  # [H]
    set_param(layer, "dt_bias", layer.dt_bias.data[channels])
    column_parallel(layer.b_proj, [heads])
    layer.o_proj = row_parallel(layer.o_proj, group, channels)
    layer.num_heads = heads.stop - heads.start
    layer.qkv_dim = layer.num_heads * layer.head_dim
    layer.conv_dim = 3 * layer.qkv_dim


def split_mla(layer: nn.Module, group: ParallelGroup) -> None:
    heads = rank_share(layer.num_heads, group, "num_attention_heads")
    column_parallel(layer.q_proj if layer.q_lora_rank is None else layer.q_b_proj, [head_rows(heads, layer.qk_dim)])
    up = layer.kv_b_proj  # [H * (nope + v), rank], heads in order
    set_param(up, "weight", up.weight.data[head_rows(heads, layer.nope + layer.v_dim)])
    layer.o_proj = row_parallel(layer.o_proj, group, head_rows(heads, layer.v_dim))
    layer.num_heads = layer.attn.num_heads = heads.stop - heads.start


def split_bailing_mla(layer: nn.Module, group: ParallelGroup) -> None:
    """Kimi's MLA split, plus the per-head output gate g_proj (one row per head)."""
    heads = rank_share(layer.num_heads, group, "num_attention_heads")
    split_mla(layer, group)
    column_parallel(layer.g_proj, [heads])


def _register_mla() -> None:
    from stateserve.models.bailing_hybrid import BailingMLA
    from stateserve.models.kimi_linear import KimiMLA

    split_rule(KimiMLA)(split_mla)
    split_rule(BailingMLA)(split_bailing_mla)


_register_mla()
