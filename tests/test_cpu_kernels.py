"""The fused C++ CPU kernels of recurrent layers (scans, decode state updates) against their PyTorch paths (the
kernels switched off), including in-place state updates at the given slots only, snapshots and bfloat16 rounding.
The per-token small ops are in test_cpu_small_ops.py, the delta-rule kernels in test_delta_rule_kernels.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stateserve.platform import cpu_kernels
from stateserve.layers.selective_scan import selective_scan_prefill, selective_state_update
from stateserve.layers.ssd import ssd_chunk_scan, ssd_decode_step
from utils import random_mamba2_mixer

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="C++ CPU kernels unavailable")


def _close(a, b, tol):
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def _scan_magnitude(u, dt, A, B, C, Dskip=None, z=None):
    """Mamba1 scan outputs and states computed over absolute values, in float64: the sums |C| |h| (+ |D u|, times
    |silu(z)|) that bound how much a rounding anywhere in the scan can move y and h."""
    u, dt, B, C = (t.double().abs() for t in (u, dt, B, C))
    decay = torch.exp(dt[:, :, None] * A.double()[None])  # [L, D, N]
    h = torch.zeros(u.shape[1], A.shape[1], dtype=torch.float64)
    ys = []
    for t in range(u.shape[0]):
        h = decay[t] * h + (dt[t] * u[t])[:, None] * B[t][None]
        ys.append(h @ C[t])
    y = torch.stack(ys)
    if Dskip is not None:
        y = y + u * Dskip.double().abs()
    if z is not None:
        y = y * F.silu(z.double()).abs()
    return y, h


def _assert_within_scan_error(got, ref, magnitude, dt, A, ulps_of_inputs=4):
    """float32 scans agree to the rounding the recurrence allows: a relative change of e in a step (e.g. the
    last ulps of two softplus or exp implementations, which differ between CPUs and libms) moves the decay by
    |A dt| e and the input by e, and each of the L steps adds its own roundings, so to first order
    |got - ref| <= eps (ulps_of_inputs (1 + max |A dt|) L + N) * magnitude, with magnitude the scan over |values|
    (_scan_magnitude). A constant tolerance would ignore that y is a sum of terms much larger than itself."""
    L, N = dt.shape[0], A.shape[1]
    growth = 1 + (dt.double().abs()[:, :, None] * A.double().abs()[None]).max().item()
    bound = torch.finfo(torch.float32).eps * (ulps_of_inputs * growth * L + N) * magnitude
    err = (got.double() - ref.double()).abs()
    worst = (err / bound).max().item()
    assert worst <= 1, f"error {err.max().item():.3g} is {worst:.2f}x the rounding bound of the scan"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N", [16, 12, 40])  # unrolled 16-state path, the bounded loop (<= 32), the scalar loop
@pytest.mark.parametrize("D", [40, 37])  # partial lane blocks of 16 (AVX-512) and of 8 (AVX2)
def test_mamba1_scan_matches_pytorch_chunks_and_snapshots(dtype, N, D, no_kernels):
    g = torch.Generator().manual_seed(1)
    L = 70  # spans three of the kernel's 32-token steps
    u = torch.randn(L, D, generator=g).to(dtype)
    dt = (torch.rand(L, D, generator=g) * 0.5 + 0.01).to(dtype)
    A = -torch.rand(D, N, generator=g) * 2
    B, C = torch.randn(L, N, generator=g).to(dtype), torch.randn(L, N, generator=g).to(dtype)
    h0 = torch.randn(D, N, generator=g)
    offsets = [1, 16, 17, 33, 70]
    no_kernels(False)
    ref_y, ref_h, ref_s = selective_scan_prefill(u, dt, A, B, C, h0, offsets, chunk_size=8)
    no_kernels(True)
    y, h, snaps = selective_scan_prefill(u, dt, A, B, C, h0, offsets)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    _close(y, ref_y, tol)
    _close(h, ref_h, 1e-5)
    assert sorted(snaps) == offsets
    for off in offsets:
        _close(snaps[off], ref_s[off], 1e-5)
    assert torch.equal(snaps[70], h)
    # h0 is an input, not updated in place
    y2, _, _ = selective_scan_prefill(u, dt, A, B, C, h0, offsets)
    assert torch.equal(y, y2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N", [16, 40])
def test_mamba1_gated_scan_reads_model_dtype_in_place(dtype, N, no_kernels):
    """With the block's D skip and gate fused, the kernel reads u, dt and z in the model dtype (z a column slice
    of [x | z], as the mixer passes it) and writes (y + u D) * silu(z) in that dtype, as the PyTorch path does."""
    g = torch.Generator().manual_seed(6)
    L, D = 45, 40
    xz = torch.randn(L, 2 * D, generator=g).to(dtype)
    u, z = xz[:, :D].contiguous(), xz[:, D:]  # z: row stride 2D
    dt = (torch.rand(L, D, generator=g) * 0.5 + 0.01).to(dtype)
    A = -torch.rand(D, N, generator=g) * 2
    B, C = torch.randn(L, N, generator=g).to(dtype), torch.randn(L, N, generator=g).to(dtype)
    Dskip, h0 = torch.randn(D, generator=g).to(dtype), torch.randn(D, N, generator=g)
    no_kernels(False)
    ref_y, ref_h, _ = selective_scan_prefill(u, dt, A, B, C, h0, [], chunk_size=8, D=Dskip, z=z)
    no_kernels(True)
    y, h, _ = selective_scan_prefill(u, dt, A, B, C, h0, [], D=Dskip, z=z)
    assert y.dtype == ref_y.dtype == dtype
    _close(y, ref_y, 1e-5 if dtype == torch.float32 else 3e-2)
    _close(h, ref_h, 1e-5)
    ungated, _, _ = selective_scan_prefill(u, dt, A, B, C, h0, [])
    assert (ungated.float() - y.float()).abs().max() > 0.1  # the gate is applied


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N", [16, 40])
def test_mamba1_scan_takes_the_softplus_of_raw_steps(dtype, N, no_kernels):
    """With dt_bias the kernel is given dt before bias and softplus (F.softplus(dt + bias) in the model dtype, its
    threshold at 20 included), over raw values from very negative to past the threshold.

    The two sides take the softplus with different code: N = 40 runs the kernel's portable loop, whose step is
    glibc's log1pf(expf(.)), against PyTorch's vectorised softplus (SLEEF); N = 12 and 16 the kernel's own vector
    softplus. Each is within an ulp or two, not the same ulps, and which ulps depends on the code paths picked at run
    time by the CPU (glibc's ifunc variants, ATen's CPU-capability dispatch): on Intel Emerald Rapids one element of
    y differed by 2.6e-5 where Zen CPUs stayed under 1e-5. y sums terms 6-11x larger than itself, so an ulp of a
    step shows up as ~1e-5; the float32 bound below follows from that (_assert_within_scan_error), not from one
    CPU's rounding."""
    g = torch.Generator().manual_seed(7)
    L, D = 40, 40
    u = torch.randn(L, D, generator=g).to(dtype)
    dt_raw = (torch.randn(L, D, generator=g) * 6).to(dtype)
    dt_raw[::7, ::5] = 23.0  # past the threshold: the step is the input itself
    dt_raw[1::7, ::3] = -30.0  # a step of ~1e-13: only its relative precision keeps it
    bias = (torch.randn(D, generator=g) * 0.5).to(dtype)
    A = -torch.rand(D, N, generator=g) * 0.05  # long memory, so the big steps do not erase every state
    B, C = torch.randn(L, N, generator=g).to(dtype), torch.randn(L, N, generator=g).to(dtype)
    Dskip, z = torch.randn(D, generator=g).to(dtype), torch.randn(L, D, generator=g).to(dtype)
    ref_y, ref_h, _ = selective_scan_prefill(u, F.softplus(dt_raw + bias), A, B, C, None, [], D=Dskip, z=z)
    y, h, _ = selective_scan_prefill(u, dt_raw, A, B, C, None, [], D=Dskip, z=z, dt_bias=bias)
    if dtype == torch.float32:  # the two softplus (kernel's, PyTorch's) may differ in their last ulps
        mag_y, mag_h = _scan_magnitude(u, F.softplus(dt_raw + bias), A, B, C, Dskip, z)
        _assert_within_scan_error(y, ref_y, mag_y, F.softplus(dt_raw + bias), A)
        _assert_within_scan_error(h, ref_h, mag_h, F.softplus(dt_raw + bias), A)
    else:
        _close(y, ref_y, 3e-2)
        _close(h, ref_h, 3e-2)
    wrong, _, _ = selective_scan_prefill(u, dt_raw + bias, A, B, C, None, [], D=Dskip, z=z)  # no softplus
    assert (wrong.float() - y.float()).abs().max() > 0.1
    no_kernels(False)
    fallback, _, _ = selective_scan_prefill(u, dt_raw, A, B, C, None, [], chunk_size=8, D=Dskip, z=z, dt_bias=bias)
    if dtype == torch.float32:
        _assert_within_scan_error(fallback, ref_y, mag_y, F.softplus(dt_raw + bias), A)
    else:
        _close(fallback, ref_y, 3e-2)


