"""Base-size bodies around the bundled demo models' trained function, for benchmarks that need a model whose
output follows real text (speculative decoding's copy workload) at the cost of a ~125M model.

The demo models (stateserve/assets/models) are trained, so their text is real (they do not copy a passage of their
prompt, but they repeat their own text as real text does), but a decode step of a 2M-parameter model takes under a
millisecond, so per-step overheads decide every ratio. Random base-size models have the right cost and the wrong
outputs (the Mamba2 and hybrid ones repeat nothing). A widened demo model has both:

- Width x r (r a power of two, so 1/r is exact): every hidden-size vector is the original repeated r times
  (embeddings repeated, every norm weight repeated), so each RMS norm sees the same mean square; every
  projection reading a repeated vector takes the original weight divided by r in each of the r column blocks,
  so it computes the original product. Attention heads, KV heads, MLP channels and Mamba2 heads are repeated the
  same way (one Mamba2 group: its B and C are shared by all heads and stay as they are), so each head of a copy
  computes exactly what its original computes; GQA's head -> KV-head map holds for the repeated blocks.
- Depth: layers past the demo's own are copies of its layers whose output projections (o_proj, down_proj,
  Mamba out_proj) are zero: they read the real hidden states, keep their own KV and state, cost what a layer
  costs, and add exactly zero to the residual stream.

So the widened model's logits are the demo's up to float rounding (tests/test_widen_demo.py), and its greedy text
is the demo's text. Its vocabulary stays 2048, so the LM head costs less than a 32k-vocabulary base model's.
"""
from __future__ import annotations

import json
import os
import re
import shutil

import torch

DEMO_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "stateserve", "assets", "models")
# name -> (demo folder, width factor, layers): ~122M (mamba2), ~89M (hybrid), ~91M (llama) parameters, the
# bodies of bench/common.py's base mamba2 (24 x 768), bamba (12 x 768) and llama (12 x 768)
WIDE_MODELS = {"mamba2-demo-wide": ("mamba2-demo", 4, 24), "hybrid-demo-wide": ("hybrid-demo", 4, 12),
               "llama-demo-wide": ("llama-demo", 4, 12)}
_ZEROED = ("o_proj", "down_proj", "out_proj")  # a dead layer's writes to the residual stream


def _repeat(t: torch.Tensor, r: int, dim: int) -> torch.Tensor:
    return torch.cat([t] * r, dim)


def _spread(t: torch.Tensor, r: int, dim: int) -> torch.Tensor:
    """Columns that read a repeated input: each of the r blocks carries 1/r of the original weight."""
    return torch.cat([t / r] * r, dim)


def _mamba_rows(t: torch.Tensor, r: int, parts: list[tuple[int, bool]]) -> torch.Tensor:
    """Rows (dim 0) cut into consecutive parts, each repeated r times or kept (the shared B and C)."""
    out, start = [], 0
    for size, repeated in parts:
        piece = t[start:start + size]
        out.append(_repeat(piece, r, 0) if repeated else piece)
        start += size
    assert start == t.shape[0], (start, t.shape)
    return torch.cat(out, 0)


def widen_tensor(name: str, t: torch.Tensor, cfg: dict, r: int) -> torch.Tensor:
    """One checkpoint tensor of a Llama, Mamba2 or Bamba demo model, widened r times (see the module docstring)."""
    leaf = name.rsplit(".", 2)[-2] if name.endswith((".weight", ".bias")) else name.rsplit(".", 1)[-1]
    if name.endswith(("embeddings.weight", "embed_tokens.weight")):
        return _repeat(t, r, 1)
    if name == "lm_head.weight":
        return _spread(t, r, 1)
    if leaf in ("A_log", "D", "dt_bias") or re.search(r"norm(_f)?\.weight$|layernorm\.weight$", name):
        return _repeat(t, r, 0)  # per Mamba head, or over a repeated vector (hidden, a Mamba2 gated norm's)
    if leaf in ("in_proj", "conv1d"):
        bamba = cfg["model_type"] == "bamba"
        inner = (cfg["mamba_expand"] if bamba else cfg["expand"]) * cfg["hidden_size"]
        shared = 2 * (cfg["mamba_n_groups"] * cfg["mamba_d_state"] if bamba else cfg["n_groups"] * cfg["state_size"])
        if leaf == "conv1d":  # channels [x | B | C]
            return _mamba_rows(t, r, [(inner, True), (shared, False)])
        heads = cfg["mamba_n_heads"] if bamba else cfg["num_heads"]  # in_proj's rows: [z | x | B | C | dt]
        return _spread(_mamba_rows(t, r, [(inner, True), (inner, True), (shared, False), (heads, True)]), r, 1)
    if leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj") + _ZEROED:  # heads / channels / hidden out
        return _spread(_repeat(t, r, 0), r, 1)
    raise ValueError(f"widen_demo: no rule for {name} {tuple(t.shape)}")


