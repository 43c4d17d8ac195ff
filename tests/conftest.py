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


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    from utils import make_tokenizer

    return make_tokenizer(str(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture
def no_kernels(monkeypatch):
    """no_kernels(True) runs the C++ kernels, no_kernels(False) the PyTorch fallbacks: the reference the kernels must
    reproduce."""
    from stateserve.layers import cpu_kernels

    kernels = cpu_kernels.load()

    def use(enabled: bool) -> None:
        monkeypatch.setattr(cpu_kernels, "load", (lambda: kernels) if enabled else (lambda: None))
    return use
