"""Pure descriptions of the cache a layer needs. Layers return these from `cache_spec()`;
the cache module allocates storage from them and the runner binds views back to the layers."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def _elem_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class KVCacheSpec:
    """Paged K and V for one attention layer: storage is [num_blocks, num_kv_heads, block_size, head_dim] each.

    sliding_window: the layer's queries see only keys fewer than this many positions back (None: every key). When
    every attention layer of a model has the same window, the cache manager gives back the blocks that left it."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    sliding_window: int | None = None

    def block_shapes(self, block_size: int) -> tuple[tuple[int, ...], ...]:
        """The shape of one block in each tensor the layer keeps (K, then V)."""
        return ((self.num_kv_heads, block_size, self.head_dim),) * 2

    def bytes_per_block(self, block_size: int) -> int:
        return sum(math.prod(shape) for shape in self.block_shapes(block_size)) * _elem_size(self.dtype)


@dataclass(frozen=True)
class LatentKVCacheSpec:
    """Paged compressed KV of one multi-head latent attention layer (MLA): storage is one tensor
    [num_blocks, block_size, latent_dim], a token's row being its kv latent and its shared rope key; the layer
    up-projects keys and values from it at attention time. Blocks are the same blocks (tables, prefix keys) as
    KVCacheSpec's."""

    latent_dim: int
    dtype: torch.dtype

    def block_shapes(self, block_size: int) -> tuple[tuple[int, ...], ...]:
        """One tensor, no V."""
        return ((block_size, self.latent_dim),)

    bytes_per_block = KVCacheSpec.bytes_per_block


@dataclass(frozen=True)
class StateSpec:
    """Fixed-size recurrent state of one layer, per slot: e.g. {"conv": (conv_dim, kernel-1), "ssm": (H, P, N)}.

    A slot holds the whole state of one sequence at one position; its size does not grow with length."""

    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    dtypes: tuple[tuple[str, torch.dtype], ...]

    @classmethod
    def of(cls, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype]) -> "StateSpec":
        if set(shapes) != set(dtypes):
            raise ValueError(f"state spec shapes {sorted(shapes)} and dtypes {sorted(dtypes)} name different states")
        return cls(tuple(shapes.items()), tuple((k, dtypes[k]) for k in shapes))

    def bytes_per_slot(self) -> int:
        dt = dict(self.dtypes)
        return sum(math.prod(shape) * _elem_size(dt[name]) for name, shape in self.shapes)


CacheSpec = KVCacheSpec | LatentKVCacheSpec | StateSpec
