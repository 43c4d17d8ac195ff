"""The transformers config of a GGUF file's model, from its metadata and which tensors it holds (gguf_archs.py
says what the converter wrote for each architecture): one builder per architecture."""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

_GRANITE_SCALES = ("attention.scale", "embedding_scale", "residual_scale", "logit_scale")


def _f32(value: Any) -> float:
    """A float32 of the file as the shortest decimal that gives it (1e-06, not 9.999999974752427e-07)."""
    return float(str(np.float32(value)))


def per_layer(value: Any, i: int) -> Any:
    return value[i] if isinstance(value, (list, tuple)) else value


def _rows(f: Any, name: str) -> int:
    return int(f.tensors[name].shape[1])  # ggml order: [K, N]


def _layers(f: Any, kind: str) -> list[int]:
    """The blocks holding a tensor of `kind` (attn_q, ssm_in, ffn_gate_exps, ...)."""
    return sorted({int(n.split(".")[1]) for n in f.tensors if n.startswith("blk.") and n.split(".")[2] == kind})


def _common(f: Any) -> dict[str, Any]:
    return dict(vocab_size=int(f.tensors["token_embd.weight"].shape[-1]), hidden_size=int(f._get("embedding_length")),
                num_hidden_layers=int(f._get("block_count")), tie_word_embeddings=not f._has("output.weight"),
                bos_token_id=f.meta.get("tokenizer.ggml.bos_token_id"),
                eos_token_id=f.meta.get("tokenizer.ggml.eos_token_id"))


def _eps(f: Any, default: float = 1e-5) -> float:
    return _f32(f._get("attention.layer_norm_rms_epsilon", f._get("attention.layer_norm_epsilon", default)))


