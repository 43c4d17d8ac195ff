"""Zamba2: a stack of Mamba2 layers where the "hybrid" layers first run a shared transformer block (attention +
MLP) whose output, through a per-layer linear, is added to that Mamba layer's input.

Per transformers' Zamba2ForCausalLM:
  - hybrid layer i:  t = linear_i(shared_b(x, e));  x = x + mamba(norm(x + t))   (t never joins the residual)
    shared_b(x, e) = ff(pre_ff_norm(attn(input_norm(concat[x, e]))))   with e the token embeddings
  - shared block b = (j mod num_mem_blocks) for the j-th hybrid layer: one set of weights used at several depths;
    attention works on 2 * hidden_size (the concatenation), head_dim = 2 * hidden / heads, score scale
    (head_dim / 2) ** -0.5, rotary only with use_mem_rope.
  - per-depth LoRA adapters inside the shared block: on gate_up (always, as transformers builds them) and on
    q / k / v with use_shared_attention_adapter; depth j uses entry j of the block's adapter lists.
  - Mamba2 mixers: silu, conv bias always, gated-norm eps 1e-5, time_step_limit (time_step_min, inf). The limit
    binds for small dt; transformers applies it in its chunked path only, we on every path (the mixer's
    clamp_dt_on_decode default) so results do not depend on how steps are batched: see tests/test_zamba2.py.
Each use-depth of a shared block gets its own paged Attention module (no weights) so it has its own KV cache,
while the weights stay shared. transformers (5.x) ties a block's later depths to its first depth only when
tie_word_embeddings is set (its generic weight tying is gated on that flag): then the later depths' checkpoint
tensors are tied copies and are skipped; without it, every depth has and loads its own copy of the block, as
in transformers."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from stateserve.layers.attention import Attention
from stateserve.layers.mamba2_mixer import Mamba2Mixer
from stateserve.layers.metadata import AttnMetadata, ForwardMeta, StateMetadata
from stateserve.layers.moe import activation_fn
from stateserve.layers.norm import RMSNorm
from stateserve.layers.rotary import RotaryEmbedding, rope_parameters
from stateserve.layers.markers import stacked
from stateserve.models.base import ModelBase
from stateserve.layers.qkv_attention import map_qkv_name
from stateserve.layers.decoder_layer import rope_seq_lens

# transformers >= 5 spells Mamba layers linear_attention; older configs say mamba
_LAYER_KINDS = {"linear_attention": "mamba", "mamba": "mamba", "hybrid": "hybrid"}


def layer_kinds(cfg: Any, family: str = "Zamba2") -> list[str]:
    """Each layer's kind, "mamba" or "hybrid" (Zamba v1 spells them the same way; `family` names it in errors)."""
    types = getattr(cfg, "layers_block_type", None)
    if types is None:
        raise ValueError(f"{family}: the config has no layers_block_type")
    types = list(types)
    bad = sorted({t for t in types if t not in _LAYER_KINDS})
    if bad:
        raise ValueError(f"{family}: layers_block_type has unknown layer type(s) {bad}; each layer must be one of "
                         f"{sorted(_LAYER_KINDS)}")
    if len(types) != cfg.num_hidden_layers:
        raise ValueError(f"{family}: layers_block_type must name {cfg.num_hidden_layers} layers from "
                         f"{sorted(_LAYER_KINDS)}; got {types}")
    return [_LAYER_KINDS[t] for t in types]


def _adapter_list(num_depths: int, num_blocks: int, block_id: int, dim_in: int, rank: int,
                  dim_out: int) -> nn.ModuleList:
    """Entry j is a low-rank adapter where depth j uses this block, else identity (transformers' layout)."""
    return nn.ModuleList(
        nn.Sequential(nn.Linear(dim_in, rank, bias=False), nn.Linear(rank, dim_out, bias=False))
        if j % num_blocks == block_id else nn.Identity() for j in range(num_depths))


