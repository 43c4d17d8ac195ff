"""Mamba2: batched greedy parity with transformers under chunked prefill, teacher-forced logits at several engine
chunk sizes, state checkpoints, the decode path's fresh-slot handling, and the mixer hooks hybrids rely on."""
from __future__ import annotations

import pytest
import torch
from transformers import Mamba2Config, Mamba2ForCausalLM

from stateserve import LLM, SamplingParams
from stateserve.layers.mamba2_mixer import Mamba2Mixer
from stateserve.layers.metadata import StateMetadata
from stateserve.models.mamba2 import Mamba2ForCausalLM as OurMamba2
from state_checks import check_teacher_forced_logits
from utils import (assert_greedy_matches, build_hf_model, engine_teacher_forced_logits, hf_greedy, hf_logits,
                   save_model)

PROMPTS = [[1, 5, 9], list(range(7, 26)), list(range(100, 140)), [250], list(range(40, 52)),
           [3, 3, 3, 3, 3, 3, 3, 3, 3]]

BASE = dict(vocab_size=300, hidden_size=64, num_heads=8, head_dim=16, expand=2, state_size=16, n_groups=1,
            num_hidden_layers=2, conv_kernel=4, chunk_size=256, tie_word_embeddings=False)


def _build(tmp_path, name: str = "mamba2", **extra):
    hf = build_hf_model(Mamba2Config, Mamba2ForCausalLM, **{**BASE, **extra})
    return hf, save_model(hf, str(tmp_path / name))


GREEDY_CASES = {
    "g1": {},
    "g2_chunk8": {"n_groups": 2, "chunk_size": 8},
    "bias_fp16res_chunk5": {"n_groups": 2, "chunk_size": 5, "use_bias": True, "residual_in_fp32": False,
                            "conv_kernel": 3},
}


@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_parity_chunked(case, tmp_path):
    hf, path = _build(tmp_path, **GREEDY_CASES[case])
    max_new = 12
    ref = hf_greedy(hf, PROMPTS, max_new)
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=16, enable_prefix_caching=False) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True))
        ours = [o.outputs[0].token_ids for o in outs]
        assert_greedy_matches(ours, ref, hf, PROMPTS)
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.cache.is_idle_and_full()


@pytest.mark.parametrize("mode", ["all", "align"])
def test_greedy_parity_with_prefix_caching(mode, tmp_path):
    """Snapshots taken inside prefill chunks (block size 4, mid scan-chunk) and resumed from must not change
    greedy output: a second round of prompts sharing prefixes with the first must still match transformers."""
    hf, path = _build(tmp_path, n_groups=2, chunk_size=8)
    shared = list(range(30, 60))
    first = [shared + [7, 8], shared[:13] + [9]]
    second = [shared + [7, 8, 11], shared[:13] + [250, 3], shared[:22]]
    ref = hf_greedy(hf, first + second, 6)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=16, block_size=4, enable_prefix_caching=True,
             mamba_cache_mode=mode) as llm:
        outs = [o for rnd in (first, second) for o in llm.generate([{"prompt_token_ids": p} for p in rnd], params)]
        assert_greedy_matches([o.outputs[0].token_ids for o in outs], ref, hf, first + second)
        hits = [o.num_cached_tokens for o in outs[len(first):]]
        assert max(hits) >= 12 and min(hits) > 0, hits  # the second round really resumed from snapshots
        llm.llm_engine.check_integrity()


def test_teacher_forced_logits(tmp_path):
    # A binding time_step_limit, so the dt clamp is exercised on the prefill and the decode (chunk 1) path.
    hf, path = _build(tmp_path, n_groups=2, chunk_size=8, time_step_limit=(0.05, 0.6))
    tokens = list(range(3, 60))
    ref = hf_logits(hf, tokens)
    # float32 end to end: differences come only from summation order (chunking of the scan)
    check_teacher_forced_logits(path, ref, tokens, atol=2e-4, rtol=1e-4)


