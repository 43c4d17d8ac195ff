"""The Q4_0 / Q4_1 / Q4_K kernels (csrc/quant_q4_linear.cpp, quant_q4_a8.cpp, quant_q4_exact.cpp) against float64
references built here from the weights' fields, with bounds derived from how the kernels accumulate; the packed
size; batch invariance; their errors.

Every format is w = a * q + c per block of 32 (codes q in 0..15): Q4_0 a = d, c = -8d; Q4_1 a = d, c = m; Q4_K
a = d * sc, c = -dmin * mn (d and dmin per super-block of 256), a and c exact in float32.
A8 (quantize_activations=True): x quantized per block of 32 by llama.cpp's rule (test_quant_kernels.quantize_rows),
codes xq with block sums s and scales dx, dot = sum q * xq exact. The kernel's float32 steps per block, in order:
  Q4_0: acc = fma(fl(dx * d), dot - 8s, acc)                      B terms dx d (dot - 8s)
  Q4_1, Q4_K: acc = fma(fl(dx * a), dot, acc); acc = fma(c, fl(dx * s), acc)      2B terms dx a dot, dx c s
then + bias: n terms each rounded twice (the product, the fused add) and the bias added: within
(n + 2) eps32 (sum |term| + |bias|) of the exact sum, and the output's rounding eps(dtype) |y|.
Weight-only: x (bfloat16 widened exactly) times gguf's float32 weights fl(a * q + c), four float32 chains of K / 4
terms: within gamma_K sum |x w|, plus the output's rounding."""
from __future__ import annotations

import pytest
import torch

from stateserve.platform import cpu_kernels
from test_quant_kernels import quantize_rows, random_x

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None or not hasattr(kernels, "q4_linear"),
                                reason="C++ CPU kernels unavailable")
EPS32 = torch.finfo(torch.float32).eps
BLOCK, SUPER = 32, 256
FORMATS = ("q4_0", "q4_1", "q4_k")


