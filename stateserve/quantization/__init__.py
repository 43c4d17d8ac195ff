"""Quantized weights (EngineConfig.quantization, GGUF files): the model's dense projections become QuantLinear
layers holding llama.cpp block formats (formats.py), right after the checkpoint is read.

Methods: "int8" (Q8_0), "q4_0", "q4_k", each with int8 activations, and their "..._weight_only" twins (float
activations, exact). A GGUF file's quantized tensors keep their own format whatever the method (the file's Q5_K
and IQ4_XS, which have no kernels here, become Q8_0); the method's format applies to the float linears of a safetensors
checkpoint (of a GGUF file only when a method is asked for), its activation mode to every layer.

Which layers: every nn.Linear whose in_features fits the format's block (Q4_K: 256, else 32; a Q4_K layer that
does not fit becomes Q4_0), except MoE routers (a few columns that pick experts: kept exact, as llama.cpp keeps
them) and a head that shares its weight with the embedding (quantizing it would add a copy beside the float
embedding). A GGUF file's untied embedding keeps its blocks too (embedding.py: rows dequantized on lookup). An untied head gets at least 6 bits: Q8_0 under a 4-bit method. Never conv1d weights, A_log, D,
dt_bias, norms or recurrent state: those are not nn.Linear. MoE experts' stacked matrices (layers/moe.py
ExpertMatrices) become one QuantLinear per expert and matrix under a method (a GGUF file's experts are
dequantized to the model dtype for now)."""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from stateserve.config import QUANTIZATION_METHODS
from stateserve.layers.moe import ExpertMatrices
from stateserve.quantization import formats
from stateserve.quantization.formats import QuantizedWeight

logger = logging.getLogger("stateserve")
# method -> the format of its float linears; QUANTIZATION_METHODS holds each and its "..._weight_only" twin
_FORMAT_OF = {"int8": "q8_0", "q4_0": "q4_0", "q4_k": "q4_k"}
_KEEP_NAMES = ("router",)  # our MoE layers' expert pickers
_HEAD = "lm_head"


@dataclass(frozen=True)
class QuantSummary:
    method: str
    layers: Counter  # format -> linears quantized in it
    kept: int  # linears left in the model dtype
    weight_bytes: int  # bytes of the quantized layers' packed weights and of the quantized embeddings
    file_formats: bool = False  # the layers hold a file's own blocks (the method names only the activation mode)
    embeddings: Counter = field(default_factory=Counter)  # format -> embeddings kept in it (GGUF files)

    def describe(self) -> str:
        """What the load log says, e.g. "weights quantized to q4_k (Q4_K x4, Q8_0 x1): 5 linears, ..."."""
        kinds = ", ".join(f"{fmt.upper()} x{n}" for fmt, n in self.layers.most_common()) if len(self.layers) > 1 \
            else next(iter(self.layers), "none").upper()
        if self.file_formats:
            activations = "float" if self.method.endswith("_weight_only") else "int8"
            what = f"weights kept as stored ({kinds}, {activations} activations)"
        else:
            what = f"weights quantized to {self.method} ({kinds})"
        embeddings = "".join(f", embedding {fmt.upper()}" for fmt in self.embeddings)
        return f"{what}: {sum(self.layers.values())} linears{embeddings}, {self.weight_bytes / 2**30:.4f} GiB; " \
               f"{self.kept} linears kept in the model dtype"


def _kernels(device: torch.device) -> object | None:
    from stateserve.platform import cpu_kernels

    module = cpu_kernels.load() if device.type == "cpu" else None
    supported = getattr(module, "q8_0_supported", None)
    return module if supported is not None and supported() else None


def _layer_format(method_fmt: str | None, head: bool, in_features: int) -> str | None:
    """The format a float linear gets (None: it stays float)."""
    if method_fmt is None:
        return None
    fmt = "q8_0" if head else method_fmt  # the head at no less than 6 bits
    if fmt == "q4_k" and not formats.fits(fmt, in_features):
        fmt = "q4_0"
    return fmt if formats.fits(fmt, in_features) else None


def _supplied_weight(parts: dict[int | None, QuantizedWeight], sizes: list[int] | None) -> list[QuantizedWeight]:
    """A fused projection's parts in order, neighbours of one format joined."""
    runs: list[list[QuantizedWeight]] = []
    for shard in [None] if not sizes else range(len(sizes)):
        part = parts[shard]
        if runs and runs[-1][0].fmt == part.fmt:
            runs[-1].append(part)
        else:
            runs.append([part])
    return [formats.concat(run) for run in runs]


