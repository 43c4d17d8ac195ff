"""GGUF files (issue 36) written by llama.cpp's own converter (convert_hf_to_gguf.py from the llama-cpp-python sdist,
fetched from the package registry once and cached) from tiny random Llama, Mamba and Mamba2 folders: a float32
file gives transformers' logits; a Q8_0 file keeps its linears quantized with the file's own codes and gives the
logits of the model with those dequantized weights; the file's vocabulary works as the tokenizer."""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM

from stateserve import LLM
from stateserve.models.gguf_file import GGUFCheckpoint
from stateserve.quantization import q8_0
from stateserve.quantization.embedding import QuantEmbedding
from stateserve.quantization.linear import QuantLinear
from utils import build_hf_model, engine_teacher_forced_logits, hf_logits, save_model

LLAMA_CPP_PYTHON = "0.3.36"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(vocab_size=32000, hidden_size=64, intermediate_size=128,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                 max_position_embeddings=256, tie_word_embeddings=False)),
    "mamba": (MambaConfig, MambaForCausalLM, dict(vocab_size=320, hidden_size=64, state_size=8, num_hidden_layers=2,
                                                 tie_word_embeddings=False)),
    "mamba2": (Mamba2Config, Mamba2ForCausalLM, dict(vocab_size=320, hidden_size=64, num_heads=8, head_dim=16,
                                                    expand=2, state_size=16, n_groups=2, num_hidden_layers=2,
                                                    conv_kernel=4, chunk_size=256, tie_word_embeddings=False)),
}
TOKENS = [(37 * i + 11) % 300 + 3 for i in range(20)]


@pytest.fixture(scope="session")
def converter() -> str:
    """convert_hf_to_gguf.py of the pinned llama-cpp-python sdist: downloaded with pip once into the cache (CI has
    the package registry), only the converter's own files unpacked."""
    cache = os.path.join(os.path.expanduser(os.environ.get("STATESERVE_CACHE_DIR", "~/.cache/stateserve")),
                         f"llama_cpp_python-{LLAMA_CPP_PYTHON}")
    script = os.path.join(cache, "vendor", "llama.cpp", "convert_hf_to_gguf.py")
    if os.path.isfile(script):
        return script
    archive = os.path.join(cache, f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz")
    if not os.path.isfile(archive):
        os.makedirs(cache, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "-d", cache, f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], check=True, timeout=900)
    wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/ggml-vocab-llama-spm.gguf",
              "models/ggml-vocab-gpt-neox.gguf")
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name
                   and m.name.split("/vendor/llama.cpp/", 1)[1].startswith(wanted)]
        for m in members:
            m.name = m.name.split("/", 1)[1]  # drop the sdist's top folder
        tar.extractall(cache, members=members, filter="data")
    return script


