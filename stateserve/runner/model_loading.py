"""One rank's model, built and filled with its weights: the model class for the architecture, built without random
init when a checkpoint fills it (its weights stay untouched memory until loaded), and then
- a tensor-parallel rank over a safetensors folder loads and splits a layer at a time (distributed/load.py);
- a pipeline rank moves the other stages' layers to the meta device first (distributed/pipeline.py);
- any other load reads the whole checkpoint (models/loader.load_checkpoint: safetensors, GGUF, dummy weights,
  load-time quantization), a tensor-parallel one then splitting it.
The runner's load_model takes it from there (CPU kernels, panel copies, the model state, the pipeline split)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stateserve.config import EngineConfig, ModelConfig
from stateserve.distributed.group import ParallelGroup
from stateserve.distributed.load import LoadPeak, load_and_split
from stateserve.distributed.pipeline import release_other_stages
from stateserve.distributed.sharding import split_model
from stateserve.models.loader import load_checkpoint, no_weight_init
from stateserve.models.registry import ModelRegistry


@dataclass
class LoadedModel:
    model: nn.Module
    quantized: Any  # quantization.QuantSummary, or None for float weights
    source: str  # what the load log adds about the source (a GGUF file's formats)
    vocab_split: bool  # tensor parallelism split the vocabulary (each rank holds its share of the logits)
    stage: tuple[int, int] | None  # a pipeline rank's layers [first, end)


def loads_layer_by_layer(config: EngineConfig, group: ParallelGroup | None, path: str) -> bool:
    """Tensor parallelism over a safetensors folder of float weights (GGUF files, dummy weights and load-time
    quantization load whole)."""
    from stateserve.models.gguf_file import is_gguf

    return group is not None and config.tensor_parallel_size > 1 and config.load_format != "dummy" \
        and config.quantization is None and not is_gguf(path)


def build_and_load(config: EngineConfig, model_config: ModelConfig, device: torch.device,
                   group: ParallelGroup | None, show_progress: bool) -> LoadedModel:
    cls = ModelRegistry.resolve(model_config.architecture)
    torch.manual_seed(config.seed)
    dtype, path = model_config.dtype, model_config.path
    streamed = loads_layer_by_layer(config, group, path)
    peak = LoadPeak()  # a tensor- or pipeline-parallel rank logs it
    # a checkpoint fills every weight (the loader checks): random init would only make the float32 model resident
    # before the cast to `dtype` (a peak of ~2x the model in bfloat16 for nothing)
    fills = config.load_format != "dummy"
    with torch.device(device), (no_weight_init() if fills else contextlib.nullcontext()):
        model = cls(model_config.hf_config, dtype)
    peak.measure(model, dtype)
    stage = release_other_stages(model, group) if group is not None and config.pipeline_parallel_size > 1 else None
    if streamed:  # a tensor-parallel rank never holds the whole model
        vocab_split = load_and_split(model, path, dtype, group, model_config.vocab_size, peak)  # type: ignore[arg-type]
        return LoadedModel(model, None, "", vocab_split, None)
    quantized, source = load_checkpoint(model.to(dtype=dtype), path, config, device, show_progress)
    vocab_split = False
    if group is not None:
        if quantized is not None:
            raise ValueError("tensor and pipeline parallelism take float weights: a quantized model "
                             "(quantization= or a GGUF file's quantized tensors) runs on one rank")
        if config.tensor_parallel_size > 1:
            vocab_split = split_model(model, group, model_config.vocab_size)
            peak.log(group, "loaded whole, then split")
        if stage is not None:
            peak.log(group, f"layers {stage[0]}-{stage[1] - 1} loaded (its stage)", "Pipeline rank")
    return LoadedModel(model, quantized, source, vocab_split, stage)