def test_bfloat16_logits(tmp_path):
    hf, path = _build(tmp_path, n_groups=2, chunk_size=8)
    tokens = list(range(3, 60))
    ref = hf_logits(hf.to(torch.bfloat16), tokens)
    with LLM(path, skip_tokenizer_init=True, dtype="bfloat16") as llm:
        # one step: the same scan chunks as transformers' forward, so only rounding order can differ
        torch.testing.assert_close(engine_teacher_forced_logits(llm, tokens, 64), ref, atol=2e-2, rtol=1e-2)
        # resumed steps re-chunk the float32 scan; bf16 out_proj rounding makes that ~1 ulp of logits (|x| < 16)
        torch.testing.assert_close(engine_teacher_forced_logits(llm, tokens, 7), ref, atol=0.25, rtol=2e-2)
        state = llm.llm_engine.runner.caches.storage.states["backbone.layers.0.mixer"]  # the default (auto) keeps the
        assert state["conv"].dtype == torch.bfloat16 and state["ssm"].dtype == torch.bfloat16  # model dtype


@pytest.mark.parametrize("choice", ["bfloat16", "auto"])
def test_bfloat16_ssm_state_option(choice, tmp_path):
    """mamba_ssm_cache_dtype keeps the SSM state in bfloat16 (auto: the model's dtype): decode steps and resumed
    prefill chunks read and write rounded states, so logits stay close to the float32-state run but not equal;
    greedy tokens of a decisive model match transformers; prefix-cache snapshots are taken in the same dtype."""
    hf, path = _build(tmp_path, n_groups=2, chunk_size=8)
    tokens = list(range(3, 60))
    dtype = "bfloat16" if choice == "auto" else "float32"
    with LLM(path, skip_tokenizer_init=True, dtype=dtype, mamba_ssm_cache_dtype="float32") as llm:
        reference = engine_teacher_forced_logits(llm, tokens, 1)
    with LLM(path, skip_tokenizer_init=True, dtype=dtype, mamba_ssm_cache_dtype=choice, block_size=4,
             max_num_batched_tokens=16, enable_prefix_caching=True) as llm:
        state = llm.llm_engine.runner.caches.storage.states["backbone.layers.0.mixer"]
        assert state["ssm"].dtype == torch.bfloat16
        got = engine_teacher_forced_logits(llm, tokens, 1)  # every token a decode step on the rounded state
        assert not torch.equal(got, reference)
        torch.testing.assert_close(got, reference, atol=0.25, rtol=0.05)
        if dtype == "float32":
            ref = hf_greedy(hf, PROMPTS, 8)
            for _ in range(2):  # the second round resumes from bfloat16 snapshots
                outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                    SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
                assert_greedy_matches([o.outputs[0].token_ids for o in outs], ref, hf, PROMPTS)
            assert llm.llm_engine.cache.snapshots is not None
        llm.llm_engine.check_integrity()


def test_ssm_state_option_refused_by_float32_only_layers_and_checked(tmp_path):
    """An explicit bfloat16 state is refused by Mamba1 layers; auto (the default) keeps their float32."""
    from transformers import MambaConfig, MambaForCausalLM

    hf = build_hf_model(MambaConfig, MambaForCausalLM, vocab_size=300, hidden_size=32, state_size=8,
                        num_hidden_layers=2, tie_word_embeddings=False)
    path = save_model(hf, str(tmp_path / "mamba1"))
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype=bfloat16: MambaMixer keeps its state in float32"):
        LLM(path, skip_tokenizer_init=True, mamba_ssm_cache_dtype="bfloat16")
    with LLM(path, skip_tokenizer_init=True, dtype="bfloat16") as llm:  # the default, auto: float32 for Mamba1
        state = llm.llm_engine.runner.caches.storage.states["backbone.layers.0.mixer"]
        assert state["conv"].dtype == torch.bfloat16 and state["ssm"].dtype == torch.float32
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype must be float32, bfloat16 or auto"):
        LLM(path, skip_tokenizer_init=True, mamba_ssm_cache_dtype="fp8")