def test_mamba1_scan_breaks_when_state_is_not_carried(no_kernels):
    """Sanity of the comparison itself: dropping the initial state must show up."""
    g = torch.Generator().manual_seed(2)
    u, dt = torch.randn(8, 16, generator=g), torch.rand(8, 16, generator=g) * 0.1
    A, B, C = -torch.rand(16, 4, generator=g), torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)
    with_state, _, _ = selective_scan_prefill(u, dt, A, B, C, torch.randn(16, 4, generator=g) * 10)
    without, _, _ = selective_scan_prefill(u, dt, A, B, C, None)
    assert (with_state - without).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N", [16, 32, 12])  # the kernel's vector path (one or more vectors a row), its scalar loop
def test_mamba1_state_update_in_place_at_slots(dtype, N, no_kernels):
    g = torch.Generator().manual_seed(3)
    S, D, slots_n = 3, 24, 6
    state = torch.randn(slots_n, D, N, generator=g)
    slots = torch.tensor([4, 0, 2])
    # u and z as the two halves of in_proj's output, B and C as slices of x_proj's: rows with strides
    u, z = torch.randn(S, 2 * D, generator=g).to(dtype).chunk(2, dim=-1)
    _, B, C = torch.randn(S, 3 + 2 * N, generator=g).to(dtype).split([3, N, N], dim=-1)
    dt_raw, dt_bias = torch.randn(S, D, generator=g).to(dtype), torch.randn(D, generator=g)
    A, Dskip = -torch.rand(D, N, generator=g), torch.randn(D, generator=g)
    ref_state = state.clone()
    no_kernels(False)
    ref = selective_state_update(ref_state, slots, u, dt_raw, dt_bias, A, B, C, Dskip, z)
    no_kernels(True)
    got = selective_state_update(state, slots, u, dt_raw, dt_bias, A, B, C, Dskip, z)
    _close(got, ref, 1e-5 if dtype == torch.float32 else 2e-2)
    _close(state, ref_state, 1e-5)
    assert torch.equal(state[[1, 3, 5]], ref_state[[1, 3, 5]])  # other slots untouched


