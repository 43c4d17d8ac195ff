"""The architectures of GGUF files (llama.cpp's names): which Hugging Face tensor each GGUF tensor is, for
gguf_file.GGUFCheckpoint (one name table per architecture; the configs: gguf_configs.py).

What llama.cpp's converter (convert_hf_to_gguf.py and its conversion/*.py) wrote, and how it is read back:
  llama           q/k rows interleaved per head (undone in gguf_file); Llama 3.1 rope scaling only as per-frequency
                  factors (rope_freqs): rope_type "llama3" parameters that give the same factors (llama3_rope)
  mamba, mamba2   A as -exp(A_log), conv1d squeezed, Mamba2's A and D as [heads, 1] and its norm per group
  jamba           Mamba1 as above; which layers are attention / MoE only by which tensors a block holds (the
                  period and offset are found again); experts stacked [E, N, K]
  falcon-h1       Mamba2 as above; every muP multiplier folded into the weights and not recorded: the config gets
                  multipliers of 1 (the same function, not the original weights); a gated norm runs after the gate
                  (as llama.cpp runs it: the file does not say)
  nemotron_h(_moe) Mamba2 as above; q/k interleaved like Llama's on the layers the converter took for attention
                  (those with head_count_kv > 0); experts stacked; relu2 MLPs (llama.cpp's)
  granitehybrid   BambaForCausalLM or GraniteMoeHybridForCausalLM: the granite multipliers (attention.scale,
                  embedding_scale, residual_scale, logit_scale) or experts are GraniteMoeHybrid's only; Mamba2 as
                  above; q/k as nemotron_h; gate and up split (experts, shared MLP, dense MLP), joined again; rotary
                  as rope.scaling.finetuned says, Bamba's partial rotary as rope.dimension_count / head_dim
A file whose layout a class cannot hold is refused with a ValueError naming what it holds."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stateserve.models.gguf_configs import is_granite, per_layer


ARCHITECTURES = ("llama", "mamba", "mamba2", "jamba", "falcon-h1", "nemotron_h", "nemotron_h_moe", "granitehybrid")
MAMBA2_LAYOUT = ("mamba2", "falcon-h1", "nemotron_h", "nemotron_h_moe", "granitehybrid")  # A, D as [heads, 1]
_BARE = ("ssm_a", "ssm_d")  # written without a suffix, like their Hugging Face names


@dataclass(frozen=True)
class Target:
    """Where a GGUF tensor goes: its Hugging Face name ("{e}" in it: a 3-D tensor split per expert, "" for one read
    with another tensor or into the config), whether the converter interleaved its q/k rows, and the GGUF tensor
    whose rows follow its own in the Hugging Face tensor (gate, then up)."""
    name: str
    rotary: bool = False
    join: str | None = None


@dataclass(frozen=True)
class Names:
    top: dict[str, str]  # token_embd / output_norm / output / rope_freqs -> Hugging Face stem ("" = config only)
    layer: str  # "model.layers.{i}"
    table: dict[str, Any]  # GGUF kind (or kind.suffix: the name as is) -> local name, or (local name, joined kind)
    rotary: frozenset[int]  # layers whose q/k rows the converter interleaved


def _attention(p: str) -> dict[str, str]:
    return {"attn_q": f"{p}.q_proj", "attn_k": f"{p}.k_proj", "attn_v": f"{p}.v_proj", "attn_output": f"{p}.o_proj"}


def _mamba1(p: str) -> dict[str, str]:
    return {"ssm_in": f"{p}.in_proj", "ssm_conv1d": f"{p}.conv1d", "ssm_x": f"{p}.x_proj", "ssm_dt": f"{p}.dt_proj",
            "ssm_out": f"{p}.out_proj", "ssm_a": f"{p}.A_log", "ssm_d": f"{p}.D", "ssm_dt_norm": f"{p}.dt_layernorm",
            "ssm_b_norm": f"{p}.b_layernorm", "ssm_c_norm": f"{p}.c_layernorm"}


def _mamba2(p: str) -> dict[str, str]:
    return {"ssm_in": f"{p}.in_proj", "ssm_conv1d": f"{p}.conv1d", "ssm_out": f"{p}.out_proj", "ssm_norm": f"{p}.norm",
            "ssm_a": f"{p}.A_log", "ssm_d": f"{p}.D", "ssm_dt.bias": f"{p}.dt_bias"}


def _mlp(p: str, gate: bool = True) -> dict[str, str]:
    return {**({"ffn_gate": f"{p}.gate_proj"} if gate else {}), "ffn_up": f"{p}.up_proj", "ffn_down": f"{p}.down_proj"}


def _experts(p: str, gate: bool = True) -> dict[str, str]:
    return {f"ffn_{w}_exps": f"{p}.{{e}}.{w}_proj" for w in (("gate", "up", "down") if gate else ("up", "down"))}


_TOP_NORM = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_TOP_LLAMA = {**_TOP_NORM, "rope_freqs": ""}  # rope_freqs: read into the config
_TOP_FINAL = {"token_embd": "model.embed_tokens", "output_norm": "model.final_layernorm", "output": "lm_head"}
_TOP_BACKBONE = {"token_embd": "backbone.embeddings", "output_norm": "backbone.norm_f", "output": "lm_head"}


def names(f: Any) -> Names:
    """The name table of the file's architecture (for granitehybrid: of the class its metadata says)."""
    arch, n = f.arch, int(f._get("block_count"))
    rotary = frozenset(i for i in range(n) if per_layer(f._get("attention.head_count_kv", 0), i))  # converter's
    if arch == "llama":
        table = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", **_attention("self_attn"),
                 **_mlp("mlp")}
        return Names(_TOP_LLAMA, "model.layers.{i}", table, frozenset(range(n)))
    if arch in ("mamba", "mamba2"):
        table = {"attn_norm": "norm", **(_mamba1("mixer") if arch == "mamba" else _mamba2("mixer"))}
        return Names(_TOP_BACKBONE, "backbone.layers.{i}", table, frozenset())
    if arch == "jamba":
        table = {"attn_norm": "input_layernorm", "ffn_norm": "pre_ff_layernorm", **_attention("self_attn"),
                 **_mamba1("mamba"), **_mlp("feed_forward"), "ffn_gate_inp": "feed_forward.router",
                 **_experts("feed_forward.experts")}
        return Names(_TOP_FINAL, "model.layers.{i}", table, frozenset())
    if arch == "falcon-h1":
        table = {"attn_norm": "input_layernorm", "ffn_norm": "pre_ff_layernorm", **_attention("self_attn"),
                 **_mamba2("mamba"), **_mlp("feed_forward")}
        return Names(_TOP_FINAL, "model.layers.{i}", table, frozenset())
    if arch in ("nemotron_h", "nemotron_h_moe"):
        table = {"attn_norm": "norm", **_attention("mixer"), **_mamba2("mixer"), **_mlp("mixer", gate=False),
                 "ffn_gate_inp": "mixer.gate", "exp_probs_b.bias": "mixer.gate.e_score_correction_bias",
                 **_experts("mixer.experts", gate=False), "ffn_up_shexp": "mixer.shared_experts.up_proj",
                 "ffn_down_shexp": "mixer.shared_experts.down_proj", "ffn_latent_down": "mixer.fc1_latent_proj",
                 "ffn_latent_up": "mixer.fc2_latent_proj"}
        return Names(_TOP_BACKBONE, "backbone.layers.{i}", table, rotary)
    if arch == "granitehybrid" and not is_granite(f):  # Bamba
        table = {"attn_norm": "input_layernorm", "ffn_norm": "pre_ff_layernorm", **_attention("self_attn"),
                 **_mamba2("mamba"), **_mlp("feed_forward")}
        return Names(_TOP_FINAL, "model.layers.{i}", table, rotary)
    if arch == "granitehybrid":  # the converter split transformers' fused gate|up rows: joined again here
        table = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", **_attention("self_attn"),
                 **_mamba2("mamba"), "ffn_gate_inp": "block_sparse_moe.router.layer",
                 "ffn_gate_exps": ("block_sparse_moe.input_linear", "ffn_up_exps"), "ffn_up_exps": "",
                 "ffn_down_exps": "block_sparse_moe.output_linear",
                 "ffn_gate_shexp": ("shared_mlp.input_linear", "ffn_up_shexp"), "ffn_up_shexp": "",
                 "ffn_down_shexp": "shared_mlp.output_linear",
                 "ffn_gate": ("shared_mlp.input_linear", "ffn_up"), "ffn_up": "",
                 "ffn_down": "shared_mlp.output_linear"}
        return Names(_TOP_NORM, "model.layers.{i}", table, rotary)
    raise ValueError(f"GGUF architecture {arch!r} is not supported here; supported: {', '.join(ARCHITECTURES)}")


def target(table: Names, name: str) -> Target | None:
    """The Target of GGUF tensor `name`, or None for a tensor the architecture does not have."""
    parts = name.split(".")
    if parts[0] != "blk":
        stem = table.top.get(parts[0])
        return None if stem is None else Target(f"{stem}.{'.'.join(parts[1:])}" if stem else "")
    if len(parts) < 3 or not parts[1].isdigit():
        return None
    layer, kind, suffix = int(parts[1]), parts[2], ".".join(parts[3:])
    exact = f"{kind}.{suffix}" if suffix else kind
    if (suffix or kind in _BARE) and exact in table.table:
        entry, as_is = table.table[exact], True
    elif kind in table.table:
        entry, as_is = table.table[kind], False
    else:
        return None
    local, join = (entry, None) if isinstance(entry, str) else entry
    if not local:
        return Target("")
    if not as_is:
        local = f"{local}.{suffix or 'weight'}"  # falcon-h1 writes its ffn_norm without one
    return Target(f"{table.layer.format(i=layer)}.{local}",
                  rotary=kind in ("attn_q", "attn_k") and layer in table.rotary,
                  join=f"blk.{layer}.{join}.{suffix or 'weight'}" if join else None)