def widened_config(cfg: dict, r: int, layers: int) -> dict:
    out = dict(cfg, num_hidden_layers=layers, hidden_size=cfg["hidden_size"] * r)
    kind = cfg["model_type"]
    if kind in ("llama", "bamba"):
        out.update(intermediate_size=cfg["intermediate_size"] * r, num_attention_heads=cfg["num_attention_heads"] * r,
                   num_key_value_heads=cfg["num_key_value_heads"] * r)
    if kind == "mamba2":
        out.update(num_heads=cfg["num_heads"] * r)
    if kind == "bamba":
        out.update(mamba_n_heads=cfg["mamba_n_heads"] * r)
        period = cfg["num_hidden_layers"]  # the demo's pattern, repeated down the stack
        out["attn_layer_indices"] = [i for i in range(layers) if i % period in cfg["attn_layer_indices"]]
    if (kind == "mamba2" and cfg["n_groups"] != 1) or (kind == "bamba" and cfg["mamba_n_groups"] != 1):
        raise ValueError("widen_demo: repeating heads keeps one Mamba2 group only")
    if kind not in ("llama", "mamba2", "bamba"):
        raise ValueError(f"widen_demo: no rule for model_type {kind!r}")
    return out


def widen_state_dict(state: dict[str, torch.Tensor], cfg: dict, r: int, layers: int) -> dict[str, torch.Tensor]:
    """Layer i >= the demo's depth copies demo layer i % depth (same kind: the pattern repeats) with its output
    projections zeroed."""
    depth = cfg["num_hidden_layers"]
    out = {}
    for name, t in state.items():
        m = re.match(r"(.*layers\.)(\d+)(\..*)", name)
        wide = widen_tensor(name, t.float(), cfg, r)
        if m is None:
            out[name] = wide
            continue
        for i in range(int(m.group(2)), layers, depth):
            dead = i >= depth and any(f".{leaf}." in m.group(3) for leaf in _ZEROED)
            out[f"{m.group(1)}{i}{m.group(3)}"] = torch.zeros_like(wide) if dead else wide.clone()
    return out


def write_widened(demo: str, out_dir: str, r: int, layers: int, dtype: torch.dtype) -> str:
    """Write the widened Hugging Face folder (config, weights in `dtype`, the demo's tokenizer files)."""
    from safetensors.torch import load_file, save_file

    src = os.path.join(DEMO_DIR, demo) if not os.path.isdir(demo) else demo
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    state = widen_state_dict(load_file(os.path.join(src, "model.safetensors")), cfg, r, layers)
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.to(dtype).contiguous() for k, v in state.items()}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(dict(widened_config(cfg, r, layers), dtype=str(dtype).removeprefix("torch.")), f, indent=2)
    for name in os.listdir(src):
        if name.startswith("tokenizer") or name == "generation_config.json":
            shutil.copy(os.path.join(src, name), out_dir)
    return out_dir


def widened_folder(name: str, model_dir: str, dtype: torch.dtype = torch.bfloat16) -> str:
    """The folder of one of WIDE_MODELS, written once under `model_dir`."""
    demo, r, layers = WIDE_MODELS[name]
    path = os.path.join(model_dir, f"{name}-{str(dtype).removeprefix('torch.')}")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        write_widened(demo, path, r, layers, dtype)
    return path
