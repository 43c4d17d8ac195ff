"""Weights moved onto a huge-page arena after loading: same values and outputs, tied tensors still shared, small
tensors left alone, nothing moved when switched off, and the mapping gone once the model is."""
from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from stateserve import envs
from stateserve.platform import huge_pages

pytestmark = pytest.mark.skipif(not huge_pages.available(), reason="no madvise(MADV_HUGEPAGE) here")


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1024, 512)  # 2 MiB
        self.proj = nn.Linear(512, 1024)  # 2 MiB weight, 4 KiB bias (left where it is)
        self.head = nn.Linear(512, 1024, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("table", torch.randn(600, 512))  # 1.2 MiB buffer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.table[ids]
        return self.head(torch.tanh(self.proj(h)[..., :512]))


def _mapped(ptr: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return True
    return False


def test_weights_move_into_one_aligned_arena_and_outputs_stay():
    torch.manual_seed(0)
    model = Tiny().requires_grad_(False)
    ids = torch.tensor([1, 5, 599, 3])
    expected = model(ids)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    bias_ptr = model.proj.bias.data_ptr()
    moved = huge_pages.move_parameters(model)
    assert moved >= 2 * (2 << 20) + 600 * 512 * 4
    ptrs = [model.embed.weight.data_ptr(), model.proj.weight.data_ptr(), model.table.data_ptr()]
    assert min(ptrs) % huge_pages.HUGE_PAGE == 0  # the arena starts on a huge page
    assert max(ptrs) - min(ptrs) < moved  # all in one arena
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()  # still tied
    assert model.proj.bias.data_ptr() == bias_ptr  # too small to move
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name]), name
    assert torch.equal(model(ids), expected)

    arena_ptr = min(ptrs)
    assert _mapped(arena_ptr)
    del model, t
    gc.collect()
    assert not _mapped(arena_ptr)  # freeing the model unmaps the arena


def test_switched_off_moves_nothing(monkeypatch):
    monkeypatch.setenv("STATESERVE_HUGE_PAGES", "0")
    envs.disable_envs_cache()
    model = Tiny().requires_grad_(False)
    ptr = model.proj.weight.data_ptr()
    assert huge_pages.move_parameters(model) == 0
    assert model.proj.weight.data_ptr() == ptr


def _faulted_kib(ptr: int) -> int:
    """Resident KiB of the mapping holding ptr (from /proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            first = line.split()[0]
            if "-" in first and ":" not in first:
                lo, hi = (int(x, 16) for x in first.split("-"))
                inside = lo <= ptr < hi
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1])
    raise AssertionError("not mapped")


@pytest.mark.parametrize("switched_on", [True, False])
def test_caches_on_faulted_in_huge_pages(monkeypatch, switched_on):
    """The KV pool and the recurrent-state slots are allocated on huge-page-aligned mappings, zeroed and already
    resident (faulted in at allocation, not mid-run); switched off, they are ordinary tensors. Either way they are
    all zeros, and a layer's state view still writes into the shared stacked tensor."""
    from stateserve.cache.spec import KVCacheSpec, StateSpec
    from stateserve.cache.storage import CachePlan, CacheStorage

    monkeypatch.setenv("STATESERVE_HUGE_PAGES", "1" if switched_on else "0")
    envs.disable_envs_cache()
    spec = KVCacheSpec(num_kv_heads=4, head_dim=64, dtype=torch.bfloat16)
    state = StateSpec.of({"ssm": (8, 64, 64)}, {"ssm": torch.float32})  # 128 KiB a slot
    plan = CachePlan(num_blocks=256, num_slots=16, max_num_seqs=8, kv_bytes=256 * spec.bytes_per_block(16),
                     state_bytes=16 * 2 * state.bytes_per_slot())
    storage = CacheStorage({"layer": spec}, {"m0": state, "m1": state}, plan, 16, torch.device("cpu"))
    k, v = storage.kv["layer"]
    ssm0, ssm1 = storage.states["m0"]["ssm"], storage.states["m1"]["ssm"]
    assert k.shape == (256, 4, 16, 64) and not k.any() and not v.any()
    assert ssm0.shape == (16, 8, 64, 64) and not ssm0.any() and not ssm1.any()
    for tensor in (k, v, ssm0):  # 2 MiB each (the two layers' states are one 4 MiB group)
        assert (tensor.data_ptr() % huge_pages.HUGE_PAGE == 0) == switched_on
        if switched_on:  # resident before any step wrote to it
            assert _faulted_kib(tensor.data_ptr()) * 1024 >= tensor.numel() * tensor.element_size()
    ssm1[3].fill_(1.0)
    storage.zero_slot(3)
    assert not ssm1.any()
    envs.disable_envs_cache()