def test_mamba1_state_update_refuses_a_slot_outside_the_cache():
    state = torch.zeros(2, 16, 16)
    u = torch.zeros(1, 16)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.selective_state_update_(state, torch.tensor([2]), u, u, torch.zeros(16), torch.zeros(16, 16),
                                        torch.zeros(1, 16), torch.zeros(1, 16), torch.zeros(16), u)
    assert not state.any()


# 16-lane vectors: the scalar row loop, then 16 rows a pass; 8-lane (AVX2): 8 rows a pass for both, the last scalar
@pytest.mark.parametrize("P,N", [(8, 16), (32, 64), (6, 16)])
def test_mamba2_state_update_in_place_at_slots(P, N):
    g = torch.Generator().manual_seed(4)
    S, H, G, slots_n = 2, 4, 2, 5
    states = torch.randn(slots_n, H, P, N, generator=g)
    untouched = states.clone()
    slots = torch.tensor([3, 1])
    x, dt = torch.randn(S, H, P, generator=g), torch.rand(S, H, generator=g)
    A, D = -torch.rand(H, generator=g), torch.randn(H, generator=g)
    B, C = torch.randn(S, G, N, generator=g), torch.randn(S, G, N, generator=g)
    ref_y, ref_state = ssd_decode_step(states[slots], x, dt, A, B, C, D)
    y = kernels.ssd_state_update_(states, slots, x, dt, A, B, C, D)
    _close(y, ref_y, 1e-5)
    _close(states[slots], ref_state, 1e-5)
    assert torch.equal(states[[0, 2, 4]], untouched[[0, 2, 4]])


