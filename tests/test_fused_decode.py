"""The fused decode kernels of whole layers (mamba1_decode_, mamba2_mixer_decode_; decoder_layer_decode_ is tested
in test_llama.py) against the same layers op by op and against PyTorch without kernels: outputs, states updated at
the step's slots only, prefix-cache snapshots, when the fused path declines, and weight updates."""
from __future__ import annotations

import pytest
import torch

from stateserve.platform import cpu_kernels, kernels as kernel_table
from utils import random_mamba2_mixer

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="C++ CPU kernels unavailable")


def _skip_without_few_row_kernel(dtype):
    """The fused steps run their projections on the few-row kernel (every build has it in both dtypes; a module that
    lacks it would skip here rather than test the fallback against itself)."""
    if not kernels.fast_linear_supported(dtype):
        pytest.skip(f"no few-row linear kernel for {dtype} in this build ({kernels.compiled_isa()})")


def _close(a, b, tol):
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def _decode_meta(slots: list[int], checkpoints=()):
    from stateserve.layers.metadata import StateMetadata
    S = len(slots)
    return StateMetadata(query_start_loc=list(range(S + 1)), query_lens=[1] * S, slots=torch.tensor(slots),
                         has_initial_state=[True] * S, is_decode_only=True, checkpoints=list(checkpoints))


def _fused_against_op_by_op(mixer, states, x, meta, dtype, monkeypatch):
    """Runs a decode step of `mixer` three ways from the same states: its fused kernel, the same kernels op by op
    (the fused path switched off), and PyTorch without kernels. Returns {name: (output, states)}."""
    from stateserve.layers.linear import install_fast_linear
    fused = type(mixer)._fused_decode
    results = {}
    for name in ("pytorch", "op_by_op", "fused"):
        table = kernel_table.build(None) if name == "pytorch" else kernel_table.table()
        with kernel_table.using(table), torch.inference_mode():
            if name == "op_by_op":  # the linears as the runner has them on CPU (pytorch: plain nn.Linear)
                assert install_fast_linear(torch.nn.Sequential(mixer), dtype, torch.device("cpu")) > 0
            monkeypatch.setattr(type(mixer), "_fused_decode", fused if name == "fused" else (lambda *a: None))
            mixer.bind_cache({k: v.clone() for k, v in states.items()})
            if name == "fused":
                assert mixer._fused_decode(x, meta) is not None  # the fused kernel applies here ...
                mixer.bind_cache({k: v.clone() for k, v in states.items()})
            results[name] = (mixer(x, meta), mixer.states)
    return results


