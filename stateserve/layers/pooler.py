"""Sequence pooling over the flat, unpadded hidden states of a batch, and how a model folder asks for it.

A sentence-transformers folder says how it pools in modules.json (Transformer -> Pooling -> [Normalize]),
1_Pooling/config.json (the modes) and sentence_bert_config.json (max_seq_length, do_lower_case). A plain
Hugging Face folder has none of these: the model class's default mode is used and the result is
L2-normalised, which is what vLLM does for an `embed` model without a sentence-transformers config."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# sentence-transformers' modes, in the order it concatenates them when several are on
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
_LEGACY_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_ALIASES = {"last": "lasttoken", "mean_tokens": "mean", "cls_token": "cls"}  # vLLM's CLS / MEAN / LAST


@dataclass(frozen=True)
class PoolingConfig:
    modes: tuple[str, ...]
    normalize: bool
    max_seq_length: int | None = None  # sentence-transformers' encoder limit, if the folder sets one
    do_lower_case: bool = False  # sentence-transformers lower-cases text before tokenizing
    source: str = "default"  # "sentence-transformers" or "default"


def canonical_mode(mode: str) -> str:
    name = _ALIASES.get(mode.lower(), mode.lower())
    if name not in POOLING_MODES:
        raise ValueError(f"pooling mode {mode!r} is not supported; supported: {', '.join(POOLING_MODES)}")
    return name


def _read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def _pooling_modes(cfg: dict[str, Any]) -> tuple[str, ...]:
    if not cfg.get("include_prompt", True):
        raise ValueError("sentence-transformers Pooling with include_prompt=False is not supported")
    if "pooling_mode" in cfg:  # sentence-transformers >= 5 writes one key, a mode or a list of modes
        raw = cfg["pooling_mode"]
        modes = [raw] if isinstance(raw, str) else list(raw)
        modes = [canonical_mode(m) for m in modes]
        return tuple(m for m in POOLING_MODES if m in modes)
    modes = tuple(mode for key, mode in _LEGACY_KEYS.items() if cfg.get(key, False))
    return modes or ("mean",)  # sentence-transformers' own default when no flag is set


def load_pooling_config(model_path: str, default_mode: str) -> PoolingConfig:
    """The pooling a folder asks for; `default_mode` (the model class's) when it is not a sentence-transformers
    folder. Module kinds other than Transformer, Pooling and Normalize are refused rather than skipped."""
    modules_file = os.path.join(model_path, "modules.json")
    if not os.path.isfile(modules_file):
        return PoolingConfig(modes=(canonical_mode(default_mode),), normalize=True)
    modes: tuple[str, ...] = (canonical_mode(default_mode),)
    normalize, max_seq_length, lower = False, None, False
    for module in sorted(_read_json(modules_file), key=lambda m: m.get("idx", 0)):
        kind = module.get("type", "").rsplit(".", 1)[-1]
        folder = os.path.join(model_path, module.get("path", ""))
        if kind == "Transformer":
            bert_cfg = os.path.join(folder, "sentence_bert_config.json")
            if os.path.isfile(bert_cfg):
                st = _read_json(bert_cfg)
                max_seq_length = st.get("max_seq_length")
                lower = bool(st.get("do_lower_case", False))
        elif kind == "Pooling":
            cfg_file = os.path.join(folder, "config.json")
            modes = _pooling_modes(_read_json(cfg_file)) if os.path.isfile(cfg_file) else ("mean",)
        elif kind == "Normalize":
            normalize = True
        else:
            raise ValueError(f"sentence-transformers module {module.get('type')!r} in {modules_file} is not "
                             "supported (supported: Transformer, Pooling, Normalize)")
    return PoolingConfig(modes=modes, normalize=normalize, max_seq_length=max_seq_length, do_lower_case=lower,
                         source="sentence-transformers")


class Pooler(nn.Module):
    """Flat hidden states [T, H] + sequence boundaries -> one vector per sequence [S, H * len(modes)].
    Holds no weights. Sums are taken in float32 and the result is returned in float32."""

    def __init__(self, config: PoolingConfig) -> None:
        super().__init__()
        if not config.modes:
            raise ValueError("a pooler needs at least one pooling mode")
        self.modes = tuple(canonical_mode(m) for m in config.modes)
        self.normalize = config.normalize

    def forward(self, hidden: torch.Tensor, query_start_loc: list[int]) -> torch.Tensor:
        # hidden: [T, H]; sequence i is rows [query_start_loc[i], query_start_loc[i + 1])
        hidden = hidden.float()
        starts = torch.tensor(query_start_loc[:-1], dtype=torch.long, device=hidden.device)  # [S]
        ends = torch.tensor(query_start_loc[1:], dtype=torch.long, device=hidden.device)
        lens = (ends - starts).to(hidden.dtype)[:, None]  # [S, 1]
        seg = torch.repeat_interleave(torch.arange(len(starts), device=hidden.device), ends - starts)  # [T]

        def segment_sum(values: torch.Tensor) -> torch.Tensor:
            return torch.zeros(len(starts), values.shape[1], dtype=values.dtype,
                               device=values.device).index_add_(0, seg, values)

        pieces = []
        for mode in self.modes:
            if mode == "cls":
                pieces.append(hidden[starts])
            elif mode == "lasttoken":
                pieces.append(hidden[ends - 1])
            elif mode == "max":
                out = torch.full((len(starts), hidden.shape[1]), float("-inf"), device=hidden.device)
                index = seg[:, None].expand_as(hidden)
                pieces.append(out.scatter_reduce(0, index, hidden, reduce="amax", include_self=True))
            elif mode == "mean":
                pieces.append(segment_sum(hidden) / lens)
            elif mode == "mean_sqrt_len_tokens":
                pieces.append(segment_sum(hidden) / lens.sqrt())
            elif mode == "weightedmean":  # token i (1-based) of a sequence weighs i
                weights = (torch.arange(hidden.shape[0], device=hidden.device) - starts[seg] + 1).to(hidden.dtype)
                pieces.append(segment_sum(hidden * weights[:, None]) / (lens * (lens + 1) / 2))
        pooled = torch.cat(pieces, dim=-1)  # [S, H * len(modes)]
        return F.normalize(pooled, p=2, dim=-1) if self.normalize else pooled
