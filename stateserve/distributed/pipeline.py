"""Pipeline parallelism: a model's layers split into consecutive stages, one per rank, each stage's KV blocks and
state slots living with its layers.

Every rank runs the model's whole forward, so the model code stays as it is; a layer another stage owns is a
`RemoteLayer` that holds no weights and no cache. Where ownership changes hands, the last owned layer's output
(whatever it returns: the hidden rows, or (hidden, residual)) is sent to the next stage, whose `RemoteLayer` of
that index receives it and returns it in the layer's place; every other `RemoteLayer` hands its inputs on untouched
(they are nobody's result). After the last layer its output goes back to rank 0, which applies the final norm and
the head. A step thus makes one transfer per stage boundary plus one back to rank 0; stages run one after another
(no micro-batches), so on one host the point is memory per process, not speed.

With tensor parallelism as well, the ranks form a grid: stage s holds ranks s * T .. s * T + T - 1 (T =
tensor_parallel_size), which split that stage's layers among them as one tensor-parallel group; activations pass
between the ranks of the same tensor rank in consecutive stages (each holds the whole hidden rows), and after the
last layer back to stage 0's rank of that tensor rank, whose group computes the (split) head's logits.

A model takes part by naming its layer list and what one layer hands the next (ModelBase.pipeline_layers,
pipeline_carry); a model whose forward does more between its layers (shared blocks, cross-layer inputs) names
none and is refused."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stateserve.distributed.group import ParallelGroup
from stateserve.distributed.sharding import TensorParallelError

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
_HEADER = 32  # int64 entries: count, then per item: present, dtype, ndim, dims


def stage_bounds(num_layers: int, num_stages: int) -> list[int]:
    """Layer index where each stage starts (and num_layers at the end): equal shares, earlier stages one more."""
    if num_layers < num_stages:
        raise TensorParallelError(f"pipeline_parallel_size={num_stages} is more than the model's {num_layers} layers")
    base, extra = divmod(num_layers, num_stages)
    bounds = [0]
    for stage in range(num_stages):
        bounds.append(bounds[-1] + base + (stage < extra))
    return bounds


def stage_of(rank: int, tensor_size: int) -> int:
    """The pipeline stage of a global rank (stages are consecutive runs of tensor_size ranks)."""
    return rank // tensor_size


def tensor_ranks(rank: int, tensor_size: int) -> list[int]:
    """The global ranks of `rank`'s stage: its tensor-parallel group."""
    first = stage_of(rank, tensor_size) * tensor_size
    return list(range(first, first + tensor_size))


def tensor_group_of(group: ParallelGroup | None, config: Any) -> ParallelGroup | None:
    """The tensor-parallel group of this rank (every rank of `group` calls this once, together): its stage's ranks
    as a group of their own with pipeline stages too, the whole group without, None without tensor parallelism."""
    tensor_size = config.tensor_parallel_size
    if group is None or tensor_size == 1:
        return None
    if tensor_size == group.size:
        return group
    ranks = tensor_ranks(group.rank, tensor_size)
    return group.subgroup(ranks, f"tensor-stage-{stage_of(group.rank, tensor_size)}")


def _send(group: ParallelGroup, value: Any, dst: int) -> None:
    items = list(value) if isinstance(value, tuple) else [value]
    header = [len(items)]
    for item in items:
        if item is None:
            header += [0, 0, 0]
        else:
            header += [1, _DTYPES.index(item.dtype), item.dim(), *item.shape]
    if len(header) > _HEADER:
        raise RuntimeError(f"a layer output of {len(items)} items is too large for the pipeline header")
    group.send(torch.tensor(header + [0] * (_HEADER - len(header)), dtype=torch.int64), dst)
    for item in items:
        if item is not None:
            group.send(item, dst)


def _recv(group: ParallelGroup, src: int) -> Any:
    header = group.recv(torch.empty(_HEADER, dtype=torch.int64), src).tolist()
    items, at = [], 1
    for _ in range(header[0]):
        present, dtype, ndim = header[at:at + 3]
        shape = header[at + 3:at + 3 + ndim]
        at += 3 + ndim
        items.append(group.recv(torch.empty(shape, dtype=_DTYPES[dtype]), src) if present else None)
    return items[0] if header[0] == 1 else tuple(items)


class RemoteLayer(nn.Module):
    """Layer `index`, owned by another stage. receive_from: the stage whose output this rank takes here (the rank
    owns the next layer, or this is the last layer and the rank is 0); None: pass the inputs on."""

    def __init__(self, index: int, owner: int, carry: int, receive_from: int | None, group: ParallelGroup) -> None:
        super().__init__()
        self.index, self.owner, self.carry, self.receive_from, self.group = index, owner, carry, receive_from, group

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.receive_from is not None:
            return _recv(self.group, self.receive_from)
        return args[0] if self.carry == 1 else tuple(args[:self.carry])

    def extra_repr(self) -> str:
        return f"index={self.index}, owner=rank {self.owner}"


def release_other_stages(model: nn.Module, group: ParallelGroup, tensor_size: int = 1) -> tuple[int, int] | None:
    """Before loading: the layers other stages own move to the meta device (their weights, never initialised, are
    dropped without ever being resident), so the loader skips their tensors and this rank holds only its stage.
    Returns this stage's layers [first, end) (None: the model has no pipeline layer list; split_pipeline refuses
    it). The modules stay in place until split_pipeline, so every stage still plans the caches of all layers."""
    path = model.pipeline_layers
    if path is None:
        return None
    layers: nn.ModuleList = model.get_submodule(path)
    stage = stage_of(group.rank, tensor_size)
    bounds = stage_bounds(len(layers), group.size // tensor_size)
    first, end = bounds[stage], bounds[stage + 1]
    for i, layer in enumerate(layers):
        if not first <= i < end:
            layer.to(device="meta")
    return first, end


def split_pipeline(model: nn.Module, group: ParallelGroup, tensor_size: int = 1) -> None:
    """Keep this rank's stage of the model's layers; the others become RemoteLayers (group: all ranks; stages of
    tensor_size ranks each)."""
    path, carry = model.pipeline_layers, model.pipeline_carry
    if path is None:
        raise TensorParallelError(f"{type(model).__name__} does not support pipeline parallelism (its forward is more "
                                  "than a plain loop over its layers); use tensor_parallel_size instead")
    layers: nn.ModuleList = model.get_submodule(path)
    num_stages, tensor_rank = group.size // tensor_size, group.rank % tensor_size
    bounds = stage_bounds(len(layers), num_stages)
    # the rank of this tensor rank that runs each layer
    owner = [stage * tensor_size + tensor_rank for stage in range(num_stages) for _ in range(bounds[stage],
                                                                                            bounds[stage + 1])]
    me, last = group.rank, len(layers) - 1
    for i in range(len(layers)):
        following = owner[i + 1] if i < last else tensor_rank  # the last layer's output goes to stage 0's head
        if owner[i] == me:
            if following != me:
                layers[i].register_forward_hook(lambda module, inputs, output, dst=following: _send(group, output, dst))
        else:
            layers[i] = RemoteLayer(i, owner[i], carry, owner[i] if following == me else None, group)
