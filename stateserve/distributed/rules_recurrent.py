"""Tensor-parallel split rules of the recurrent layers (see distributed/sharding.py).

Each rank keeps a share of the layer's channels or heads, with everything that is per channel / per head (the
conv taps, A_log, D, dt biases) and so its share of the state rows: the caches, built from cache_spec() after the
split, hold only those. The input projection is column-parallel part by part, the output projection row-parallel
(one all-reduce), plus what a layer needs on top:
- MambaMixer (Mamba1, Jamba's Mamba layers): d_inner channels. x_proj contracts over them, so it is row-parallel
  too: dt_low, B and C are summed over the ranks (one more all-reduce), then dt_proj is column-parallel; the
  dt/B/C norms act on those whole vectors. ZambaMambaMixer (Zamba v1's per-head x_proj / dt_proj): whole heads.
- Mamba2Mixer: heads, with their groups of B/C: n_groups / N groups per rank when they divide, else (fewer groups
  than ranks) the one group the rank's heads read, replicated like shared KV heads. A gated-norm group held whole
  by each rank stays local; one that spans ranks sums its squares over them (`SplitGatedRMSNorm`, one all-reduce
  of [tokens, norm groups] floats).
- GatedDeltaNet: key heads with their value heads (or, with fewer key heads than ranks, the key head the rank's
  value heads read, replicated); the projections' rows are picked by index, whatever the checkpoint layout
  (Qwen3-Next's rows grouped per key head, or flat). Its gated norm is per head: local.
- ShortConv (LFM2 / LFM3): channels; in_proj's [B | C | u] parts column-parallel, the conv per channel, out_proj
  row-parallel.
- RGLRUBlock (RecurrentGemma): heads (the gates' diagonal blocks) with their channels: linear_x / linear_y rows,
  conv channels, recurrent_param, the gates' blocks; linear_out row-parallel (its bias once).
- xLSTM's MLSTMLayer: heads, with their q / k / v / output-gate rows, input and forget gate rows, the per-head
  layer norm's weights and the cell's state; out_proj row-parallel. Its feed-forward: gate and up rows, down
  row-parallel.
- LightningAttention (MiniMax): heads, with their [q | k | v] rows, output-gate rows and decay slopes; the RMSNorm
  over all heads' outputs sums its squares over the ranks (`SplitRMSNorm`, one all-reduce of [tokens] floats).
The fused C++ decode paths of these layers take their projections through decode_projections(), which refuses a
RowParallelLinear, so a split layer always runs op by op."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stateserve.distributed.group import ParallelGroup
from stateserve.distributed.sharding import (SplitRMSNorm, TensorParallelError, column_parallel, conv_channels,
                                             head_rows, rank_share, row_parallel, set_param, share_or_replica,
                                             split_rule, take_rows)
from stateserve.layers.delta_rule import GatedDeltaNet
from stateserve.layers.lightning import LightningAttention
from stateserve.layers.mamba2_mixer import Mamba2Mixer
from stateserve.layers.rg_lru import RGLRUBlock
from stateserve.layers.selective_scan import MambaMixer
from stateserve.layers.short_conv import ShortConv
from stateserve.layers.zamba_mamba import ZambaMambaMixer


def _rows(t: torch.Tensor, index: list[int]) -> torch.Tensor:
    return t.index_select(0, torch.tensor(index, dtype=torch.long, device=t.device))


# ---- Mamba1 --------------------------------------------------------------------------------------------------
def split_mamba_mixer(mixer: MambaMixer, group: ParallelGroup) -> None:
    D = mixer.intermediate_size
    share = rank_share(D, group, "intermediate_size (Mamba d_inner)")
    column_parallel(mixer.in_proj, [share, share], [D, D])  # [x | z]
    conv_channels(mixer.conv1d, [D], [share])
    # dt_low, B and C contract over d_inner: every rank needs their sum (the dt/B/C norms then act on it whole)
    mixer.x_proj = row_parallel(mixer.x_proj, group, share)
    column_parallel(mixer.dt_proj, [share])
    set_param(mixer, "A_log", mixer.A_log.data[share])
    set_param(mixer, "D", mixer.D.data[share])
    mixer.out_proj = row_parallel(mixer.out_proj, group, share)
    mixer.intermediate_size = share.stop - share.start
    # scan_chunk stays: the same chunks as on one rank (and a smaller [Q, D, N] temporary)


def split_zamba_mamba_mixer(mixer: ZambaMambaMixer, group: ParallelGroup) -> None:
    """Zamba v1: whole heads (each has its own x_proj / dt_proj over its channels); in_proj interleaves u and z
    per channel, so a channel share is a contiguous run of rows there too."""
    heads = rank_share(mixer.num_heads, group, "n_mamba_heads")
    channels = head_rows(heads, mixer.head_dim)
    D = mixer.intermediate_size
    column_parallel(mixer.in_proj, [head_rows(channels, 2)], [2 * D])
    conv_channels(mixer.conv1d, [D], [channels])
    for name in ("x_proj_weight", "dt_proj_weight", "dt_proj_bias", "A_log", "D"):
        set_param(mixer, name, getattr(mixer, name).data[heads])
    mixer.out_proj = row_parallel(mixer.out_proj, group, channels)
    mixer.num_heads = heads.stop - heads.start
    mixer.intermediate_size = channels.stop - channels.start


# ---- Mamba2 --------------------------------------------------------------------------------------------------
class SplitGatedRMSNorm(nn.Module):
    """GatedRMSNorm (layers/mamba2_mixer.py) of a rank holding `local` channels that start at channel `offset` of
    a norm whose groups (`group_size` channels) span ranks: each token's sum of squares per group is summed over
    the ranks (one all-reduce of [T, groups] float32: a rank writes its partial sum into its group's column, zeros
    elsewhere), then divided by the whole group's size. The float32 arithmetic of GatedRMSNorm's PyTorch path."""

    def __init__(self, weight: torch.Tensor, group_size: int, eps: float, norm_before_gate: bool, offset: int,
                 num_groups: int, group: ParallelGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.group_size, self.eps, self.norm_before_gate = group_size, eps, norm_before_gate
        self.norm_group = offset // group_size  # the norm group this rank's channels lie in
        self.num_groups = num_groups
        self.group = group

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # y: [T, local] float32, gate: [T, local] -> [T, local] in gate's dtype
        dtype = gate.dtype
        h = y.float()
        if not self.norm_before_gate:
            h = h * F.silu(gate.float())
        sums = h.new_zeros(*h.shape[:-1], self.num_groups)
        sums[..., self.norm_group] = h.pow(2).sum(-1)
        sums = self.group.all_reduce(sums.contiguous())[..., self.norm_group:self.norm_group + 1]
        h = h * torch.rsqrt(sums / self.group_size + self.eps)
        if self.norm_before_gate:
            return (self.weight * h * F.silu(gate.float())).to(dtype)
        return (self.weight * h).to(dtype)


def split_mamba2_mixer(mixer: Mamba2Mixer, group: ParallelGroup) -> None:
    H, P, G, N = mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.state_size
    inner, gn = mixer.intermediate_size, G * N
    heads = rank_share(H, group, "Mamba2 num_heads")
    groups = share_or_replica(G, group, "Mamba2 n_groups")  # the B/C groups its heads read
    x_rows, bc_rows = head_rows(heads, P), head_rows(groups, N)
    local = x_rows.stop - x_rows.start
    # the gated norm's groups: whole on each rank (local), or spanning ranks (summed over them); nothing between
    norm = mixer.norm
    if norm is not None and local % norm.group_size and norm.group_size % local:
        raise TensorParallelError(f"Mamba2 gated norm groups of {norm.group_size} channels cannot be split over "
                                  f"tensor_parallel_size={group.size} ranks of {local} channels each")
    parts, shares = [inner, inner, gn, gn, H], [x_rows, x_rows, bc_rows, bc_rows, heads]  # z | x | B | C | dt
    column_parallel(mixer.in_proj, shares, parts)
    if mixer.in_proj_scale is not None:  # FalconH1's multipliers follow in_proj's rows
        mixer.in_proj_scale = take_rows(mixer.in_proj_scale, parts, shares)
    conv_channels(mixer.conv1d, [inner, gn, gn], [x_rows, bc_rows, bc_rows])  # over [x | B | C]
    for name in ("dt_bias", "A_log", "D"):
        set_param(mixer, name, getattr(mixer, name).data[heads])
    if norm is not None:
        weight = norm.weight.data[x_rows]
        if local % norm.group_size == 0:
            set_param(norm, "weight", weight)
        else:
            mixer.norm = SplitGatedRMSNorm(weight, norm.group_size, norm.eps, norm.norm_before_gate, x_rows.start,
                                           inner // norm.group_size, group)
    mixer.out_proj = row_parallel(mixer.out_proj, group, x_rows)
    mixer.num_heads, mixer.n_groups = heads.stop - heads.start, groups.stop - groups.start
    mixer.intermediate_size = local
    mixer.conv_dim = local + 2 * mixer.n_groups * N


# ---- Gated DeltaNet ------------------------------------------------------------------------------------------
def delta_net_head_shares(num_k_heads: int, num_v_heads: int, group: ParallelGroup) -> tuple[list[int], list[int]]:
    """(this rank's key heads, its value heads), as global indices. Value heads h*r .. h*r+r-1 read key head h."""
    if num_k_heads % group.size == 0:
        k = rank_share(num_k_heads, group, "linear_num_key_heads")
        r = num_v_heads // num_k_heads
        return list(range(k.start, k.stop)), list(range(k.start * r, k.stop * r))
    if group.size % num_k_heads or num_v_heads % group.size:
        raise TensorParallelError(f"Gated DeltaNet linear_num_key_heads={num_k_heads} is not a multiple of "
                                  f"tensor_parallel_size={group.size}, nor a divisor of it with "
                                  f"linear_num_value_heads={num_v_heads} a multiple of it")
    v = rank_share(num_v_heads, group, "linear_num_value_heads")
    return [group.rank * num_k_heads // group.size], list(range(v.start, v.stop))


def split_gated_delta_net(layer: GatedDeltaNet, group: ParallelGroup) -> None:
    Hk, Hv, dk, dv, r = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, layer.group
    k_heads, v_heads = delta_net_head_shares(Hk, Hv, group)
    key_dim, conv_dim = layer.key_dim, layer.conv_dim

    def span(start: int, n: int) -> list[int]:
        return list(range(start, start + n))

    def reads(kh: int) -> list[int]:  # this rank's value heads of key head kh
        return [vh for vh in v_heads if vh // r == kh]

    q = [i for kh in k_heads for i in span(kh * dk, dk)]
    k = [key_dim + i for i in q]
    v = [2 * key_dim + i for vh in v_heads for i in span(vh * dv, dv)]
    conv_rows = q + k + v  # the conv runs over [q | k | v] in every layout
    if layer.layout == "grouped":  # per key head: [q | k | v of its value heads | z of them]; [b ... | a ...]
        width = 2 * dk + 2 * r * dv
        qkvz = []
        for kh in k_heads:
            base = kh * width
            qkvz += span(base, 2 * dk)
            qkvz += [base + 2 * dk + (vh - kh * r) * dv + i for vh in reads(kh) for i in range(dv)]
            qkvz += [base + 2 * dk + r * dv + (vh - kh * r) * dv + i for vh in reads(kh) for i in range(dv)]
        ba = []
        for kh in k_heads:
            ba += [kh * 2 * r + (vh - kh * r) for vh in reads(kh)]
            ba += [kh * 2 * r + r + (vh - kh * r) for vh in reads(kh)]
    else:  # [q | k | v | z] and [b | a]
        qkvz = conv_rows + [conv_dim + i for vh in v_heads for i in span(vh * dv, dv)]
        ba = v_heads + [Hv + vh for vh in v_heads]
    lk, lv = len(k_heads), len(v_heads)
    layer.num_k_heads, layer.num_v_heads, layer.group = lk, lv, lv // lk
    layer.key_dim, layer.value_dim = lk * dk, lv * dv
    layer.conv_dim = 2 * layer.key_dim + layer.value_dim
    if layer.layout == "flat":
        qkvz_sizes, ba_sizes = [layer.conv_dim, layer.value_dim], [lv, lv]
    else:
        qkvz_sizes, ba_sizes = [layer.key_dim, layer.key_dim, layer.value_dim, layer.value_dim], [lv, lv]
    set_param(layer.in_proj_qkvz, "weight", _rows(layer.in_proj_qkvz.weight.data, qkvz), qkvz_sizes)
    set_param(layer.in_proj_ba, "weight", _rows(layer.in_proj_ba.weight.data, ba), ba_sizes)
    for proj in (layer.in_proj_qkvz, layer.in_proj_ba):
        proj.out_features = proj.weight.shape[0]
    set_param(layer.conv1d, "weight", _rows(layer.conv1d.weight.data, conv_rows),
               [layer.key_dim, layer.key_dim, layer.value_dim])
    layer.conv1d.in_channels = layer.conv1d.out_channels = layer.conv1d.groups = layer.conv_dim
    set_param(layer, "dt_bias", _rows(layer.dt_bias.data, v_heads))
    set_param(layer, "A_log", _rows(layer.A_log.data, v_heads))
    # the gated norm is per value head (head_v_dim channels): unchanged. A rank's value heads are contiguous (a
    # range of them, or all those of its key heads): its columns of out_proj are one slice
    layer.out_proj = row_parallel(layer.out_proj, group, slice(v_heads[0] * dv, (v_heads[-1] + 1) * dv))


split_rule(MambaMixer)(split_mamba_mixer)
split_rule(ZambaMambaMixer)(split_zamba_mamba_mixer)
split_rule(Mamba2Mixer)(split_mamba2_mixer)
split_rule(GatedDeltaNet)(split_gated_delta_net)


@split_rule(ShortConv)
def split_short_conv(layer: ShortConv, group: ParallelGroup) -> None:
    channels = layer.hidden_size  # the conv's width (the model's hidden size before the split)
    share = rank_share(channels, group, "short conv channels (hidden_size)")
    column_parallel(layer.in_proj, [share] * 3, [channels] * 3)
    conv_channels(layer.conv1d, [channels], [share])
    layer.out_proj = row_parallel(layer.out_proj, group, share)
    layer.hidden_size = share.stop - share.start


@split_rule(LightningAttention)
def split_lightning(layer: LightningAttention, group: ParallelGroup) -> None:
    heads = rank_share(layer.num_heads, group, "MiniMax num_attention_heads")
    d, total = layer.head_dim, layer.num_heads * layer.head_dim
    column_parallel(layer.qkv_proj, [head_rows(heads, 3 * d)])  # per head [q | k | v]
    column_parallel(layer.output_gate, [head_rows(heads, d)])
    layer.norm = SplitRMSNorm(layer.norm.weight.data[head_rows(heads, d)], total, layer.norm.eps, group)
    layer.out_proj = row_parallel(layer.out_proj, group, head_rows(heads, d))
    layer.keep_heads(heads.start, heads.stop - heads.start)


@split_rule(RGLRUBlock)
def split_rg_lru(block: RGLRUBlock, group: ParallelGroup) -> None:
    heads = rank_share(block.num_heads, group, "RecurrentGemma num_attention_heads")
    channels, width = head_rows(heads, block.block_width), block.width
    column_parallel(block.linear_x, [channels])
    column_parallel(block.linear_y, [channels])
    conv_channels(block.conv1d, [width], [channels])
    set_param(block, "recurrent_param", block.recurrent_param.data[channels])
    for name in ("input_gate_weight", "input_gate_bias", "recurrent_gate_weight", "recurrent_gate_bias"):
        set_param(block, name, getattr(block, name).data[heads])
    block.linear_out = row_parallel(block.linear_out, group, channels)
    block.num_heads = heads.stop - heads.start
    block.width = block.num_heads * block.block_width


def split_mlstm_layer(layer: nn.Module, group: ParallelGroup) -> None:
    heads = rank_share(layer.num_heads, group, "xLSTM num_heads")
    cell, norm = layer.cell, layer.multihead_norm
    qk_rows, v_rows = head_rows(heads, cell.dqk), head_rows(heads, cell.dv)
    for proj, rows in ((layer.q, qk_rows), (layer.k, qk_rows), (layer.v, v_rows), (layer.ogate_preact, v_rows),
                       (layer.igate_preact, heads), (layer.fgate_preact, heads)):
        column_parallel(proj, [rows])
    set_param(norm, "weight", norm.weight.data[v_rows])  # a layer norm per head: local
    if norm.bias is not None:
        set_param(norm, "bias", norm.bias.data[v_rows])
    layer.out_proj = row_parallel(layer.out_proj, group, v_rows)
    layer.num_heads = cell.num_heads = heads.stop - heads.start


def _register_xlstm() -> None:
    from stateserve.distributed.rules_attention import split_separate_gated_mlp
    from stateserve.models.xlstm import MLSTMLayer, XFeedForward

    split_rule(MLSTMLayer)(split_mlstm_layer)
    split_rule(XFeedForward)(lambda ffn, group: split_separate_gated_mlp(ffn, group,
                                                                         ("proj_up_gate", "proj_up", "proj_down")))


_register_xlstm()