def random_q4(fmt: str, n: int, k: int, seed: int) -> dict[str, torch.Tensor]:
    """q4_pack's fields: random codes with blocks of extremes (all 0, all 15, Q4_0's zero code 8), zero scales on
    nonzero codes, a large one; Q4_K's sc and mn over 0..63 with both ends."""
    g = torch.Generator().manual_seed(seed)
    blocks = k // BLOCK
    scales = k // SUPER if fmt == "q4_k" else blocks
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    flat = codes.view(n, blocks, BLOCK)
    flat[0, 0] = 15
    flat[-1, -1] = 0
    if n > 2:
        flat[1, :] = 15
        flat[2, 0] = 8
    d = (torch.rand(n, scales, generator=g) * 0.02 + 1e-4).half()
    d[n // 2, 0] = 0.0  # a zero scale on nonzero codes
    d[-1, scales // 2] = 3.0  # a large one
    fields = {"codes": codes, "d": d}
    if fmt == "q4_1":
        fields["m"] = (torch.randn(n, scales, generator=g) * 0.05).half()
    if fmt == "q4_k":
        fields["m"] = (torch.rand(n, scales, generator=g) * 0.02).half()
        fields["m"][0, 0] = 0.0
        sc, mn = torch.randint(0, 64, (2, n, blocks), generator=g, dtype=torch.uint8)
        sc[0, 0], mn[0, 0], sc[-1, -1], mn[-1, -1] = 63, 0, 0, 63
        fields["sc"], fields["mn"] = sc, mn
    return fields


def pack(fmt: str, f: dict[str, torch.Tensor]) -> torch.Tensor:
    return kernels.q4_pack(fmt, f["codes"], f["d"], f.get("m"), f.get("sc"), f.get("mn"))


def block_params(fmt: str, f: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, c) per block [N, B] as float32 (exact): w = a * q + c."""
    d = f["d"].float()
    if fmt == "q4_0":
        return d, -8 * d
    if fmt == "q4_1":
        return d, f["m"].float()
    per = SUPER // BLOCK
    return d.repeat_interleave(per, 1) * f["sc"].float(), -(f["m"].float().repeat_interleave(per, 1) * f["mn"].float())


def dequantize(fmt: str, f: dict[str, torch.Tensor]) -> torch.Tensor:
    """W [N, K] in float32 as gguf.quants computes it: a * q exact, one rounding in the addition."""
    n, k = f["codes"].shape
    a, c = block_params(fmt, f)
    q = f["codes"].float().reshape(n, k // BLOCK, BLOCK)
    return (a.unsqueeze(-1) * q + c.unsqueeze(-1)).reshape(n, k)


def reference(fmt, x, f, bias, quantize_activations):
    """(y in float64, the bound on |kernel - y|) for x [M, K] and the weight's fields."""
    codes = f["codes"]
    n, k = codes.shape
    m, blocks = x.shape[0], k // BLOCK
    b = torch.zeros(n, dtype=torch.float64) if bias is None else bias.double()
    if quantize_activations:
        xq, dx = quantize_rows(x.float())
        xq = xq.reshape(m, blocks, BLOCK)
        dots = torch.einsum("mbk,nbk->mnb", xq, codes.long().reshape(n, blocks, BLOCK)).double()
        sums = xq.sum(-1).double()[:, None, :]
        a, c = (t.double()[None] for t in block_params(fmt, f))
        dxd = dx.double()[:, None, :]
        if fmt == "q4_0":
            terms = [dxd * a * (dots - 8 * sums)]
        else:
            terms = [dxd * a * dots, dxd * c * sums]
        y = sum(t.sum(-1) for t in terms) + b
        bound = (len(terms) * blocks + 2) * EPS32 * (sum(t.abs().sum(-1) for t in terms) + b.abs())
    else:
        w = dequantize(fmt, f).double()
        xd = x.double()
        y = xd @ w.T + b
        gamma = (k + 2) * EPS32 / (1 - (k + 2) * EPS32)
        bound = gamma * (xd.abs() @ w.abs().T + b.abs())
    return y, bound + torch.finfo(x.dtype).eps * y.abs() + 1e-30


def gguf_bytes(fmt: str, n: int, k: int) -> int:
    return n * k // BLOCK * {"q4_0": 18, "q4_1": 20, "q4_k": 18}[fmt]


@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_unpack_round_trip(fmt):
    for n, k in [(1, 256), (7, 512), (33, 768), (100, 256), (16, 256)]:
        f = random_q4(fmt, n, k, seed=n * k)
        f["d"][0, 0] = 65504.0  # the largest finite float16
        f["d"][-1, 0] = 6e-8  # a subnormal one
        packed = pack(fmt, f)
        assert packed.dtype == torch.uint8 and packed.dim() == 1
        got_fmt, codes, d, m, sc, mn = kernels.q4_unpack(packed, n, k)
        assert got_fmt == fmt and torch.equal(codes, f["codes"]) and torch.equal(d, f["d"])
        for name, got in (("m", m), ("sc", sc), ("mn", mn)):
            assert (got is None) == (name not in f) and (got is None or torch.equal(got, f[name]))
        # non-contiguous inputs are packed as their values
        wide = torch.zeros(n, 2 * k, dtype=torch.uint8)
        wide[:, ::2] = f["codes"]
        assert torch.equal(pack(fmt, {**f, "codes": wide[:, ::2]}), packed)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(4096, 4096), (11008, 4096), (4096, 11008), (32000, 4096), (32001, 768), (64, 256),
                                 (100, 512), (20, 256)])
def test_packed_size_stays_close_to_gguf(fmt, n, k):
    """Within 1.03x of GGUF's bytes (Q4_0, Q4_1 exactly, Q4_K 296 / 288), rows not a multiple of 16 included."""
    f = random_q4(fmt, n, k, seed=0)
    assert pack(fmt, f).numel() <= 1.03 * gguf_bytes(fmt, n, k) + 32


SHAPES = [("q4_0", 32), ("q4_0", 96), ("q4_0", 512), ("q4_1", 64), ("q4_1", 256), ("q4_k", 256), ("q4_k", 512)]


