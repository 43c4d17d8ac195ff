"""What this machine can do at best, measured with torch: memory bandwidth (a large copy), GEMV (a weight
matrix times one vector: the shape of decoding one token) and matmul FLOP/s, in float32 and bfloat16; and the
decode roofline of a model: every weight is read once per generated token, so bytes of weights / bandwidth
bounds single-request decode from above.

    python bench/machine_limits.py [--threads N] [--model FOLDER --dtype bfloat16]
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import time
from typing import Callable

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_ST_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}


def best_time(fn: Callable[[], object], min_total_s: float = 0.6, max_reps: int = 50) -> float:
    """Fastest of several calls after one warm-up: the machine's capability, not its noise."""
    fn()
    best, total, reps = float("inf"), 0.0, 0
    while (total < min_total_s or reps < 3) and reps < max_reps:
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best, total, reps = min(best, took), total + took, reps + 1
    return best


def copy_bandwidth(dtype: torch.dtype, nbytes: int = 256 << 20) -> float:
    """GB/s of a large tensor copy, counting the read and the write; far beyond any cache."""
    n = nbytes // torch.empty((), dtype=dtype).element_size()
    src, dst = torch.ones(n, dtype=dtype), torch.empty(n, dtype=dtype)
    return 2 * nbytes / best_time(lambda: dst.copy_(src)) / 1e9


def gemv(dtype: torch.dtype, rows: int = 8192, cols: int = 8192) -> tuple[float, float]:
    """(GB/s of weights streamed, GFLOP/s) of a [rows, cols] matrix times a vector."""
    weight, vec = torch.randn(rows, cols).to(dtype), torch.randn(cols).to(dtype)
    took = best_time(lambda: torch.mv(weight, vec))
    return weight.numel() * weight.element_size() / took / 1e9, 2 * rows * cols / took / 1e9


def matmul_flops(dtype: torch.dtype, n: int = 1536) -> float:
    """GFLOP/s of a square [n, n] @ [n, n] product: the compute ceiling of prefill."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n ** 3 / best_time(lambda: a @ b) / 1e9


def measure(threads: int | None = None) -> dict:
    if threads:
        torch.set_num_threads(threads)
    limits: dict = {"threads": torch.get_num_threads()}
    for name, dtype in DTYPES.items():
        gemv_bw, gemv_flops = gemv(dtype)
        limits[name] = {"copy_GBps": copy_bandwidth(dtype), "gemv_GBps": gemv_bw, "gemv_GFLOPs": gemv_flops,
                        "matmul_GFLOPs": matmul_flops(dtype)}
    return limits


def _safetensors_shapes(folder: str) -> dict[str, tuple[list[int], str]]:
    """name -> (shape, dtype) read from the safetensors headers alone (no weights loaded)."""
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{folder} has no .safetensors files")
    shapes = {}
    for fname in files:
        with open(os.path.join(folder, fname), "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        shapes.update({k: (v["shape"], v["dtype"]) for k, v in header.items() if k != "__metadata__"})
    return shapes


# bytes per weight of the quantized types (blocks of 32: the codes and a float16 scale), for matrices whose rows
# are whole blocks; the rest of such a model stays bfloat16
QUANT_BYTES = {"q8_0": 34 / 32, "q4_0": 18 / 32, "q4_k_m": 144 / 256}  # Q4_K_M: its Q4_K majority


def weight_bytes_per_token(folder: str, dtype: str) -> int:
    """Bytes of weights one decode step reads in `dtype`: every tensor in full, except that an input
    embedding table contributes one row (unless it is also the output head, i.e. tied). A quantized type counts
    its bytes per weight for the 2-D matrices of whole blocks, bfloat16 for the rest."""
    float_dtype = "bfloat16" if dtype in QUANT_BYTES else dtype
    elem = torch.empty((), dtype=DTYPES[float_dtype]).element_size()
    shapes = _safetensors_shapes(folder)
    has_head = any(n.endswith("lm_head.weight") for n in shapes)
    total = 0.0
    for name, (shape, _) in shapes.items():
        numel = 1
        for d in shape:
            numel *= d
        is_embedding = "embed" in name and len(shape) == 2
        per = QUANT_BYTES[dtype] if dtype in QUANT_BYTES and len(shape) == 2 and shape[1] % 32 == 0 \
            and not (is_embedding and has_head) else elem
        total += (shape[1] if is_embedding and has_head else numel) * per
    return int(total)


def decode_roofline(folder: str, dtype: str, limits: dict) -> dict:
    """Most tokens per second one request can decode: bandwidth / weight bytes read per token."""
    nbytes = weight_bytes_per_token(folder, dtype)
    float_dtype = "bfloat16" if dtype in QUANT_BYTES else dtype
    copy_bw = limits[float_dtype]["copy_GBps"] * 1e9
    return {"weight_bytes_per_token": nbytes, "bandwidth_GBps": limits[float_dtype]["copy_GBps"],
            "max_tok_s": copy_bw / nbytes}


def format_limits(limits: dict) -> str:
    from common import cpu_name  # bench/ is on sys.path wherever these scripts run

    lines = [f"CPU: {cpu_name()}",
             f"Machine limits ({limits['threads']} threads, best of repeated runs):",
             f"  {'dtype':<9} {'copy GB/s':>10} {'GEMV GB/s':>10} {'GEMV GFLOP/s':>13} {'matmul GFLOP/s':>15}"]
    for name in DTYPES:
        d = limits[name]
        lines.append(f"  {name:<9} {d['copy_GBps']:>10.1f} {d['gemv_GBps']:>10.1f} {d['gemv_GFLOPs']:>13.1f} "
                     f"{d['matmul_GFLOPs']:>15.1f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--model", default=None, help="HF folder: also print its decode roofline")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    args = parser.parse_args()
    limits = measure(args.threads)
    print(format_limits(limits))
    if args.model:
        roof = decode_roofline(args.model, args.dtype, limits)
        print(f"  decode roofline ({args.dtype}): {roof['weight_bytes_per_token'] / 1e6:.1f} MB of weights per "
              f"token -> at most {roof['max_tok_s']:.1f} tok/s")


if __name__ == "__main__":
    main()
