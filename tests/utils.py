"""Helpers for tests: build tiny decisive random models, run HF greedy, drive the engine for teacher forcing."""
from __future__ import annotations

import os
import shutil
import subprocess

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A state space model keeps a fixed-size state per sequence.",
    "Attention reads every previous token from the key value cache.",
    "def add(a, b):\n    return a + b\n",
    "Paged memory makes continuous batching cheap.",
] * 20


def make_tokenizer(out_dir: str, vocab_size: int = 300) -> str:
    """A byte-level BPE tokenizer trained on a few sentences, saved like a Hugging Face folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(out_dir)
    return out_dir


def decisive_init(model: torch.nn.Module, seed: int = 0) -> None:
    """Re-draw embeddings and the LM head with std 1 so greedy choices are far apart."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        emb = model.get_input_embeddings()
        emb.weight.copy_(torch.randn(emb.weight.shape, generator=gen))
        head = model.get_output_embeddings()
        if head is not None and head.weight.data_ptr() != emb.weight.data_ptr():
            head.weight.copy_(torch.randn(head.weight.shape, generator=gen) / head.weight.shape[1] ** 0.5 * 4)


def save_model(hf_model, out_dir: str, tokenizer_dir: str | None = None, original_format: bool = True) -> str:
    """save_pretrained; original_format=False writes transformers' in-memory layout instead of the checkpoints'
    (3-D fused expert tensors, fused convs, renamed modules: its conversion mapping left unreverted)."""
    hf_model.save_pretrained(out_dir, safe_serialization=True, save_original_format=original_format)
    if tokenizer_dir:
        for f in os.listdir(tokenizer_dir):
            shutil.copy(os.path.join(tokenizer_dir, f), out_dir)
    return out_dir


def build_hf_model(config_cls, model_cls, seed: int = 0, **cfg):
    torch.manual_seed(seed)
    cfg.setdefault("initializer_range", 0.3)
    config = config_cls(**cfg)
    model = model_cls(config).eval()
    decisive_init(model, seed)
    return model


def hf_greedy(hf_model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy generation, one prompt at a time (no padding effects)."""
    outs = []
    gc = hf_model.generation_config
    gc.eos_token_id = None  # the engine runs with ignore_eos; min_new_tokens would instead mask EOS out
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                    do_sample=False, pad_token_id=0, generation_config=gc)
            outs.append(gen[0, len(p):].tolist())
    return outs


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def engine_teacher_forced_logits(llm, token_ids: list[int], chunk: int) -> torch.Tensor:
    """Feed `token_ids` through the real engine caches in chunks of `chunk` tokens; logits of every position."""
    from stateserve.engine.teacher_forcing import teacher_forced_logits

    return teacher_forced_logits(llm, token_ids, chunk)


def check_fused_experts_load(hf_model, per_expert_path: str, out_dir: str, tokens: list[int],
                              fused_name: str = "experts.gate_up_proj", atol: float = 5e-4) -> None:
    """The same weights saved in transformers' in-memory layout (3-D fused experts: `experts.gate_up_proj`
    [E, 2I, H], gate rows then up rows; `experts.down_proj` [E, H, I]) load: teacher-forced logits equal those of
    the per-expert checkpoint at `per_expert_path` bit for bit, and transformers' to `atol`."""
    import re

    from safetensors import safe_open

    from state_checks import small_llm

    fused_path = save_model(hf_model, out_dir, original_format=False)
    with safe_open(os.path.join(fused_path, "model.safetensors"), framework="pt") as f:
        shapes = {n: f.get_slice(n).get_shape() for n in f.keys()}
    assert any(n.endswith("." + fused_name) and len(s) == 3 for n, s in shapes.items()), sorted(shapes)
    assert not any(re.search(r"\.experts\.\d+\.", n) for n in shapes), "the file still holds per-expert tensors"
    results = []
    for path in (per_expert_path, fused_path):
        with small_llm(path) as llm:
            results.append(engine_teacher_forced_logits(llm, tokens, 7))
    assert torch.equal(results[0], results[1]), (results[0] - results[1]).abs().max()
    torch.testing.assert_close(results[1], hf_logits(hf_model, tokens), atol=atol, rtol=1e-4)


