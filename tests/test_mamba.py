"""Mamba and FalconMamba: greedy parity with transformers under chunked prefill, teacher-forced logits through
the real state caches (float32 and bfloat16), prefix-caching checkpoints of the mixer, memory of the scan."""
from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import FalconMambaConfig, FalconMambaForCausalLM, MambaConfig, MambaForCausalLM

from stateserve import LLM, SamplingParams
from stateserve.layers.metadata import StateMetadata
from stateserve.layers.selective_scan import (MAX_SCAN_CHUNK, SCAN_BUDGET_ELEMENTS, MambaMixer, scan_chunk_size,
                                              selective_scan_prefill)
from state_checks import check_teacher_forced_logits
from utils import (assert_greedy_matches, build_hf_model, engine_teacher_forced_logits, hf_greedy, hf_logits,
                   save_model)

ARCHS = {"mamba": (MambaConfig, MambaForCausalLM), "falcon_mamba": (FalconMambaConfig, FalconMambaForCausalLM)}
BASE = dict(vocab_size=300, hidden_size=64, state_size=8, num_hidden_layers=2, tie_word_embeddings=False)
PROMPTS = [[1, 5, 9], [7, 3, 2, 8, 10, 11, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52],
           list(range(100, 136)), [250], [(17 * i) % 290 + 3 for i in range(40)]]


def _build(arch: str, tmp_path, **extra):
    config_cls, model_cls = ARCHS[arch]
    hf = build_hf_model(config_cls, model_cls, **{**BASE, **extra})
    # transformers initialises D, the norms and the biases to constants; perturb them so that a
    # mis-wired 1-D parameter changes the output
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 1 and "embeddings" not in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return hf, save_model(hf, str(tmp_path / arch))


GREEDY_CASES = [("mamba", {}), ("mamba", {"tie_word_embeddings": True}), ("falcon_mamba", {})]


@pytest.mark.parametrize("arch,extra", GREEDY_CASES, ids=["mamba", "mamba-tied", "falcon_mamba"])
def test_greedy_parity_chunked(arch, extra, tmp_path):
    hf, path = _build(arch, tmp_path, **extra)
    max_new = 12
    ref = hf_greedy(hf, PROMPTS, max_new)
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=16, enable_prefix_caching=False) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True))
        ours = [o.outputs[0].token_ids for o in outs]
        assert_greedy_matches(ours, ref, hf, PROMPTS)
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.cache.is_idle_and_full()


TF_CASES = [("mamba", {}), ("falcon_mamba", {"mixer_rms_eps": 1e-3}),
            ("mamba", {"residual_in_fp32": False, "use_bias": True, "use_conv_bias": False, "conv_kernel": 3,
                       "time_step_rank": 6, "layer_norm_epsilon": 1e-3})]


@pytest.mark.parametrize("arch,extra", TF_CASES, ids=["mamba", "falcon_mamba", "mamba-options"])
def test_teacher_forced_logits(arch, extra, tmp_path):
    hf, path = _build(arch, tmp_path, **extra)
    tokens = [(7 * i) % 290 + 3 for i in range(70)]
    ref = hf_logits(hf, tokens)
    # float32 states: only the scan's association order differs from transformers' sequential loop
    check_teacher_forced_logits(path, ref, tokens, atol=2e-4, rtol=1e-4)


def _hf_stepwise_logits(hf, tokens: list[int]) -> torch.Tensor:
    """transformers fed one token at a time through its cache: its decode arithmetic."""
    rows = []
    with torch.no_grad():
        out = hf(torch.tensor([tokens[:1]]), use_cache=True)
        rows.append(out.logits[0, -1].float())
        for t in tokens[1:]:
            out = hf(torch.tensor([[t]]), cache=out.cache, use_cache=True)
            rows.append(out.logits[0, -1].float())
    return torch.stack(rows)


