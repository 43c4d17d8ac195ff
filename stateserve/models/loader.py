"""Weights: safetensors (single file or sharded with its index), read tensor by tensor, or seeded dummy weights.
Every checkpoint tensor must land on a parameter of the right shape, and every parameter must be filled."""
from __future__ import annotations

import glob
import json
import os
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import torch
from safetensors import safe_open
from torch import nn
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


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


class SafetensorsReader:
    """A folder's tensors by name, each read on demand with plain file reads (in file order by iterate_safetensors,
    a layer at a time by distributed/load.py). Not mmap'ed: a mapping keeps every page read so far resident in this
    process for as long as the file stays open, the whole checkpoint by the end; read() leaves them to the page
    cache, which the kernel reclaims. The format: an 8-byte little-endian header length, a JSON header (dtype,
    shape, data offsets of each tensor), the data."""

    def __init__(self, path: str) -> None:
        self.entries: dict[str, tuple[str, int, dict]] = {}
        for file in safetensors_files(path):
            with open(file, "rb") as f:
                length = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(length))
            for name, info in header.items():
                if name != "__metadata__":
                    self.entries[name] = (file, 8 + length, info)

    def names(self) -> list[str]:
        return list(self.entries)

    def tensors(self, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:
            file, data_start, info = self.entries[name]
            dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
            if dtype is None:  # a type read here only through the library (float8, ...)
                with safe_open(file, framework="pt") as f:
                    yield name, f.get_tensor(name)
                continue
            begin, end = info["data_offsets"]
            raw = torch.empty(end - begin, dtype=torch.uint8)
            with open(file, "rb") as f:
                f.seek(data_start + begin)
                if f.readinto(memoryview(raw.numpy())) != end - begin:
                    raise WeightLoadError(f"{file}: tensor {name!r} is cut short (the file is truncated)")
            yield name, raw.view(dtype).reshape(info["shape"])


@contextmanager
def no_weight_init() -> Iterator[None]:
    """Builds modules without nn.Linear / nn.Embedding / nn.Conv1d's random initialisation, for a model a checkpoint
    fills completely (WeightLoader checks that): their weights stay untouched memory, which the kernel makes resident
    only when a tensor is copied in, so a model can be loaded (and split) a layer at a time."""
    classes = (nn.Linear, nn.Embedding, nn.Conv1d)
    saved = {cls: cls.__dict__.get("reset_parameters") for cls in classes}  # None: inherited (Conv1d's)
    try:
        for cls in classes:
            cls.reset_parameters = lambda self: None  # type: ignore[method-assign]
        yield
    finally:
        for cls, fn in saved.items():
            if fn is None:
                del cls.reset_parameters
            else:
                cls.reset_parameters = fn  # type: ignore[method-assign]


def iterate_safetensors(path: str, show_progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a folder, file by file, each read when it is reached (SafetensorsReader: plain reads)."""
    reader = SafetensorsReader(path)
    by_file: dict[str, list[str]] = {}
    for name, (file, _, _) in reader.entries.items():
        by_file.setdefault(file, []).append(name)
    for file in tqdm(by_file, desc="Loading safetensors shards", disable=not show_progress, leave=False):
        yield from reader.tensors(by_file[file])


class WeightLoader:
    """Copies checkpoint tensors onto a model's parameters and keeps count of which (parameter, shard)s were filled.
    A block-quantized tensor of a GGUF file (gguf_file.GGUFTensor) bound for a linear layer's or an untied
    embedding's weight goes into `quantized` by (parameter, shard) in its own format, for quantization.quantize_model
    to keep (None: it is dequantized onto the parameter like the others). `retire(prefix)` takes the parameters under
    a module out of the targets once that module was split or changed (distributed/load.py)."""

    def __init__(self, model: ModelBase, quantized: dict[tuple[str, int | None], Any] | None = None) -> None:
        self.model, self.quantized = model, quantized
        self.params = dict(model.named_parameters())
        self.tied = set(model.tied_params)
        # what keeps a file's blocks: linears, and embeddings whose matrix no head shares
        self.kept_blocks = {f"{n}.weight" if n else "weight" for n, m in model.named_modules()
                            if isinstance(m, (nn.Linear, nn.Embedding))} - set(model.tied_params.values())
        self.expected: set[tuple[str, int | None]] = set()
        for name, p in self.params.items():
            if name in self.tied or p.is_meta:  # meta: a layer of another pipeline stage, never loaded here
                continue
            sizes = getattr(p, "shard_sizes", None)
            self.expected.update((name, i) for i in range(len(sizes))) if sizes else self.expected.add((name, None))
        self.loaded: set[tuple[str, int | None]] = set()
        self.retired: list[str] = []

    def load(self, weights: Iterable[tuple[str, Any]]) -> None:
        model, params = self.model, self.params
        for file_name, file_tensor in weights:
            # expand_weight: a tensor that fills several parameters comes back in pieces (ModelBase)
            for ckpt_name, tensor in model.expand_weight(file_name, file_tensor):
                target = model.map_weight_name(ckpt_name)
                if target is None:
                    continue
                pname, shard = target
                if pname in self.tied or (pname in params and params[pname].is_meta):
                    continue  # e.g. lm_head.weight saved alongside tied embeddings; another stage's layer
                if pname not in params:
                    done = [p for p in self.retired if pname.startswith(p + ".")]
                    raise WeightLoadError(f"checkpoint tensor {ckpt_name!r} does not match any parameter of "
                                          f"{type(model).__name__}" + (f" (it comes after {done[0]} was already "
                                                                      "loaded whole and split)" if done else ""))
                if not isinstance(tensor, torch.Tensor):  # a GGUF file's quantized tensor
                    if self.quantized is not None and pname in self.kept_blocks:
                        _check_shape(ckpt_name, tensor.shape, _target(params, pname, shard).shape)
                        self.quantized[(pname, shard)] = tensor.to_quantized()
                        self.loaded.add((pname, shard))
                        continue
                    tensor = tensor.to_float()
                dst = _target(params, pname, shard)
                _check_shape(ckpt_name, tensor.shape, dst.shape)
                dst.copy_(tensor)
                sizes = getattr(params[pname], "shard_sizes", None)
                # a stacked parameter given whole (an in-memory name, e.g. Kimi's conv1d) fills every shard of it
                self.loaded.update((pname, i) for i in range(len(sizes))) if sizes and shard is None else \
                    self.loaded.add((pname, shard))

    def missing(self, prefix: str | None = None) -> list[str]:
        """Parameters (of the module `prefix`, None: all) that no tensor has filled yet."""
        gaps = [(n, s) for n, s in self.expected - self.loaded if prefix is None or n.startswith(prefix + ".")]
        return sorted(f"{n}" + (f"[shard {s}]" if s is not None else "") for n, s in gaps)

    def check_complete(self) -> None:
        missing = self.missing()
        if missing:
            raise WeightLoadError(f"checkpoint is missing tensor(s) for: {', '.join(missing[:10])}"
                                  + (f" and {len(missing) - 10} more" if len(missing) > 10 else ""))

    def retire(self, prefix: str) -> None:
        """The module `prefix` is complete and was replaced in place (split): no tensor may target it any more."""
        self.params = {n: p for n, p in self.params.items() if not n.startswith(prefix + ".")}
        self.retired.append(prefix)


def load_weights(model: ModelBase, weights: Iterator[tuple[str, Any]],
                 quantized: dict[tuple[str, int | None], Any] | None = None) -> None:
    """Copies each checkpoint tensor onto its parameter (WeightLoader) and checks that every parameter was filled."""
    loader = WeightLoader(model, quantized)
    loader.load(weights)
    loader.check_complete()


def _target(params: dict[str, nn.Parameter], pname: str, shard: int | None) -> torch.Tensor:
    dst = params[pname].data
    if shard is not None:
        sizes = params[pname].shard_sizes  # type: ignore[attr-defined]
        dst = dst.narrow(0, sum(sizes[:shard]), sizes[shard])
    return dst


def _check_shape(ckpt_name: str, shape: Any, expected: Any) -> None:
    if tuple(shape) != tuple(expected):
        raise WeightLoadError(f"checkpoint tensor {ckpt_name!r} has shape {tuple(shape)}, expected {tuple(expected)}")


def init_dummy_weights(model: ModelBase, seed: int) -> None:
    """Reproducible random weights: matrices ~ N(0, 0.02); 1-D parameters keep the values the
    model constructed (norm weights, SSM decay rates), which keeps recurrent models stable."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tied = set(model.tied_params)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if name in tied or p.dim() < 2:
            continue
        p.data.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.02)


def read_checkpoint(model: ModelBase, path: str, engine_config: Any,
                    show_progress: bool = True) -> tuple[dict[tuple[str, int | None], Any], str]:
    """Fills the model's weights from a Hugging Face folder, a GGUF file or seeded random values. Returns a GGUF
    file's quantized tensors kept in their own formats, by (parameter, shard), and what the load log adds about the
    source."""
    from stateserve.models.gguf_file import GGUFCheckpoint, is_gguf

    supplied: dict[tuple[str, int | None], Any] = {}
    source = ""
    if engine_config.load_format == "dummy":
        init_dummy_weights(model, engine_config.seed)
    elif is_gguf(path):
        gguf = GGUFCheckpoint(path)
        load_weights(model, gguf.tensors_hf(), supplied)
        source = f"; read from GGUF (linears {gguf.linear_format()})"
    else:
        load_weights(model, iterate_safetensors(path, show_progress))
    return supplied, source


def quantize_loaded(model: ModelBase, engine_config: Any, device: torch.device,
                    supplied: dict[tuple[str, int | None], Any]) -> Any:
    """Quantizes the loaded model's linears (engine_config.quantization; a GGUF file's quantized tensors, `supplied`,
    in their own formats). Returns the quantization.QuantSummary, or None for float weights."""
    from stateserve.quantization import quantize_model

    method = engine_config.quantization
    if method is None and not supplied:
        return None
    # a GGUF file's own formats are kept with int8 activations unless a method says otherwise
    return quantize_model(model, method or "int8", device, file_formats=method is None, supplied=supplied)
