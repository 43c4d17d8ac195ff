"""The fused C++ CPU kernels of the per-token small ops (conv updates and prefill conv, norms, rotary, SiLU-and-mul,
step sizes) against their PyTorch paths (the kernels switched off), and the cached parameter copies they read."""
from __future__ import annotations

import pytest
import torch

from stateserve.platform import cpu_kernels
from stateserve.layers.norm import RMSNorm
from stateserve.layers.recurrent import causal_conv1d_decode

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="C++ CPU kernels unavailable")


def _close(a, b, tol):
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def _conv_case(seed: int, dtype: torch.dtype, channels: int, K: int):
    """Three sequences' new inputs at slots 2, 0, 4 of a 5-slot conv state, weights and bias: (state, a copy of it
    for the reference, slots, x, weight, bias)."""
    g = torch.Generator().manual_seed(seed)
    conv = torch.randn(5, channels, K - 1, generator=g).to(dtype)
    x, w, b = (torch.randn(3, channels, generator=g).to(dtype), torch.randn(channels, K, generator=g).to(dtype),
               torch.randn(channels, generator=g).to(dtype))
    return conv, conv.clone(), torch.tensor([2, 0, 4]), x, w, b


@pytest.mark.parametrize("dtype,float_accumulate", [(torch.float32, False), (torch.bfloat16, False),
                                                     (torch.bfloat16, True)])
