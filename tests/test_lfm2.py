"""Lfm2, Lfm2-MoE and LFM3 (short-conv state + paged attention) against transformers 5.24 on tiny random models: batched
chunked-prefill greedy tokens, teacher-forced logits through the real caches (and in bfloat16), prefix-cache
snapshots of the conv state (mamba_cache_mode all / align) with hits, preemption and recompute, the conv state after
decode steps against transformers' after a full forward, speculative decoding's rollback of the conv state, weight
names that load 1:1, and the errors of bad configs."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch
from transformers import Lfm2Config, Lfm2ForCausalLM, Lfm2MoeConfig, Lfm2MoeForCausalLM, Lfm3Config, Lfm3ForCausalLM

from stateserve import SamplingParams
from stateserve.core.batch import SchedulerOutput, build_input_batch
from stateserve.core.request import Request
from stateserve.layers.short_conv import ShortConv
from stateserve.models.lfm2 import Lfm2ForCausalLM as OurLfm2
from stateserve.models.lfm2_moe import Lfm2MoeForCausalLM as OurLfm2Moe
from stateserve.models.lfm3 import Lfm3ForCausalLM as OurLfm3
from stateserve.models.loader import iterate_safetensors, load_weights
from state_checks import (check_bfloat16_logits, check_preemption_exact, check_prefix_cache_one_by_one,
                          check_routing_decisive, check_speculative_rollback_exact, check_teacher_forced_logits,
                          greedy_params, make_routing_decisive, small_llm)
from utils import (assert_greedy_matches, build_hf_model, check_fused_experts_load, engine_teacher_forced_logits,
                   hf_greedy, hf_logits, save_model)

COMMON = dict(vocab_size=300, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
HYBRID = ["conv", "full_attention", "conv", "conv"]
ARCHS = {
    # conv biases on (in_proj, conv, out_proj); the MLP width adjusted: 2/3 of 96 times 1.5, rounded up to 16 -> 96
    "lfm2": (Lfm2Config, Lfm2ForCausalLM, OurLfm2,
             dict(intermediate_size=96, num_hidden_layers=4, layer_types=HYBRID, conv_bias=True,
                  block_multiple_of=16, block_ffn_dim_multiplier=1.5)),
    # one dense layer then MoE; the expert bias (perturbed below) changes which experts are picked; the LM head
    # tied to the embeddings (LFM2's default: the file has no lm_head.weight)
    "lfm2_moe": (Lfm2MoeConfig, Lfm2MoeForCausalLM, OurLfm2Moe,
                 dict(intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4, num_dense_layers=1,
                      num_experts=4, num_experts_per_tok=2, routed_scaling_factor=1.5, layer_types=HYBRID,
                      tie_word_embeddings=True)),
    # LFM3's default pattern over 6 layers (conv, conv, full, conv, sliding, conv), a 6-token window, proportional
    # rope on the full layer, gated attention with biases, sandwich norms, a 4-tap conv
    "lfm3": (Lfm3Config, Lfm3ForCausalLM, OurLfm3,
             dict(intermediate_size=64, num_hidden_layers=6, head_dim=8, sliding_window=6, conv_L_cache=4,
                  attention_bias=True)),
}
PROMPTS = [[250], [7, 3, 2], list(range(20, 29)), list(range(100, 116)), list(range(40, 57)),
           [(17 * i) % 290 + 3 for i in range(40)]]


def _build(arch: str, tmp_path, **extra):
    config_cls, model_cls, _, base = ARCHS[arch]
    hf = build_hf_model(config_cls, model_cls, **{**COMMON, **base, **extra})
    # transformers initialises norms to ones and the expert bias to zeros: perturb them so a mis-wired one shows
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
        for name, b in hf.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=gen))
    return hf, save_model(hf, str(tmp_path / arch))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = _build(arch, tmp_path_factory.mktemp(arch))
        return cache[arch]
    return get


@pytest.mark.parametrize("arch", list(ARCHS))
def test_weight_names_load_one_to_one(arch, built):
    hf, path = built(arch)
    ours = ARCHS[arch][2](hf.config, torch.float32)
    names = [n for n, _ in iterate_safetensors(path, show_progress=False)]  # the file's names (experts apart)
    assert {ours.map_weight_name(n)[0] for n in names} == set(dict(ours.named_parameters()))
    load_weights(ours, iterate_safetensors(path, show_progress=False))  # strict: every tensor lands, none missing


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_parity_chunked(arch, built):
    hf, path = built(arch)
    ref = hf_greedy(hf, PROMPTS, 10)
    # 16-token steps: the 40-token prompt takes three chunks, and prefill chunks share steps with decodes
    with small_llm(path, max_num_batched_tokens=16, enable_prefix_caching=False) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy_params(10), use_tqdm=False)
        assert_greedy_matches([o.outputs[0].token_ids for o in outs], ref, hf, PROMPTS)
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.cache.is_idle_and_full()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_teacher_forced_logits(arch, built):
    hf, path = built(arch)
    tokens = [(7 * i) % 290 + 3 for i in range(40)]  # three KV blocks; far past LFM3's 6-token window
    ref = hf_logits(hf, tokens)
    # float32 throughout: observed max error ~4e-5 on logits up to ~17
    check_teacher_forced_logits(path, ref, tokens, atol=2e-4)


@pytest.mark.parametrize("arch", ["lfm2", "lfm3"])  # Lfm2-MoE: test_bfloat16_logits_moe
def test_bfloat16_logits(arch, built):
    """One whole-prompt step, resumed 7-token steps and token by token (the decode conv), beside transformers'
    bfloat16 (tolerance derived in check_bfloat16_logits)."""
    hf, path = built(arch)
    check_bfloat16_logits(hf, path, [(7 * i) % 290 + 3 for i in range(40)], (40, 7, 1))


def test_bfloat16_logits_moe(tmp_path):
    """Lfm2-MoE as test_bfloat16_logits, its routing made decisive first (random routers: bfloat16 flipped a token's
    experts in two layers, transformers' own logits then off by up to 4.3): make_routing_decisive with a steeper
    router (the sigmoid scores must clear the expert bias) and the built expert bias shrunk 4x (its 0.47 on one
    expert still tied some tokens' 2nd and 3rd choices), margin checked."""
    hf, _ = _build("lfm2_moe", tmp_path)
    make_routing_decisive(hf, "feed_forward.gate", scale=8.0)
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("expert_bias"):
                b.mul_(0.25)
    tokens = [(7 * i) % 290 + 3 for i in range(40)]
    check_routing_decisive(hf, tokens, "feed_forward.gate")
    check_bfloat16_logits(hf, save_model(hf, str(tmp_path / "decisive")), tokens, (40, 7, 1))


def _toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


@pytest.mark.parametrize("mode", ["all", "align"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_prefix_cache_snapshots(arch, mode, built):
    """Conv-state snapshots at block boundaries (block size 8, 16-token steps: taken mid-chunk in `all`), resumed
    from on the second and third prompts: the tokens and logprobs of a cold engine, with hits."""
    bs = 8
    shared = _toks(5 * bs + 3, 1)
    prompts = [shared + _toks(9, 2), shared + _toks(20, 3), shared + _toks(2, 4)]
    [hits] = check_prefix_cache_one_by_one(built(arch)[1], mode, prompts, block_size=bs, max_num_batched_tokens=16)
    assert hits[0] == 0
    if mode == "all":
        assert hits[1] == hits[2] == 5 * bs
    else:  # align: the second request ends a chunk where sharing stops, so the third gets the hit
        assert hits[2] == 5 * bs


@pytest.mark.parametrize("arch", list(ARCHS))
def test_preemption_recompute_gives_same_tokens(arch, built):
    check_preemption_exact(built(arch)[1], 16)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_conv_state_after_decode_matches_full_forward(arch, built):
    """Through the engine's caches: a prompt of 13 tokens in chunks of 8 and 5, then 9 decode-only steps; each
    short-conv layer's state is then the last K-1 conv inputs of transformers' full forward over all 22 tokens."""
    hf, path = built(arch)
    tokens = [(11 * i) % 290 + 3 for i in range(22)]
    with torch.no_grad():
        cache = hf(torch.tensor([tokens]), use_cache=True).cache
    hf_types = hf.config.layer_types
    with small_llm(path, enable_prefix_caching=False) as llm:
        engine, runner = llm.llm_engine, llm.llm_engine.runner
        req = Request("probe", list(tokens), SamplingParams(max_tokens=1), arrival_index=0)
        try:
            with torch.inference_mode():
                for n in [8, 5] + [1] * 9:
                    engine.cache.allocate(req, n)
                    sched = SchedulerOutput()
                    sched.add(req, n)
                    batch = build_input_batch(sched, runner.device)
                    assert batch.is_decode_only == (n == 1)
                    runner.model(batch.input_ids, batch.positions, runner.model_state.prepare_meta(batch))
                    req.num_computed_tokens += n
            convs = [(i, layer.conv) for i, layer in enumerate(runner.model.model.layers) if layer.layer_type == "conv"]
            assert convs and [i for i, _ in convs] == [i for i, t in enumerate(hf_types) if t == "conv"]
            for i, layer in convs:
                assert isinstance(layer, ShortConv)
                theirs = cache.layers[i].conv_states[0][0]  # [hidden, K]: transformers keeps K inputs
                ours = layer.states["conv"][req.state_slot]  # [hidden, K-1]
                torch.testing.assert_close(ours, theirs[:, 1:], atol=1e-5, rtol=1e-4, msg=lambda m: f"layer {i}: {m}")
        finally:
            engine.cache.free(req)


@pytest.mark.parametrize("arch", ["lfm2", "lfm3"])  # Lfm2-MoE's conv layers are Lfm2's
def test_speculative_decoding_rolls_back_conv_state(arch, built, monkeypatch):
    check_speculative_rollback_exact(built(arch)[1], monkeypatch)


def test_layer_mixes_route_and_run(tmp_path):
    """Only conv layers: attention-free (no KV cache at all), logits still transformers'; only attention: the
    plain decoder state (Lfm2Config's default without full_attn_idxs or layer_types)."""
    assert OurLfm3.resolve_flags(Lfm3Config(**{**COMMON, **ARCHS["lfm3"][3]})) == (False, True)
    tokens = list(range(3, 30))
    for name, types in (("conv", ["conv", "conv"]), ("attention", None)):
        # layer_types None (and no full_attn_idxs): Lfm2Config makes every layer attention
        hf, path = _build("lfm2", tmp_path / name, num_hidden_layers=2, layer_types=types)
        assert OurLfm2.resolve_flags(hf.config) == ((True, False) if types else (False, False))
        with small_llm(path) as llm:
            assert llm.llm_engine.model_config.is_attention_free == bool(types)
            assert (llm.llm_engine.runner.caches.manager.slot_pool is None) == (not types)
            with torch.no_grad():  # transformers' cache cannot count tokens without an attention layer
                ref = hf(torch.tensor([tokens]), use_cache=False).logits[0]
            torch.testing.assert_close(engine_teacher_forced_logits(llm, tokens, 9), ref, atol=2e-4, rtol=1e-4)


def test_bad_configs_name_what_is_wrong(tmp_path):
    # transformers' config accepts (and normalises: mamba -> linear_attention) a set of type names; those of
    # another family reach the model class
    with pytest.raises(ValueError, match="unknown layer type 'linear_attention'"):
        OurLfm2(Lfm2Config(**COMMON, num_hidden_layers=2, layer_types=["conv", "mamba"]), torch.float32)
    with pytest.raises(ValueError, match="unknown layer type 'sliding_attention'"):  # LFM3's, not Lfm2's
        OurLfm2(Lfm2Config(**COMMON, num_hidden_layers=2, layer_types=["conv", "sliding_attention"]), torch.float32)
    with pytest.raises(ValueError, match="unknown layer type 'chunked_attention'"):
        OurLfm3(Lfm3Config(**COMMON, num_hidden_layers=2, layer_types=["conv", "chunked_attention"]), torch.float32)
    with pytest.raises(ValueError, match="Lfm2MoeForCausalLM: the config has no layer_types"):
        OurLfm2Moe(Lfm2MoeConfig(**COMMON, num_hidden_layers=2), torch.float32)
    vl = Lfm2Config(**COMMON, num_hidden_layers=2, layer_types=["conv", "full_attention"])
    vl.vision_config = {"model_type": "siglip2_vision_model"}
    with pytest.raises(ValueError, match="vision_config"):
        OurLfm2(vl, torch.float32)
    # through the engine: the folder's config names the bad layer type
    _, path = _build("lfm2", tmp_path, num_hidden_layers=2, layer_types=["conv", "full_attention"])
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["layer_types"] = ["conv", "linear_attention"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="unknown layer type 'linear_attention'"):
        small_llm(path)


def test_fused_expert_tensors_load(tmp_path):
    """transformers' in-memory layout (save_pretrained(save_original_format=False), as some hub checkpoints store
    it: feed_forward.experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) loads, the experts split per
    expert: the same logits as the per-expert checkpoint, and as transformers."""
    hf, path = _build("lfm2_moe", tmp_path)
    check_fused_experts_load(hf, path, str(tmp_path / "fused"),
                             list(range(3, 80)), atol=2e-4)
