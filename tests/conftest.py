"""Shared fixtures: tiny random models written with transformers' save_pretrained, and a tiny tokenizer."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("STATESERVE_DISABLE_TQDM", "1")
# Tests compare runs bit for bit, and a kernel's reduction order follows the team size: a team that shrank between
# two runs because something else ran on the machine would fail them. tests/test_cpu_threads.py runs the governor.
os.environ.setdefault("STATESERVE_ADAPTIVE_THREADS", "0")
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _settings_read_afresh():
    """An engine freezes the STATESERVE_* settings (envs.enable_envs_cache); without this a value one test set with
    monkeypatch would outlive it in this worker process and reach the next test's engines (while the ranks they
    spawn would read os.environ)."""
    yield
    from stateserve import envs

    envs.disable_envs_cache()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    from utils import make_tokenizer

    return make_tokenizer(str(tmp_path_factory.mktemp("tokenizer")))


class _CountingModule:
    """The C++ module with every kernel call counted: a test that asked for the kernels and never reached one would
    compare the PyTorch path with itself."""

    def __init__(self, module) -> None:
        self.module, self.calls = module, 0

    def __getattr__(self, name: str):
        fn = getattr(self.module, name)
        if name.endswith("_supported") or name in ("simd_float32_lanes", "compiled_isa"):
            return fn

        def counted(*args, **kwargs):
            self.calls += 1
            return fn(*args, **kwargs)
        return counted


@pytest.fixture
def no_kernels():
    """no_kernels(True) runs the C++ kernels, no_kernels(False) the PyTorch fallbacks (the reference the kernels must
    reproduce): a kernel table with the C++ module, or one without, until the test ends, which fails if the kernels
    were asked for and none ran."""
    import contextlib

    from stateserve.platform import cpu_kernels, kernels

    module = cpu_kernels.load()
    counting = _CountingModule(module) if module is not None else None
    with_module, pytorch = kernels.build(counting), kernels.build(None)
    stack, asked = contextlib.ExitStack(), []

    def use(enabled: bool) -> None:
        asked.append(enabled)
        stack.enter_context(kernels.using(with_module if enabled else pytorch))
    yield use
    stack.close()
    if counting is not None and any(asked):
        assert counting.calls, "no_kernels(True), but no C++ kernel ran: the test compared PyTorch with itself"
