"""The panel linear kernel (csrc/packed_linear.cpp) and FastLinear's packed copy, against F.linear in float64."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stateserve.layers.linear import PANEL_COLUMNS, install_fast_linear, prepack_fast_linear
from stateserve.platform import cpu_kernels, kernels as kernel_table

kernels = cpu_kernels.load()
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _packed(w: torch.Tensor, lane_order: bool = False) -> torch.Tensor:
    n, k = w.shape
    step = 2 if w.dtype == torch.bfloat16 else 1
    out = torch.full((-(-n // PANEL_COLUMNS), k // step, PANEL_COLUMNS), 7, dtype=torch.int32)  # 7: stale bits
    kernels.pack_linear_weight_(out, w, lane_order)
    return out


def _skip_unless(dtype: torch.dtype, in_features: int = 64) -> None:
    if kernels is None or not kernels.packed_linear_supported(dtype, in_features):
        pytest.skip(f"no panel kernel for {dtype} here")


def _rel_err(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> float:
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("lane_order", [False, True], ids=["k-order", "lane-order"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,out_features,in_features", [
    (3, 1, 16), (8, 47, 64), (9, 48, 40), (17, 49, 100), (40, 130, 768), (300, 100, 96), (2, 250, 34)])
def test_panel_kernel_matches_float64(dtype, rows, out_features, in_features, lane_order):
    """Every rest: columns past the last full panel (1, 47, 49, 130), rows past full 8-row tiles and past the
    256-row pass (300), row chunks split across threads (few panels, many rows); rows with a stride."""
    _skip_unless(dtype, in_features)
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, 2 * in_features, generator=g).to(dtype)[:, ::2]
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype)
    packed = _packed(w, lane_order)
    for bias in (None, b):
        out = kernels.packed_linear(x, packed, bias, out_features, lane_order)
        assert out.shape == (rows, out_features) and out.dtype == dtype
        assert _rel_err(out, x, w, bias) < TOL[dtype]
        assert _rel_err(out, x, -w, bias) > 0.1  # a wrong weight would be seen


@pytest.mark.parametrize("lane_order", [False, True], ids=["k-order", "lane-order"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panel_kernel_is_batch_invariant(dtype, lane_order):
    """A row's outputs are bit-identical alone and in any batch: the 8-row tiles, their rests, the 256-row passes."""
    _skip_unless(dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 100, generator=g).to(dtype)
    w = torch.randn(100, 100, generator=g).to(dtype)
    b = torch.randn(100, generator=g).to(dtype)
    packed = _packed(w, lane_order)
    full = kernels.packed_linear(x, packed, b, 100, lane_order)
    for i in (0, 7, 8, 13, 255, 256, 299):
        assert torch.equal(kernels.packed_linear(x[i:i + 1], packed, b, 100, lane_order), full[i:i + 1])
        assert torch.equal(kernels.packed_linear(x[i:i + 3], packed, b, 100, lane_order)[:1], full[i:i + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features", [2, 16, 30, 34, 64, 100, 200, 768])
def test_panel_kernel_sums_in_the_few_row_kernels_order(dtype, in_features):
    """In the lane order (batch_invariant): every output bit-identical to the few-row kernel's (csrc/linear.cpp) for
    any number of rows: one or two decoding rows take that kernel, more this one, and a request's result must not depend on which. K covers chains
    of equal and unequal lengths (k-steps a multiple of the lanes or not, fewer k-steps than lanes); rows cover every
    tile height and its rest; columns a partial panel; with and without bias. Checked to fail when the chains are
    added in another order than the few-row kernel's reduction."""
    _skip_unless(dtype, in_features)
    if not kernels.fast_linear_supported(dtype):
        pytest.skip(f"no few-row kernel for {dtype} here")
    g = torch.Generator().manual_seed(in_features)
    out_features = 113
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype)
    packed = _packed(w, lane_order=True)
    x = torch.randn(17, in_features, generator=g).to(dtype)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for bias in (None, b):
        few_row = kernels.fast_linear(x, w, bias)
        for rows in range(1, 18):
            assert torch.equal(kernels.packed_linear(x[:rows], packed, bias, out_features, True).view(bits),
                               few_row[:rows].view(bits)), rows


def test_panel_kernel_rejects_what_it_cannot_do():
    _skip_unless(torch.float32)
    w = torch.randn(50, 64)
    packed = _packed(w)
    with pytest.raises(RuntimeError, match="does not match"):
        kernels.packed_linear(torch.randn(4, 32), packed, None, 50)  # another in_features
    with pytest.raises(RuntimeError, match="does not match"):
        kernels.packed_linear(torch.randn(4, 64), packed, None, 200)  # more outputs than panels
    with pytest.raises(RuntimeError, match="bias"):
        kernels.packed_linear(torch.randn(4, 64), packed, torch.randn(49), 50)
    with pytest.raises(RuntimeError, match="packed must be int32"):
        kernels.pack_linear_weight_(torch.zeros(1, 64, PANEL_COLUMNS, dtype=torch.int32), w)  # too few panels
    assert not kernels.packed_linear_supported(torch.bfloat16, 33)  # pairs of k: an odd K has no bfloat16 layout
    assert not kernels.packed_linear_supported(torch.float16, 64)
    with pytest.raises(RuntimeError, match="no packed kernel"):
        kernels.pack_linear_weight_(torch.zeros(1, 16, PANEL_COLUMNS, dtype=torch.int32), torch.randn(5, 33).bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_packed_weights_route_match_and_follow_weight_changes(dtype):
    """After prepack, products of more than max_rows_prepacked rows use the panel copy: same results as F.linear, and
    a weight written in place or replaced after packing is packed again, never served stale."""
    _skip_unless(dtype)
    torch.manual_seed(0)
    calls = []

    class Spy:  # records the panel kernel's calls, forwards everything else
        def __getattr__(self, name):
            return getattr(kernels, name)

        def packed_linear(self, x, p, *args):
            calls.append((x.shape[0], p))
            return kernels.packed_linear(x, p, *args)

    layer = nn.Linear(96, 200).to(dtype).requires_grad_(False)
    with kernel_table.using(kernel_table.build(Spy())) as table:
        install_fast_linear(layer, dtype, torch.device("cpu"))
    few = table.linear(dtype).max_rows_prepacked
    assert prepack_fast_linear(layer) == 5 * (96 // (2 if dtype == torch.bfloat16 else 1)) * PANEL_COLUMNS * 4
    assert layer.packed is not None and layer.packed.dtype == torch.int32
    assert layer.max_rows == few
    x = torch.randn(40, 96).to(dtype)

    def check() -> None:
        ref = F.linear(x.float(), layer.weight.float(), layer.bias.float())
        torch.testing.assert_close(layer(x).float(), ref, rtol=TOL[dtype] * 5, atol=TOL[dtype] * 5)

    check()
    packed = layer.packed
    calls.clear()
    layer(x)  # 40 rows and few + 1 through the panel copy, `few` through the other kernel
    layer(x[:few + 1])
    layer(x[:few])
    assert [n for n, _ in calls] == [40, few + 1] and all(p is packed for _, p in calls)
    layer.weight.mul_(-1)  # in place (a weight reload copies into the parameter)
    check()
    assert layer.packed is not packed
    layer.weight.data = torch.randn(200, 96).to(dtype)  # replaced
    check()
