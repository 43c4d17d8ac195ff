"""GGUF tensor types decoded in PyTorch (quantization/ggml_types.py) against gguf.quants.dequantize and llama.cpp's own
C code, bit for bit; the load-time 4-bit quantizers (quantization/q4.py) against gguf's Q4_0 and ggml's
quantize_row_q4_0_ref / quantize_row_q4_K_ref compiled from the pinned llama-cpp-python sdist."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

import ggml_reference
from stateserve.quantization import ggml_types, q4

# gguf's numpy code warns where the extreme inputs give inf or NaN scales, as intended here
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")
SHAPE = (8, 512)
# byte offsets of each block's float16 scales: random bytes there could be NaN or inf
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
              "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}
PY_QUANTIZED = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0")  # types gguf.quants can write


def _bits(t: torch.Tensor) -> torch.Tensor:
    """float32 values as their bits, every NaN as one: equality that tells -0.0 from 0.0 and NaN from inf (a NaN's
    sign and payload are the hardware's, not the format's)."""
    return torch.where(t.isnan(), torch.full_like(t, float("nan")), t).contiguous().view(torch.int32)


def _assert_bits_equal(ours: torch.Tensor, ref, what: str) -> None:
    ref = torch.as_tensor(np.ascontiguousarray(ref, dtype=np.float32))
    assert ours.dtype == torch.float32 and ours.shape == ref.shape, (what, ours.dtype, ours.shape, ref.shape)
    diff = (_bits(ours) != _bits(ref)).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.shape[0]} values differ, first at {diff[0].tolist()}: " \
                              f"{ours[tuple(diff[0])].item()!r} vs {ref[tuple(diff[0])].item()!r}"


def _values(rng: np.random.Generator, shape=SHAPE) -> np.ndarray:
    """Random rows with blocks of zeros, -0.0, ties of magnitude, tiny, huge and integer values."""
    x = (rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 3, (shape[0], 1))).astype(np.float32)
    x[0, :32] = 0
    x[0, 32:64] = -0.0
    x[0, 64:96] = np.tile(np.float32([3, -3]), 16)  # +max first
    x[0, 96:128] = np.tile(np.float32([-3, 3]), 16)  # -max first
    x[1, :32] = rng.integers(-8, 8, 32)  # codes land on integers: exact halves after + 8.5
    x[1, 32:64] = 1e-30
    x[1, 64:96] = rng.standard_normal(32) * 3e4
    x[1, 96:128] = 7.25
    x[2, :256] = -rng.uniform(0, 1, 256)
    return x


def _random_blocks(rng: np.random.Generator, name: str, shape=SHAPE) -> np.ndarray:
    """Random bytes for every code and scale field, with finite float16 scales: normal, subnormal, zero, negative."""
    block, size = GGML_QUANT_SIZES[T[name]]
    raw = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
    for at in F16_FIELDS[name]:
        d = (rng.standard_normal(raw.shape[:2]) * 10.0 ** rng.uniform(-7, 2, raw.shape[:2])).astype(np.float16)
        d[0, 0] = 0
        raw[..., at:at + 2] = d[..., None].view(np.uint8)
    return raw.reshape(shape[0], -1)


def _raw_cases(name: str):
    rng = np.random.default_rng(sum(map(ord, name)))
    if name in PY_QUANTIZED:
        yield "quantized", gguf.quants.quantize(_values(rng), T[name])
    if name in F16_FIELDS:
        yield "random", _random_blocks(rng, name)


@pytest.fixture(scope="module")
def clib():
    try:
        return ggml_reference.library()
    except ggml_reference.Unavailable as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("name", ggml_types.TAKEN)
def test_dequantize_matches_gguf_bit_for_bit(name):
    for case, raw in _raw_cases(name):
        ours = ggml_types.dequantize(raw, T[name], SHAPE)
        _assert_bits_equal(ours, gguf.quants.dequantize(raw, T[name]).reshape(SHAPE), f"{name} {case}")
        # a torch byte tensor, and the tensor as numpy holds it (typed view) read the same
        assert torch.equal(_bits(ggml_types.dequantize(torch.from_numpy(np.ascontiguousarray(raw)).view(torch.uint8),
                                                       name, SHAPE)), _bits(ours))


@pytest.mark.parametrize("name", list(F16_FIELDS))
def test_dequantize_matches_llama_cpp_c(name, clib):
    raw = _random_blocks(np.random.default_rng(7), name)
    _assert_bits_equal(ggml_types.dequantize(raw, name, SHAPE), ggml_reference.dequantize(clib, raw, name, SHAPE),
                       f"{name} against ggml's dequantize_row")


def _per(t: torch.Tensor, n: int) -> torch.Tensor:
    return t.to(torch.float32).repeat_interleave(n, dim=1)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q4_K", "Q6_K", *ggml_types.INT8_TYPES])
def test_fields_rebuild_the_values(name):
    """Each fields function's documented formula, in float32, gives gguf's values bit for bit."""
    n, k = SHAPE
    for case, raw in _raw_cases(name):
        ref = gguf.quants.dequantize(raw, T[name]).reshape(SHAPE)
        if name == "Q4_0":
            codes, d = ggml_types.q4_0_fields(raw, SHAPE)
            assert d.dtype == torch.float16 and d.shape == (n, k // 32)
            values = _per(d, 32) * (codes.to(torch.float32) - 8)
        elif name == "Q4_1":
            codes, d, m = ggml_types.q4_1_fields(raw, SHAPE)
            assert d.dtype == m.dtype == torch.float16 and m.shape == (n, k // 32)
            values = _per(d, 32) * codes.to(torch.float32) + _per(m, 32)
        elif name == "Q4_K":
            codes, d, dmin, sc, mn = ggml_types.q4_k_fields(raw, SHAPE)
            assert d.dtype == dmin.dtype == torch.float16 and d.shape == dmin.shape == (n, k // 256)
            assert sc.dtype == mn.dtype == torch.uint8 and sc.shape == mn.shape == (n, k // 32)
            assert int(sc.max()) <= 63 and int(mn.max()) <= 63
            values = _per(_per(d, 8) * sc.to(torch.float32), 32) * codes.to(torch.float32) \
                - _per(_per(dmin, 8) * mn.to(torch.float32), 32)
        elif name == "Q6_K":
            codes, sc, d = ggml_types.q6_k_fields(raw, SHAPE)
            assert codes.dtype == torch.uint8 and codes.shape == SHAPE and int(codes.max()) <= 63
            assert sc.dtype == torch.int8 and sc.shape == (n, k // 16)
            assert d.dtype == torch.float16 and d.shape == (n, k // 256)
            values = _per(_per(d, 16) * sc.to(torch.float32), 16) * (codes.to(torch.float32) - 32)
        else:
            codes, scales = ggml_types.int8_fields(raw, T[name], SHAPE)
            assert codes.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (n, k // 32)
            values = codes.to(torch.float32) * _per(scales, 32)
        if name in ("Q4_0", "Q4_1", "Q4_K"):
            assert codes.dtype == torch.uint8 and codes.shape == SHAPE and int(codes.max()) <= 15
        _assert_bits_equal(values, ref, f"{name} {case} fields")


def test_q6_k_fields_as_a_weight_dequantize_as_gguf():
    """A GGUF file's Q6_K bytes kept as a q6_k weight (what GGUFTensor.to_quantized makes of them): the weight's own
    dequantize, QuantLinear's fallback and the kernels' reference, gives gguf.quants' values bit for bit; every code
    0..63 and every scale -128..127 occur."""
    from stateserve.quantization import formats

    shape = (64, 1024)
    raw = _random_blocks(np.random.default_rng(23), "Q6_K", shape)
    fields = ggml_types.q6_k_fields(raw, shape)
    weight = formats.QuantizedWeight("q6_k", dict(zip(formats.FIELDS["q6_k"], fields)))
    codes, sc, _ = fields
    assert set(codes.unique().tolist()) == set(range(64)) and set(sc.unique().tolist()) == set(range(-128, 128))
    assert weight.shape == shape and weight.nbytes == shape[0] * shape[1] // 256 * (256 + 16 + 2)
    _assert_bits_equal(weight.dequantize(), gguf.quants.dequantize(raw, T.Q6_K).reshape(shape), "q6_k weight")
    half = weight.map_rows(lambda t: t[::2])  # rows first: a row operation applies to every field alike
    _assert_bits_equal(half.dequantize(), gguf.quants.dequantize(raw, T.Q6_K).reshape(shape)[::2], "q6_k rows")
    assert formats.BITS["q6_k"] == 210 * 8 / 256 and formats.fits("q6_k", 768) and not formats.fits("q6_k", 800)
    with pytest.raises(ValueError, match="no load-time quantizer for 'q6_k'"):
        formats.quantize(torch.zeros(4, 256), "q6_k")


def test_int8_fields_code_ranges():
    rng = np.random.default_rng(3)
    expect = {"Q8_0": (-128, 127), "Q5_0": (-16, 15), "IQ4_NL": (-127, 113), "IQ4_XS": (-127, 113)}
    for name, (lo, hi) in expect.items():
        codes, _ = ggml_types.int8_fields(_random_blocks(rng, name, (64, 512)), name, (64, 512))
        assert (int(codes.min()), int(codes.max())) == (lo, hi), name
        if name.startswith("IQ4"):
            assert set(codes.unique().tolist()) == set(ggml_types.IQ4_KVALUES)
    with pytest.raises(ValueError, match="Q4_K"):
        ggml_types.int8_fields(_random_blocks(rng, "Q4_K"), "Q4_K", SHAPE)


def test_check_type_names_tensor_type_and_accepted_list():
    for name in ggml_types.TAKEN:
        ggml_types.check_type(T[name], "blk.0.ffn_up.weight")
    for bad in (T.Q2_K, T.IQ2_XXS, "Q5_1"):
        with pytest.raises(ValueError) as e:
            ggml_types.check_type(bad, "blk.3.attn_q.weight")
        msg = str(e.value)
        assert "blk.3.attn_q.weight" in msg and ggml_types.type_name(bad) in msg, msg
        assert all(name in msg for name in ggml_types.TAKEN), msg
    with pytest.raises(ValueError, match="bytes"):
        ggml_types.dequantize(np.zeros(17, np.uint8), T.Q4_0, (1, 32))


def test_quantize_q4_0_matches_gguf():
    x = _values(np.random.default_rng(11))
    x[0, 32:64] = 0  # gguf takes a leading -0.0 as the max where ggml keeps +0.0 (see the C test)
    codes, d = q4.quantize_q4_0(torch.from_numpy(x))
    assert codes.dtype == torch.uint8 and d.dtype == torch.float16 and d.shape == (SHAPE[0], SHAPE[1] // 32)
    assert np.array_equal(q4.pack_q4_0(codes, d).numpy(), gguf.quants.quantize(x, T.Q4_0))
    # bfloat16 weights are taken as their float32 values
    xb = torch.from_numpy(x).bfloat16()
    assert np.array_equal(q4.pack_q4_0(*q4.quantize_q4_0(xb)).numpy(), gguf.quants.quantize(xb.float().numpy(), T.Q4_0))
    raw = q4.pack_q4_0(codes, d).numpy()
    _assert_bits_equal(q4.dequantize_q4_0(codes, d), gguf.quants.dequantize(raw, T.Q4_0).reshape(SHAPE), "Q4_0")


def _q4_k_inputs(rng: np.random.Generator) -> np.ndarray:
    """Rows of 1024 covering make_qkx2_quants' paths: positive-only and negative-only sub-blocks, constant and zero
    sub-blocks, integer grids (exact halves), outliers, scales whose float16 d underflows (codes kept from the
    search) or overflows (inf and NaN scales), mixed magnitudes within a super-block."""
    x = (rng.standard_normal((16, 1024)) * 10.0 ** rng.integers(-3, 3, (16, 1))).astype(np.float32)
    x[0] = rng.uniform(0, 1, 1024)
    x[1] = -rng.uniform(0, 1, 1024)
    x[2] = rng.integers(-8, 8, 1024)
    x[3] = rng.integers(0, 16, 1024)
    x[4, :32], x[4, 32:64], x[4, 64:96], x[4, 96:128] = 0, -0.0, 2.5, -1.5
    x[5] *= rng.random(1024) < 0.05
    x[6, ::97] *= 1000
    x[7] *= 1e-9
    x[8] *= 1e8
    x[9] *= 10.0 ** rng.integers(-12, 12, 1024)
    x[10, :256] = np.float32(1.0) + np.arange(256, dtype=np.float32) * np.float32(2 ** -20)
    x[11] = torch.from_numpy(x[11]).bfloat16().float().numpy()
    return x


@pytest.fixture(params=["kernel", "pytorch"])
def q4_k_path(request):
    """quantize_q4_k through each of its paths: the C++ kernel (csrc/quant_q4k_quantize.cpp; skipped where the
    kernels did not build, which tests/test_kernel_build.py catches) and the PyTorch fallback (a table without
    kernels). Both must be llama.cpp's bytes: neither may drift from the C on its own."""
    from stateserve.platform import cpu_kernels, kernels

    if request.param == "pytorch":
        with kernels.using(kernels.build(None)):
            assert kernels.table().quantize_q4_k(torch.float32) is None
            yield request.param
        return
    module = cpu_kernels.load()
    if module is None:
        pytest.skip("C++ CPU kernels unavailable")
    assert kernels.table().quantize_q4_k(torch.float32) is module.q4_k_quantize
    yield request.param


