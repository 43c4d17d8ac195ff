"""The delta-rule decode kernels of csrc/delta_rule_update.cpp (the gated delta net of Qwen3.5 / Qwen3-Next / OLMo
Hybrid, Kimi's KDA) against float64, with bounds derived from their roundings; run again on every ISA build by
test_kernel_build.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stateserve.platform import cpu_kernels

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="C++ CPU kernels unavailable")


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn-decay-per-head", "kda-decay-per-key"])
@pytest.mark.parametrize("dk,dv", [(8, 12), (16, 32), (3, 17)])
def test_delta_rule_decode_step_matches_float64(per_channel, dk, dv):
    """csrc/delta_rule_update.cpp against the delta rule in float64: the states at the given slots updated in place
    (the others untouched), the output q^T S. Bound: each output and state element is a sum of Dk products of
    values rounded once or twice, so |error| <= 4 (Dk + 4) u times the same sum over absolute values (u = 2^-24).
    Checked to fail with the two passes' roles swapped (the output read from the state before its update)."""
    from stateserve.layers.delta_rule import delta_rule_step

    g = torch.Generator().manual_seed(dk * 100 + dv + per_channel)
    slots_total, S, H = 7, 3, 4
    state = torch.randn(slots_total, H, dk, dv, generator=g)
    slots = torch.tensor([5, 0, 3])
    q, k = (torch.nn.functional.normalize(torch.randn(S, H, dk, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(S, H, dv, generator=g)
    decay = torch.rand(S, H, *((dk,) if per_channel else ()), generator=g) * 0.5 + 0.5
    beta = torch.rand(S, H, generator=g)
    # float64 reference, and the same sums over absolute values
    d = decay.double()[..., None, None] if not per_channel else decay.double().unsqueeze(-1)
    ref_state = state.double()[slots] * d
    mag_state = ref_state.abs()
    delta = (v.double() - torch.einsum("shk,shkv->shv", k.double(), ref_state)) * beta.double()[..., None]
    mag_delta = (v.double().abs() + torch.einsum("shk,shkv->shv", k.double().abs(), mag_state))
    ref_state = ref_state + k.double()[..., None] * delta[..., None, :]
    mag_state = mag_state + k.double().abs()[..., None] * mag_delta[..., None, :]
    ref_out = torch.einsum("shk,shkv->shv", q.double(), ref_state)
    mag_out = torch.einsum("shk,shkv->shv", q.double().abs(), mag_state)
    untouched = state[[1, 2, 4, 6]].clone()
    out = delta_rule_step(state, slots, q, k, v, decay, beta)
    u = 2.0 ** -24
    assert out.shape == (S, H, dv) and out.dtype == torch.float32
    assert ((out.double() - ref_out).abs() <= 4 * (dk + 4) * u * mag_out + 1e-30).all()
    assert ((state[slots].double() - ref_state).abs() <= 4 * (dk + 4) * u * mag_state + 1e-30).all()
    assert torch.equal(state[[1, 2, 4, 6]], untouched)
    # the kernel ran (not the PyTorch path): its module function is what the table serves for float32 states
    from stateserve.platform import kernels as table

    assert table.table().delta_rule_decode(torch.float32) is kernels.delta_rule_decode_


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 2, 16, 32), (2, 4, 8, 12), (1, 3, 5, 7)])
def test_gated_delta_decode_matches_its_pytorch_steps_in_float64(dtype, hk, hv, dk, dv):
    """csrc/delta_rule_update.cpp's gated_delta_decode_ (the gated delta net's gates, l2 norms and update from the
    conv output in one call) against the same formula in float64 from the same inputs: beta is torch.sigmoid of b
    in b's dtype, as the layer's PyTorch path computes it. Bound: the delta-rule update's (4 (Dk + 4) u of the sums
    over absolute values) plus the gates' and norms' own roundings (q's and k's norms ~3 u each, k entering twice;
    the decay's exp and log1p ~3 u; beta ~2 u: 16 u more), and for bfloat16
    inputs one bfloat16 step of beta (the sigmoid's float32 value can round the other way at a tie: 2^-8 relative).
    Value heads h * r .. share key head h. Checked to fail with q and k swapped, and with the decay's softplus left
    out."""
    from stateserve.platform import kernels as table

    g = torch.Generator().manual_seed(hk * 1000 + hv * 100 + dk + dv)
    slots_total, S = 6, 3
    state = torch.randn(slots_total, hv, dk, dv, generator=g)
    slots = torch.tensor([4, 0, 2])
    qkv = torch.randn(S, 2 * hk * dk + hv * dv, generator=g).to(dtype)
    ba = (torch.randn(S, 2 * hv, generator=g) * 2).to(dtype)
    # views of one projection's output, as the layer passes them: rows apart by 2 Hv; with one value head per key
    # head (grouped layout) a column step of 2
    b, a = (ba[:, :hv], ba[:, hv:]) if hk != hv else (ba[:, 0::2], ba[:, 1::2])
    neg_exp_A = -torch.rand(hv, generator=g) * 4
    dt_bias = torch.randn(hv, generator=g)
    # float64 reference from the same (rounded) inputs
    x = qkv.double()
    q = x[:, :hk * dk].view(S, hk, dk)
    k = x[:, hk * dk:2 * hk * dk].view(S, hk, dk)
    v = x[:, 2 * hk * dk:].view(S, hv, dv)
    q = (q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() * dk ** -0.5).repeat_interleave(hv // hk, dim=1)
    k = (k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()).repeat_interleave(hv // hk, dim=1)
    beta = torch.sigmoid(b).double()
    decay = torch.exp(neg_exp_A.double() * F.softplus(a.double() + dt_bias.double()))
    ref_state = state.double()[slots] * decay[..., None, None]
    mag_state = ref_state.abs()
    delta = (v - torch.einsum("shk,shkv->shv", k, ref_state)) * beta[..., None]
    mag_delta = v.abs() + torch.einsum("shk,shkv->shv", k.abs(), mag_state)
    ref_state = ref_state + k[..., None] * delta[..., None, :]
    mag_state = mag_state + k.abs()[..., None] * mag_delta[..., None, :]
    ref_out = torch.einsum("shk,shkv->shv", q, ref_state)
    mag_out = torch.einsum("shk,shkv->shv", q.abs(), mag_state)
    untouched = state[[1, 3, 5]].clone()
    out = kernels.gated_delta_decode_(state, slots, qkv, b, a, neg_exp_A, dt_bias, hk, 1.0)
    u = 2.0 ** -24
    rel = 4 * (dk + 4) * u + 16 * u + (2.0 ** -8 if dtype == torch.bfloat16 else 0.0)
    assert out.shape == (S, hv, dv) and out.dtype == torch.float32
    assert ((out.double() - ref_out).abs() <= rel * mag_out + 1e-30).all()
    assert ((state[slots].double() - ref_state).abs() <= rel * mag_state + 1e-30).all()
    assert torch.equal(state[[1, 3, 5]], untouched)
    assert table.table().gated_delta_decode(dtype) is kernels.gated_delta_decode_