class Zamba2SharedAttention(nn.Module):
    """q/k/v/o over the 2*hidden concatenation, plus optional per-depth q/k/v adapters. The paged Attention op
    is passed in by the depth that calls it."""

    def __init__(self, cfg: Any, num_depths: int, block_id: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.attention_head_dim
        width = cfg.attention_hidden_size
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = nn.Linear(width, sum(self.sizes), bias=False)
        stacked(self.qkv_proj.weight, self.sizes)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        # Zamba v1's config has neither flag: no adapters, no rotary
        self.use_adapters = bool(getattr(cfg, "use_shared_attention_adapter", False))
        if self.use_adapters:
            if q_size != width or kv_size != width:
                raise ValueError(f"Zamba2: use_shared_attention_adapter needs q and k/v widths equal to "
                                 f"attention_hidden_size={width} (got {q_size} / {kv_size}: grouped kv heads?)")
            args = (num_depths, cfg.num_mem_blocks, block_id, width, cfg.adapter_rank, width)
            self.linear_q_adapter_list = _adapter_list(*args)
            self.linear_k_adapter_list = _adapter_list(*args)
            self.linear_v_adapter_list = _adapter_list(*args)
        self.rotary = (RotaryEmbedding(self.head_dim, rope_parameters(cfg), cfg.max_position_embeddings)
                       if getattr(cfg, "use_mem_rope", False) else None)

    def forward(self, x: torch.Tensor, depth: int, attn: Attention, positions: torch.Tensor, meta: AttnMetadata,
                rope_lens: torch.Tensor | None) -> torch.Tensor:
        # x: [T, 2 * hidden] -> [T, hidden]
        qkv = self.qkv_proj(x)
        if self.use_adapters:
            qkv = qkv + torch.cat([self.linear_q_adapter_list[depth](x), self.linear_k_adapter_list[depth](x),
                                   self.linear_v_adapter_list[depth](x)], dim=-1)
        q, k, v = qkv.split(self.sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k, rope_lens)
        return self.o_proj(attn(q, k, v, meta).flatten(1))


class Zamba2SharedMLP(nn.Module):
    def __init__(self, cfg: Any, num_depths: int, block_id: int) -> None:
        super().__init__()
        inter, bias = cfg.intermediate_size, bool(cfg.add_bias_linear)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=bias)  # one tensor in the checkpoint too
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=bias)
        self.gate_up_proj_adapter_list = _adapter_list(num_depths, cfg.num_mem_blocks, block_id, cfg.hidden_size,
                                                       cfg.adapter_rank, 2 * inter)
        self.act = activation_fn(cfg.hidden_act)

    def forward(self, x: torch.Tensor, depth: int) -> torch.Tensor:
        gate, up = (self.gate_up_proj(x) + self.gate_up_proj_adapter_list[depth](x)).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Zamba2SharedBlock(nn.Module):
    """The transformer block shared by several depths; `depth` (0-based among hybrid layers) picks adapters."""

    def __init__(self, cfg: Any, num_depths: int, block_id: int) -> None:
        super().__init__()
        self.self_attn = Zamba2SharedAttention(cfg, num_depths, block_id)
        self.feed_forward = Zamba2SharedMLP(cfg, num_depths, block_id)
        self.input_layernorm = RMSNorm(cfg.attention_hidden_size, cfg.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, embeddings: torch.Tensor, depth: int, attn: Attention,
                positions: torch.Tensor, meta: AttnMetadata, rope_lens: torch.Tensor | None) -> torch.Tensor:
        # x, embeddings: [T, hidden] -> [T, hidden]
        h = self.input_layernorm(torch.cat([x, embeddings], dim=-1))
        h = self.self_attn(h, depth, attn, positions, meta, rope_lens)
        return self.feed_forward(self.pre_ff_layernorm(h), depth)


def zamba2_mixer(cfg: Any, dtype: torch.dtype) -> Mamba2Mixer:
    intermediate = int(cfg.mamba_expand * cfg.hidden_size)
    head_dim = getattr(cfg, "mamba_headdim", None) or intermediate // cfg.n_mamba_heads
    return Mamba2Mixer(
        hidden_size=cfg.hidden_size, num_heads=cfg.n_mamba_heads, head_dim=head_dim, state_size=cfg.mamba_d_state,
        n_groups=cfg.mamba_ngroups, conv_kernel=cfg.mamba_d_conv, chunk_size=cfg.chunk_size,
        intermediate_size=intermediate, use_conv_bias=True, use_bias=bool(cfg.add_bias_linear), activation="silu",
        norm_eps=1e-5, time_step_limit=(cfg.time_step_min, float("inf")), time_step_min=cfg.time_step_min,
        time_step_max=cfg.time_step_max, time_step_floor=cfg.time_step_floor, dtype=dtype)


