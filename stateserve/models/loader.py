"""Weights: safetensors (single file or sharded with its index), mmap'ed, or seeded dummy weights.
Every checkpoint tensor must land on a parameter of the right shape, and every parameter must be filled."""
from __future__ import annotations

import glob
import json
import os
from typing import Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm

from stateserve.models.base import ModelBase


class WeightLoadError(ValueError):
    pass


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, n) for n in names]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise WeightLoadError(f"shard(s) listed in model.safetensors.index.json are missing: {missing}")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {path!r} (use load_format='dummy' for random weights)")
    return files


def iterate_safetensors(path: str, show_progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    files = safetensors_files(path)
    for file in tqdm(files, desc="Loading safetensors shards", disable=not show_progress, leave=False):
        with safe_open(file, framework="pt") as f:  # mmap'ed: tensors are read on access
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(model: ModelBase, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters())
    tied = set(model.tied_params)
    expected: set[tuple[str, int | None]] = set()
    for name, p in params.items():
        if name in tied:
            continue
        sizes = getattr(p, "shard_sizes", None)
        expected.update((name, i) for i in range(len(sizes))) if sizes else expected.add((name, None))
    loaded: set[tuple[str, int | None]] = set()
    for ckpt_name, tensor in weights:
        target = model.map_weight_name(ckpt_name)
        if target is None:
            continue
        pname, shard = target
        if pname in tied:
            continue  # e.g. lm_head.weight saved alongside tied embeddings
        if pname not in params:
            raise WeightLoadError(f"checkpoint tensor {ckpt_name!r} does not match any parameter of "
                                  f"{type(model).__name__}")
        dst = params[pname].data
        if shard is not None:
            sizes = params[pname].shard_sizes
            start = sum(sizes[:shard])
            dst = dst.narrow(0, start, sizes[shard])
        if tuple(dst.shape) != tuple(tensor.shape):
            raise WeightLoadError(f"checkpoint tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, expected "
                                  f"{tuple(dst.shape)}")
        dst.copy_(tensor)
        loaded.add((pname, shard))
    missing = sorted(f"{n}" + (f"[shard {s}]" if s is not None else "") for n, s in expected - loaded)
    if missing:
        raise WeightLoadError(f"checkpoint is missing tensor(s) for: {', '.join(missing[:10])}"
                              + (f" and {len(missing) - 10} more" if len(missing) > 10 else ""))


def init_dummy_weights(model: ModelBase, seed: int) -> None:
    """Reproducible random weights: matrices ~ N(0, 0.02); 1-D parameters keep the values the
    model constructed (norm weights, SSM decay rates), which keeps recurrent models stable."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tied = set(model.tied_params)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if name in tied or p.dim() < 2:
            continue
        p.data.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.02)
