"""bench/widen_demo.py: a demo model widened and deepened computes the demo's own logits (so the speculative-
decoding benchmark's base-size copy workload runs the trained function, not a random one)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)
import widen_demo  # noqa: E402


@pytest.mark.parametrize("demo", ["mamba2-demo", "hybrid-demo", "llama-demo"])
def test_widened_demo_computes_the_demo_logits(demo, tmp_path):
    from transformers import AutoModelForCausalLM

    src = os.path.join(widen_demo.DEMO_DIR, demo)
    out = widen_demo.write_widened(demo, str(tmp_path / "wide"), r=2, layers=6, dtype=torch.float32)
    ids = torch.randint(1, 2048, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()(ids).logits
        wide_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        wide = wide_model(ids).logits
    assert wide_model.config.num_hidden_layers == 6
    assert sum(p.numel() for p in wide_model.parameters()) > 3 * sum(
        p.numel() for p in AutoModelForCausalLM.from_pretrained(src).parameters())
    # float32 round-off of sums taken in another order over ~10 layers: relative error ~1e-6; a wrong rule is O(1)
    scale = ref.abs().max().item()
    assert (wide - ref).abs().max().item() <= 1e-5 * scale, (wide - ref).abs().max().item()
    assert torch.equal(wide.argmax(-1), ref.argmax(-1))
