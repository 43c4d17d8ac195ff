"""The Q6_K kernels (csrc/quant_q6k_linear.cpp, quant_q6k_a8.cpp, quant_q6k_exact.cpp) against float64 references
built here from the weights' fields, with bounds derived from how the kernels accumulate; GGUF's bytes through the
packing, bit for bit; the packed size; batch invariance; the fused decode calls; their errors.

Q6_K: w = d * sc * (q - 32), codes q in 0..63, sc int8 per 16 values of k, d float16 per 256; every w exact in
float32 (11, 7 and 5 significant bits).
A8 (quantize_activations=True): x quantized per block of 32 by llama.cpp's rule (test_quant_kernels.quantize_rows),
codes xq and scales dx; per block the integer isum = sum over its two sub-blocks of sc * sum (q - 32) xq, exact in
every path, |isum| < 2^24 so float32 holds it; the kernel's float32 step per block:
  acc = fma(fl(dx * d), isum, acc)          dx * d exact (11 by 11 bits): B terms dx d isum
then + bias: B terms each rounded at most twice (the product, the add; once with FMA) and the bias added: within
(B + 2) eps32 (sum |term| + |bias|) of the exact sum, and the output's rounding eps(dtype) |y|.
Weight-only: x (bfloat16 widened exactly) times the exact weights, four float32 chains of K / 4 terms: within
gamma_K sum |x w|, plus the output's rounding."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from stateserve.platform import cpu_kernels
from stateserve.quantization import ggml_types
from stateserve.quantization.formats import QuantizedWeight
from test_quant_kernels import quantize_rows, random_x

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None or not hasattr(kernels, "q6_k_linear"),
                                reason="C++ CPU kernels unavailable")
EPS32 = torch.finfo(torch.float32).eps
BLOCK, SUB, SUPER = 32, 16, 256


def random_q6k(n: int, k: int, seed: int) -> dict[str, torch.Tensor]:
    """q6_k_pack's fields: random codes with blocks of extremes (all 0, all 63, all 32: a zero block), sc over the
    whole int8 range with both ends and a zero, d of several magnitudes with a zero and a large one."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 64, (n, k), generator=g, dtype=torch.uint8)
    flat = codes.view(n, k // BLOCK, BLOCK)
    flat[0, 0] = 63
    flat[-1, -1] = 0
    if n > 2:
        flat[1, :] = 63
        flat[2, 0] = 32  # w = 0 whatever the scales
        flat[2, -1] = 0
    sc = torch.randint(-128, 128, (n, k // SUB), generator=g, dtype=torch.int8)
    sc[0, 0], sc[-1, -1] = 127, -128
    if n > 2:
        sc[1, 1], sc[2, -1] = 0, -128
    d = (torch.rand(n, k // SUPER, generator=g) * 2e-4 + 1e-6).half()
    d[n // 2, 0] = 0.0
    d[-1, -1] = 0.05
    return {"codes": codes, "sc": sc, "d": d}


def pack(f: dict[str, torch.Tensor]) -> torch.Tensor:
    return kernels.q6_k_pack(f["codes"], f["sc"], f["d"])


def dequantize(f: dict[str, torch.Tensor]) -> torch.Tensor:
    return QuantizedWeight("q6_k", dict(f)).dequantize()


def reference(x, f, bias, quantize_activations):
    """(y in float64, the bound on |kernel - y|) for x [M, K] and the weight's fields."""
    codes = f["codes"]
    n, k = codes.shape
    m, blocks = x.shape[0], k // BLOCK
    b = torch.zeros(n, dtype=torch.float64) if bias is None else bias.double()
    if quantize_activations:
        xq, dx = quantize_rows(x.float())
        dots = torch.einsum("mjk,njk->mnj", xq.reshape(m, k // SUB, SUB), codes.long().reshape(n, k // SUB, SUB) - 32)
        isum = (dots * f["sc"].long()[None]).reshape(m, n, blocks, 2).sum(-1)  # exact integers
        assert isum.abs().max() < 2 ** 24
        d = f["d"].double().repeat_interleave(SUPER // BLOCK, dim=1)
        terms = dx.double()[:, None, :] * d[None] * isum.double()
        y = terms.sum(-1) + b
        bound = (blocks + 2) * EPS32 * (terms.abs().sum(-1) + b.abs())
    else:
        w = dequantize(f).double()
        xd = x.double()
        y = xd @ w.T + b
        gamma = (k + 2) * EPS32 / (1 - (k + 2) * EPS32)
        bound = gamma * (xd.abs() @ w.abs().T + b.abs())
    return y, bound + torch.finfo(x.dtype).eps * y.abs() + 1e-30


def test_pack_unpack_round_trip():
    for n, k in [(1, 256), (7, 512), (33, 768), (100, 256), (16, 256)]:
        f = random_q6k(n, k, seed=n * k)
        f["d"][0, 0] = 65504.0  # the largest finite float16
        f["d"][-1, 0] = 6e-8  # a subnormal one
        packed = pack(f)
        assert packed.dtype == torch.uint8 and packed.dim() == 1
        codes, sc, d = kernels.q6_k_unpack(packed, n, k)
        assert torch.equal(codes, f["codes"]) and torch.equal(sc, f["sc"]) and torch.equal(d, f["d"])
        wide = torch.zeros(n, 2 * k, dtype=torch.uint8)  # non-contiguous inputs are packed as their values
        wide[:, ::2] = f["codes"]
        assert torch.equal(kernels.q6_k_pack(wide[:, ::2], f["sc"], f["d"]), packed)


@pytest.mark.parametrize("n,k", [(32000, 768), (4096, 4096), (11008, 4096), (32001, 768), (100, 512), (20, 256)])
def test_packed_size_is_gguf_s(n, k):
    """GGUF's 210 bytes per 256 values, plus a full panel's padding to 64 bytes (32 where K / 256 is odd) and the
    trailer: within 1.01x of GGUF's bytes at a model's sizes."""
    gguf_bytes = n * k // SUPER * 210
    size = pack(random_q6k(n, k, seed=0)).numel()
    assert size == gguf_bytes + n // 16 * (32 if k // SUPER % 2 else 0) + 32
    assert n < 4096 or size <= 1.01 * gguf_bytes


def _gguf_q6_k(n: int, k: int, seed: int) -> np.ndarray:
    """Random Q6_K bytes [n, k / 256 * 210], finite float16 d of several magnitudes, normal and subnormal."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // SUPER, 210), dtype=np.uint8)
    d = (rng.standard_normal(raw.shape[:2]) * 10.0 ** rng.uniform(-7, 2, raw.shape[:2])).astype(np.float16)
    raw[..., 208:210] = d[..., None].view(np.uint8)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only_gives_gguf_s_values(dtype):
    """A GGUF file's Q6_K bytes through ggml_types.q6_k_fields and the packing; x = I: each output is one weight times
    1 plus zeros, so the weight-only product is W^T with every value as gguf.quants dequantizes it, bit for bit."""
    n, k = 40, 512
    raw = _gguf_q6_k(n, k, seed=3)
    codes, sc, d = ggml_types.q6_k_fields(raw, (n, k))
    out = kernels.q6_k_linear(torch.eye(k, dtype=dtype), kernels.q6_k_pack(codes, sc, d), None, n, k, False)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, GGMLQuantizationType.Q6_K).reshape(n, k)).T
    assert torch.equal(out, expected.to(dtype))


SHAPES = [(256, 1), (768, 2)]  # (K, seed)


@pytest.mark.parametrize("quantize_activations", [True, False], ids=["a8", "weight_only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,seed", SHAPES)
@pytest.mark.parametrize("n", [1, 15, 17, 40, 100])
def test_q6_k_linear_matches_float64(n, k, seed, dtype, quantize_activations):
    """M = 1 .. 17 (every tile's rest), ragged N (panels of 16, groups of 2 and 3), several super-blocks, with and
    without bias; each M's rows bitwise the first rows of the 17-row product."""
    f = random_q6k(n, k, seed=n + seed)
    packed = pack(f)
    x = random_x(17, k, dtype, seed=n * k)
    bias = (torch.randn(n, generator=torch.Generator().manual_seed(k)) * 0.5).to(dtype)
    for b in (None, bias):
        ref, bound = reference(x, f, b, quantize_activations)
        full = kernels.q6_k_linear(x, packed, b, n, k, quantize_activations)
        assert full.shape == (17, n) and full.dtype == dtype
        for m in range(1, 18):
            out = kernels.q6_k_linear(x[:m], packed, b, n, k, quantize_activations)
            err = (out.double() - ref[:m]).abs()
            assert (err <= bound[:m]).all(), (m, (err / bound[:m]).max().item())
            assert torch.equal(out, full[:m])
        # a wrong weight would be seen: the codes mirrored
        wrong = kernels.q6_k_linear(x, pack({**f, "codes": 63 - f["codes"]}), b, n, k, quantize_activations)
        assert ((wrong.double() - ref).abs() > bound).any()


@pytest.mark.parametrize("code,sc,x", [(0, -128, 127.0), (63, 127, -127.0), (63, -128, 127.0), (0, 127, -127.0)])
def test_extreme_blocks_are_exact(code, sc, x):
    """One block of extreme codes and scales against x at its largest codes (d = d_x = 1: y is isum itself, up to
    2 * 128 * 16 * 32 * 127 = 16646144 < 2^24): no int16 pair sum saturates (|2 * 2 * 63 * 127| = 32004), no int32
    step overflows, the -32 offset is applied per sub-block. The other blocks' codes are 32 (w = 0)."""
    n, k = 17, 512
    codes = torch.full((n, k), 32, dtype=torch.uint8)
    codes[:, 256 + 64:256 + 96] = code  # block 10: super-block 1
    f = {"codes": codes, "sc": torch.full((n, k // SUB), sc, dtype=torch.int8), "d": torch.ones(n, 2).half()}
    xs = torch.full((3, k), x)
    expected = float(2 * sc * SUB * (code - 32) * int(x))
    for quantize_activations in (True, False):
        out = kernels.q6_k_linear(xs, pack(f), None, n, k, quantize_activations)
        assert torch.equal(out, torch.full((3, n), expected)), (quantize_activations, out[0, 0].item(), expected)


def identity(k: int) -> dict[str, torch.Tensor]:
    """W = I exactly: code 33 on the diagonal, 32 elsewhere, sc = 1, d = 1."""
    return {"codes": torch.eye(k, dtype=torch.uint8) + 32, "sc": torch.ones(k, k // SUB, dtype=torch.int8),
            "d": torch.ones(k, k // SUPER, dtype=torch.half)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_code_reaches_its_column(dtype):
    """W = identity: y[m, n] = x's value at n exactly (weight-only) or d_x * code_x (A8: 11 by 8 bits), so a code in
    the wrong nibble, field or lane, or a wrong activation code, shows."""
    k = 512
    packed = pack(identity(k))
    x = random_x(9, k, dtype, seed=5)
    assert torch.equal(kernels.q6_k_linear(x, packed, None, k, k, False), x)
    xq, dx = quantize_rows(x.float())
    expected = (xq.double() * dx.double().repeat_interleave(BLOCK, dim=1)).to(dtype)
    assert torch.equal(kernels.q6_k_linear(x, packed, None, k, k, True), expected)


@pytest.mark.parametrize("quantize_activations", [True, False], ids=["a8", "weight_only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_batch_invariant(dtype, quantize_activations):
    """A row's outputs are bit-identical alone, in any batch and in any order: row tiles and their rests, rows split
    across threads (few panels), passes of 256 rows (300 rows)."""
    n, k = 40, 256
    packed = pack(random_q6k(n, k, seed=3))
    x = random_x(300, k, dtype, seed=4)
    bias = torch.randn(n).to(dtype)
    full = kernels.q6_k_linear(x, packed, bias, n, k, quantize_activations)
    for i in (0, 1, 5, 17, 255, 256, 299):
        assert torch.equal(kernels.q6_k_linear(x[i:i + 1], packed, bias, n, k, quantize_activations), full[i:i + 1])
    perm = torch.randperm(300, generator=torch.Generator().manual_seed(0))[:37]
    assert torch.equal(kernels.q6_k_linear(x[perm], packed, bias, n, k, quantize_activations), full[perm])
    wide = torch.zeros(300, k + 64, dtype=dtype)  # rows with a stride (a view of a wider tensor) as the same rows
    wide[:, :k] = x
    assert torch.equal(kernels.q6_k_linear(wide[:, :k], packed, bias, n, k, quantize_activations), full)


def test_pack_errors_are_clear():
    f = random_q6k(8, 256, seed=1)
    codes, sc, d = f["codes"], f["sc"], f["d"]
    with pytest.raises(RuntimeError, match="codes must be uint8"):
        kernels.q6_k_pack(codes.to(torch.int8), sc, d)
    with pytest.raises(RuntimeError, match=r"K = 96 is not a positive multiple of 256 \(q6_k\)"):
        kernels.q6_k_pack(codes[:, :96], sc[:, :6], d)
    with pytest.raises(RuntimeError, match=r"sc must be int8 \[N, K / 16\] = \[8, 16\]"):
        kernels.q6_k_pack(codes, sc.view(torch.uint8), d)
    with pytest.raises(RuntimeError, match=r"d must be float16 \[N, K / 256\] = \[8, 1\]"):
        kernels.q6_k_pack(codes, sc, d.float())
    with pytest.raises(RuntimeError, match=r"d must be float16"):
        kernels.q6_k_pack(codes, sc, torch.ones(8, 2, dtype=torch.half))
    with pytest.raises(RuntimeError, match=r"codes must be in 0 \.\. 63"):
        kernels.q6_k_pack(codes | 64, sc, d)
    assert kernels.q6_k_pack(codes=codes, sc=sc, d=d).numel() > 0


def test_linear_errors_are_clear():
    f = random_q6k(8, 256, seed=1)
    packed = pack(f)
    x = torch.randn(2, 256)
    with pytest.raises(RuntimeError, match=r"K = 64 is not a positive multiple of 256 \(q6_k\)"):
        kernels.q6_k_linear(torch.randn(2, 64), packed, None, 8, 64, True)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.q6_k_linear(x.half(), packed, None, 8, 256, True)
    with pytest.raises(RuntimeError, match="x has 512 columns"):
        kernels.q6_k_linear(torch.randn(2, 512), packed, None, 8, 256, False)
    with pytest.raises(RuntimeError, match=r"holds a \[8, 256\] weight, not the \[9, 256\]"):
        kernels.q6_k_linear(x, packed, None, 9, 256, True)
    with pytest.raises(RuntimeError, match="not a packed Q6_K weight"):
        kernels.q6_k_linear(x, torch.zeros_like(packed), None, 8, 256, True)
    q4 = kernels.q4_pack("q4_k", torch.zeros(8, 256, dtype=torch.uint8), torch.ones(8, 1, dtype=torch.half),
                         torch.ones(8, 1, dtype=torch.half), torch.ones(8, 8, dtype=torch.uint8),
                         torch.ones(8, 8, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="not a packed Q6_K weight"):
        kernels.q6_k_linear(x, q4, None, 8, 256, True)
    with pytest.raises(RuntimeError, match="not a packed Q4 weight"):
        kernels.q4_linear(x, packed, None, 8, 256, True)
    with pytest.raises(RuntimeError, match="has .* bytes"):
        kernels.q6_k_unpack(torch.cat([packed[:-64], packed[-32:]]), 8, 256)
    with pytest.raises(RuntimeError, match="bias must be"):
        kernels.q6_k_linear(x, packed, torch.zeros(8, dtype=torch.bfloat16), 8, 256, True)
    assert kernels.q6_k_linear(torch.zeros(0, 256), packed, None, 8, 256, True).shape == (0, 8)


def _to_q6_k(w: torch.Tensor) -> QuantizedWeight:
    """Some Q6_K weight near w (not llama.cpp's quantizer: this engine reads Q6_K from GGUF files only)."""
    n, k = w.shape
    sub = w.detach().float().reshape(n, k // SUB, SUB)
    amax = sub.abs().amax(-1)  # [n, k / 16]
    d = (amax.reshape(n, k // SUPER, SUPER // SUB).amax(-1) / (31 * 127)).half()
    dd = d.float().repeat_interleave(SUPER // SUB, dim=1)
    sc = torch.where(dd > 0, amax / (31 * dd), torch.zeros_like(dd)).round().clamp(-128, 127).to(torch.int8)
    scale = (dd * sc.float()).unsqueeze(-1)
    q = torch.where(scale != 0, sub / scale, torch.zeros_like(sub)).round().clamp(-32, 31) + 32
    return QuantizedWeight("q6_k", {"codes": q.to(torch.uint8).reshape(n, k), "sc": sc, "d": d})


@pytest.mark.parametrize("method", ["q4_k", "q4_k_weight_only"])
def test_fused_decode_takes_q6_k_weights(method, tmp_path, monkeypatch):
    """A Mamba2 model whose projections hold Q6_K weights (what a GGUF file's Q6_K tensors become): the fused decode
    call (csrc/projection.cpp routes the packed weights by their trailer) gives what the layers give op by op."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    from stateserve import LLM, SamplingParams
    from stateserve.layers.mamba2_mixer import Mamba2Mixer
    from stateserve.quantization import formats
    from stateserve.quantization.linear import QuantLinear
    from utils import build_hf_model, save_model

    cfg = dict(vocab_size=300, hidden_size=256, num_heads=8, head_dim=64, expand=2, state_size=16, n_groups=1,
               num_hidden_layers=2, conv_kernel=4, chunk_size=256, tie_word_embeddings=False)
    path = save_model(build_hf_model(Mamba2Config, Mamba2ForCausalLM, **cfg), str(tmp_path / "mamba2"))
    quantize = formats.quantize
    monkeypatch.setattr(formats, "quantize", lambda w, fmt: _to_q6_k(w) if fmt == "q4_k" else quantize(w, fmt))
    fused_calls = []
    original = Mamba2Mixer._fused_decode

    def counting(self, *args):
        out = original(self, *args)
        fused_calls.append(out is not None)
        return out

    prompts = [{"prompt_token_ids": [5, 6, 7 + 3 * i][: 2 + i]} for i in range(2)]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3)
    with LLM(path, dtype="bfloat16", quantization=method, skip_tokenizer_init=True,
             enable_prefix_caching=False) as llm:
        kinds = {name: m.fmt for name, m in llm.llm_engine.runner.model.named_modules() if isinstance(m, QuantLinear)}
        assert {fmt for name, fmt in kinds.items() if name.endswith("_proj")} == {"q6_k"}, kinds
        monkeypatch.setattr(Mamba2Mixer, "_fused_decode", counting)
        fused = llm.generate(prompts, params, use_tqdm=False)
        assert sum(fused_calls) >= 4, fused_calls
        monkeypatch.setattr(Mamba2Mixer, "_fused_decode", lambda *args: None)
        plain = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [{t: p.logprob for t, p in step.items()} for step in a.outputs[0].logprobs] == \
            [{t: p.logprob for t, p in step.items()} for step in b.outputs[0].logprobs]