def test_weight_names_and_config_checks(tmp_path):
    cfg = Mamba2Config(**{**BASE, "n_groups": 2})
    model = OurMamba2(cfg, torch.float32)
    names = set(dict(model.named_parameters()))
    for suffix in ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight",
                   "out_proj.weight"):
        assert f"backbone.layers.1.mixer.{suffix}" in names
    hf_names = set(Mamba2ForCausalLM(cfg).state_dict())
    assert names == hf_names
    assert model.map_weight_name("backbone.embedding.weight") == ("backbone.embeddings.weight", None)
    assert OurMamba2.is_attention_free
    spec = dict(model.backbone.layers[0].mixer.cache_spec().shapes)
    assert spec == {"conv": (128 + 2 * 2 * 16, 3), "ssm": (8, 16, 16)}
    bf16 = dict(OurMamba2(cfg, torch.bfloat16).backbone.layers[0].mixer.cache_spec().dtypes)
    assert bf16 == {"conv": torch.bfloat16, "ssm": torch.float32}
    # transformers validates at construction; configs edited afterwards (hf_overrides) reach us unchecked
    for field, value, message in [("head_dim", 8, "num_heads \\* head_dim"), ("n_groups", 3, "n_groups"),
                                  ("hidden_act", "tanh", "activation")]:
        bad = Mamba2Config(**BASE)
        setattr(bad, field, value)
        with pytest.raises(ValueError, match=message):
            OurMamba2(bad, torch.float32)


# ---- mixer-level tests: the layer alone, states bound directly --------------------------------------------

def _mixer(seed: int = 0, **kw) -> Mamba2Mixer:
    torch.manual_seed(seed)
    args = dict(hidden_size=32, num_heads=4, head_dim=8, state_size=6, n_groups=2, conv_kernel=4, chunk_size=4)
    m = Mamba2Mixer(**{**args, **kw}).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() >= 2 or name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.3)
        m.A_log.copy_(torch.rand(m.num_heads))  # decays that matter over a few tokens
    return m


def _bind(m: Mamba2Mixer, num_slots: int) -> dict[str, torch.Tensor]:
    spec = m.cache_spec()
    dtypes = dict(spec.dtypes)
    states = {k: torch.randn(num_slots, *shape).to(dtypes[k]) * 3 for k, shape in spec.shapes}  # garbage
    m.bind_cache(states)
    return states


def _meta(lens: list[int], slots: list[int], has_init: list[bool], checkpoints=()) -> StateMetadata:
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    return StateMetadata(query_start_loc=qsl, query_lens=list(lens), slots=torch.tensor(slots),
                         has_initial_state=list(has_init), is_decode_only=all(n == 1 for n in lens),
                         checkpoints=list(checkpoints))