def _quantize_experts(module: ExpertMatrices, method_fmt: str, activations: bool,
                      kernels: object | None) -> tuple[Counter, int]:
    """A MoE layer's stacked expert matrices as one QuantLinear per expert and matrix (a matrix whose K fits no
    format stays float)."""
    from stateserve.quantization.linear import QuantLinear

    products, counts, nbytes = {}, Counter(), 0
    for name, matrices in module.expert_matrices().items():  # [E, N, K]
        fmt = _layer_format(method_fmt, False, matrices.shape[-1])
        if fmt is None:
            continue
        products[name] = [QuantLinear(formats.quantize(w, fmt), None, activations, kernels) for w in matrices]
        counts[fmt] += len(products[name])
        nbytes += sum(p.weight_bytes for p in products[name])
    if products:
        module.replace_expert_matrices(products)
    return counts, nbytes


def quantize_model(model: nn.Module, method: str, device: torch.device, file_formats: bool = False,
                   supplied: dict[tuple[str, int | None], QuantizedWeight] | None = None) -> QuantSummary:
    """Replaces the model's eligible nn.Linear layers by QuantLinear, in place. supplied: quantized weights read from
    a file, by (parameter name, shard), which the layers keep as they are (file_formats: only those layers are
    quantized; the float ones stay)."""
    from stateserve.quantization.embedding import QuantEmbedding
    from stateserve.quantization.linear import QuantLinear

    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {method!r}")
    if device.type != "cpu":
        raise ValueError(f"quantization={method!r} runs on CPU only; got device {device}")
    kernels = _kernels(device)
    if kernels is None:
        logger.warning("quantization=%s without the C++ kernels: the products run in PyTorch, far slower", method)
    method_fmt = None if file_formats else _FORMAT_OF[method.removesuffix("_weight_only")]
    activations = not method.endswith("_weight_only")
    by_param: dict[str, dict[int | None, QuantizedWeight]] = {}  # parameter -> its supplied shards
    for (pname, shard), part in (supplied or {}).items():
        by_param.setdefault(pname, {})[shard] = part
    owners: dict[int, int] = {}  # data_ptr -> how many parameters hold it (tied weights)
    for _, p in model.named_parameters(remove_duplicate=False):
        owners[p.data_ptr()] = owners.get(p.data_ptr(), 0) + 1
    layers: Counter = Counter()
    kept = size = 0
    embeddings: Counter = Counter()
    for path, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            pname = f"{path}.{name}.weight" if path else f"{name}.weight"
            if isinstance(child, nn.Embedding) and pname in by_param:  # a GGUF file's embedding, as stored
                embedding = QuantEmbedding(by_param.pop(pname)[None], child.weight.dtype)
                setattr(parent, name, embedding)
                embeddings[embedding.fmt] += 1
                size += embedding.weight_bytes
                continue
            if not isinstance(child, nn.Linear) or child.weight.is_meta:  # meta: another pipeline stage's layer
                continue
            parts = by_param.pop(pname, None)
            eligible = name not in _KEEP_NAMES and owners.get(child.weight.data_ptr(), 0) == 1
            weight = None
            if parts:
                weight = _supplied_weight(parts, getattr(child.weight, "shard_sizes", None))
                if not eligible:
                    child.weight.data.copy_(torch.cat([w.dequantize() for w in weight]))
                    weight = None
            elif eligible:
                fmt = _layer_format(method_fmt, path == "" and name == _HEAD, child.in_features)
                weight = formats.quantize(child.weight, fmt) if fmt is not None else None
            if weight is None:
                kept += 1
                continue
            layer = QuantLinear(weight, child.bias, activations, kernels)
            setattr(parent, name, layer)
            layers[layer.fmt] += 1
            size += layer.weight_bytes
    if method_fmt is not None:
        for module in model.modules():
            if isinstance(module, ExpertMatrices) and module.expert_products is None and \
                    not any(p.is_meta for p in module.parameters()):
                quantized, nbytes = _quantize_experts(module, method_fmt, activations, kernels)
                layers.update(quantized)
                size += nbytes
    if by_param:
        raise ValueError(f"quantized tensors for {sorted(by_param)[:5]} have no linear or embedding layer")
    return QuantSummary(method, layers, kept, size, file_formats, embeddings)
