"""The C++ few-row linear kernel (csrc/linear.cpp) and FastLinear, against F.linear in float64."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stateserve.layers import cpu_kernels
from stateserve.layers.linear import MAX_ROWS, FastLinear, _onednn_linear, install_fast_linear

kernels = cpu_kernels.load()
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _supported(dtype: torch.dtype) -> bool:
    return kernels is not None and kernels.fast_linear_supported(dtype)


def _rel_err(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> float:
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,out_features,in_features", [
    (1, 64, 64), (1, 13, 40), (1, 21, 70), (3, 7, 33), (4, 9, 16), (5, 130, 100), (8, 1, 17), (17, 64, 768), (64, 255, 31), (2, 6, 1)])
def test_kernel_matches_float64(dtype, rows, out_features, in_features):
    if not _supported(dtype):
        pytest.skip(f"no kernel for {dtype} on this CPU")
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype)
    assert _rel_err(kernels.fast_linear(x, w, None), x, w, None) < TOL[dtype]
    assert _rel_err(kernels.fast_linear(x, w, b), x, w, b) < TOL[dtype]


@pytest.mark.parametrize("in_features", [96, 100])  # 100: a masked rest of k after the full vectors
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_is_batch_invariant_and_takes_strided_rows(dtype, in_features):
    if not _supported(dtype):
        pytest.skip(f"no kernel for {dtype} on this CPU")
    g = torch.Generator().manual_seed(0)
    # 14 rows: tiles of 4, 4, 4 and 2 rows of x, each compared with one row alone (three code paths); rows with a
    # stride, not unit column stride
    x = torch.randn(14, 2 * in_features, generator=g).to(dtype)[:, ::2]
    w = torch.randn(50, in_features, generator=g).to(dtype)  # 50 outputs: six 8-row tiles of the one-row path, a rest
    b = torch.randn(50, generator=g).to(dtype)
    for bias in (None, b):
        full = kernels.fast_linear(x, w, bias)
        for i in range(x.shape[0]):  # each row alone gives bit-identical outputs: results do not depend on batching
            assert torch.equal(kernels.fast_linear(x[i:i + 1], w, bias), full[i:i + 1])
        assert _rel_err(full, x, w, bias) < TOL[dtype]


def test_kernel_rejects_bad_shapes():
    if not _supported(torch.float32):
        pytest.skip("no float32 kernel on this CPU")
    with pytest.raises(RuntimeError, match="columns"):
        kernels.fast_linear(torch.randn(2, 5), torch.randn(3, 4), None)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        kernels.fast_linear(torch.randn(2, 4), torch.randn(3, 4).double(), None)


def test_fast_linear_module_routes_by_rows_and_grad():
    if not _supported(torch.float32):
        pytest.skip("no float32 kernel on this CPU")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 8, bias=False))
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    assert install_fast_linear(model, torch.float32, torch.device("cpu")) == 2
    assert all(isinstance(m, FastLinear) for m in (model[0], model[2]))
    assert model.state_dict().keys() == reference.keys()  # same parameters, same names
    calls = []
    real = kernels.fast_linear
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "fast_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
        x = torch.randn(3, 5, 32)  # 15 rows in a 3-d batch
        with torch.no_grad():
            out = model(x)
        assert calls == [15, 15]
        with torch.no_grad():
            model(torch.randn(MAX_ROWS[torch.float32] + 1, 32))  # more rows than max_rows: oneDNN, not the kernel
        assert calls == [15, 15]
        model(x)  # grad enabled: F.linear, so autograd still works
        assert calls == [15, 15]
    ref = F.linear(F.relu(F.linear(x, reference["0.weight"], reference["0.bias"])), reference["2.weight"])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wide_products_go_through_onednn_and_match_f_linear(dtype):
    onednn = _onednn_linear()
    if onednn is None:
        pytest.skip("no oneDNN in this torch build")
    torch.manual_seed(0)
    layer = nn.Linear(384, 1152).to(dtype)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    install_fast_linear(layer, dtype, torch.device("cpu"))
    assert layer.onednn is onednn
    x = torch.randn(3, 100, 384).to(dtype)  # 300 rows, past max_rows
    with torch.no_grad():
        out = layer(x)
    assert out.shape == (3, 100, 1152)
    ref = F.linear(x.float(), weight.float(), bias.float())
    tol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    assert not torch.allclose(out.float(), F.linear(x.float(), weight.float().roll(1, 0), bias.float()), atol=tol)


def test_install_skips_unsupported_dtypes_and_devices():
    model = nn.Linear(4, 4).half()
    assert install_fast_linear(model, torch.float16, torch.device("cpu")) == 0
    assert install_fast_linear(nn.Linear(4, 4), torch.float32, torch.device("meta")) == 0
    assert type(model) is nn.Linear