# vector tiles of 16 (P 16) and 32 channels (P 32), both in one head (P 48: the 16-channel rest has N 24, which
# only the scalar loop takes), the scalar loop alone
@pytest.mark.parametrize("P,N", [(16, 64), (32, 128), (48, 24), (6, 24)])
@pytest.mark.parametrize("decay", ["mild", "steep"])  # steep: the rescaled state's factor is reset many times
def test_mamba2_prefill_scan_matches_chunked_ssd_with_snapshots(P, N, decay):
    """The sequential SSD kernel against the chunked PyTorch form, over more tokens than one of the kernel's
    128-token steps, resuming from a state, with snapshots inside and at the ends of those steps; x, B and C are
    views into one wider buffer, as the conv's output hands them over."""
    g = torch.Generator().manual_seed(5)
    L, H, G = 300, 4, 2
    xbc = torch.randn(L, H * P + 2 * G * N + 3, generator=g)
    x = xbc[:, :H * P].view(L, H, P)
    B, C = (xbc[:, H * P + i * G * N:H * P + (i + 1) * G * N].view(L, G, N) for i in range(2))
    dt = torch.rand(L, H, generator=g) * (0.5 if decay == "mild" else 4.0)
    A = -torch.rand(H, generator=g) * (1.0 if decay == "mild" else 8.0)
    A[0] = -60.0 if decay == "steep" else A[0]  # decays that underflow to 0: the state restarts
    D = torch.randn(H, generator=g)
    h0 = torch.randn(H, P, N, generator=g)
    offsets = [1, 128, 140, 256]
    y, final, snaps = kernels.ssd_scan_fwd(x, dt, A, B, C, D, h0, offsets)
    ref_y, ref_final = ssd_chunk_scan(x, dt, A, B, C, 16, D, h0)
    assert torch.isfinite(y).all() and torch.isfinite(final).all()
    _close(y, ref_y, 1e-4)
    _close(final, ref_final, 1e-4)
    for j, off in enumerate(offsets):
        _, ref_state = ssd_chunk_scan(x[:off], dt[:off], A, B[:off], C[:off], 16, D, h0)
        _close(snaps[j], ref_state, 1e-4)


@pytest.mark.parametrize("P,N", [(16, 64), (6, 24)])  # a vector tile, the scalar loop
def test_mamba2_prefill_snapshot_is_the_state_of_the_prompt_that_stops_there(P, N):
    """Bit for bit: a prefix-cache snapshot must not depend on how many tokens follow it in the same chunk (nor on
    where the threads' share of tokens ends)."""
    g = torch.Generator().manual_seed(6)
    L, H, G = 300, 3, 1
    x, dt = torch.randn(L, H, P, generator=g), torch.rand(L, H, generator=g)
    B, C = torch.randn(L, G, N, generator=g), torch.randn(L, G, N, generator=g)
    A, D, h0 = -torch.rand(H, generator=g), torch.randn(H, generator=g), torch.randn(H, P, N, generator=g)
    offsets = [5, 131, 257]
    _, _, snaps = kernels.ssd_scan_fwd(x, dt, A, B, C, D, h0, offsets)
    for j, off in enumerate(offsets):
        _, final, _ = kernels.ssd_scan_fwd(x[:off], dt[:off], A, B[:off], C[:off], D, h0, [])
        assert torch.equal(snaps[j], final), off


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_mamba2_decode_equals_the_op_by_op_path(dtype, no_kernels):
    """mamba2_decode_ (conv, step sizes and state update in one call) must give exactly the result of the kernels
    one after the other, and match the PyTorch fallback; 5 sequences in scattered slots, 2 groups, clamped dt."""
    from stateserve.layers.metadata import StateMetadata

    g = torch.Generator().manual_seed(21)
    S, num_slots = 5, 9
    mixer, states = random_mamba2_mixer(dtype, num_slots, g)
    slots = torch.tensor([7, 2, 5, 0, 8])
    meta = StateMetadata(query_start_loc=list(range(S + 1)), query_lens=[1] * S, slots=slots,
                         has_initial_state=[True] * S, is_decode_only=True)
    xbc = torch.randn(S, mixer.conv_dim, generator=g).to(dtype)
    dt = torch.randn(S, 4, generator=g).to(dtype)
    A = mixer.neg_exp_A()
    results = {}
    for name in ("fused", "op_by_op", "pytorch"):
        no_kernels(name != "pytorch")
        mixer.bind_cache({k: v.clone() for k, v in states.items()})
        if name == "op_by_op":
            y = mixer._decode_unfused(xbc, dt, A, slots)
        else:
            y = mixer._decode(xbc, dt, A, meta)
        results[name] = (y, mixer.states)
    (yf, sf), (yo, so), (yp, sp) = results["fused"], results["op_by_op"], results["pytorch"]
    assert torch.equal(yf, yo) and all(torch.equal(sf[k], so[k]) for k in sf)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    _close(yf, yp, tol)
    for k in sf:
        _close(sf[k], sp[k], tol)
    untouched = [i for i in range(num_slots) if i not in slots.tolist()]
    assert all(torch.equal(sf[k][untouched], states[k][untouched]) for k in sf)
    assert not torch.equal(sf["ssm"][slots], states["ssm"][slots])  # the update happened