def _convert(converter: str, folder: str, outtype: str) -> str:
    out = f"{folder}-{outtype}.gguf"
    run = subprocess.run([sys.executable, os.path.join(REPO, "bench", "peers", "gguf_convert.py"), converter, folder,
                          out, outtype], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out


@pytest.fixture(scope="module", params=list(MODELS))
def converted(request, converter, tmp_path_factory):
    config_cls, model_cls, cfg = MODELS[request.param]
    hf = build_hf_model(config_cls, model_cls, **cfg)
    folder = save_model(hf, str(tmp_path_factory.mktemp("gguf") / request.param))
    return request.param, hf, folder, {t: _convert(converter, folder, t) for t in ("f32", "q8_0")}


def test_float32_file_gives_transformers_logits(converted):
    arch, hf, _, files = converted
    ref = hf_logits(hf, TOKENS)
    with LLM(files["f32"], dtype="float32", skip_tokenizer_init=True, enable_prefix_caching=False) as llm:
        for chunk in (len(TOKENS), 1):
            ours = engine_teacher_forced_logits(llm, TOKENS, chunk)
            # A is stored as -exp(A_log) in the file and taken back with log: round-off of float32
            torch.testing.assert_close(ours, ref, atol=2e-4 * ref.abs().max(), rtol=0)


def test_q8_0_file_stays_quantized_with_its_own_codes(converted):
    arch, hf, folder, files = converted
    ckpt = GGUFCheckpoint(files["q8_0"])
    q8 = [n for n, t in ckpt.tensors.items() if t.tensor_type.name == "Q8_0" and n.startswith("blk.")]
    assert q8 and ckpt.linear_format() == "Q8_0"
    for name in q8:  # quantizing the file's values again gives back its codes and scales, bit for bit
        raw = ckpt.tensors[name].data.reshape(-1, 34)
        codes, scales = q8_0.quantize(torch.from_numpy(ckpt._array(name)))
        assert np.array_equal(codes.numpy().reshape(-1, 32), raw[:, 2:].view(np.int8)), name
        assert np.array_equal(scales.numpy().reshape(-1), raw[:, :2].copy().view(np.float16).reshape(-1)), name
    # the reference: transformers' model holding the file's (dequantized) values
    ref_model = build_hf_model(*MODELS[arch][:2], **MODELS[arch][2])
    state = {k: v if isinstance(v, torch.Tensor) else v.to_float() for k, v in ckpt.tensors_hf()}
    missing = set(ref_model.state_dict()) - set(state)
    assert missing <= {"lm_head.weight"}, missing
    ref_model.load_state_dict(state, strict=False)
    ref = hf_logits(ref_model, TOKENS)
    with LLM(files["q8_0"], dtype="float32", quantization="int8_weight_only", skip_tokenizer_init=True,
             enable_prefix_caching=False) as llm:
        model = llm.llm_engine.runner.model
        assert sum(isinstance(m, QuantLinear) for m in model.modules()) >= len(q8) // 2
        assert [m.fmt for m in model.modules() if isinstance(m, QuantEmbedding)] == ["q8_0"]  # the file's blocks
        for chunk in (len(TOKENS), 1):
            torch.testing.assert_close(engine_teacher_forced_logits(llm, TOKENS, chunk), ref,
                                       atol=2e-4 * ref.abs().max(), rtol=0)
    with LLM(files["q8_0"], skip_tokenizer_init=True) as llm:  # by default: the file's int8, in bfloat16
        assert llm.llm_engine.runner.model_config.dtype == torch.bfloat16
        assert any(m.quantize_activations for m in llm.llm_engine.runner.model.modules()
                   if isinstance(m, QuantLinear))


def test_the_files_vocabulary_is_the_tokenizer(converted):
    arch, _, folder, files = converted
    if arch != "llama":
        pytest.skip("one vocabulary is enough: the converter gives every model here a list it ships (Llama: the "
                    "SentencePiece one, whole: a vocabulary cut to a tiny model loses its byte tokens)")
    with LLM(files["f32"], dtype="float32") as llm:
        tok = llm.get_tokenizer()
        ids = tok("Hello world", add_special_tokens=False).input_ids
        assert ids and tok.decode(ids) == "Hello world"
        out = llm.generate(["Hello world"], use_tqdm=False)
        assert out[0].outputs[0].token_ids


def test_unsupported_files_are_refused_clearly(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="could not be read as a GGUF file"):
        LLM(str(bad))


def test_cli_and_server_take_a_gguf_file(converted):
    """`stateserve generate --model F.gguf` logs where the weights came from; `stateserve serve F.gguf` answers a
    completion through the openai client with the file's own vocabulary."""
    import openai

    from utils import start_server

    arch, _, _, files = converted
    if arch != "llama":
        pytest.skip("the file's vocabulary is needed for text: the Llama one")
    env = {**os.environ, "STATESERVE_DISABLE_TQDM": "1"}
    run = subprocess.run([sys.executable, "-m", "stateserve.entrypoints.cli", "generate", "--model", files["q8_0"],
                          "--prompt", "Hello", "--max-tokens", "3"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert "read from GGUF (linears Q8_0); weights kept as stored (Q8_0, int8 activations): " in run.stdout + run.stderr
    proc, url, _ = start_server(files["q8_0"], "--served-model-name", "tiny")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        out = client.completions.create(model="tiny", prompt="Hello world", max_tokens=4, temperature=0)
        assert out.usage.completion_tokens == 4 and out.choices[0].text
    finally:
        proc.terminate()
        proc.wait(timeout=60)


WIDE = {  # Q4_K needs K a multiple of 256
    "llama": (LlamaConfig, LlamaForCausalLM, dict(vocab_size=32000, hidden_size=256, intermediate_size=512,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                 max_position_embeddings=256, tie_word_embeddings=False)),
    "mamba2": (Mamba2Config, Mamba2ForCausalLM, dict(vocab_size=320, hidden_size=256, num_heads=8, head_dim=64,
                                                    expand=2, state_size=16, n_groups=2, num_hidden_layers=2,
                                                    conv_kernel=4, chunk_size=256, tie_word_embeddings=False)),
}


def _mix(name: str, shape: tuple[int, int]) -> str | None:
    """A Q4_K_M-like mix: Q4_K mostly, Q4_0 for the MLP's down projection (and Mamba2's out_proj), Q6_K for the head
    and for layer 0's v rows (so that one fused q/k/v projection holds two formats), the embedding at Q4_K; layer 1
    has a Q4_1 and a Q5_0 linear."""
    if shape[1] % 32 or not name.endswith("weight") or any(k in name for k in ("norm", "conv1d", "ssm_")) and \
            not name.endswith(("ssm_in.weight", "ssm_out.weight")):
        return None
    if name == "output.weight":
        return "Q6_K"
    if name == "blk.0.attn_v.weight":
        return "Q6_K"
    if name in ("blk.1.ffn_down.weight", "blk.1.ssm_out.weight"):
        return "Q5_0"
    if name in ("blk.1.attn_output.weight", "blk.1.ssm_in.weight"):
        return "Q4_1"
    if name.endswith(("ffn_down.weight", "ssm_out.weight")):
        return "Q4_0"
    return "Q4_K" if shape[1] % 256 == 0 else "Q4_0"


@pytest.mark.parametrize("arch", list(WIDE))
def test_4_bit_files_stay_quantized(arch, converter, tmp_path):
    """Q4_0, Q4_K and Q6_K tensors in one file (rewritten from the converter's float32 file, tests/gguf_requantize.py):
    the linears keep Q4_0, Q4_K and Q6_K as stored (Q5_0 as Q8_0, exactly), and the logits are those of transformers'
    model holding the same values (the file's, dequantized)."""
    from gguf_requantize import requantize

    config_cls, model_cls, cfg = WIDE[arch]
    folder = save_model(build_hf_model(config_cls, model_cls, **cfg), str(tmp_path / arch))
    path = str(tmp_path / f"{arch}-mix.gguf")
    requantize(_convert(converter, folder, "f32"), path, _mix)
    ckpt = GGUFCheckpoint(path)
    assert set(ckpt.linear_format().split(",")) == {"Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q6_K"} - \
        ({"Q6_K"} if arch == "mamba2" else set())
    state = {}
    for (name, t), (hf_name, value) in zip(ckpt.tensors.items(), ckpt.tensors_hf()):
        if isinstance(value, torch.Tensor):
            state[hf_name] = value
        else:
            state[hf_name] = value.to_float()
    ref_model = build_hf_model(config_cls, model_cls, **cfg)
    ref_model.load_state_dict(state, strict=False)
    ref = hf_logits(ref_model, TOKENS)
    with LLM(path, dtype="float32", quantization="int8_weight_only", skip_tokenizer_init=True,
             enable_prefix_caching=False) as llm:
        model = llm.llm_engine.runner.model
        kinds = {n: m.fmt for n, m in model.named_modules() if isinstance(m, QuantLinear)}
        assert kinds["lm_head"] == "q6_k"
        if arch == "llama":
            assert kinds["model.layers.0.self_attn.qkv_proj"] == "q4_k+q6_k"
            assert kinds["model.layers.1.self_attn.qkv_proj"] == "q4_k"
            assert kinds["model.layers.0.mlp.down_proj"] == "q4_0"
            assert kinds["model.layers.1.mlp.down_proj"] == "q8_0"  # Q5_0's codes, exactly
            assert kinds["model.layers.1.self_attn.o_proj"] == "q4_1"
        else:
            assert kinds["backbone.layers.0.mixer.in_proj"] == "q4_k"
            assert kinds["backbone.layers.0.mixer.out_proj"] == "q4_0"
            assert kinds["backbone.layers.1.mixer.in_proj"] == "q4_1"
            assert kinds["backbone.layers.1.mixer.out_proj"] == "q8_0"
        embedding = model.model.embed_tokens if arch == "llama" else model.backbone.embeddings
        assert isinstance(embedding, QuantEmbedding) and embedding.fmt == "q4_k"  # as stored, no bfloat16 copy
        for chunk in (len(TOKENS), 1):
            torch.testing.assert_close(engine_teacher_forced_logits(llm, TOKENS, chunk), ref,
                                       atol=2e-4 * ref.abs().max(), rtol=0)


def test_a_tied_embedding_serves_as_the_head(converter, tmp_path):
    """A tied model's file has no output tensor: its Q8_0 token_embd is both the embedding and the head, held once
    (dequantized, as the shared matrix), and the logits are transformers' on the file's values."""
    config_cls, model_cls, cfg = MODELS["mamba2"]
    folder = save_model(build_hf_model(config_cls, model_cls, **{**cfg, "tie_word_embeddings": True}),
                        str(tmp_path / "tied"))
    path = _convert(converter, folder, "q8_0")
    ckpt = GGUFCheckpoint(path)
    assert "output.weight" not in ckpt.tensors and ckpt.tensors["token_embd.weight"].tensor_type.name == "Q8_0"
    ref_model = build_hf_model(config_cls, model_cls, **{**cfg, "tie_word_embeddings": True})
    ref_model.load_state_dict({k: v if isinstance(v, torch.Tensor) else v.to_float()
                               for k, v in ckpt.tensors_hf()}, strict=False)
    ref = hf_logits(ref_model, TOKENS)
    with LLM(path, dtype="float32", quantization="int8_weight_only", skip_tokenizer_init=True,
             enable_prefix_caching=False) as llm:
        model = llm.llm_engine.runner.model
        assert model.lm_head.weight is model.backbone.embeddings.weight
        torch.testing.assert_close(engine_teacher_forced_logits(llm, TOKENS, len(TOKENS)), ref,
                                   atol=2e-4 * ref.abs().max(), rtol=0)
