"""The Q8_0 kernels (csrc/quant_linear.cpp, quant_a8.cpp, quant_exact.cpp) against float64 references built here from
the dequantized operands, with bounds derived from how the kernels accumulate; batch invariance; their errors.

A8 (quantize_activations=True): x is quantized per block of 32 by llama.cpp's rule (written below in torch), so the
reference is sum_b dx_b * dw_b * dot_b with exact integer dots; the kernel's float32 steps (dx * dw rounded, one
fused or two roundings per block, B blocks in order, the bias) err by at most ~(B + 2) eps32 (sum_b |term_b| +
|bias|), and the output rounding by eps(dtype) |y|. Weight-only: x (bfloat16 widened exactly) times the dequantized
weights (exact in float32); float32 sums of K terms err by at most gamma_K sum_k |x_k w_k|, plus the output rounding."""
from __future__ import annotations

import os

import pytest
import torch

from stateserve.platform import cpu_kernels

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None or not hasattr(kernels, "q8_0_linear"),
                                reason="C++ CPU kernels unavailable")
EPS32 = torch.finfo(torch.float32).eps
BLOCK = 32


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's quantize_row_q8_0 on float32 rows [M, K]: per block d = amax / 127, id = 1 / d (0 when d is 0),
    codes roundf(x * id) (half away from zero), d stored as float16. Returns (codes int64 [M, K], d float16
    [M, K / 32])."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    v = (blocks * inv).double()  # the float32 product, then rounded exactly in float64
    whole = v.trunc()
    codes = whole + torch.sign(v) * ((v - whole).abs() >= 0.5).double()
    return codes.long().reshape(m, k), d.squeeze(-1).half()


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    return (codes.double().reshape(n, k // BLOCK, BLOCK) * scales.double().unsqueeze(-1)).reshape(n, k)


def reference(x, codes, scales, bias, quantize_activations):
    """(y in float64, the bound on |kernel - y|) for x [M, K], W = (codes, scales)."""
    n, k = codes.shape
    m, blocks = x.shape[0], k // BLOCK
    b = torch.zeros(n, dtype=torch.float64) if bias is None else bias.double()
    if quantize_activations:
        xq, dx = quantize_rows(x.float())
        dots = torch.einsum("mbk,nbk->mnb", xq.reshape(m, blocks, BLOCK), codes.long().reshape(n, blocks, BLOCK))
        terms = dx.double()[:, None, :] * scales.double()[None, :, :] * dots.double()  # exact in float64
        y = terms.sum(-1) + b
        bound = (blocks + 2) * EPS32 * (terms.abs().sum(-1) + b.abs())
    else:
        w = dequantize(codes, scales)
        xd = x.double()
        y = xd @ w.T + b
        gamma = (k + 2) * EPS32 / (1 - (k + 2) * EPS32)
        bound = gamma * (xd.abs() @ w.abs().T + b.abs())
    return y, bound + _eps(x.dtype) * y.abs() + 1e-30


def random_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes over the whole int8 range (-128 included), with rows and blocks of extremes, all-zero blocks and zero
    scales; scales of several magnitudes."""
    g = torch.Generator().manual_seed(seed)
    blocks = k // BLOCK
    codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, blocks, generator=g) * 0.02 + 1e-4).half()
    flat = codes.view(n, blocks, BLOCK)
    flat[0, 0] = 127
    flat[-1, -1] = -128
    if n > 2:
        flat[1, :] = -127
        flat[2, 0] = 0  # an all-zero block
    scales[n // 2, 0] = 0.0  # a zero scale on nonzero codes
    scales[-1, blocks // 2] = 3.0  # a large one
    return codes, scales


def random_x(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows of mixed magnitudes, an all-zero block, and a block whose codes hit rounding ties (amax 127: d = 1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 2, m).unsqueeze(1)
    x[0, :BLOCK] = 0
    if m > 1:  # amax 127: d = 1, and x * id = x lands on every tie from -15.5 to 14.5
        x[1, :BLOCK - 1] = torch.arange(BLOCK - 1) - 15.5
        x[1, BLOCK - 1] = 127.0
    return x.to(dtype)


def test_pack_unpack_round_trip():
    for n, k in [(1, 32), (7, 96), (33, 800), (100, 64), (16, 32)]:
        codes, scales = random_weight(n, k, seed=n * k)
        scales[0, 0] = 65504.0  # the largest finite float16
        scales[-1, 0] = 6e-8  # a subnormal one
        packed = kernels.q8_0_pack(codes, scales)
        assert packed.dtype == torch.uint8 and packed.dim() == 1
        got_codes, got_scales = kernels.q8_0_unpack(packed, n, k)
        assert torch.equal(got_codes, codes) and torch.equal(got_scales, scales)
        # non-contiguous inputs are packed as their values
        wide = torch.zeros(n, 2 * k, dtype=torch.int8)
        wide[:, ::2] = codes
        assert torch.equal(kernels.q8_0_pack(wide[:, ::2], scales), packed)


@pytest.mark.parametrize("n,k", [(3072, 768), (768, 3072), (32000, 768), (4096, 4096), (32001, 64), (20, 128),
                                 (100, 800), (36, 64)])
def test_packed_size_stays_close_to_q8_0(n, k):
    """Within 1.15x of Q8_0's codes and float16 scales, rows not a multiple of the panel's 16 included."""
    packed = kernels.q8_0_pack(torch.zeros(n, k, dtype=torch.int8), torch.zeros(n, k // BLOCK, dtype=torch.half))
    assert packed.numel() <= 1.15 * (n * k + 2 * n * k // BLOCK)


@pytest.mark.parametrize("quantize_activations", [True, False], ids=["a8", "weight_only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [32, 96, 800])
@pytest.mark.parametrize("n", [1, 7, 33, 100])
def test_q8_0_linear_matches_float64(n, k, dtype, quantize_activations):
    """M = 1 .. 17 (every tile's rest), ragged N (panels of 16, groups of 3), with and without bias; each M's rows
    bitwise the first rows of the 17-row product."""
    codes, scales = random_weight(n, k, seed=n + k)
    packed = kernels.q8_0_pack(codes, scales)
    x = random_x(17, k, dtype, seed=n * k)
    bias = (torch.randn(n, generator=torch.Generator().manual_seed(k)) * 0.5).to(dtype)
    for b in (None, bias):
        ref, bound = reference(x, codes, scales, b, quantize_activations)
        full = kernels.q8_0_linear(x, packed, b, n, k, quantize_activations)
        assert full.shape == (17, n) and full.dtype == dtype
        for m in range(1, 18):
            out = kernels.q8_0_linear(x[:m], packed, b, n, k, quantize_activations)
            err = (out.double() - ref[:m]).abs()
            assert (err <= bound[:m]).all(), (m, (err / bound[:m]).max().item())
            assert torch.equal(out, full[:m])
        # a wrong weight would be seen
        wrong = kernels.q8_0_linear(x, kernels.q8_0_pack(-codes.clamp(min=-127), scales), b, n, k,
                                    quantize_activations)
        assert ((wrong.double() - ref).abs() > bound).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_are_quantized_as_llama_cpp(dtype):
    """W = identity (codes 1 on the diagonal, scales 1): y[m, n] = d_x * code_x exactly (11 by 8 bits), so the
    kernel's codes and float16 scales show through the product, ties (half away from zero) and all."""
    k = 96
    codes = torch.eye(k, dtype=torch.int8)
    packed = kernels.q8_0_pack(codes, torch.ones(k, k // BLOCK, dtype=torch.half))
    x = random_x(9, k, dtype, seed=5)
    x[2, BLOCK:2 * BLOCK] = torch.linspace(-1e-4, 1e-3, BLOCK)  # d a subnormal float16
    x[3, BLOCK:2 * BLOCK] = torch.linspace(-1e-8, 1e-8, BLOCK)  # d 0 in float16, the codes not
    xq, dx = quantize_rows(x.float())
    assert xq[1, :BLOCK].tolist() == [*range(-16, 0), *range(1, 16), 127]  # ties away from zero
    assert 0 < dx[2, 1] < torch.finfo(torch.half).tiny and dx[3, 1] == 0 and xq[3, BLOCK:2 * BLOCK].abs().max() == 127
    expected = (xq.double() * dx.double().repeat_interleave(BLOCK, dim=1)).to(dtype)
    assert torch.equal(kernels.q8_0_linear(x, packed, None, k, k, True), expected)


@pytest.mark.parametrize("quantize_activations", [True, False], ids=["a8", "weight_only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_batch_invariant(dtype, quantize_activations):
    """A row's outputs are bit-identical alone, in any batch and in any order: row tiles and their rests, rows split
    across threads (few panels), passes of 256 rows (300 rows)."""
    n, k = 40, 96
    codes, scales = random_weight(n, k, seed=3)
    packed = kernels.q8_0_pack(codes, scales)
    x = random_x(300, k, dtype, seed=4)
    bias = torch.randn(n).to(dtype)
    full = kernels.q8_0_linear(x, packed, bias, n, k, quantize_activations)
    for i in (0, 1, 5, 17, 255, 256, 299):
        assert torch.equal(kernels.q8_0_linear(x[i:i + 1], packed, bias, n, k, quantize_activations), full[i:i + 1])
    perm = torch.randperm(300, generator=torch.Generator().manual_seed(0))[:37]
    assert torch.equal(kernels.q8_0_linear(x[perm], packed, bias, n, k, quantize_activations), full[perm])
    # rows with a stride (a view of a wider tensor) as the same rows
    wide = torch.zeros(300, k + 64, dtype=dtype)
    wide[:, :k] = x
    assert torch.equal(kernels.q8_0_linear(wide[:, :k], packed, bias, n, k, quantize_activations), full)


def test_errors_are_clear():
    codes, scales = random_weight(8, 64, seed=1)
    packed = kernels.q8_0_pack(codes, scales)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="not a positive multiple of 32"):
        kernels.q8_0_pack(torch.zeros(8, 40, dtype=torch.int8), torch.zeros(8, 1, dtype=torch.half))
    with pytest.raises(RuntimeError, match="scales must be float16"):
        kernels.q8_0_pack(codes, scales.float())
    with pytest.raises(RuntimeError, match="codes must be int8"):
        kernels.q8_0_pack(codes.to(torch.uint8), scales)
    with pytest.raises(RuntimeError, match="not a multiple of 32"):
        kernels.q8_0_linear(torch.randn(2, 40), packed, None, 8, 40, True)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.q8_0_linear(x.half(), packed, None, 8, 64, True)
    with pytest.raises(RuntimeError, match="x has 96 columns"):
        kernels.q8_0_linear(torch.randn(2, 96), packed, None, 8, 64, False)
    with pytest.raises(RuntimeError, match=r"holds a \[8, 64\] weight, not the \[9, 64\]"):
        kernels.q8_0_linear(x, packed, None, 9, 64, True)
    with pytest.raises(RuntimeError, match="not a packed Q8_0 weight"):
        kernels.q8_0_linear(x, torch.zeros_like(packed), None, 8, 64, True)
    with pytest.raises(RuntimeError, match="the uint8 tensor q8_0_pack returned"):
        kernels.q8_0_linear(x, packed.float(), None, 8, 64, True)
    with pytest.raises(RuntimeError, match="has .* bytes"):
        kernels.q8_0_unpack(torch.cat([packed[:-64], packed[-32:]]), 8, 64)  # the trailer, the size wrong
    with pytest.raises(RuntimeError, match="bias must be"):
        kernels.q8_0_linear(x, packed, torch.zeros(8, dtype=torch.bfloat16), 8, 64, True)
    with pytest.raises(RuntimeError, match="bias must be"):
        kernels.q8_0_linear(x, packed, torch.zeros(7), 8, 64, True)
    assert kernels.q8_0_linear(torch.zeros(0, 64), packed, None, 8, 64, True).shape == (0, 8)


def test_the_build_takes_the_integer_product_of_its_instruction_sets():
    """STATESERVE_CPU_ISA=avx512 stands for Skylake-SP: AVX-512 without VNNI, so its vpmaddubsw path is tested."""
    assert kernels.q8_0_supported()
    isa = os.environ.get("STATESERVE_CPU_ISA", "native")
    flags = set(cpu_kernels.cpu_features().split())
    expected = {"avx512": "avx512bw", "avx2": "avx2", "scalar": "scalar"}.get(isa)
    if expected is None and kernels.compiled_isa().startswith("avx512"):
        expected = "avx512_vnni" if "avx512_vnni" in flags else "avx512bw"
    assert expected is None or kernels.q8_0_dot_path() == expected
