"""The bundled demo models: well-formed folders, stateserve's greedy output equals transformers', and they
learned something (held-out loss on Python's documentation well below the uniform guess log(vocab))."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import sys

import pytest
import torch

from stateserve import LLM, ModelRegistry, SamplingParams
from stateserve.assets import MODELS_DIR, bundled_models, default_model_path
from utils import assert_greedy_matches, hf_greedy

NAMES = ["mamba2-demo", "hybrid-demo", "llama-demo"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["The with statement is used to", "Return a new list containing",
           "The \"try\" statement specifies exception handlers and/or cleanup code for a group of statements. "
           "The except clause(s) specify one or more exception handlers. When no exception occurs"]
MAX_NEW = 20


def _path(name: str) -> str:
    path = os.path.join(MODELS_DIR, name)
    if not os.path.isfile(os.path.join(path, "config.json")):
        pytest.fail(f"bundled model {name} is missing: run scripts/train_demo_models.py")
    return path


def _arch(path: str) -> str:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["architectures"][0]


def _require_registered(path: str) -> None:
    arch = _arch(path)
    if not ModelRegistry.is_registered(arch):
        pytest.skip(f"stateserve does not implement {arch} yet")


def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _training_script():
    spec = importlib.util.spec_from_file_location("train_demo_models",
                                                  os.path.join(REPO, "scripts", "train_demo_models.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


def test_bundle_is_complete_and_small():
    assert set(NAMES) <= set(bundled_models()), f"bundled: {sorted(bundled_models())}"
    assert "mamba2" in os.path.basename(default_model_path())
    total = 0
    for name in NAMES:
        path = _path(name)
        for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                  "generation_config.json"):
            assert os.path.isfile(os.path.join(path, f)), f"{name} lacks {f}"
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            template = json.load(f).get("chat_template")
        assert template and "<|assistant|>" in template, f"{name}: tokenizer_config.json has no chat template"
        with open(os.path.join(path, "generation_config.json")) as f:
            eos = json.load(f)["eos_token_id"]
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        assert eos == tok.eos_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
        chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                       add_generation_prompt=True)
        assert chat == "<|user|>\nhi\n<|assistant|>\n"
        total += sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    assert total <= 30 * 2 ** 20, f"bundled models take {total / 2 ** 20:.1f} MiB, more than 30"


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_transformers(name):
    path = _path(name)
    _require_registered(path)
    hf = _hf_model(path)
    with LLM(path, max_num_batched_tokens=16, kv_cache_memory_bytes=64 * 2 ** 20) as llm:
        tokenizer = llm.get_tokenizer()
        prompts = [tokenizer(p).input_ids for p in PROMPTS]
        assert prompts == [llm.llm_engine.tokenize(p) for p in PROMPTS]
        ref = hf_greedy(hf, prompts, MAX_NEW)
        # chunked prefill (16 tokens per step) and a batch of three: the engine's own paths, not one-shot
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True), use_tqdm=False)
        ours = [o.outputs[0].token_ids for o in outs]
        assert_greedy_matches(ours, ref, hf, prompts)
        # text prompts give the same tokens, and the text is the tokenizer's decoding of them
        text_outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True),
                                 use_tqdm=False)
        for o, ids in zip(text_outs, ours):
            assert o.outputs[0].token_ids == ids
            assert o.outputs[0].text == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def heldout_data():
    """Per tokenizer (one, shared by the three models): 16 evenly spaced held-out windows and the
    cross-entropy a unigram model fitted on the training text gets on them (what no-context guessing gives)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(_path("llama-demo"))
    script = _training_script()
    train, heldout = script.corpus_splits()
    windows = script.heldout_windows(script.token_stream(tokenizer, heldout), 128)
    windows = windows[:: max(1, len(windows) // 16)][:16]  # [16, 129]
    counts = torch.bincount(script.token_stream(tokenizer, train), minlength=len(tokenizer)).double() + 1
    unigram = float(-(counts / counts.sum()).log()[windows[:, 1:]].mean())
    return tokenizer, script, windows, unigram


@pytest.mark.parametrize("name", NAMES)
def test_heldout_loss_well_below_uniform(name, heldout_data):
    """Trained, not random: on documents the training never saw, loss is far below log(vocab) and well below
    the unigram baseline, so the model uses context."""
    tokenizer, script, windows, unigram = heldout_data
    path = _path(name)
    with open(os.path.join(path, "tokenizer.json")) as f, \
            open(os.path.join(_path("llama-demo"), "tokenizer.json")) as g:
        assert json.load(f) == json.load(g), "the three demo models share one tokenizer"
    loss = script.evaluate(_hf_model(path), windows, batch_size=16)
    log_v = math.log(len(tokenizer))
    assert loss < 0.65 * log_v, f"{name}: held-out loss {loss:.3f} is not well below log(vocab) = {log_v:.3f}"
    assert loss < unigram - 1.5, f"{name}: held-out loss {loss:.3f} vs unigram baseline {unigram:.3f}"