class Zamba2MambaLayer(nn.Module):
    """RMSNorm + a recurrent mixer with a residual: Zamba2's Mamba2 mixer, or the one given (Zamba v1's)."""

    def __init__(self, cfg: Any, dtype: torch.dtype, mixer: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mamba = zamba2_mixer(cfg, dtype) if mixer is None else mixer

    def forward(self, x: torch.Tensor, meta: StateMetadata, extra: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, hidden]; extra: the shared block's contribution to this layer's input only
        h = x if extra is None else x + extra
        return x + self.mamba(self.input_layernorm(h), meta)


class Zamba2HybridLayer(nn.Module):
    """A shared block's use at one depth (`shared` is any module with Zamba2SharedBlock's forward and a
    `self_attn` giving num_heads / num_kv_heads / head_dim), its linear, and the Mamba layer it feeds."""

    def __init__(self, cfg: Any, shared: nn.Module, depth: int, dtype: torch.dtype,
                 mamba_decoder: Zamba2MambaLayer | None = None) -> None:
        super().__init__()
        self.shared_transformer = shared  # the same module object at every depth that uses this block
        self.depth = depth
        self.linear = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.mamba_decoder = Zamba2MambaLayer(cfg, dtype) if mamba_decoder is None else mamba_decoder
        attn = shared.self_attn
        # this depth's own KV cache: a paged Attention op outside the shared module
        self.attn = Attention(attn.num_heads, attn.num_kv_heads, attn.head_dim, (attn.head_dim / 2) ** -0.5, dtype)

    def forward(self, x: torch.Tensor, embeddings: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta,
                rope_lens: torch.Tensor | None) -> torch.Tensor:
        t = self.shared_transformer(x, embeddings, self.depth, self.attn, positions, meta.attn, rope_lens)
        return self.mamba_decoder(x, meta.state, self.linear(t))


# (number of hybrid depths, block id) -> a shared block; () -> a Mamba layer (Zamba v1 passes its own of both)
BlockFactory = Callable[[int, int], nn.Module]
MambaFactory = Callable[[], Zamba2MambaLayer]


class Zamba2Model(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, family: str = "Zamba2", num_blocks: int | None = None,
                 make_block: BlockFactory | None = None, make_mamba: MambaFactory | None = None) -> None:
        super().__init__()
        kinds = layer_kinds(cfg, family)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        num_depths = kinds.count("hybrid")
        num_blocks = cfg.num_mem_blocks if num_blocks is None else num_blocks
        if num_depths and num_blocks < 1:
            raise ValueError(f"{family}: num_mem_blocks must be >= 1, got {num_blocks}")
        make_block = make_block or (lambda depths, block_id: Zamba2SharedBlock(cfg, depths, block_id))
        make_mamba = make_mamba or (lambda: Zamba2MambaLayer(cfg, dtype))
        # transformers ties a block's later depths to its first only under tie_word_embeddings (it applies every
        # _tied_weights_keys entry only then); otherwise each depth loads its own copy of the block
        share = bool(getattr(cfg, "tie_word_embeddings", False))
        layers: list[nn.Module] = []
        self.first_use: dict[int, int] = {}  # hybrid layer index -> layer index where its block's weights live
        blocks: dict[int, tuple[int, nn.Module]] = {}  # block id -> (first layer, block), when shared
        depth = 0
        for i, kind in enumerate(kinds):
            if kind == "mamba":
                layers.append(make_mamba())
                continue
            block_id = depth % num_blocks
            if share:
                if block_id not in blocks:
                    blocks[block_id] = (i, make_block(num_depths, block_id))
                first, block = blocks[block_id]
            else:
                first, block = i, make_block(num_depths, block_id)
            layers.append(Zamba2HybridLayer(cfg, block, depth, dtype, make_mamba()))
            self.first_use[i] = first
            depth += 1
        self.layers = nn.ModuleList(layers)
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def _check_config(cfg: Any) -> None:
    expected = 2 * cfg.hidden_size
    if getattr(cfg, "attention_hidden_size", expected) != expected:
        raise ValueError(f"Zamba2: attention_hidden_size must be 2 * hidden_size = {expected}")
    if getattr(cfg, "use_shared_mlp_adapter", True) is False:
        raise ValueError("Zamba2: use_shared_mlp_adapter=False is not supported: transformers always applies the "
                         "shared MLP's per-depth adapters")


class Zamba2ForCausalLM(ModelBase):
    is_hybrid = True

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__(hf_config)
        cfg = hf_config
        _check_config(cfg)
        self.dynamic_rope = bool(cfg.use_mem_rope) and rope_parameters(cfg)["rope_type"] == "dynamic"
        self.model = Zamba2Model(cfg, dtype)
        self.add_lm_head(cfg)

    @classmethod
    def resolve_flags(cls, hf_config: Any) -> tuple[bool, bool]:
        """(is_attention_free, is_hybrid): without hybrid layers Zamba2 is a pure Mamba2 stack."""
        has_attention = "hybrid" in layer_kinds(hf_config)
        return not has_attention, has_attention

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        embeddings = self.model.embed_tokens(input_ids)  # [T, hidden]; also the shared blocks' second input
        rope_lens = (rope_seq_lens(meta.attn, embeddings.device)
                     if self.dynamic_rope and meta.attn is not None else None)
        x = embeddings
        for layer in self.model.layers:
            if isinstance(layer, Zamba2HybridLayer):
                x = layer(x, embeddings, positions, meta, rope_lens)
            else:
                x = layer(x, meta.state)
        return self.model.final_layernorm(x)

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        if "rotary_emb" in name:
            return None
        parts = name.split(".")
        if len(parts) > 4 and parts[:2] == ["model", "layers"] and parts[3] == "shared_transformer":
            layer = int(parts[2])
            if layer in self.model.first_use and self.model.first_use[layer] != layer:
                return None  # a tied copy of the block's weights at its first depth
            if parts[4] == "self_attn":
                fused = map_qkv_name(name)
                if fused is not None:
                    return fused
        return name, None