@pytest.mark.parametrize("arch", ["mamba", "falcon_mamba"])
def test_bfloat16_arithmetic(arch, tmp_path):
    """bf16 rounding points match transformers: prefill vs its full forward, decode vs its one-token steps.
    (Adding the dt bias in float32, or doing decode's D skip in float32, moves logits by > 0.1 here.)"""
    hf, path = _build(arch, tmp_path)
    hf = hf.to(torch.bfloat16)
    tokens = [(11 * i) % 290 + 3 for i in range(40)]
    full_ref, step_ref = hf_logits(hf, tokens), _hf_stepwise_logits(hf, tokens)
    with LLM(path, skip_tokenizer_init=True, dtype="bfloat16") as llm:
        prefill = engine_teacher_forced_logits(llm, tokens, 64)
        decode = engine_teacher_forced_logits(llm, tokens, 1)
    assert (prefill - full_ref).abs().max() <= 0.1
    assert (decode - step_ref).abs().max() <= 0.1


# ---- the mixer layer on its own: checkpoints, resuming, decode -------------------------------------------
D_INNER, N_STATE, HIDDEN, NUM_SLOTS = 32, 8, 16, 10


def _mixer(bcdt_norm: str | None) -> MambaMixer:
    torch.manual_seed(0)
    m = MambaMixer(HIDDEN, D_INNER, N_STATE, conv_kernel=4, time_step_rank=4, use_conv_bias=True, use_bias=True,
                   bcdt_norm=bcdt_norm, rms_eps=1e-5)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name != "A_log":
                p.copy_(torch.randn(p.shape) * 0.3 + (1.0 if name.endswith("layernorm.weight") else 0.0))
    m.scan_chunk = 4  # tiny scan chunks so sequences and checkpoints straddle chunk boundaries
    # slots start as garbage: a first chunk must not read them
    m.bind_cache({"conv": torch.randn(NUM_SLOTS, D_INNER, 3), "ssm": torch.randn(NUM_SLOTS, D_INNER, N_STATE)})
    return m.eval()


def _step(m: MambaMixer, seqs: list[tuple[torch.Tensor, int, bool]], checkpoints=()) -> list[torch.Tensor]:
    """Run one step; seqs: (x [L, hidden], slot, has_initial_state). Returns each sequence's output."""
    lens = [x.shape[0] for x, _, _ in seqs]
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    meta = StateMetadata(query_start_loc=qsl, query_lens=lens, slots=torch.tensor([s for _, s, _ in seqs]),
                         has_initial_state=[r for _, _, r in seqs], is_decode_only=all(n == 1 for n in lens),
                         checkpoints=list(checkpoints))
    with torch.inference_mode():
        out = m(torch.cat([x for x, _, _ in seqs]), meta)
    return [out[a:b] for a, b in zip(qsl[:-1], qsl[1:])]


def _state(m: MambaMixer, slot: int) -> dict[str, torch.Tensor]:
    return {k: t[slot].clone() for k, t in m.states.items()}


def _set_state(m: MambaMixer, slot: int, state: dict[str, torch.Tensor]) -> None:
    for k, t in m.states.items():
        t[slot].copy_(state[k])


def _assert_state(m: MambaMixer, slot: int, expected: dict[str, torch.Tensor]) -> None:
    for k, t in m.states.items():
        torch.testing.assert_close(t[slot], expected[k], atol=1e-5, rtol=1e-5, msg=f"{k} state of slot {slot}")


@pytest.mark.parametrize("bcdt_norm", [None, "weightless", "weighted"])
def test_mixer_checkpoints(bcdt_norm):
    m = _mixer(bcdt_norm)
    torch.manual_seed(1)
    a0, b0 = torch.randn(5, HIDDEN), torch.randn(9, HIDDEN)
    a1, b1 = torch.randn(11, HIDDEN), torch.randn(3, HIDDEN)
    _step(m, [(a0, 0, False), (b0, 1, False)])
    start = {0: _state(m, 0), 1: _state(m, 1)}
    # prefill chunks of two sequences in one step, snapshots inside, across and at the end of scan chunks
    cps = [(0, 1, 2), (0, 6, 3), (0, 11, 4), (1, 2, 5), (1, 3, 6)]
    _step(m, [(a1, 0, True), (b1, 1, True)], cps)
    final = {0: _state(m, 0), 1: _state(m, 1)}
    for seq, off, dst in cps:
        x = (a1, b1)[seq]
        _set_state(m, 9, start[seq])
        _step(m, [(x[:off], 9, True)])
        _assert_state(m, dst, _state(m, 9))
    _assert_state(m, 4, final[0])
    # decode-only step: the snapshot after its single token equals the sequence's new state
    _step(m, [(torch.randn(1, HIDDEN), 0, True), (torch.randn(1, HIDDEN), 1, True)], [(1, 1, 7)])
    _assert_state(m, 7, _state(m, 1))
    # a sequence continuing by one token inside a mixed step takes the decode path: same snapshot rule
    _step(m, [(torch.randn(1, HIDDEN), 0, True), (torch.randn(4, HIDDEN), 8, False)], [(0, 1, 2), (1, 4, 3)])
    _assert_state(m, 2, _state(m, 0))
    _assert_state(m, 3, _state(m, 8))