def assert_greedy_matches(ours: list[list[int]], ref: list[list[int]], hf_model, prompts, tol: float = 1e-4):
    """Token-for-token equality, except where transformers' top two logits are within `tol` at the first
    divergence: then the prefix must agree and the divergence must be a near-tie."""
    for p, a, b in zip(prompts, ours, ref):
        if a == b:
            continue
        k = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        logits = hf_logits(hf_model, p + b[:k])[-1]
        top2 = logits.topk(2).values
        assert float(top2[0] - top2[1]) < tol, f"greedy diverged at step {k}: ours {a} vs transformers {b}"


def random_mamba2_mixer(dtype: torch.dtype, num_slots: int, g: torch.Generator):
    """A Mamba2 mixer (hidden 32, 4 heads of 16, 2 groups, clamped dt) with weights drawn at std 0.5, and random
    conv and ssm states for `num_slots` slots."""
    from stateserve.layers.mamba2_mixer import Mamba2Mixer
    mixer = Mamba2Mixer(hidden_size=32, num_heads=4, head_dim=16, state_size=16, n_groups=2, conv_kernel=4,
                        time_step_limit=(0.01, 0.2), dtype=dtype).to(dtype)
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    states = {"conv": torch.randn(num_slots, mixer.conv_dim, 3, generator=g).to(dtype),
              "ssm": torch.randn(num_slots, 4, 16, 16, generator=g)}
    return mixer, states


def start_server(model: str, *args: str, env: dict[str, str] | None = None,
                 timeout_s: float = 600) -> tuple["subprocess.Popen", str, list[str]]:
    """`stateserve serve MODEL --port 0 ARGS` in a subprocess, once its /health answers 200: (the process, its URL,
    its log lines, still growing). stateserve logs on stdout and uvicorn on stderr: both are read, in one stream,
    for the port and for the report if the start fails. The deadline is generous: a first start after a kernel
    source change compiles for minutes, and killing it then would leave torch's build lock behind; a server that
    fails exits on its own."""
    import re
    import subprocess
    import sys
    import threading
    import time

    import httpx2

    cmd = [sys.executable, "-m", "stateserve.entrypoints.cli", "serve", model, "--port", "0", *args]
    full_env = {**os.environ, "STATESERVE_DISABLE_TQDM": "1", "STATESERVE_NUM_THREADS": "1", **(env or {})}
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env, cwd=repo)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while True:
        found = [m for line in list(lines) if (m := re.search(r"on http://127\.0\.0\.1:(\d+)", line))]
        if found:
            url = f"http://127.0.0.1:{found[0].group(1)}"
            try:
                if httpx2.get(url + "/health", timeout=2).status_code == 200:
                    return proc, url, lines
            except httpx2.HTTPError:
                pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("server subprocess did not come up:\n" + "".join(lines))
        time.sleep(0.1)


def assert_cache_sized(llm, num_blocks: int, max_num_seqs: int | None = None) -> None:
    """The engine planned exactly `num_blocks` KV blocks, every one usable by requests but the one kept back for
    CUDA-graph padding rows where decode graphs are captured; given max_num_seqs, that many sequences run at once,
    each with its state slot where the model has recurrent state."""
    caches = llm.llm_engine.runner.caches
    assert caches.plan.num_blocks == num_blocks, caches.plan
    assert llm.llm_engine.cache.max_blocks() == num_blocks - (caches.scratch_block is not None), caches.plan
    if max_num_seqs is not None:
        assert llm.llm_engine.runner.max_num_seqs == max_num_seqs, caches.plan
        if caches.manager.slot_pool is not None:
            assert caches.manager.slot_pool.num_slots == max_num_seqs, caches.plan


def demo_model(name: str) -> str:
    """The bundled demo model folder `name` (llama-demo, mamba2-demo, hybrid-demo); the test is skipped without it."""
    import pytest

    from stateserve.assets import bundled_models

    model = bundled_models().get(name)
    if model is None:
        pytest.skip(f"the bundled {name} model is missing")
    return model
