"""Model config, registry and weights: hf_overrides, dtypes, sharded checkpoints, dummy weights, and errors
that name the problem (unknown architecture, missing / unexpected / mis-shaped tensors)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from stateserve import LLM, ModelRegistry, SamplingParams
from stateserve.models.loader import WeightLoadError
from utils import build_hf_model, hf_greedy, save_model

CFG = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=128)
PROMPT = {"prompt_token_ids": [3, 9, 27, 81, 243]}
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_and_dir(tmp_path_factory):
    hf = build_hf_model(LlamaConfig, LlamaForCausalLM, **CFG)
    return hf, save_model(hf, str(tmp_path_factory.mktemp("llama")))


def _copy_with(src: str, dst: str, edit) -> str:
    os.makedirs(dst, exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(dst, "config.json"), "w") as g:
        g.write(f.read())
    return dst


def test_missing_tensor_is_named(hf_and_dir, tmp_path):
    path = _copy_with(hf_and_dir[1], str(tmp_path / "m"), lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        LLM(path, skip_tokenizer_init=True)


def test_wrong_shape_is_named(hf_and_dir, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    path = _copy_with(hf_and_dir[1], str(tmp_path / "s"), edit)
    with pytest.raises(WeightLoadError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*shape"):
        LLM(path, skip_tokenizer_init=True)


def test_unexpected_tensor_is_named(hf_and_dir, tmp_path):
    def edit(t):
        t["model.layers.0.extra.weight"] = torch.zeros(2)
    path = _copy_with(hf_and_dir[1], str(tmp_path / "u"), edit)
    with pytest.raises(WeightLoadError, match=r"model\.layers\.0\.extra\.weight"):
        LLM(path, skip_tokenizer_init=True)


def test_errors_are_value_errors():
    assert issubclass(WeightLoadError, ValueError)


def test_unknown_architecture_lists_supported(hf_and_dir, tmp_path):
    d = tmp_path / "unk"
    d.mkdir()
    cfg = json.load(open(os.path.join(hf_and_dir[1], "config.json")))
    cfg["architectures"] = ["NoSuchModelForCausalLM"]
    json.dump(cfg, open(d / "config.json", "w"))
    with pytest.raises(ValueError, match="NoSuchModelForCausalLM.*LlamaForCausalLM"):
        LLM(str(d), skip_tokenizer_init=True)


def test_not_a_folder():
    with pytest.raises(ValueError, match="neither a folder nor a .gguf file"):
        LLM("/no/such/model", skip_tokenizer_init=True)


def test_sharded_checkpoint_loads(hf_and_dir, tmp_path):
    hf, _ = hf_and_dir
    path = str(tmp_path / "sharded")
    hf.save_pretrained(path, safe_serialization=True, max_shard_size="100KB")
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    ref = hf_greedy(hf, [PROMPT["prompt_token_ids"]], 6)[0]
    with LLM(path, skip_tokenizer_init=True) as llm:
        assert llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids == ref


def test_hf_overrides_applied_before_build(hf_and_dir):
    with LLM(hf_and_dir[1], skip_tokenizer_init=True, load_format="dummy",
             hf_overrides={"num_hidden_layers": 1}) as llm:
        assert len(llm.llm_engine.runner.model.model.layers) == 1


def test_dummy_weights_reproducible(hf_and_dir):
    outs = []
    for seed in (5, 5, 6):
        with LLM(hf_and_dir[1], skip_tokenizer_init=True, load_format="dummy", seed=seed) as llm:
            outs.append(llm.llm_engine.runner.model.model.layers[0].mlp.down_proj.weight.clone())
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_dtypes(hf_and_dir, dtype):
    with LLM(hf_and_dir[1], skip_tokenizer_init=True, dtype=dtype) as llm:
        model = llm.llm_engine.runner.model
        assert next(model.parameters()).dtype == getattr(torch, dtype)
        out = llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    assert len(out) == 6


def test_auto_dtype_float16_becomes_float32_on_cpu(hf_and_dir, tmp_path):
    hf, _ = hf_and_dir
    path = str(tmp_path / "fp16")
    hf.to(torch.float16).save_pretrained(path, safe_serialization=True)
    hf.to(torch.float32)
    with LLM(path, skip_tokenizer_init=True) as llm:
        assert llm.llm_engine.model_config.dtype == torch.float32


def test_registry_plugin_lazy_string():
    ModelRegistry.register_model("TinyPluginForCausalLM", "stateserve.models.llama:LlamaForCausalLM")
    assert "TinyPluginForCausalLM" in ModelRegistry.get_supported_archs()
    with pytest.raises(ValueError, match="package.module:ClassName"):
        ModelRegistry.register_model("Bad", "no_colon_here")


def test_safetensors_reader_reads_every_dtype_as_the_library_does(tmp_path):
    """SafetensorsReader's plain reads give the tensors safetensors' own loader gives (dtype, shape, bits), empty and
    0-d ones included; a file cut short is named."""
    from stateserve.models.loader import SafetensorsReader, iterate_safetensors

    torch.manual_seed(0)
    tensors = {"a.f32": torch.randn(3, 5), "b.bf16": torch.randn(7).bfloat16(), "c.f16": torch.randn(2, 2).half(),
               "d.i64": torch.arange(6).view(2, 3), "e.u8": torch.randint(0, 255, (9,), dtype=torch.uint8),
               "f.bool": torch.tensor([True, False, True]), "g.empty": torch.zeros(0, 4), "h.scalar": torch.tensor(2.5),
               "i.f64": torch.randn(4, dtype=torch.float64), "j.i8": torch.tensor([-128, 0, 127], dtype=torch.int8)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    reader = SafetensorsReader(str(tmp_path))
    got = dict(reader.tensors(reversed(reader.names())))  # any order
    assert got.keys() == tensors.keys() == dict(iterate_safetensors(str(tmp_path), False)).keys()
    for name, want in load_file(str(tmp_path / "model.safetensors")).items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape and torch.equal(got[name], want), name
    with open(tmp_path / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / "model.safetensors") - 4)
    last = max(reader.names(), key=lambda n: reader.entries[n][2]["data_offsets"][1])  # its bytes end the file
    with pytest.raises(WeightLoadError, match=f"tensor {last!r} is cut short"):
        dict(SafetensorsReader(str(tmp_path)).tensors([last]))


def test_a_checkpoint_model_is_built_without_random_init_and_init_comes_back():
    """Under no_weight_init (every checkpoint load) nn.Linear / nn.Embedding / nn.Conv1d skip their random init;
    after it every class initialises as before (Conv1d's inherited reset_parameters included)."""
    from torch import nn

    from stateserve.models.loader import no_weight_init

    calls = []
    original = nn.Linear.reset_parameters
    nn.Linear.reset_parameters = lambda self: calls.append(self)  # type: ignore[method-assign]
    try:
        with no_weight_init():
            nn.Linear(4, 4), nn.Embedding(5, 4), nn.Conv1d(4, 4, 3)
        assert calls == []
        nn.Linear(4, 4)
        assert len(calls) == 1
    finally:
        nn.Linear.reset_parameters = original  # type: ignore[method-assign]
    assert "reset_parameters" not in nn.Conv1d.__dict__
    torch.manual_seed(0)
    conv = nn.Conv1d(4, 4, 3)
    assert conv.weight.abs().sum() > 0 and conv.weight.abs().max() <= (1 / 12) ** 0.5