def _check_fused(results, states, slots, dtype, checkpoint_dst):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    (yf, sf) = results["fused"]
    for other in ("op_by_op", "pytorch"):
        yo, so = results[other]
        _close(yf, yo, tol)
        for k in sf:
            _close(sf[k], so[k], tol)
    untouched = [i for i in range(states["ssm"].shape[0]) if i not in slots and i != checkpoint_dst]
    assert all(torch.equal(sf[k][untouched], states[k][untouched]) for k in sf)
    assert not torch.equal(sf["ssm"][slots], states["ssm"][slots])  # the update happened
    assert all(torch.equal(sf[k][checkpoint_dst], sf[k][slots[1]]) for k in sf)  # the snapshot of sequence 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_mamba1_mixer_decode_matches_the_layer_op_by_op(dtype, monkeypatch):
    """mamba1_decode_ (in_proj to out_proj in one call) against the layer's op-by-op kernels and PyTorch: outputs,
    states updated at the step's slots only, and a prefix-cache snapshot taken after the step."""
    _skip_without_few_row_kernel(dtype)
    from stateserve.layers.selective_scan import MambaMixer
    g = torch.Generator().manual_seed(5)
    mixer = MambaMixer(24, 40, 16, conv_kernel=4, time_step_rank=6, use_conv_bias=True, use_bias=True,
                       dtype=dtype).to(dtype)
    with torch.no_grad():
        for name, p in mixer.named_parameters():
            if name != "A_log":
                p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    slots, num_slots = [6, 1, 3], 8
    states = {"conv": torch.randn(num_slots, 40, 3, generator=g).to(dtype),
              "ssm": torch.randn(num_slots, 40, 16, generator=g)}
    x = torch.randn(3, 24, generator=g).to(dtype)
    results = _fused_against_op_by_op(mixer, states, x, _decode_meta(slots, [(1, 1, 7)]), dtype, monkeypatch)
    _check_fused(results, states, slots, dtype, checkpoint_dst=7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_mamba2_mixer_decode_matches_the_layer_op_by_op(dtype, monkeypatch):
    """mamba2_mixer_decode_ (in_proj, conv, state update, gated norm, out_proj in one call) likewise."""
    _skip_without_few_row_kernel(dtype)
    g = torch.Generator().manual_seed(6)
    slots, num_slots = [4, 0, 2], 8
    mixer, states = random_mamba2_mixer(dtype, num_slots, g)
    x = torch.randn(3, 32, generator=g).to(dtype)
    results = _fused_against_op_by_op(mixer, states, x, _decode_meta(slots, [(1, 1, 7)]), dtype, monkeypatch)
    _check_fused(results, states, slots, dtype, checkpoint_dst=7)


def test_fused_mixer_decode_steps_aside_past_the_few_row_kernel():
    """More rows than the few-row kernel takes (a large decode batch): the fused path declines and the layer's
    usual path runs."""
    _skip_without_few_row_kernel(torch.float32)
    from stateserve.layers.linear import install_fast_linear
    from stateserve.layers.selective_scan import MambaMixer
    mixer = MambaMixer(24, 40, 16, conv_kernel=4, time_step_rank=6, use_conv_bias=True, use_bias=False)
    install_fast_linear(torch.nn.Sequential(mixer), torch.float32, torch.device("cpu"))
    mixer.bind_cache({"conv": torch.zeros(40, 40, 3), "ssm": torch.zeros(40, 40, 16)})
    with torch.inference_mode():
        assert mixer._fused_decode(torch.randn(2, 24), _decode_meta([0, 1])) is not None
        rows = mixer.in_proj.max_rows + 1
        assert mixer._fused_decode(torch.randn(rows, 24), _decode_meta(list(range(rows)))) is None


def test_fused_decode_follows_weight_updates(monkeypatch):
    """The fused call's arguments are made once per weight version: a parameter written in place (D, whose bfloat16
    copy the call holds) or replaced (out_proj's weight) is what the next step computes with."""
    from stateserve.layers.linear import install_fast_linear
    from stateserve.layers.selective_scan import MambaMixer
    dtype = torch.bfloat16
    _skip_without_few_row_kernel(dtype)
    g = torch.Generator().manual_seed(8)
    mixer = MambaMixer(24, 40, 16, conv_kernel=4, time_step_rank=6, use_conv_bias=True, use_bias=False,
                       dtype=dtype).to(dtype)
    mixer.D.data = mixer.D.data.float()  # kept in float32, as checkpoints often have it: the call holds a copy
    install_fast_linear(torch.nn.Sequential(mixer), dtype, torch.device("cpu"))
    states = {"conv": torch.randn(4, 40, 3, generator=g).to(dtype), "ssm": torch.randn(4, 40, 16, generator=g)}
    x, meta = torch.randn(2, 24, generator=g).to(dtype), _decode_meta([1, 3])

    def step(fused: bool) -> torch.Tensor:
        mixer.bind_cache({k: v.clone() for k, v in states.items()})
        with torch.inference_mode():
            return mixer._fused_decode(x, meta) if fused else mixer(x, _decode_meta([1, 3]))

    before = step(True)
    with torch.no_grad():
        mixer.D.mul_(3.0)
    after_d = step(True)
    mixer.out_proj.weight = torch.nn.Parameter(torch.randn(24, 40, generator=g).to(dtype))
    after_w = step(True)
    assert not torch.equal(before, after_d) and not torch.equal(after_d, after_w)
    monkeypatch.setattr(MambaMixer, "_fused_decode", lambda *a: None)
    _close(after_w, step(False), 2e-2)