def _heads(f: Any) -> dict[str, int]:
    """num_attention_heads, num_key_value_heads, head_dim of the attention layers, from their q/k rows (a converter
    may have written head_count_kv 0 on an attention layer it took for a Mamba one)."""
    layers = _layers(f, "attn_q")
    if not layers:
        return dict(num_attention_heads=max(int(per_layer(f._get("attention.head_count", 1), 0)), 1))
    i = layers[0]
    heads = int(per_layer(f._get("attention.head_count"), i))
    head_dim = int(f._get("attention.key_length", _rows(f, f"blk.{i}.attn_q.weight") // heads))
    return dict(num_attention_heads=heads, num_key_value_heads=_rows(f, f"blk.{i}.attn_k.weight") // head_dim,
                head_dim=head_dim)


def _ssm2(f: Any) -> dict[str, Any]:
    """The Mamba2 mixer's sizes (inner width, heads, head size, groups, state, conv) and biases."""
    inner, heads = int(f._get("ssm.inner_size")), int(f._get("ssm.time_step_rank"))
    m = _layers(f, "ssm_in")[0]
    return dict(inner=inner, heads=heads, head_dim=inner // heads, groups=int(f._get("ssm.group_count", 1)),
                state=int(f._get("ssm.state_size")), conv=int(f._get("ssm.conv_kernel")),
                conv_bias=f._has(f"blk.{m}.ssm_conv1d.bias"), proj_bias=f._has(f"blk.{m}.ssm_in.bias"),
                out_bias=f._has(f"blk.{m}.ssm_out.bias"))


def _expand(f: Any, inner: int, hidden: int) -> int:
    if inner % hidden:
        raise ValueError(f"{f.path}: ssm.inner_size {inner} is not a multiple of the hidden size {hidden}, which "
                         f"this architecture's config (mamba_expand) cannot hold")
    return inner // hidden


def _period(flags: list[bool], what: str, path: str) -> tuple[int, int]:
    """(period, offset) with flags[i] == (i % period == offset), as JambaConfig places its layers."""
    n = len(flags)
    for period in range(1, n + 2):
        for offset in range(period):
            if all(flag == (i % period == offset) for i, flag in enumerate(flags)):
                return period, offset
    raise ValueError(f"{path}: the {what} {[i for i, x in enumerate(flags) if x]} follow no period and offset, "
                     "which JambaConfig needs")


def is_granite(f: Any) -> bool:
    """GraniteMoeHybrid rather than Bamba: only its converter writes the granite multipliers or experts."""
    return any(f._get(k) is not None for k in _GRANITE_SCALES) or bool(_layers(f, "ffn_gate_exps"))


def config(f: Any) -> Any:
    """The transformers config of the model in GGUF file `f` (a gguf_file.GGUFCheckpoint)."""
    import transformers

    arch, common, eps = f.arch, _common(f), _eps(f)
    if arch == "llama":
        return _llama(f, common, eps)
    if arch in ("mamba", "mamba2"):
        ssm = dict(state_size=int(f._get("ssm.state_size")), conv_kernel=int(f._get("ssm.conv_kernel")),
                   layer_norm_epsilon=eps, use_bias=f._has("blk.0.ssm_in.bias"),
                   use_conv_bias=f._has("blk.0.ssm_conv1d.bias"))
        inner, hidden = int(f._get("ssm.inner_size")), common["hidden_size"]
        if arch == "mamba":
            falcon = bool(f._get("ssm.dt_b_c_rms", False))
            cls = transformers.FalconMambaConfig if falcon else transformers.MambaConfig
            return cls(**common, **ssm, architectures=["FalconMambaForCausalLM" if falcon else "MambaForCausalLM"],
                       intermediate_size=inner, expand=inner // hidden,
                       time_step_rank=int(f._get("ssm.time_step_rank")))
        heads = int(f._get("ssm.time_step_rank"))
        return transformers.Mamba2Config(**common, **ssm, architectures=["Mamba2ForCausalLM"], expand=inner // hidden,
                                         num_heads=heads, head_dim=inner // heads,
                                         n_groups=int(f._get("ssm.group_count", 1)))
    if arch == "jamba":
        return _jamba(f, common, eps)
    if arch == "falcon-h1":
        return _falcon_h1(f, common, eps)
    if arch in ("nemotron_h", "nemotron_h_moe"):
        return _nemotron_h(f, common, eps)
    return _granite(f, common, eps) if is_granite(f) else _bamba(f, common, eps)


def _llama(f: Any, common: dict[str, Any], eps: float) -> Any:
    from transformers import LlamaConfig

    heads = int(f._get("attention.head_count"))
    head_dim = int(f._get("attention.key_length", common["hidden_size"] // heads))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": _f32(f._get("rope.freq_base", 10000.0))}
    if f._get("rope.scaling.type") == "linear":
        rope = {**rope, "rope_type": "linear", "factor": _f32(f._get("rope.scaling.factor"))}
    elif f._get("rope.scaling.type") not in (None, "none"):
        raise ValueError(f"{f.path}: rope scaling {f._get('rope.scaling.type')!r} is not supported from GGUF")
    if f._has("rope_freqs.weight"):
        if rope["rope_type"] != "default":
            raise ValueError(f"{f.path}: rope_freqs beside rope scaling {rope['rope_type']!r} is not supported")
        rope = {**rope, **llama3_rope(f._array("rope_freqs.weight"), rope["rope_theta"], head_dim, f.path)}
    return LlamaConfig(**common, architectures=["LlamaForCausalLM"],
                       intermediate_size=int(f._get("feed_forward_length")),
                       num_attention_heads=heads, num_key_value_heads=int(f._get("attention.head_count_kv", heads)),
                       head_dim=head_dim, max_position_embeddings=int(f._get("context_length", 4096)),
                       rms_norm_eps=eps, rope_parameters=rope)


def _converter_factors(theta: float, dim: int, factor: float, low: float, high: float, old: float) -> np.ndarray:
    """rope_freqs as llama.cpp's converter computes them (LlamaModel.generate_extra_tensors)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(torch.tensor(out, dtype=torch.float32))


def llama3_rope(factors: np.ndarray, theta: float, head_dim: int, path: str = "") -> dict[str, Any]:
    """rope_parameters of rope_type "llama3" that give the per-frequency factors the converter wrote (rope_freqs).
    The factors are 1 for short wavelengths, `factor` for long ones and 1 / ((1 - s) / factor + s) between, s linear
    in 1 / wavelength: 1 / factor is a clamped line in the frequency, whose two ends give the wavelength bounds. Only
    their ratios matter (original_max_position_embeddings / low_freq_factor and / high_freq_factor), so
    low_freq_factor is taken as 1. Where the factors fix the line only within a range (fewer than two between the
    ends), any line of the range gives the same factors; the result is checked by computing the factors again."""
    r = [float(x) for x in np.asarray(factors, dtype=np.float64).reshape(-1)]
    bad = ValueError(f"{path}: rope_freqs {np.round(r, 4).tolist()} are not the factors of Llama 3 rope scaling "
                     f"(1 for short wavelengths, a factor for long ones, smoothly between), which is all rope "
                     f"scaling through rope_freqs is supported as")
    if 2 * len(r) != head_dim:
        raise ValueError(f"{path}: rope_freqs holds {len(r)} factors for heads of {head_dim}")
    factor = max(r)
    if min(r) < 1 or any(b < a for a, b in zip(r, r[1:])):
        raise bad
    if factor == 1:
        return {"rope_type": "default"}
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    u = [float(x) / (2 * math.pi) for x in freqs]  # 1 / wavelength, decreasing
    v = [1 / x for x in r]  # 1 / factor: a line in u clamped to [1 / factor, 1]
    mid = [i for i in range(len(r)) if 1 < r[i] < factor]
    ones, full = [i for i in range(len(r)) if r[i] == 1], [i for i in range(len(r)) if r[i] == factor]
    if len(mid) >= 2:
        a, b = mid[0], mid[-1]
        slope = (v[a] - v[b]) / (u[a] - u[b])
        u_low, u_high = u[a] - (v[a] - 1 / factor) / slope, u[a] + (1 - v[a]) / slope
    elif len(mid) == 1:
        m = mid[0]
        bounds = [(v[m] - 1 / factor) / u[m]] + [(1 - v[m]) / (u[i] - u[m]) for i in ones[-1:]] + \
                 [(v[m] - 1 / factor) / (u[m] - u[i]) for i in full[:1]]
        slope = 2 * max(bounds)
        u_low, u_high = u[m] - (v[m] - 1 / factor) / slope, u[m] + (1 - v[m]) / slope
    else:
        lo = u[full[0]]
        hi = u[ones[-1]] if ones else 2 * lo
        u_low, u_high = lo + (hi - lo) / 3, lo + 2 * (hi - lo) / 3
    if not 0 < u_low < u_high:
        raise bad
    old, high = 1 / u_low, u_high / u_low  # low_freq_factor 1: L = old, H = old / high
    for snap in (True, False):  # the original's round numbers where they are within round-off
        o, h = (round(old), round(high, 6)) if snap else (old, high)
        params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": float(h),
                  "original_max_position_embeddings": int(o) if float(o).is_integer() else o}
        again = _converter_factors(theta, head_dim, factor, 1.0, h, o)
        if np.allclose(again, np.asarray(r, dtype=np.float32), rtol=1e-5, atol=0):
            return params
    raise bad


def _jamba(f: Any, common: dict[str, Any], eps: float) -> Any:
    from transformers import JambaConfig

    n, hidden = common["num_hidden_layers"], common["hidden_size"]
    attn, moe = _layers(f, "attn_q"), _layers(f, "ffn_gate_exps")
    heads = _heads(f)
    if heads.pop("head_dim", hidden // heads["num_attention_heads"]) * heads["num_attention_heads"] != hidden:
        raise ValueError(f"{f.path}: attention heads of another width than hidden_size / heads, which JambaConfig "
                         "cannot hold")
    sizes = {_rows(f, f"blk.{i}.ffn_gate.weight") for i in _layers(f, "ffn_gate")} | \
            {int(f.tensors[f"blk.{i}.ffn_gate_exps.weight"].shape[1]) for i in moe}
    if len(sizes) > 1:
        raise ValueError(f"{f.path}: MLPs of widths {sorted(sizes)}; JambaConfig has one intermediate_size")
    ap, ao = _period([i in attn for i in range(n)], "attention layers", f.path)
    ep, eo = _period([i in moe for i in range(n)], "MoE layers", f.path)
    inner = int(f._get("ssm.inner_size"))
    m = _layers(f, "ssm_in")
    return JambaConfig(**common, architectures=["JambaForCausalLM"],
                       intermediate_size=sizes.pop() if sizes else int(f._get("feed_forward_length")), **heads,
                       attn_layer_period=ap, attn_layer_offset=ao, expert_layer_period=ep, expert_layer_offset=eo,
                       num_experts=int(f._get("expert_count", 1)) if moe else 1,
                       num_experts_per_tok=int(f._get("expert_used_count", 1)) if moe else 1,
                       mamba_d_state=int(f._get("ssm.state_size")), mamba_d_conv=int(f._get("ssm.conv_kernel")),
                       mamba_expand=_expand(f, inner, hidden), mamba_dt_rank=int(f._get("ssm.time_step_rank")),
                       mamba_conv_bias=bool(m) and f._has(f"blk.{m[0]}.ssm_conv1d.bias"),
                       mamba_proj_bias=bool(m) and f._has(f"blk.{m[0]}.ssm_in.bias"), rms_norm_eps=eps,
                       max_position_embeddings=int(f._get("context_length", 262144)))


def _falcon_h1(f: Any, common: dict[str, Any], eps: float) -> Any:
    from transformers import FalconH1Config

    s = _ssm2(f)
    return FalconH1Config(
        **common, architectures=["FalconH1ForCausalLM"], intermediate_size=int(f._get("feed_forward_length")),
        **_heads(f), mamba_d_ssm=s["inner"], mamba_n_heads=s["heads"], mamba_d_head=s["head_dim"],
        mamba_n_groups=s["groups"], mamba_d_state=s["state"], mamba_d_conv=s["conv"],
        mamba_expand=max(s["inner"] // common["hidden_size"], 1), mamba_conv_bias=s["conv_bias"],
        mamba_proj_bias=s["proj_bias"], projectors_bias=s["out_bias"], mamba_rms_norm=f._has("blk.0.ssm_norm.weight"),
        mamba_norm_before_gate=False, attention_bias=f._has("blk.0.attn_q.bias"), mlp_bias=f._has("blk.0.ffn_up.bias"),
        rms_norm_eps=eps, max_position_embeddings=int(f._get("context_length", 8192)),
        rope_parameters={"rope_type": "default", "rope_theta": _f32(f._get("rope.freq_base", 10000.0))},
        # folded into the weights by the converter
        embedding_multiplier=1.0, lm_head_multiplier=1.0, attention_in_multiplier=1.0, attention_out_multiplier=1.0,
        key_multiplier=1.0, ssm_in_multiplier=1.0, ssm_out_multiplier=1.0, mlp_multipliers=[1.0, 1.0],
        ssm_multipliers=[1.0] * 5)


def _nemotron_h(f: Any, common: dict[str, Any], eps: float) -> Any:
    from transformers import NemotronHConfig

    if int(f._get("nextn_predict_layers", 0) or 0):
        raise ValueError(f"{f.path}: a NemotronH multi-token-prediction head (nextn_predict_layers) is not supported "
                         "here; convert the model without it (--no-mtp)")
    kinds = {"ssm_in": "linear_attention", "attn_q": "full_attention", "ffn_up_exps": "moe", "ffn_up": "mlp"}
    types: list[str | None] = [None] * common["num_hidden_layers"]
    for kind, block in kinds.items():
        for i in _layers(f, kind):
            types[i] = types[i] or block
    if None in types:
        raise ValueError(f"{f.path}: NemotronH block(s) {[i for i, t in enumerate(types) if t is None]} hold no "
                         f"mixer (ssm_in, attn_q, ffn_up or ffn_up_exps)")
    s = _ssm2(f) if "linear_attention" in types else {}
    dense, moe = _layers(f, "ffn_up"), _layers(f, "ffn_up_exps")
    extra: dict[str, Any] = {}
    if s:
        extra.update(mamba_num_heads=s["heads"], mamba_head_dim=s["head_dim"], ssm_state_size=s["state"],
                     n_groups=s["groups"], conv_kernel=s["conv"], use_conv_bias=s["conv_bias"], use_bias=s["proj_bias"])
    if dense:
        extra["intermediate_size"] = _rows(f, f"blk.{dense[0]}.ffn_up.weight")
    if moe:
        i = moe[0]
        extra.update(n_routed_experts=int(f._get("expert_count")), num_experts_per_tok=int(f._get("expert_used_count")),
                     moe_intermediate_size=int(f.tensors[f"blk.{i}.ffn_up_exps.weight"].shape[1]),
                     moe_shared_expert_intermediate_size=_rows(f, f"blk.{i}.ffn_up_shexp.weight"),
                     n_group=int(f._get("expert_group_count", 1)), topk_group=int(f._get("expert_group_used_count", 1)),
                     norm_topk_prob=bool(f._get("expert_weights_norm", True)),
                     routed_scaling_factor=_f32(f._get("expert_weights_scale", 1.0)),
                     n_shared_experts=int(f._get("expert_shared_count", 1)),
                     moe_latent_size=int(f._get("moe_latent_size")) if f._get("moe_latent_size") else None)
    return NemotronHConfig(**common, **extra, **_heads(f), architectures=["NemotronHForCausalLM"],
                           layers_block_type=types, mlp_hidden_act="relu2", mamba_hidden_act="silu",
                           mlp_bias=any(f._has(f"blk.{i}.{k}.bias") for i in dense + moe
                                        for k in ("ffn_up", "ffn_up_shexp")),
                           layer_norm_epsilon=eps, max_position_embeddings=int(f._get("context_length", 4096)))


def _granite_common(f: Any, common: dict[str, Any], eps: float) -> dict[str, Any]:
    s, attn = _ssm2(f) if _layers(f, "ssm_in") else None, _layers(f, "attn_q")
    out = dict(**common, **_heads(f), rms_norm_eps=eps, max_position_embeddings=int(f._get("context_length", 4096)),
               attention_bias=bool(attn) and f._has(f"blk.{attn[0]}.attn_q.bias"))
    if s:
        out.update(mamba_n_heads=s["heads"], mamba_d_head=s["head_dim"], mamba_n_groups=s["groups"],
                   mamba_d_state=s["state"], mamba_d_conv=s["conv"], mamba_conv_bias=s["conv_bias"],
                   mamba_proj_bias=s["proj_bias"], mamba_expand=_expand(f, s["inner"], common["hidden_size"]))
    return out


def _bamba(f: Any, common: dict[str, Any], eps: float) -> Any:
    from transformers import BambaConfig

    attn = _layers(f, "attn_q")
    kw = _granite_common(f, common, eps)
    rope = {"rope_type": "default", "rope_theta": _f32(f._get("rope.freq_base", 10000.0))}
    if attn:
        if not f._get("rope.scaling.finetuned", True):
            raise ValueError(f"{f.path}: Bamba attention without rotary embeddings (rope.scaling.finetuned false) "
                             "cannot be held by BambaForCausalLM")
        rope["partial_rotary_factor"] = int(f._get("rope.dimension_count", kw["head_dim"])) / kw["head_dim"]
    gate = _layers(f, "ffn_gate")
    return BambaConfig(**kw, architectures=["BambaForCausalLM"], attn_layer_indices=attn, rope_parameters=rope,
                       intermediate_size=_rows(f, f"blk.{gate[0]}.ffn_gate.weight") if gate else
                       int(f._get("feed_forward_length")), mlp_bias=bool(gate) and f._has(f"blk.{gate[0]}.ffn_up.bias"))


def _granite(f: Any, common: dict[str, Any], eps: float) -> Any:
    from transformers import GraniteMoeHybridConfig

    n, moe, dense = common["num_hidden_layers"], _layers(f, "ffn_gate_exps"), _layers(f, "ffn_gate")
    attn, ssm = set(_layers(f, "attn_q")), set(_layers(f, "ssm_in"))
    if any((i in attn) == (i in ssm) for i in range(n)):
        raise ValueError(f"{f.path}: every GraniteMoeHybrid block needs one mixer (attn_q or ssm_in)")
    if moe and dense:
        raise ValueError(f"{f.path}: blocks {moe} with experts beside dense MLP blocks {dense}; GraniteMoeHybrid "
                         "has one or the other")
    kw = _granite_common(f, common, eps)
    if kw.pop("head_dim", common["hidden_size"] // kw["num_attention_heads"]) * kw["num_attention_heads"] != \
            common["hidden_size"]:
        raise ValueError(f"{f.path}: attention heads of another width than hidden_size / heads, which "
                         "GraniteMoeHybridConfig cannot hold")
    if moe:
        i = moe[0]
        kw.update(num_local_experts=int(f._get("expert_count")), num_experts_per_tok=int(f._get("expert_used_count")),
                  intermediate_size=int(f.tensors[f"blk.{i}.ffn_gate_exps.weight"].shape[1]),
                  shared_intermediate_size=_rows(f, f"blk.{i}.ffn_gate_shexp.weight")
                  if f._has(f"blk.{i}.ffn_gate_shexp.weight") else 0)
    else:
        kw.update(num_local_experts=0, intermediate_size=int(f._get("feed_forward_length")),
                  shared_intermediate_size=_rows(f, f"blk.{dense[0]}.ffn_gate.weight") if dense else 0)
    rope = bool(attn) and bool(f._get("rope.scaling.finetuned", False))  # llama.cpp's: rotary only where it says
    scale = {k: _f32(f._get(g, 1.0)) for k, g in zip(("attention_multiplier", "embedding_multiplier",
                                                       "residual_multiplier", "logits_scaling"), _GRANITE_SCALES)}
    return GraniteMoeHybridConfig(
        **kw, **scale, architectures=["GraniteMoeHybridForCausalLM"],
        layer_types=["full_attention" if i in attn else "linear_attention" for i in range(n)],
        position_embedding_type="rope" if rope else None,
        rope_parameters={"rope_type": "default", "rope_theta": _f32(f._get("rope.freq_base", 10000.0))})
