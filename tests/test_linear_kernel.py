"""The C++ few-row linear kernel (csrc/linear.cpp) and FastLinear, against F.linear in float64."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stateserve.layers.linear import FastLinear, install_fast_linear
from stateserve.platform import cpu_kernels, kernels as kernel_table
from stateserve.platform.kernels import MAX_ROWS, UPCAST_MIN_ROWS, computes_linear, onednn_linear

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
    calls = []

    class Spy:  # counts the few-row kernel's calls, forwards everything else
        def __getattr__(self, name):
            return getattr(kernels, name)

        def fast_linear(self, *args):
            calls.append(args[0].shape[0])
            return kernels.fast_linear(*args)

    with kernel_table.using(kernel_table.build(Spy())):
        assert install_fast_linear(model, torch.float32, torch.device("cpu")) == 2
        assert all(isinstance(m, FastLinear) for m in (model[0], model[2]))
        assert model.state_dict().keys() == reference.keys()  # same parameters, same names
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
    onednn = onednn_linear(dtype)
    if onednn is None:
        pytest.skip(f"no oneDNN linear for {dtype} here (bfloat16 needs AVX-512)")
    torch.manual_seed(0)
    layer = nn.Linear(384, 1152).to(dtype)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    install_fast_linear(layer, dtype, torch.device("cpu"))
    assert layer.routes.onednn is onednn
    x = torch.randn(3, 100, 384).to(dtype)  # 300 rows, past max_rows
    with torch.no_grad():
        out = layer(x)
    assert out.shape == (3, 100, 1152)
    ref = F.linear(x.float(), weight.float(), bias.float())
    tol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    assert not torch.allclose(out.float(), F.linear(x.float(), weight.float().roll(1, 0), bias.float()), atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_row_count_works_on_this_cpu_whatever_its_paths(dtype):
    """Whatever this CPU lacks (AVX-512, bfloat16 in oneDNN), an installed layer must compute, not raise."""
    torch.manual_seed(0)
    layer = nn.Linear(96, 200).to(dtype)
    weight, bias = layer.weight.detach().float(), layer.bias.detach().float()
    install_fast_linear(layer, dtype, torch.device("cpu"))
    tol = 1e-4 if dtype == torch.float32 else 0.1
    for rows in (1, 2, 5, 300):
        x = torch.randn(rows, 96).to(dtype)
        with torch.no_grad():
            out = layer(x)
        torch.testing.assert_close(out.float(), F.linear(x.float(), weight, bias), rtol=tol, atol=tol)


def test_a_op_that_refuses_a_dtype_is_not_used_for_it():
    def refuses_bfloat16(x, w, bias, *args):  # what oneDNN does on a CPU without AVX-512
        if x.dtype == torch.bfloat16:
            raise RuntimeError("could not create a primitive descriptor for the inner product")
        return F.linear(x, w, bias)

    assert computes_linear(refuses_bfloat16, torch.float32)
    assert not computes_linear(refuses_bfloat16, torch.bfloat16)
    assert not computes_linear(lambda x, w, *args: F.linear(x, w) + 1, torch.float32)  # wrong answers: refused too


def test_bfloat16_without_any_fast_path_computes_in_float32_and_says_so(monkeypatch, caplog):
    """An AVX2-only CPU without the C++ kernels: oneDNN refuses bfloat16 and PyTorch's own bfloat16 matmul crawls,
    so many rows upcast."""
    with kernel_table.using(kernel_table.build(None, onednn=False)), caplog.at_level("WARNING", logger="stateserve"):
        assert install_fast_linear(nn.Linear(4, 4), torch.float32, torch.device("cpu")) == 0
        assert not caplog.records
        torch.manual_seed(0)
        layer = nn.Linear(64, 48).bfloat16()
        assert install_fast_linear(layer, torch.bfloat16, torch.device("cpu")) == 1
    assert "float32" in caplog.records[0].getMessage() and layer.routes.upcast
    calls, plain_linear = [], F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: calls.append(x.dtype) or plain_linear(x, w, b))
    for rows in (1, UPCAST_MIN_ROWS - 1, UPCAST_MIN_ROWS, 100):
        x = torch.randn(rows, 64).bfloat16()
        with torch.no_grad():
            out = layer(x)
        assert out.dtype == torch.bfloat16
        ref = plain_linear(x.float(), layer.weight.float(), layer.bias.float())
        torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
    assert calls == [torch.bfloat16] * 2 + [torch.float32] * 2


def test_install_skips_unsupported_dtypes_and_devices():
    model = nn.Linear(4, 4).half()
    assert install_fast_linear(model, torch.float16, torch.device("cpu")) == 0
    assert install_fast_linear(nn.Linear(4, 4), torch.float32, torch.device("meta")) == 0
    assert type(model) is nn.Linear