@torch.no_grad()
def test_checkpoints_equal_states_of_prefix():
    m = _mixer()
    states = _bind(m, 16)
    x_a, x_b = torch.randn(11, 32), torch.randn(9, 32)
    # Sequence b resumes from a state built by its first 5 tokens; a starts fresh. Offsets: mid-chunk, on a chunk
    # boundary (4, 8), the whole chunk, and 1.
    m(x_b[:5], _meta([5], [1], [False]))
    ckpts = [(0, 3, 4), (0, 8, 5), (0, 11, 6), (1, 1, 7), (1, 4, 8), (1, 2, 9)]
    m(torch.cat([x_a, x_b[5:]]), _meta([11, 4], [0, 1], [False, True], ckpts))
    for seq, off, dst in ckpts:
        ref_slot = 15
        if seq == 0:
            m(x_a[:off], _meta([off], [ref_slot], [False]))
        else:
            m(x_b[:5 + off], _meta([5 + off], [ref_slot], [False]))
        for key in ("conv", "ssm"):
            torch.testing.assert_close(states[key][dst], states[key][ref_slot], atol=1e-5, rtol=1e-5,
                                       msg=lambda s: f"{key} checkpoint ({seq}, {off}) differs: {s}")
    # a decode step's checkpoint is the state after its one token
    m(x_a[:1], _meta([1], [10], [False]))
    m(x_a[1:2], _meta([1], [10], [True], [(0, 1, 11)]))
    m(x_a[:2], _meta([2], [ref_slot], [False]))
    for key in ("conv", "ssm"):
        torch.testing.assert_close(states[key][11], states[key][ref_slot], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_resume_and_decode_match_one_pass():
    """Any split of a sequence into chunks (mid scan-chunk, shorter than the conv window, single tokens through the
    batched decode path with fresh and resumed slots) gives the one-pass output."""
    m = _mixer(1)
    _bind(m, 8)
    x = torch.randn(14, 32)
    full = m(x, _meta([14], [0], [False]))
    outs = [m(x[:1], _meta([1], [1], [False]))]  # decode path, slot full of garbage, no initial state
    pos = 1
    for n in (2, 1, 5, 1, 1, 3):
        outs.append(m(x[pos:pos + n], _meta([n], [1], [True])))
        pos += n
    assert pos == len(x)
    torch.testing.assert_close(torch.cat(outs), full, atol=1e-5, rtol=1e-5)
    # batched decode: two sequences at different positions in one step
    a = m(x[:6], _meta([6], [2], [False]))
    b = m(x[:9], _meta([9], [3], [False]))
    step = m(torch.stack([x[6], x[9]]), _meta([1, 1], [2, 3], [True, True]))
    torch.testing.assert_close(step, torch.stack([full[6], full[9]]), atol=1e-5, rtol=1e-5)
    assert a.shape == (6, 32) and b.shape == (9, 32)
    # a mixed step: slot 2 decodes its 8th token (batched update) next to a fresh 5-token prefill in slot 4,
    # whose checkpoint after 3 tokens lands in slot 5, and slot 3's decode snapshot in slot 6
    mixed = m(torch.cat([x[7:8], x[:5], x[10:11]]),
              _meta([1, 5, 1], [2, 4, 3], [True, False, True], checkpoints=[(1, 3, 5), (2, 1, 6)]))
    torch.testing.assert_close(mixed, torch.cat([full[7:8], full[:5], full[10:11]]), atol=1e-5, rtol=1e-5)
    resumed = m(x[3:5], _meta([2], [5], [True]))  # resume from the snapshot: tokens 3 and 4 again
    torch.testing.assert_close(resumed, full[3:5], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m(x[11:12], _meta([1], [6], [True])), full[11:12], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rms_norm,before_gate", [(True, True), (True, False), (False, False)])
@torch.no_grad()
def test_hooks_match_falcon_h1_mixer(rms_norm, before_gate):
    """Hooks FalconH1 needs (norm_before_gate, no norm, out_proj bias, zxbcdt multipliers) against its mixer."""
    from transformers import FalconH1Config
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1Mixer, compute_mup_vector

    mults = [0.5, 1.5, 0.7, 1.3, 0.9]
    # mamba_d_ssm (48) differs from expand * hidden (64): the mixer's width comes from heads * head_dim
    cfg = FalconH1Config(hidden_size=32, mamba_n_heads=4, mamba_d_head=12, mamba_expand=2, mamba_d_ssm=48,
                         mamba_n_groups=2,
                         mamba_d_state=6, mamba_d_conv=4, mamba_chunk_size=4, mamba_rms_norm=rms_norm,
                         mamba_norm_before_gate=before_gate, ssm_multipliers=mults, projectors_bias=True,
                         mamba_proj_bias=False, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=50)
    ref = FalconH1Mixer(cfg, layer_idx=0).eval()
    ref.register_buffer("mup_vector", compute_mup_vector(cfg), persistent=False)  # as FalconH1Model does
    ours = Mamba2Mixer(hidden_size=32, num_heads=4, head_dim=12, state_size=6, n_groups=2, conv_kernel=4,
                       chunk_size=4, use_bias=False, out_proj_bias=True, norm_eps=cfg.rms_norm_eps,
                       norm_before_gate=before_gate, use_norm=rms_norm, zxbcdt_multipliers=mults,
                       time_step_limit=cfg.time_step_limit)
    torch.manual_seed(3)
    for p in ref.parameters():
        p.copy_(torch.randn_like(p) * 0.3)
    missing = ours.load_state_dict({k: v for k, v in ref.state_dict().items() if k != "mup_vector"}, strict=True)
    assert not missing.missing_keys
    _bind(ours, 2)
    x = torch.randn(1, 10, 32)
    torch.testing.assert_close(ours(x[0], _meta([10], [0], [False])), ref(x)[0], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_clamp_dt_on_decode_hook():
    """With a binding time_step_limit the decode path clamps like prefill by default; clamp_dt_on_decode=False
    reproduces transformers' single-token path, which skips the clamp."""
    x = torch.randn(6, 32)
    outs = {}
    for clamp in (True, False):
        m = _mixer(2, time_step_limit=(0.8, 1.2), clamp_dt_on_decode=clamp)
        _bind(m, 4)
        full = m(x, _meta([6], [0], [False]))
        m(x[:5], _meta([5], [1], [False]))
        outs[clamp] = (m(x[5:], _meta([1], [1], [True])), full[5:])
    torch.testing.assert_close(*outs[True], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(*outs[False], atol=1e-3)