@pytest.mark.parametrize("quantize_activations", [True, False], ids=["a8", "weight_only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt,k", SHAPES)
@pytest.mark.parametrize("n", [1, 15, 16, 17, 40, 100])
def test_q4_linear_matches_float64(n, fmt, k, dtype, quantize_activations):
    """M = 1 .. 17 (every tile's rest), ragged N (panels of 16, groups of 3), with and without bias; each M's rows
    bitwise the first rows of the 17-row product."""
    f = random_q4(fmt, n, k, seed=n + k)
    packed = pack(fmt, f)
    x = random_x(17, k, dtype, seed=n * k)
    bias = (torch.randn(n, generator=torch.Generator().manual_seed(k)) * 0.5).to(dtype)
    for b in (None, bias):
        ref, bound = reference(fmt, x, f, b, quantize_activations)
        full = kernels.q4_linear(x, packed, b, n, k, quantize_activations)
        assert full.shape == (17, n) and full.dtype == dtype
        for m in range(1, 18):
            out = kernels.q4_linear(x[:m], packed, b, n, k, quantize_activations)
            err = (out.double() - ref[:m]).abs()
            assert (err <= bound[:m]).all(), (m, (err / bound[:m]).max().item())
            assert torch.equal(out, full[:m])
        # a wrong weight would be seen: the codes mirrored
        wrong = kernels.q4_linear(x, pack(fmt, {**f, "codes": 15 - f["codes"]}), b, n, k, quantize_activations)
        assert ((wrong.double() - ref).abs() > bound).any()


def identity(fmt: str, k: int) -> dict[str, torch.Tensor]:
    """W = I exactly: one code per row on the diagonal, a = 1 and c = 0 (Q4_0: code 9 there, 8 elsewhere)."""
    eye = torch.eye(k, dtype=torch.uint8)
    ones = torch.ones(k, k // (SUPER if fmt == "q4_k" else BLOCK), dtype=torch.half)
    if fmt == "q4_0":
        return {"codes": eye + 8, "d": ones}
    if fmt == "q4_1":
        return {"codes": eye, "d": ones, "m": torch.zeros_like(ones)}
    mn = torch.randint(0, 64, (k, k // BLOCK), dtype=torch.uint8)  # dmin 0: any mn gives c = 0
    return {"codes": eye, "d": ones, "m": torch.zeros_like(ones), "sc": torch.ones_like(mn), "mn": mn}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_code_reaches_its_column(fmt, dtype):
    """W = identity: y[m, n] = x's value at n exactly (weight-only) or d_x * code_x (A8: 11 by 8 bits), so a code in
    the wrong nibble or lane, or a wrong activation code, shows."""
    k = 512
    packed = pack(fmt, identity(fmt, k))
    x = random_x(9, k, dtype, seed=5)
    assert torch.equal(kernels.q4_linear(x, packed, None, k, k, False), x)
    xq, dx = quantize_rows(x.float())
    expected = (xq.double() * dx.double().repeat_interleave(BLOCK, dim=1)).to(dtype)
    assert torch.equal(kernels.q4_linear(x, packed, None, k, k, True), expected)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only_dequantizes_as_gguf(fmt, dtype):
    """x = I: each output is one weight times 1 plus zeros, so the weight-only product is W^T with every value as
    gguf.quants dequantizes it in float32, bit for bit (each block's own parameters, each code's own nibble)."""
    n, k = 40, 512
    f = random_q4(fmt, n, k, seed=11)
    x = torch.eye(k, dtype=dtype)
    assert torch.equal(kernels.q4_linear(x, pack(fmt, f), None, n, k, False), dequantize(fmt, f).T.to(dtype))


@pytest.mark.parametrize("quantize_activations", [True, False], ids=["a8", "weight_only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_are_batch_invariant(fmt, dtype, quantize_activations):
    """A row's outputs are bit-identical alone, in any batch and in any order: row tiles and their rests, rows split
    across threads (few panels), passes of 256 rows (300 rows)."""
    n, k = 40, 256
    packed = pack(fmt, random_q4(fmt, n, k, seed=3))
    x = random_x(300, k, dtype, seed=4)
    bias = torch.randn(n).to(dtype)
    full = kernels.q4_linear(x, packed, bias, n, k, quantize_activations)
    for i in (0, 1, 5, 17, 255, 256, 299):
        assert torch.equal(kernels.q4_linear(x[i:i + 1], packed, bias, n, k, quantize_activations), full[i:i + 1])
    perm = torch.randperm(300, generator=torch.Generator().manual_seed(0))[:37]
    assert torch.equal(kernels.q4_linear(x[perm], packed, bias, n, k, quantize_activations), full[perm])
    wide = torch.zeros(300, k + 64, dtype=dtype)  # rows with a stride (a view of a wider tensor) as the same rows
    wide[:, :k] = x
    assert torch.equal(kernels.q4_linear(wide[:, :k], packed, bias, n, k, quantize_activations), full)


def test_pack_errors_are_clear():
    f = random_q4("q4_k", 8, 256, seed=1)
    codes, d, m, sc, mn = f["codes"], f["d"], f["m"], f["sc"], f["mn"]
    d32 = torch.ones(8, 8, dtype=torch.half)
    with pytest.raises(RuntimeError, match="format must be q4_0, q4_1 or q4_k, got 'q5_0'"):
        kernels.q4_pack("q5_0", codes, d32)
    with pytest.raises(RuntimeError, match="codes must be uint8"):
        kernels.q4_pack("q4_0", codes.to(torch.int8), d32)
    with pytest.raises(RuntimeError, match=r"K = 40 is not a positive multiple of 32 \(q4_0\)"):
        kernels.q4_pack("q4_0", torch.zeros(8, 40, dtype=torch.uint8), torch.ones(8, 1, dtype=torch.half))
    with pytest.raises(RuntimeError, match=r"K = 96 is not a positive multiple of 256 \(q4_k\)"):
        kernels.q4_pack("q4_k", codes[:, :96], d, m, sc[:, :3], mn[:, :3])
    with pytest.raises(RuntimeError, match=r"d must be float16 \[8, 8\] for q4_0"):
        kernels.q4_pack("q4_0", codes, d32.float())
    with pytest.raises(RuntimeError, match=r"d must be float16 \[8, 1\] for q4_k"):
        kernels.q4_pack("q4_k", codes, d32, m, sc, mn)
    with pytest.raises(RuntimeError, match="q4_0 takes no m"):
        kernels.q4_pack("q4_0", codes, d32, d32)
    with pytest.raises(RuntimeError, match="q4_1 needs m"):
        kernels.q4_pack("q4_1", codes, d32)
    with pytest.raises(RuntimeError, match="q4_1 takes no sc"):
        kernels.q4_pack("q4_1", codes, d32, d32, sc)
    with pytest.raises(RuntimeError, match="q4_k needs mn"):
        kernels.q4_pack("q4_k", codes, d, m, sc)
    with pytest.raises(RuntimeError, match=r"sc must be uint8 \[8, 8\]"):
        kernels.q4_pack("q4_k", codes, d, m, sc.to(torch.int8), mn)
    with pytest.raises(RuntimeError, match=r"codes must be in 0 \.\. 15"):
        kernels.q4_pack("q4_0", codes + 1, d32)  # a code of 16
    with pytest.raises(RuntimeError, match=r"mn must be in 0 \.\. 63"):
        kernels.q4_pack("q4_k", codes, d, m, sc, mn + 1)
    assert kernels.q4_pack("q4_0", codes=codes, d=d32).numel() > 0  # keywords: format, codes, d, m, sc, mn


def test_linear_errors_are_clear():
    f = random_q4("q4_0", 8, 64, seed=1)
    packed = pack("q4_0", f)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="not a multiple of 32"):
        kernels.q4_linear(torch.randn(2, 40), packed, None, 8, 40, True)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.q4_linear(x.half(), packed, None, 8, 64, True)
    with pytest.raises(RuntimeError, match="x has 96 columns"):
        kernels.q4_linear(torch.randn(2, 96), packed, None, 8, 64, False)
    with pytest.raises(RuntimeError, match=r"holds a \[8, 64\] weight, not the \[9, 64\]"):
        kernels.q4_linear(x, packed, None, 9, 64, True)
    with pytest.raises(RuntimeError, match="not a packed Q4 weight"):
        kernels.q4_linear(x, torch.zeros_like(packed), None, 8, 64, True)
    q8 = kernels.q8_0_pack(torch.zeros(8, 64, dtype=torch.int8), torch.zeros(8, 2, dtype=torch.half))
    with pytest.raises(RuntimeError, match="not a packed Q4 weight"):
        kernels.q4_linear(x, q8, None, 8, 64, True)
    with pytest.raises(RuntimeError, match="not a packed Q8_0 weight"):
        kernels.q8_0_linear(x, packed, None, 8, 64, True)
    with pytest.raises(RuntimeError, match="the uint8 tensor q4_pack returned"):
        kernels.q4_linear(x, packed.float(), None, 8, 64, True)
    with pytest.raises(RuntimeError, match="has .* bytes"):
        kernels.q4_unpack(torch.cat([packed[:-64], packed[-32:]]), 8, 64)  # the trailer, the size wrong
    # another format's magic on this packing: its size gives it away
    relabelled = packed.clone()
    relabelled[-32:-24] = pack("q4_1", random_q4("q4_1", 8, 64, seed=1))[-32:-24]
    with pytest.raises(RuntimeError, match="has .* bytes"):
        kernels.q4_linear(x, relabelled, None, 8, 64, True)
    packed_k = pack("q4_k", random_q4("q4_k", 8, 256, seed=1))
    with pytest.raises(RuntimeError, match=r"K = 96 is not a positive multiple of 256 \(q4_k\)"):
        kernels.q4_unpack(packed_k, 8, 96)
    with pytest.raises(RuntimeError, match="bias must be"):
        kernels.q4_linear(x, packed, torch.zeros(8, dtype=torch.bfloat16), 8, 64, True)
    with pytest.raises(RuntimeError, match="bias must be"):
        kernels.q4_linear(x, packed, torch.zeros(7), 8, 64, True)
    assert kernels.q4_linear(torch.zeros(0, 64), packed, None, 8, 64, True).shape == (0, 8)
    assert kernels.q4_supported()
