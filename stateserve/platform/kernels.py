"""Which kernel serves each CPU operation: one table, filled once (at its first use, a model's load) from the C++
module of cpu_kernels.py (if it built) and the instruction sets that module was compiled for, and asked by the
layers instead of each probing the module, the dtypes and the vector width on its own.

    kernel = kernels.table(x.device).rms_norm(x.dtype)   # the kernel, or None: the layer's PyTorch path
    routes = kernels.table().linear(torch.bfloat16)      # few-row / panel / oneDNN / float32 upcast, by rows

Each operation (an `Op`) maps the dtypes of the tensors its kernel reads, in the order of its parameters, to the
kernel; a key missing from it is a PyTorch fallback. Off the CPU every operation is missing. Tests swap the table
with `using(build(None))` (PyTorch everywhere) or `using(build(spy_module))` and `reset()` forgets it."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.nn.functional as F

logger = logging.getLogger("stateserve")
Kernel = Callable[..., Any]
f32, bf16, f16, f64 = torch.float32, torch.bfloat16, torch.float16, torch.float64

# ---- linear: up to how many rows the few-row kernel (csrc/linear.cpp) serves, by dtype ----------------------------
# Measured on the benchmark machine (Zen 5 with AVX-512, at the 30m and base shapes): ~16 rows against oneDNN on
# plain weights, ~2 against the panel kernel (csrc/packed_linear.cpp). On an AVX2-only Zen 3 (float32) the kernel
# also led oneDNN up to 16 rows (1.0-2x at 8-16 rows of the base shapes, 2-5x at 1-4 rows of the small ones).
MAX_ROWS = {f32: 16, bf16: 16}
MAX_ROWS_PREPACKED = {f32: 2, bf16: 2}
# With AVX2's 8-lane vectors the few-row kernel led the panel kernel up to 4 rows and trailed it from 8 (2 Zen 3
# cores, float32 GFLOP/s few-row / panel: [3072, 768] 4 rows 98 / 82, 8 rows 105 / 122; [768, 1536] 88 / 77 and
# 89 / 121); both led oneDNN at every row count from 3 to 512 (the panel kernel by 1.03-2.4x). In bfloat16 (half the
# bytes to stream, widened in registers) the few-row kernel led up to 8 rows, over a base model's 24 weights read from
# memory (ms, few-row / panel: 1 row 4.0 / 5.6, 4 rows 5.9 / 7.4, 6 rows 7.4 / 8.2, 8 rows 9.2 / 10.0); there is no
# oneDNN bfloat16 there.
MAX_ROWS_PREPACKED_8_LANES = {f32: 4, bf16: 8}
# Why the panel kernel and not oneDNN past two rows: Llama-base layer shapes, GFLOP/s on two cores (panel kernel /
# oneDNN on its own blocked copy of the weight / oneDNN on the plain weight): bfloat16 8 rows 370 / 212 / 96,
# 37 rows 402 / 355 / 229, 256 rows 430 / 427 / 406, 2048 rows 431 / 437 / 405; float32 8 rows 153 / 100 / 69,
# 37 rows 213 / 188 / 141, 2048 rows 207 / 204 / 199. One extra copy of the weights serves every batch size.
# A bfloat16 layer with neither kernel nor oneDNN (kernels that did not build, on a CPU where oneDNN has no bfloat16) computes from this many rows on in float32: PyTorch's own bfloat16 matmul ran ~1 GFLOP/s on
# an AVX2-only Zen 3. [3072, 768] weight, 2 cores, ms (bfloat16 / float32 with the weight converted each call): 4 rows
# 0.95 / 1.05, 16 rows 3.75 / 1.36, 64 rows 14.9 / 2.6, 512 rows 120 / 18.
UPCAST_MIN_ROWS = 8
# ---- prefill attention: with AVX2's 8-lane vectors the C++ kernel serves sequences of up to this many keys (context
# + chunk). 2 Zen 3 cores, 12 heads of 64, causal GFLOP/s kernel / PyTorch's flash: 512 rows 84 / 61 (bfloat16 98 /
# 53), 2048 rows 95 / 108 (102 / 103), a 2048-row chunk after 2048 of context 102 / 121 (101 / 118); past that the
# flash kernel's blocked products pull ahead. With AVX-512 the kernel has no such limit.
PREFILL_KERNEL_MAX_KEYS_8_LANES = 4096


class Op:
    """One row of the table: the kernel of an operation for each key (the dtypes its kernel reads, one dtype or a
    tuple), `default` for every other key. Called with the dtypes, it returns the kernel or None."""
    __slots__ = ("name", "kernels", "default")

    def __init__(self, name: str, kernels: Mapping[Any, Kernel], default: Kernel | None = None) -> None:
        self.name, self.kernels, self.default = name, dict(kernels), default

    def __call__(self, *dtypes: torch.dtype) -> Kernel | None:
        return self.kernels.get(dtypes[0] if len(dtypes) == 1 else dtypes, self.default)

    def __repr__(self) -> str:
        keys = [_name(k) for k in self.kernels] + (["any"] if self.default is not None else [])
        return f"{self.name}: {', '.join(keys) or '-'}"


@dataclass(frozen=True)
class LinearRoutes:
    """How FastLinear computes x @ W.T of one dtype without grad, by rows: up to `max_rows` (`max_rows_prepacked`
    once the weight has a panel copy) through `few_row`, more through `panel` on the copy `pack` made, else through
    `onednn`, else (`upcast`, from UPCAST_MIN_ROWS rows) F.linear in float32, else F.linear."""
    few_row: Kernel | None  # fast_linear(x, weight, bias)
    max_rows: int
    max_rows_prepacked: int
    panel: Kernel | None  # packed_linear(x, packed, bias, out_features, lane_order)
    pack: Kernel | None  # pack_linear_weight_(packed, weight, lane_order)
    panel_takes: Callable[[int], bool]  # whether the panel kernel takes this in_features
    onednn: Kernel | None  # mkldnn's _linear_pointwise(x, weight, bias, "none", [], "")
    upcast: bool


@dataclass(frozen=True)
class KernelTable:
    module: Any | None  # the C++ module the kernels come from (None: PyTorch everywhere)
    isa: str  # what it was compiled for: avx512_bf16, avx512, avx2 or scalar ("" without a module)
    lanes: int  # float32 lanes of its widest vector: 16, 8 or 0
    prefill_max_keys: float  # most keys (context + chunk) a sequence may have for the prefill attention kernel
    linear_routes: Mapping[torch.dtype, LinearRoutes]
    # attention over the paged cache: (cache); (q, cache); (q, cache, head size: see prefill_attention)
    write_kv: Op
    decode_attention: Op
    prefill_kernel: Op
    # per-token ops: (x, weight); (residual, x, weight); (x); (q, k); (y, gate); (dt)
    rms_norm: Op
    rms_norm_f32_weight: Op  # (x): bfloat16 rows times a float32 weight before the rounding
    add_rms_norm: Op
    silu_and_mul: Op
    rotary: Op
    gated_rms_norm: Op
    dt_softplus: Op
    # recurrent layers: convs (x, weight) / (x, conv state, weight); Mamba2 SSD state update (states), decode after
    # in_proj (xbc, dt, conv state, conv weight, ssm state), prefill scan (float32 inputs); Mamba1 scan (u), state
    # update (ssm state, u, dt, B, C, z)
    conv_prefill: Op
    conv_update: Op
    delta_rule_decode: Op  # (ssm state): the gated delta net's / KDA's decode step on float32 states
    gated_delta_decode: Op  # (conv output): the gated delta net's gates and delta rule after its conv, one call
    ssd_update: Op
    mamba2_decode: Op
    ssd_scan: Op
    selective_scan: Op
    selective_update: Op
    # whole layers' decode steps in one call: (x, conv state, ssm state) for the mixers, (x, residual stream) for a
    # decoder layer (the first layer's stream is x itself)
    mamba1_decode: Op
    mamba2_mixer_decode: Op
    decoder_layer_decode: Op
    # load-time quantization: Q4_K fields of a float32 weight (w), llama.cpp's quantize_row_q4_K_ref bit for bit
    quantize_q4_k: Op

    def linear(self, dtype: torch.dtype) -> LinearRoutes | None:
        """The routes of a linear in `dtype`, or None where nothing beats F.linear (float16, off the CPU)."""
        return self.linear_routes.get(dtype)

    def prefill_attention(self, q_dtype: torch.dtype, cache_dtype: torch.dtype,
                          head_dim: int) -> tuple[Kernel, float] | None:
        """(paged_prefill_attention, the most keys a sequence may have for it) for q, cache and head size."""
        kernel = self.prefill_kernel(q_dtype, cache_dtype, head_dim)
        return None if kernel is None else (kernel, self.prefill_max_keys)

    def describe(self) -> str:
        """The table, one line per operation: what the log and a bug report show."""
        head = f"C++ kernels: {self.isa} ({self.lanes} float32 lanes)" if self.module is not None else \
            "C++ kernels: none (PyTorch everywhere)"
        lines = [head]
        for dtype, r in self.linear_routes.items():
            routes = [f"few-row <= {r.max_rows} rows ({r.max_rows_prepacked} packed)" if r.few_row else "",
                      "panel" if r.panel else "", "oneDNN" if r.onednn else "",
                      f"float32 from {UPCAST_MIN_ROWS} rows" if r.upcast else ""]
            lines.append(f"linear {_name(dtype)}: {', '.join(x for x in routes if x) or 'F.linear'}")
        lines += [repr(op) for op in vars(self).values() if isinstance(op, Op)]
        if self.prefill_kernel.kernels:
            lines.append(f"prefill attention up to {self.prefill_max_keys:g} keys")
        return "\n".join(lines)


def _name(key: Any) -> str:
    if isinstance(key, tuple):
        return "/".join(_name(k) for k in key) if key else "any"
    return str(key).removeprefix("torch.") if isinstance(key, torch.dtype) else str(key)


def onednn_linear(dtype: torch.dtype) -> Kernel | None:
    """oneDNN's linear on dense weights of `dtype`, or None. Why not F.linear: PyTorch's float32 CPU matmul goes to
    MKL's sgemm, which on AMD processors runs ~2x below oneDNN (150-190 vs 400+ GFLOP/s on 2 Zen 5 cores, at 64-2048
    rows); for bfloat16 both reach oneDNN. The op is the one inductor's CPU backend emits for frozen linears."""
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
    return op if op is not None and computes_linear(op, dtype) else None