@pytest.mark.parametrize("K", [2, 4, 5, 6])  # bfloat16 windows of 1-4 inputs take the word-permute path, 5 not
def test_conv_update_matches_pytorch(dtype, float_accumulate, K, no_kernels):
    conv, ref_conv, slots, x, w, b = _conv_case(5, dtype, 36, K)  # 36: two 16-channel blocks and a remainder
    no_kernels(False)
    ref = causal_conv1d_decode(x, w, b, ref_conv, slots, float_accumulate)
    no_kernels(True)
    got = causal_conv1d_decode(x, w, b, conv, slots, float_accumulate)
    assert got.dtype == dtype
    # same rounding points as the PyTorch expression: equal up to the order of a 4-term float32 sum
    _close(got, ref, 1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.equal(conv, ref_conv)  # the shifted window is exact


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_pytorch(dtype, no_kernels):
    norm = RMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48))
    x = torch.randn(5, 48).to(dtype)
    no_kernels(False)
    ref = norm(x)
    no_kernels(True)
    got = norm(x)
    assert got.dtype == dtype
    _close(got, ref, 1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offset_rms_norm_kernel_rounds_once_after_the_float32_weight(dtype, no_kernels):
    """Qwen3-Next's / Qwen3.5's (1 + w) RMSNorm through the row kernels (rms_norm_f32_weight for bfloat16 rows: the
    product by the float32 weight before the one rounding), on 2-D rows and per-head 3-D ones (q/k norms), against
    its PyTorch formula. Bound: the kernel's sum of squares in another order moves the inverse root by a few float32
    steps, so float32 within 1e-6 relative; bfloat16 equal but for outputs within a float32 step of a rounding
    boundary (at most one bfloat16 step apart, and rare). Checked to fail with the weight rounded to bfloat16."""
    from stateserve.models.qwen3_next import OffsetRMSNorm

    g = torch.Generator().manual_seed(21)
    norm = OffsetRMSNorm(40, eps=1e-6).to(dtype)  # 40: two vectors and a scalar tail
    with torch.no_grad():
        norm.weight.copy_(torch.randn(40, generator=g) * 0.3)
    for x in (torch.randn(6, 40, generator=g).to(dtype), torch.randn(3, 4, 40, generator=g).to(dtype)):
        no_kernels(False)
        ref = norm(x)
        no_kernels(True)
        got = norm(x)
        assert got.dtype == dtype and got.shape == x.shape
        if dtype == torch.float32:
            _close(got, ref, 1e-6)
        else:
            step = ref.float().abs() * 2.0 ** -7
            assert ((got.float() - ref.float()).abs() <= step).all()
            assert (got == ref).float().mean() > 0.97


@pytest.mark.parametrize("stream_dtype,model_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                      (torch.float32, torch.bfloat16)])  # last: residual_in_fp32
def test_residual_add_and_norm_kernel_equals_the_two_ops(stream_dtype, model_dtype, no_kernels):
    g = torch.Generator().manual_seed(12)
    norm = RMSNorm(40, eps=1e-5).to(model_dtype)  # 40: two vectors and a scalar tail
    with torch.no_grad():
        norm.weight.copy_(torch.randn(40, generator=g))
    residual = (torch.randn(6, 40, generator=g) * 3).to(stream_dtype)
    x = torch.randn(6, 40, generator=g).to(model_dtype)
    expected_sum = residual + x
    for use_kernels in (False, True):
        no_kernels(use_kernels)
        with torch.no_grad():
            expected = norm(expected_sum.to(model_dtype))  # what the blocks computed before the fusion
            stream = residual.clone()
            got, got_sum = norm.add_forward(x, stream)
        assert torch.equal(got_sum, expected_sum) and got_sum.dtype == stream_dtype
        assert (got_sum is stream) == use_kernels  # the kernel updates the stream in place
        assert got.dtype == model_dtype and torch.equal(got, expected)
    with pytest.raises(RuntimeError, match="dtypes"):
        kernels.add_rms_norm_(residual.to(torch.float16), x, norm.weight, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [None, 8])  # full and partial rotary
def test_rotary_in_place_matches_pytorch(dtype, rotary_dim, no_kernels):
    from stateserve.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(16, {"rope_type": "default", "rope_theta": 10000.0}, 2048, rotary_dim)
    g = torch.Generator().manual_seed(6)
    qkv = torch.randn(5, (4 + 2 + 2) * 16, generator=g).to(dtype)  # q, k as views into a fused projection
    positions = torch.tensor([0, 7, 3, 1500, 2100])  # 2100: past the first table size, the table grows
    original = qkv.clone()
    q, k, _ = qkv.split([64, 32, 32], dim=-1)
    no_kernels(False)
    ref_q, ref_k = rope(positions, q.reshape(5, 4, 16).clone(), k.reshape(5, 2, 16).clone())
    no_kernels(True)
    got_q, got_k = rope(positions, q.view(5, 4, 16), k.view(5, 2, 16))
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    _close(got_q, ref_q, tol)
    _close(got_k, ref_k, tol)
    assert torch.equal(qkv[:, :64].view(5, 4, 16), got_q)  # rotated in place
    assert not torch.equal(qkv[1:, :64], original[1:, :64])  # positions > 0 really rotate
    assert torch.equal(qkv[:, 96:], original[:, 96:])  # v untouched
    # a later step past the grown table: the kernel declines, the table grows again, nothing is rotated twice
    table_rows = rope._table.shape[0]
    q2, k2 = torch.randn(1, 4, 16, generator=g).to(dtype), torch.randn(1, 2, 16, generator=g).to(dtype)
    far = torch.tensor([table_rows + 10])
    no_kernels(False)
    ref_q2, ref_k2 = rope(far, q2.clone(), k2.clone())
    no_kernels(True)
    got_q2, got_k2 = rope(far, q2, k2)
    assert rope._table.shape[0] > table_rows
    _close(got_q2, ref_q2, tol)
    _close(got_k2, ref_k2, tol)
    with pytest.raises(RuntimeError, match="negative position"):
        kernels.rotary_(q2, k2, rope._table, torch.tensor([-1]), rope.dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_pytorch(dtype, no_kernels):
    from stateserve.layers.norm import silu_and_mul

    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(7)).to(dtype)
    no_kernels(False)
    ref = silu_and_mul(x)
    no_kernels(True)
    got = silu_and_mul(x)
    assert got.shape == (3, 20) and got.dtype == dtype
    _close(got, ref, 1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("gate_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_gated_rms_norm_matches_pytorch(gate_dtype, norm_before_gate, no_kernels):
    from stateserve.layers.mamba2_mixer import GatedRMSNorm

    g = torch.Generator().manual_seed(8)
    norm = GatedRMSNorm(96, 48, eps=1e-5, norm_before_gate=norm_before_gate).to(gate_dtype)  # two groups
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=g))
    y = torch.randn(7, 96, generator=g)  # the scan's float32 output
    gate = torch.randn(7, 2 * 96, generator=g).to(gate_dtype)[:, 96:]  # strided rows, a view of in_proj's output
    no_kernels(False)
    ref = norm(y, gate)
    no_kernels(True)
    got = norm(y, gate)
    assert got.dtype == ref.dtype == gate_dtype  # rounded once to the model dtype, what out_proj reads
    if gate_dtype == torch.float32:
        _close(got, ref, 1e-5)
    else:  # the same float32 value rounded: equal but where the two sums of squares straddle a rounding boundary
        _close(got, ref, 1e-2)
        assert (got == ref).float().mean() > 0.95
    # per-group statistics: normalising over the whole row instead must show
    whole = GatedRMSNorm(96, 96, eps=1e-5, norm_before_gate=norm_before_gate).to(gate_dtype)
    with torch.no_grad():
        whole.weight.copy_(norm.weight)
    assert not torch.allclose(whole(y, gate), got, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_prefill_with_fused_silu_matches_pytorch(dtype, no_kernels):
    from stateserve.layers.recurrent import causal_conv1d_prefill, conv_state_at

    g = torch.Generator().manual_seed(9)
    L, Cn, K = 9, 40, 4  # 40 channels: two full vectors and a remainder
    wide = torch.randn(L, Cn + 5, generator=g).to(dtype)
    x = wide[:, 2:2 + Cn]  # a view with a row stride of its own, as the projection's output hands it over
    w, b = torch.randn(Cn, K, generator=g).to(dtype), torch.randn(Cn, generator=g).to(dtype)
    state = torch.randn(Cn, K - 1, generator=g).to(dtype)
    no_kernels(False)
    ref, ref_inputs = causal_conv1d_prefill(x, w, b, state, silu_float32=True)
    ref_plain, _ = causal_conv1d_prefill(x, w, b, state)
    no_kernels(True)
    got, inputs = causal_conv1d_prefill(x, w, b, state, silu_float32=True)
    plain, _ = causal_conv1d_prefill(x, w, b, state)
    assert got.dtype == ref.dtype == torch.float32 and plain.dtype == dtype
    _close(got, ref, 1e-6 if dtype == torch.float32 else 1e-2)
    _close(plain, ref_plain, 1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.equal(inputs.padded(), ref_inputs.padded())
    assert not torch.allclose(got, plain.float(), atol=1e-2)  # the activation really is applied
    # the conv state after any number of the chunk's tokens: the last K-1 inputs up to there
    padded = torch.cat([state.t(), x])
    for offset in (0, 1, K - 1, L):
        assert torch.equal(conv_state_at(inputs, offset, K), padded[offset:offset + K - 1].t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("clamp", [False, True])
def test_step_sizes_kernel_matches_pytorch(dtype, clamp, no_kernels):
    from stateserve.layers.mamba2_mixer import Mamba2Mixer

    # 20 heads: one 16-lane vector and a scalar rest; dt a view into a wider buffer, as the projection gives it
    mixer = Mamba2Mixer(hidden_size=32, num_heads=20, head_dim=8, state_size=16, time_step_limit=(0.05, 2.0),
                        dtype=dtype).to(dtype)
    g = torch.Generator().manual_seed(10)
    wide = (torch.randn(600, 23, generator=g) * 4).to(dtype)  # spans both clamp bounds and softplus' linear regime
    dt = wide[:, 3:]
    dt[0, 0] = dt[1, 17] = 25.0  # past softplus' threshold (20): the identity branch, in the vector and the rest
    dt[2, :] = -30.0  # exp underflow territory: tiny but positive step sizes
    no_kernels(False)
    ref = mixer._step_sizes(dt, clamp)
    no_kernels(True)
    got = mixer._step_sizes(dt, clamp)
    assert got.dtype == ref.dtype == torch.float32
    _close(got, ref, 1e-6)
    if clamp:
        assert float(got.min()) >= 0.05 - 1e-3 and float(got.max()) <= 2.0 + 1e-2
    else:
        assert float(got.max()) > 2.5  # unclamped values really pass the upper bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_update_with_fused_silu_matches_pytorch(dtype, no_kernels):
    conv, ref_conv, slots, x, w, b = _conv_case(11, dtype, 40, 4)  # 40 channels: two full vectors and a remainder
    no_kernels(False)
    ref = causal_conv1d_decode(x, w, b, ref_conv, slots, silu_float32=True)
    no_kernels(True)
    got = causal_conv1d_decode(x, w, b, conv, slots, silu_float32=True)
    assert got.dtype == ref.dtype == torch.float32
    _close(got, ref, 1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.equal(conv, ref_conv)
    assert float(got.min()) > -0.3  # silu's floor (~-0.28): the activation really is applied


def test_float32_copies_follow_parameter_writes():
    from stateserve.layers.param_cache import float32_copy

    lin = torch.nn.Linear(4, 3).to(torch.bfloat16)
    first = float32_copy(lin, "bias")
    assert first.dtype == torch.float32 and torch.equal(first, lin.bias.float())
    assert float32_copy(lin, "bias") is first  # made once
    with torch.no_grad():
        lin.bias.add_(1.0)  # written in place (a checkpoint load): a new copy
    second = float32_copy(lin, "bias")
    assert torch.equal(second, lin.bias.float()) and not torch.equal(second, first)
    lin.bias = torch.nn.Parameter(torch.full((3,), 7.0, dtype=torch.bfloat16))  # replaced
    assert torch.equal(float32_copy(lin, "bias"), torch.full((3,), 7.0))
    lin32 = torch.nn.Linear(4, 3)
    assert float32_copy(lin32, "weight").data_ptr() == lin32.weight.data_ptr()  # float32: no copy at all


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_update_with_cached_layer_taps_follows_weight_loads(dtype, no_kernels):
    """A Mamba2 mixer hands the kernel its conv weights pre-transposed to float32 and cached per weight version;
    loading new weights in place must refresh them. 64 sequences x 96 channels: the kernel's parallel path."""
    from stateserve.layers.mamba2_mixer import Mamba2Mixer

    g = torch.Generator().manual_seed(12)
    mixer = Mamba2Mixer(hidden_size=48, num_heads=4, head_dim=16, state_size=8, n_groups=1, conv_kernel=4,
                        dtype=dtype).to(dtype)
    Cn, K = mixer.conv_dim, mixer.conv_kernel
    S, slots_n = 64, 70
    conv = torch.randn(slots_n, Cn, K - 1, generator=g).to(dtype)
    slots = torch.randperm(slots_n, generator=g)[:S]
    x = torch.randn(S, Cn, generator=g).to(dtype)
    for _ in range(2):  # the second round after an in-place load of new weights
        with torch.no_grad():
            mixer.conv1d.weight.copy_(torch.randn(mixer.conv1d.weight.shape, generator=g))
            mixer.conv1d.bias.copy_(torch.randn(Cn, generator=g))
        w, b = mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias
        ref_conv = conv.clone()
        no_kernels(False)
        ref = causal_conv1d_decode(x, w, b, ref_conv, slots, silu_float32=True)
        no_kernels(True)
        got = causal_conv1d_decode(x, w, b, conv, slots, silu_float32=True, taps=mixer.conv_taps())
        _close(got, ref, 1e-6 if dtype == torch.float32 else 1e-2)
        assert torch.equal(conv, ref_conv)
