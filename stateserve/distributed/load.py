"""Loading a tensor-parallel rank's share of a checkpoint without ever holding the whole model.

The split rules (sharding.py) cut a loaded layer into this rank's share. Loading the whole model first and then
splitting it made every rank's peak the whole model in the model dtype, so a model larger than one machine could
never be split over several. Here the model is built without random initialisation (loader.no_weight_init: its
weights stay untouched, never-resident memory), and the checkpoint is read a decoder layer at a time: each layer is
cast to the model dtype, filled from its tensors (those named `...layers.N...`), and its rule owners are split at
once, their whole weights freed and handed back to the kernel. What has no layer index (embedding, final norm,
head) is read last, then the vocabulary is split as before. A rank's peak is then its share plus one whole layer,
the embedding and the head.

An owner whose parameters are not all filled by its layer's tensors (a checkpoint naming them otherwise) is split
with the rest at the end, as before: slower to peak, never wrong. safetensors folders only (a GGUF file, dummy
weights and quantized loads take the whole-model path)."""
from __future__ import annotations

import logging
import re

import torch
from torch import nn

from stateserve.distributed.group import ParallelGroup
from stateserve.distributed.sharding import rule_owners, split_model, split_module
from stateserve.models.loader import SafetensorsReader, WeightLoader
from stateserve.platform import host_allocator
from stateserve.platform.peak_rss import peak_rss_bytes, rss_bytes

logger = logging.getLogger("stateserve")
GiB = 1 << 30
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # a decoder layer's index in a parameter's or tensor's name


def _layer_index(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def _layer_module(name: str) -> str:
    """A parameter's or module's name -> the name of the decoder layer holding it (`....layers.N`)."""
    m = _LAYER.search(name)
    assert m is not None
    return name[:m.end() - 1]


def load_and_split(model: nn.Module, path: str, dtype: torch.dtype, group: ParallelGroup, vocab_size: int,
                   peak: LoadPeak) -> bool:
    """Fill `model` (built under loader.no_weight_init, not yet cast) from the safetensors folder `path`, splitting
    each layer's rule owners as soon as the layer is loaded (`peak`: measured before). Returns whether the
    vocabulary was split."""
    owners_at: dict[int, list[str]] = {}
    for owner in rule_owners(model):
        index = _layer_index(owner + ".")
        if index is not None:
            owners_at.setdefault(index, []).append(owner)
    reader = SafetensorsReader(path)
    names_at: dict[int | None, list[str]] = {}
    for name in reader.names():
        names_at.setdefault(_layer_index(name), []).append(name)
    loader = WeightLoader(model)
    # layers with no resident weight belong to other pipeline stages: their tensors are not read, their owners are
    # split all the same (on the meta device), so the cache plan sees every layer's split shapes
    resident = {_layer_index(name) for name, p in model.named_parameters() if not p.is_meta}
    split: list[str] = []
    for index in sorted(i for i in names_at if i is not None):
        owners = owners_at.get(index, [])
        for layer in dict.fromkeys(_layer_module(owner + ".") for owner in owners):
            model.get_submodule(layer).to(dtype=dtype)  # the layer's own _apply rules (float32 biases) hold
        if index in resident:
            loader.load(reader.tensors(names_at[index]))
        for owner in owners:
            if loader.missing(owner):
                continue  # filled by tensors named otherwise: split with the rest
            split_module(model, owner, group)
            loader.retire(owner)
            split.append(owner)
        host_allocator.release_free_memory()  # the layer's whole weights, freed by the split, back to the kernel
    model.to(dtype=dtype)
    loader.load(reader.tensors(names_at.get(None, [])))
    loader.check_complete()
    vocab_split = split_model(model, group, vocab_size, already=tuple(split))
    deferred = sum(1 for owners in owners_at.values() for owner in owners if owner not in split)
    peak.log(group, f"{len(split)} layer parts split as they were read ({deferred} after the whole checkpoint)")
    return vocab_split


class LoadPeak:
    """What a rank's load cost in resident memory, for its log line: made before the model is built, told the
    whole model's size (`measure`) before it is split."""

    def __init__(self) -> None:
        self.before = rss_bytes()
        self.whole_model = 0

    def measure(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.whole_model = sum(p.numel() for p in model.parameters()) * torch.finfo(dtype).bits // 8  # meta too

    def log(self, group: ParallelGroup, how: str, kind: str = "Tensor parallel rank") -> None:
        host_allocator.release_free_memory()
        logger.info("%s %d/%d: %s; resident memory peaked %.2f GiB above the %.2f GiB before loading (the whole "
                    "model: %.2f GiB)", kind, group.rank, group.size, how,
                    (peak_rss_bytes() - self.before) / GiB, self.before / GiB, self.whole_model / GiB)