def computes_linear(op: Kernel, dtype: torch.dtype) -> bool:
    """Whether `op` computes a small linear in `dtype` as F.linear does. The op exists in every build we pin, but
    oneDNN refuses bfloat16 on processors without AVX-512 ("could not create a primitive descriptor")."""
    try:
        x, w = torch.ones(2, 4, dtype=dtype), torch.ones(3, 4, dtype=dtype)
        return torch.equal(op(x, w, None, "none", [], ""), F.linear(x, w))
    except (RuntimeError, TypeError):
        return False


def build(module: Any | None, *, onednn: bool = True) -> KernelTable:
    """The table for `module` (the C++ module cpu_kernels.py built, or None for the PyTorch paths everywhere);
    onednn=False leaves oneDNN's linear out as well (a CPU where it refuses every dtype)."""
    m = module
    lanes = int(m.simd_float32_lanes()) if m is not None else 0
    isa = str(m.compiled_isa()) if m is not None else ""

    def op(name: str, fn: str, keys: list) -> Op:  # keys None: every key
        if m is None:
            return Op(name, {})
        kernel = getattr(m, fn)
        return Op(name, {}, kernel) if keys is None else Op(name, {k: kernel for k in keys})

    def same(n: int, *dtypes: torch.dtype) -> list[tuple]:  # n tensors of one dtype, for each of dtypes
        return [(d,) * n for d in dtypes]

    floats = (f32, bf16)
    model_state = [(d, s) for d in floats for s in floats]  # (model dtype, Mamba2 ssm state dtype)
    routes = {}
    for dtype in MAX_ROWS:
        few_row = m.fast_linear if m is not None and m.fast_linear_supported(dtype) else None
        panel = m is not None and any(m.packed_linear_supported(dtype, k) for k in (64, 128))
        dense = onednn_linear(dtype) if onednn else None
        routes[dtype] = LinearRoutes(
            few_row=few_row, max_rows=MAX_ROWS[dtype] if few_row else 0,
            max_rows_prepacked=(MAX_ROWS_PREPACKED_8_LANES if lanes == 8 else MAX_ROWS_PREPACKED).get(dtype, 0),
            panel=m.packed_linear if panel else None, pack=m.pack_linear_weight_ if panel else None,
            panel_takes=(lambda k, d=dtype: bool(m.packed_linear_supported(d, k))) if panel else (lambda k: False),
            onednn=dense, upcast=few_row is None and dense is None and dtype == bf16)
    prefill = {}
    if m is not None:
        prefill = {(d, d, h): m.paged_prefill_attention for d in floats for h in (64, 128)
                   if m.prefill_attention_supported(d, h)}
    return KernelTable(
        module=m, isa=isa, lanes=lanes,
        prefill_max_keys=PREFILL_KERNEL_MAX_KEYS_8_LANES if lanes == 8 else float("inf"),
        linear_routes=routes,
        write_kv=op("write_kv", "write_kv_cache", None),  # row copies: any dtype
        decode_attention=op("decode_attention", "paged_decode_attention", same(2, f32, bf16, f16, f64)),
        prefill_kernel=Op("prefill_attention", prefill),
        rms_norm=op("rms_norm", "rms_norm", same(2, *floats)),
        rms_norm_f32_weight=op("rms_norm_f32_weight", "rms_norm_f32_weight", [bf16]),
        # float32 or bfloat16 streams, and a float32 stream of a bfloat16 model (residual_in_fp32)
        add_rms_norm=op("add_rms_norm", "add_rms_norm_", [*same(3, *floats), (f32, bf16, bf16)]),
        silu_and_mul=op("silu_and_mul", "silu_and_mul", floats),
        rotary=op("rotary", "rotary_", same(2, *floats)),
        gated_rms_norm=op("gated_rms_norm", "gated_rms_norm", [(f32, f32), (f32, bf16)]),
        dt_softplus=op("dt_softplus", "dt_softplus", floats),
        conv_prefill=op("conv_prefill", "conv1d_prefill", same(2, *floats)),
        conv_update=op("conv_update", "conv1d_update_", same(3, f32, bf16, f64)),
        delta_rule_decode=op("delta_rule_decode", "delta_rule_decode_", [f32]),
        gated_delta_decode=op("gated_delta_decode", "gated_delta_decode_", floats),
        ssd_update=op("ssd_update", "ssd_state_update_", floats),
        mamba2_decode=op("mamba2_decode", "mamba2_decode_", [(d,) * 4 + (s,) for d, s in model_state]),
        ssd_scan=op("ssd_scan", "ssd_scan_fwd", None),  # its inputs are made float32 first
        selective_scan=op("selective_scan", "selective_scan_fwd", floats),
        selective_update=op("selective_update", "selective_state_update_", [(f32,) + (d,) * 5 for d in floats]),
        mamba1_decode=op("mamba1_decode", "mamba1_decode_", [(d, d, f32) for d in floats]),
        mamba2_mixer_decode=op("mamba2_mixer_decode", "mamba2_mixer_decode_", [(d, d, s) for d, s in model_state]),
        decoder_layer_decode=op("decoder_layer_decode", "decoder_layer_decode_", same(2, *floats)),
        quantize_q4_k=op("quantize_q4_k", "q4_k_quantize", [f32]))


_lock = threading.Lock()
_table: KernelTable | None = None
_elsewhere: KernelTable | None = None  # off the CPU: no C++ kernel, no oneDNN


def table(device: torch.device | None = None) -> KernelTable:
    """The table of this process (filled on the first call), or for a device other than the CPU one without any
    kernel."""
    if device is not None and device.type != "cpu":
        global _elsewhere
        if _elsewhere is None:
            _elsewhere = dataclasses.replace(build(None, onednn=False), linear_routes={})
        return _elsewhere
    current = _table
    return current if current is not None else _fill()


def _fill() -> KernelTable:
    global _table
    from stateserve.platform import cpu_kernels  # builds the module on first use (minutes)

    with _lock:
        if _table is None:
            _table = build(cpu_kernels.load())
            logger.debug("%s", _table.describe())
        return _table


def reset() -> None:
    """Forget the table: the next `table()` fills it again."""
    global _table
    with _lock:
        _table = None


@contextlib.contextmanager
def using(replacement: KernelTable) -> Iterator[KernelTable]:
    """Within the block, `table()` is `replacement` (for tests: build(None) runs the PyTorch paths everywhere)."""
    global _table
    saved = _table
    _table = replacement
    try:
        yield replacement
    finally:
        _table = saved