def test_quantize_q4_k_takes_the_kernel_of_the_table():
    """quantize_q4_k calls the table's kernel with the float32 rows and returns its fields as they are; a table
    without one runs the PyTorch code."""
    import dataclasses

    from stateserve.platform import kernels

    calls = []

    def spy(x):
        calls.append(x)
        return [torch.zeros(1)] * 5

    w = torch.randn(2, 512, dtype=torch.bfloat16)
    table = kernels.build(None)
    with kernels.using(dataclasses.replace(table, quantize_q4_k=kernels.Op("q", {torch.float32: spy}))):
        out = q4.quantize_q4_k(w)
    assert len(calls) == 1 and calls[0].dtype == torch.float32 and torch.equal(calls[0], w.float())
    assert isinstance(out, tuple) and len(out) == 5
    with kernels.using(table):
        assert q4.quantize_q4_k(w)[0].shape == (2, 512) and len(calls) == 1


def test_quantize_q4_k_matches_llama_cpp(clib, q4_k_path):
    x = _q4_k_inputs(np.random.default_rng(13))
    fields = q4.quantize_q4_k(torch.from_numpy(x))
    codes, d, dmin, sc, mn = fields
    n, k = x.shape
    assert codes.shape == x.shape and codes.dtype == sc.dtype == mn.dtype == torch.uint8
    assert d.shape == dmin.shape == (n, k // 256) and d.dtype == dmin.dtype == torch.float16
    assert sc.shape == mn.shape == (n, k // 32)
    ours, ref = q4.pack_q4_k(*fields).numpy(), ggml_reference.quantize(clib, x, "Q4_K")
    bad = np.nonzero((ours != ref).reshape(n, -1, 144).any(-1))
    assert not bad[0].size, f"{bad[0].size} of {n * k // 256} super-blocks differ, first (row, block) " \
                            f"{bad[0][0], bad[1][0]}"
    # the fields read back from ggml's bytes are ours, and our values are gguf's
    for mine, theirs in zip(fields, ggml_types.q4_k_fields(ref, x.shape)):
        assert torch.equal(mine, theirs)
    _assert_bits_equal(q4.dequantize_q4_k(*fields), gguf.quants.dequantize(ref, T.Q4_K), "Q4_K values")
    # float16 and bfloat16 weights are quantized as their float32 values
    for dtype in (torch.float16, torch.bfloat16):
        w = torch.from_numpy(x[:4] * np.float32(1e-3)).to(dtype)
        assert np.array_equal(q4.pack_q4_k(*q4.quantize_q4_k(w)).numpy(),
                              ggml_reference.quantize(clib, w.float().numpy(), "Q4_K")), dtype


def test_quantize_q4_k_random_rows_match_llama_cpp(clib, q4_k_path):
    rng = np.random.default_rng(17)
    x = (rng.standard_normal((64, 2048)) * rng.uniform(0.001, 1, (64, 1))).astype(np.float32)
    x += (rng.random(x.shape) < 0.01) * rng.standard_normal(x.shape).astype(np.float32) * 20
    assert np.array_equal(q4.pack_q4_k(*q4.quantize_q4_k(torch.from_numpy(x))).numpy(),
                          ggml_reference.quantize(clib, x, "Q4_K"))


def _q4_k_extreme_inputs(rng: np.random.Generator) -> np.ndarray:
    """Rows of 768 (3 super-blocks: an odd count per row and in all, so the kernel's last group of lanes is part
    empty) at the edges of float32: magnitudes up to the largest float (sums overflow to inf, inf - inf = NaN),
    spread over 80 decades within a sub-block, subnormals, inf and NaN (also as a sub-block's first value, which C's
    min/max keep), all-zero, -0.0 and constant sub-blocks, positive-only and negative-only sub-blocks, one outlier in
    a sub-block of tiny values, and the integer grids whose codes land on exact halves."""
    k = 768
    n = rng.standard_normal
    x = (n((21, k)) * 10.0 ** rng.integers(-4, 4, (21, 1))).astype(np.float32)
    with np.errstate(over="ignore"):
        x[0] = (n(k) * 10.0 ** rng.uniform(30, 38.5, k)).astype(np.float32)  # some overflow to inf here
    x[1] = (n(k) * 10.0 ** rng.uniform(-45, 38, k)).astype(np.float32)
    x[2] = (n(k) * 1e-40).astype(np.float32)  # subnormal
    x[3, ::37], x[3, 5::41] = np.inf, -np.inf
    x[4, ::53] = np.nan
    x[5] = np.float32(3.4e38) * np.sign(n(k)).astype(np.float32)
    sub = x[6:12].reshape(6, k // 32, 32)  # sub-block by sub-block
    sub[0, 0::4], sub[0, 1::4], sub[0, 2::4] = 0, -0.0, 7.25  # zero, -0.0 and constant sub-blocks beside others
    sub[0, 3::8] = -2.5  # a negative constant: max == min, C's early return
    sub[1] = rng.uniform(0.5, 2, sub[1].shape)  # positive only: C's min is clamped to 0
    sub[2] = -rng.uniform(0.5, 2, sub[2].shape)  # negative only
    sub[3] = n(sub[3].shape) * 10.0 ** rng.integers(-20, 20, (k // 32, 1))  # ragged: each sub-block its own scale
    sub[4] = n(sub[4].shape) * 1e-6
    sub[4, np.arange(k // 32), rng.integers(0, 32, k // 32)] = 1e3  # one outlier in each
    sub[5] = rng.integers(-8, 8, sub[5].shape) * 0.5
    x[12] = np.float32(2 ** -149) * rng.integers(-3, 4, k)  # the smallest subnormals: 63 / max_min overflows
    x[13] = np.where(rng.random(k) < 0.5, 65504.0 * 63, 1e-3).astype(np.float32)  # float16 d at its largest
    x[14] = n(k) * 1e-9
    return x


def test_quantize_q4_k_extremes_match_llama_cpp(clib, q4_k_path):
    x = _q4_k_extreme_inputs(np.random.default_rng(29))
    fields = q4.quantize_q4_k(torch.from_numpy(x))
    ours, ref = q4.pack_q4_k(*fields).numpy(), ggml_reference.quantize(clib, x, "Q4_K")
    bad = np.nonzero((ours != ref).reshape(x.shape[0], -1, 144).any(-1))
    assert not bad[0].size, f"{bad[0].size} super-blocks differ, first (row, block) {bad[0][0], bad[1][0]}"
    t = torch.from_numpy(x)
    for w in (t[:1, :256], t[:2, :512], t[3:9, 256:]):  # one super-block, two, a non-contiguous slice
        assert np.array_equal(q4.pack_q4_k(*q4.quantize_q4_k(w)).numpy(),
                              ggml_reference.quantize(clib, np.ascontiguousarray(w.numpy()), "Q4_K")), tuple(w.shape)


def test_quantize_q4_k_kernel_and_fallback_agree_on_a_large_weight():
    """A weight of many groups of lanes and parallel chunks (and one in bfloat16, taken as float32): the kernel's
    fields are the fallback's, field by field (each path is also checked against the C above)."""
    from stateserve.platform import cpu_kernels, kernels

    if cpu_kernels.load() is None:
        pytest.skip("C++ CPU kernels unavailable")
    rng = np.random.default_rng(31)
    x = torch.from_numpy((rng.standard_normal((96, 2304)) * rng.uniform(1e-4, 3, (96, 1))).astype(np.float32))
    for w in (x, x.to(torch.bfloat16)):
        mine = q4.quantize_q4_k(w)
        with kernels.using(kernels.build(None)):
            theirs = q4.quantize_q4_k(w)
        for name, a, b in zip(("codes", "d", "dmin", "sc", "mn"), mine, theirs):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name


def test_quantize_q4_0_matches_llama_cpp(clib):
    x = _values(np.random.default_rng(19))  # with the all -0.0 block
    assert np.array_equal(q4.pack_q4_0(*q4.quantize_q4_0(torch.from_numpy(x))).numpy(),
                          ggml_reference.quantize(clib, x, "Q4_0"))


def test_quantizers_reject_bad_shapes():
    with pytest.raises(ValueError, match="256"):
        q4.quantize_q4_k(torch.zeros(2, 288))
    with pytest.raises(ValueError, match="32"):
        q4.quantize_q4_0(torch.zeros(2, 48))