def test_bfloat16_ssm_states_update_in_float32_and_store_rounded(no_kernels):
    """With bfloat16 SSM states (mamba_ssm_cache_dtype) the fused decode and the plain state update compute as on
    float32 states holding the same values and store the new state rounded: y agrees to float32 summation order,
    the state is the float32 result rounded to bfloat16 (within one bfloat16 step where that order flips a
    rounding)."""
    from stateserve.layers.mamba2_mixer import Mamba2Mixer

    g = torch.Generator().manual_seed(5)
    mixer = Mamba2Mixer(hidden_size=32, num_heads=4, head_dim=16, state_size=16, n_groups=2, conv_kernel=4,
                        dtype=torch.float32)
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    conv = torch.randn(6, mixer.conv_dim, 3, generator=g)
    ssm16 = torch.randn(6, 4, 16, 16, generator=g).to(torch.bfloat16)
    slots = torch.tensor([4, 1, 3])
    xbc, dt = torch.randn(3, mixer.conv_dim, generator=g), torch.randn(3, 4, generator=g)
    A = mixer.neg_exp_A()
    taps, bias = mixer.conv_taps()
    outs = {}
    for dtype in (torch.float32, torch.bfloat16):
        states = ssm16.to(dtype).clone()
        y = kernels.mamba2_decode_(conv.clone(), states, slots, xbc, dt, taps, bias, mixer.dt_bias, 0.0,
                                   float("inf"), A, mixer.D, 2)
        outs[dtype] = (y, states)
    (y32, s32), (y16, s16) = outs[torch.float32], outs[torch.bfloat16]
    assert s16.dtype == torch.bfloat16
    _close(y16, y32, 1e-5)
    _close_bf16_state(s16, s32)
    untouched = [i for i in range(6) if i not in slots.tolist()]
    assert torch.equal(s16[untouched], ssm16[untouched]) and not torch.equal(s16[slots], ssm16[slots])
    # the op-by-op kernel on the same inputs
    x, dts = torch.randn(3, 4, 16, generator=g), torch.rand(3, 4, generator=g)
    B, C = torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    st32, st16 = ssm16.float(), ssm16.clone()
    ya = kernels.ssd_state_update_(st32, slots, x, dts, A, B, C, mixer.D)
    yb = kernels.ssd_state_update_(st16, slots, x, dts, A, B, C, mixer.D)
    _close(yb, ya, 1e-5)
    _close_bf16_state(st16, st32)


def _close_bf16_state(got: torch.Tensor, full: torch.Tensor) -> None:
    """got (bfloat16) is full (float32) rounded, up to one bfloat16 step."""
    step = full.abs().clamp_min(1e-30) * 2.0 ** -7
    assert ((got.float() - full).abs() <= step).all()
    assert (got == full.to(torch.bfloat16)).float().mean() > 0.99
