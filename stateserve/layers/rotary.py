"""Rotary position embedding (rotate-half convention), with rope scaling linear / llama3 / dynamic, and yarn for the
models that opt in, computed as transformers defines them. cos/sin tables are cached per module and dropped at
shutdown.

yarn (transformers 5.24's _compute_yarn_parameters): frequencies blended between the original ones (extrapolation,
high frequencies) and ones divided by `factor` (interpolation, low frequencies) by a linear ramp over the dims
between the beta_fast and beta_slow correction dims (floor / ceil'ed unless truncate is false) at
original_max_position_embeddings; cos and sin are both multiplied by attention_factor (default from factor, or
mscale / mscale_all_dim). It is opt-in (RotaryEmbedding(yarn=True)) because a model's transformers rotary may not
apply attention_factor, or may not take yarn at all: only models checked against theirs pass it."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from stateserve.platform import kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic")
YARN = "yarn"


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None)
    if isinstance(legacy, dict):
        params = {**legacy, **params}
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params["rope_type"] == YARN:  # transformers' standardize_rope_params: a top-level value wins
        original = getattr(hf_config, "original_max_position_embeddings", None)
        if original is not None:
            params["original_max_position_embeddings"] = original
        else:
            params.setdefault("original_max_position_embeddings", getattr(hf_config, "max_position_embeddings", None))
    return params


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, base: float, params: dict[str, Any], max_position_embeddings: int) -> tuple:
    """(inv_freq [dim/2] float32, attention_factor), as transformers 5.24's _compute_yarn_parameters."""
    original = params.get("original_max_position_embeddings")
    if not original:
        raise ValueError("rope_type 'yarn' needs original_max_position_embeddings (in rope_parameters or the config)")
    factor = params.get("factor")
    if factor is None:  # DeepSeek-V3 style: the ratio of the context lengths
        factor = max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times over the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers': no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp  # 1 where the original frequency is kept
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention_factor)


def _heads_contiguous(x: torch.Tensor) -> bool:
    """[T, heads, D] with each token's heads back to back (any token stride): what the fused kernel reads."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, params: dict[str, Any], max_position_embeddings: int,
                 rotary_dim: int | None = None, yarn: bool = False) -> None:
        """yarn: the model's transformers rotary was checked to run yarn as _compute_yarn_parameters defines it."""
        super().__init__()
        self.rope_type = params["rope_type"]
        supported = SUPPORTED_ROPE_TYPES + ((YARN,) if yarn else ())
        if self.rope_type not in supported:
            raise ValueError(f"rope_type {self.rope_type!r} is not supported for this model; supported: {supported}")
        self.dim = rotary_dim or head_dim
        self.base = float(params["rope_theta"])
        self.params = params
        self.max_position_embeddings = max_position_embeddings
        # yarn's attention_factor multiplies cos and sin (1 for every other type)
        self.attention_factor = 1.0
        if self.rope_type == YARN:
            self.inv_freq, self.attention_factor = yarn_inv_freq(self.dim, self.base, params, max_position_embeddings)
        else:
            self.inv_freq = self._inv_freq(self.base)  # [dim/2] float32
        self._table: torch.Tensor | None = None  # [max_pos, dim] cos|sin, grown on demand

    def _inv_freq(self, base: float) -> torch.Tensor:
        inv = 1.0 / (base ** (torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim))
        p = self.params
        if self.rope_type == "linear":
            inv = inv / p["factor"]
        elif self.rope_type == "llama3":
            factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
            old_len = p["original_max_position_embeddings"]
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
            smooth = (old_len / wavelen - lo) / (hi - lo)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < old_len / hi) & ~(wavelen > old_len / lo)
            inv = torch.where(medium, smoothed, scaled)
        return inv

    def _dynamic_scaling(self, seq_lens_per_token: torch.Tensor | None) -> bool:
        """Whether this step needs NTK-scaled frequencies (dynamic rope past the trained context)."""
        return self.rope_type == "dynamic" and seq_lens_per_token is not None and \
            int(seq_lens_per_token.max()) > self.max_position_embeddings

    def _ensure_table(self, positions: torch.Tensor) -> None:
        """Grow the cached [max_pos, dim] cos|sin table to cover `positions`."""
        self._cover(int(positions.max()) + 1 if positions.numel() else 1, positions.device)

    def _cover(self, needed: int, device: torch.device) -> None:
        """Grow the table, when it is short of `needed` positions or on another device."""
        if self._table is not None and self._table.shape[0] >= needed and self._table.device == device:
            return
        size = max(needed, 2 * (self._table.shape[0] if self._table is not None else 1024))
        t = torch.arange(size, dtype=torch.float32, device=device)
        f = t[:, None] * self.inv_freq.to(device)[None, :]
        self._table = torch.cat([f.cos(), f.sin()], dim=-1)
        if self.attention_factor != 1.0:
            self._table *= self.attention_factor

    def _cos_sin(self, positions: torch.Tensor, seq_lens_per_token: torch.Tensor | None) -> tuple:
        if self._dynamic_scaling(seq_lens_per_token):
            # NTK base grows with the sequence's length once it passes the trained context
            factor, m = self.params["factor"], self.max_position_embeddings
            seq = seq_lens_per_token.clamp(min=m).double()
            base = self.base * ((factor * seq / m) - (factor - 1)) ** (self.dim / (self.dim - 2))
            exps = torch.arange(0, self.dim, 2, dtype=torch.int64).double() / self.dim
            inv = (1.0 / (base[:, None].to(positions.device) ** exps.to(positions.device))).float()
            freqs = positions.float()[:, None] * inv
        else:
            self._ensure_table(positions)
            cs = self._table[positions]
            return cs[:, : self.dim // 2], cs[:, self.dim // 2:]
        return freqs.cos(), freqs.sin()

    def kernel_table(self, num_positions: int, device: torch.device,
                     seq_lens_per_token: torch.Tensor | None = None) -> torch.Tensor | None:
        """The cos|sin table rotary_ reads, covering positions 0 .. num_positions - 1, when forward would use the
        kernel (CPU, even rotary size, no dynamic NTK scaling in this step); else None. For fused decode steps,
        which know their largest position from the metadata (no tensor max a layer)."""
        if device.type != "cpu" or self.dim % 2 or self._dynamic_scaling(seq_lens_per_token):
            return None
        self._cover(num_positions, device)
        return self._table

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                seq_lens_per_token: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]; q: [T, H, D]; k: [T, KH, D]
        kernel = kernels.table(q.device).rotary(q.dtype, k.dtype)
        if kernel is not None and not self._dynamic_scaling(seq_lens_per_token) and self.dim % 2 == 0 and \
                _heads_contiguous(q) and _heads_contiguous(k):
            # in place, one pass over q and k; False (nothing done) when a position is past the table
            if self._table is None or not kernel(q, k, self._table, positions, self.dim):
                self._ensure_table(positions)
                if not kernel(q, k, self._table, positions, self.dim):
                    raise RuntimeError("rotary table does not cover the positions")
            return q, k
        cos, sin = self._cos_sin(positions, seq_lens_per_token)  # [T, dim/2] float32
        cos = torch.cat([cos, cos], dim=-1)[:, None, :]
        sin = torch.cat([sin, sin], dim=-1)[:, None, :]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.dim], x[..., self.dim:]
        half = self.dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        out = (rot.float() * cos + rotated.float() * sin).to(x.dtype)
        return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out

    def release(self) -> None:
        self._table = None