@pytest.mark.parametrize("bcdt_norm", [None, "weightless"])
def test_mixer_resume_matches_one_shot(bcdt_norm):
    """One 30-token prefill == the same tokens as prefill chunks and single-token decode steps, from garbage slots."""
    m = _mixer(bcdt_norm)
    torch.manual_seed(2)
    x = torch.randn(30, HIDDEN)
    whole = _step(m, [(x, 0, False)])[0]
    whole_state = _state(m, 0)
    pieces, pos = [], 0
    for i, n in enumerate([7, 1, 13, 1, 1, 7]):
        other = (torch.randn(3, HIDDEN), 5, False)  # another sequence in the batch, sometimes
        seqs = [(x[pos:pos + n], 1, pos > 0)] + ([other] if i % 2 else [])
        pieces.append(_step(m, seqs)[0])
        pos += n
    torch.testing.assert_close(torch.cat(pieces), whole, atol=1e-5, rtol=1e-5)
    _assert_state(m, 1, whole_state)


def test_scan_chunk_choice():
    assert scan_chunk_size(8192, 16) * 8192 * 16 <= SCAN_BUDGET_ELEMENTS
    assert scan_chunk_size(64, 8) == MAX_SCAN_CHUNK


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages created under this mode that are still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage address -> [bytes, live tensor objects]
        self.current = self.peak = 0

    def _drop(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage().data_ptr()
            if key not in self.live:
                if key in inputs:
                    continue  # a view of memory that existed before the mode
                self.live[key] = [t.untyped_storage().nbytes(), 0]
                self.current += self.live[key][0]
                self.peak = max(self.peak, self.current)
            self.live[key][1] += 1
            weakref.finalize(t, self._drop, key)
        return out


def test_scan_memory_is_linear_in_chunk():
    L, D, N, Q = 4096, 32, 16, 64
    torch.manual_seed(3)
    u, dt = torch.randn(L, D), torch.rand(L, D) * 0.1
    A, B, C = -torch.rand(D, N), torch.randn(L, N), torch.randn(L, N)
    with torch.inference_mode(), _LiveBytes() as tracker:
        y, _, _ = selective_scan_prefill(u, dt, A, B, C, None, chunk_size=Q)
    out_bytes, chunk_bytes, full_bytes = L * D * 4, Q * D * N * 4, L * D * N * 4
    # the [L, D] output plus a handful of [Q, D, N] temporaries; a whole-prompt [L, D, N] would be 16x more
    assert tracker.peak <= out_bytes + 6 * chunk_bytes, (tracker.peak, out_bytes, chunk_bytes)
    assert tracker.peak < full_bytes / 4
    assert y.shape == (L, D)


def test_config_and_weight_names():
    from stateserve.models.mamba import FalconMambaForCausalLM as OurFalcon, MambaForCausalLM as OurMamba

    with pytest.raises(ValueError, match="hidden_act"):
        OurMamba(MambaConfig(**BASE, hidden_act="gelu"), torch.float32)
    mamba = OurMamba(MambaConfig(**{**BASE, "tie_word_embeddings": True}), torch.float32)
    assert mamba.tied_params == {"lm_head.weight": "backbone.embeddings.weight"}
    assert mamba.lm_head.weight is mamba.backbone.embeddings.weight
    assert mamba.map_weight_name("backbone.embedding.weight") == ("backbone.embeddings.weight", None)
    falcon = OurFalcon(FalconMambaConfig(**BASE), torch.float32)
    assert falcon.map_weight_name("backbone.layers.0.mixer.b_layernorm.weight") is None
    assert falcon.map_weight_name("backbone.layers.1.mixer.A_log") == ("backbone.layers.1.mixer.A_log", None)
    assert OurMamba.is_attention_free and OurFalcon.is_attention_free
