"""One rank's model, built and filled with its weights: the model class for the architecture, built without random
init when a checkpoint fills it (its weights stay untouched memory until loaded), and then
- a tensor-parallel rank over a safetensors folder loads and splits a layer at a time (distributed/load.py);
- a pipeline rank moves the other stages' layers to the meta device first (distributed/pipeline.py);
- any other load reads the whole checkpoint (models/loader.read_checkpoint: safetensors, GGUF, dummy weights), a
  tensor-parallel one then splitting it;
- then load-time quantization (or a GGUF file's quantized tensors) turns the rank's linears into quantized ones:
  after the split, so each rank quantizes its own share (a row-parallel share whose columns start at a block
  boundary gets the very blocks the whole model would).
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
from stateserve.distributed.sharding import TensorParallelError, split_model
from stateserve.models.loader import no_weight_init, quantize_loaded, read_checkpoint
from stateserve.models.registry import ModelRegistry


@dataclass
class LoadedModel:
    model: nn.Module
    quantized: Any  # quantization.QuantSummary, or None for float weights
    source: str  # what the load log adds about the source (a GGUF file's formats)
    vocab_split: bool  # tensor parallelism split the vocabulary (each rank holds its share of the logits)


def loads_layer_by_layer(config: EngineConfig, group: ParallelGroup | None, path: str) -> bool:
    """Tensor parallelism over a safetensors folder (GGUF files and dummy weights load whole)."""
    from stateserve.models.gguf_file import is_gguf

    return group is not None and config.tensor_parallel_size > 1 and config.load_format != "dummy" \
        and not is_gguf(path)


def build_and_load(config: EngineConfig, model_config: ModelConfig, device: torch.device,
                   group: ParallelGroup | None, show_progress: bool,
                   tensor_group: ParallelGroup | None = None) -> LoadedModel:
    """group: all ranks of the engine (None: one rank); tensor_group: the ranks this one splits its layers with
    (its pipeline stage's; the whole group without pipeline parallelism)."""
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
    stage = release_other_stages(model, group, config.tensor_parallel_size) \
        if group is not None and config.pipeline_parallel_size > 1 else None
    if streamed:  # a tensor-parallel rank never holds the whole model
        vocab_split = load_and_split(model, path, dtype, tensor_group, model_config.vocab_size,  # type: ignore
                                     peak)
        if stage is not None:
            peak.log(group, f"layers {stage[0]}-{stage[1] - 1} loaded (its stage) and split", "Pipeline rank")
        return LoadedModel(model, quantize_loaded(model, config, device, {}), "", vocab_split)
    supplied, source = read_checkpoint(model.to(dtype=dtype), path, config, show_progress)
    vocab_split = False
    if group is not None:
        if config.tensor_parallel_size > 1:
            if supplied:
                raise TensorParallelError(
                    "tensor parallelism cannot split a GGUF file's quantized tensors (their blocks would have to be "
                    f"cut across ranks): {path} runs with pipeline_parallel_size, or on one rank; or load a "
                    "safetensors folder with quantization= and split that")
            vocab_split = split_model(model, tensor_group, model_config.vocab_size)
            peak.log(tensor_group, "loaded whole, then split")
        if stage is not None:
            peak.log(group, f"layers {stage[0]}-{stage[1] - 1} loaded (its stage)", "Pipeline rank")
    return LoadedModel(model, quantize_loaded(model, config, device, supplied), source, vocab_split)
