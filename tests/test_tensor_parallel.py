"""Tensor parallelism (distributed/): two ranks over gloo on this machine against one rank and transformers, for a
Llama (GQA, and fewer KV heads than ranks), with chunked prefill, prefix caching and preemption; a rank that dies
mid-run; rank 0 dying; the CLI, the server and a two-node launch on loopback. The recurrent and MoE split rules
are tested in test_tensor_parallel_models.py."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from stateserve import LLM, SamplingParams, envs
from stateserve.engine.errors import EngineDeadError
from utils import build_hf_model, demo_model, engine_teacher_forced_logits, hf_greedy, hf_logits, save_model, \
    start_server

PROMPTS = [[1, 5, 9], list(range(7, 45)), [100, 120, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [250]]
BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
KW = dict(skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24, max_num_batched_tokens=16)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    hf = build_hf_model(LlamaConfig, LlamaForCausalLM, **BASE)
    return hf, save_model(hf, str(tmp_path_factory.mktemp("tp") / "llama"))


def _run(llm: LLM, prompts, max_new: int = 10):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True, logprobs=0))
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


# The split sums each product in another order, and the logits' round-off grows with their scale: a logprob may
# differ by this fraction of the largest magnitude compared (at least 1). Measured: <= 1.9e-5 at logprobs of -45.
# (Ranks on different kernel paths part by ~1.5e-4: test_workers_take_rank_0s_settings_... keeps them on one.)
# A mis-split or mis-gathered row is off by O(1).
REL_TOL = 1e-5


def logprob_tol(*values: float) -> float:
    return REL_TOL * max([1.0, *(abs(v) for v in values)])


def _assert_close(ours, ref) -> None:
    """Same tokens; logprobs within float32 round-off (the split sums each product in another order)."""
    for (t1, l1), (t2, l2) in zip(ours, ref):
        assert t1 == t2
        assert torch.allclose(torch.tensor(l1), torch.tensor(l2), atol=logprob_tol(*l2), rtol=0), (l1, l2)


def test_two_ranks_match_one_and_transformers(llama):
    """Greedy tokens equal transformers'; logprobs, a teacher-forced forward in 1/7-token chunks, a second pass
    from the prefix cache and a run that must preempt all agree with one rank."""
    hf, path = llama
    ref_tokens = hf_greedy(hf, PROMPTS, 10)
    with LLM(path, **KW) as one:
        ref = _run(one, PROMPTS)
        ref_tf = engine_teacher_forced_logits(one, PROMPTS[1], 7)
    with LLM(path, tensor_parallel_size=2, enable_prefix_caching=True, **KW) as two:
        ours = _run(two, PROMPTS)
        assert [t for t, _ in ours] == ref_tokens
        _assert_close(ours, ref)
        again = _run(two, PROMPTS)  # the prompts' full blocks now come from the cache
        assert two.llm_engine.stats["prefix_cache_hits"] > 0
        _assert_close(again, ref)
        for chunk in (1, 7):
            logits = engine_teacher_forced_logits(two, PROMPTS[1], chunk)
            assert torch.allclose(logits, ref_tf, atol=1e-4, rtol=1e-4)
        assert torch.allclose(logits, hf_logits(hf, PROMPTS[1]), atol=1e-4, rtol=1e-4)
        two.llm_engine.check_integrity()
    # 16 blocks of 4 tokens for 4 sequences that need 25: the newest are preempted and recomputed
    with LLM(path, tensor_parallel_size=2, num_gpu_blocks_override=16, block_size=4, enable_prefix_caching=False,
             **KW) as tight:
        _assert_close(_run(tight, PROMPTS), ref)
        assert tight.llm_engine.stats["preemptions"] > 0


def test_fewer_kv_heads_than_ranks_are_replicated(llama):
    """Two KV heads, four ranks: each rank keeps the KV head its one query head reads (ranks 0-1 head 0, ranks 2-3
    head 1), and its cache holds that head only."""
    hf, path = llama
    with LLM(path, tensor_parallel_size=4, **KW) as llm:
        attn = llm.llm_engine.runner.model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (1, 1)
        assert llm.llm_engine.runner.caches.storage.kv["model.layers.0.self_attn.attn"][0].shape[1] == 1
        assert [t for t, _ in _run(llm, PROMPTS)] == hf_greedy(hf, PROMPTS, 10)


def test_workers_take_rank_0s_settings_not_the_changed_environment(llama, monkeypatch, capfd):
    """An engine froze STATESERVE_PACK_LINEARS=0; os.environ says 1 again by the time the ranks start. Rank 1 must
    run as rank 0 does (no packed copy of its linears): ranks on different kernel paths part by round-off (~1e-4)
    where they should agree."""
    _, path = llama
    monkeypatch.setenv("STATESERVE_PACK_LINEARS", "0")
    envs.disable_envs_cache()
    with LLM(path, **KW):
        pass
    monkeypatch.setenv("STATESERVE_PACK_LINEARS", "1")  # (conftest drops the frozen settings after the test)
    with LLM(path, tensor_parallel_size=2, **KW) as two:
        two.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(max_tokens=2, ignore_eos=True))
    err = capfd.readouterr().err
    assert "[rank 1]" in err and "Linear weight packing" not in err


@pytest.mark.parametrize("tied", [False, True])
def test_the_vocabulary_is_split_and_gathered(tied, tmp_path):
    """An odd vocabulary (301 rows: 151 per rank, one padding row) split over two ranks, tied or not: greedy tokens
    are transformers', logprobs and prompt logprobs (logits gathered for other rows) those of one rank."""
    hf = build_hf_model(LlamaConfig, LlamaForCausalLM, **{**BASE, "vocab_size": 301, "tie_word_embeddings": tied})
    path = save_model(hf, str(tmp_path / "vocab"))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=1)
    with LLM(path, **KW) as one:
        ref = one.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    with LLM(path, tensor_parallel_size=2, **KW) as two:
        model = two.llm_engine.runner.model
        assert type(model.model.embed_tokens).__name__ == "VocabParallelEmbedding"
        assert model.lm_head.weight.shape[0] == 151 and (model.lm_head.weight is model.model.embed_tokens.weight) == tied
        ours = two.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in ours] == hf_greedy(hf, PROMPTS, 6)
    for a, b in zip(ours, ref):
        for step_a, step_b in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert step_a.keys() == step_b.keys()
            tol = logprob_tol(*(lp.logprob for lp in step_b.values()))
            diffs = {t: (step_a[t].logprob, step_b[t].logprob) for t in step_a}
            assert all(abs(a - b) < tol for a, b in diffs.values()), (tol, diffs)


def test_heads_that_do_not_divide_are_refused(tmp_path):
    hf = build_hf_model(LlamaConfig, LlamaForCausalLM, **{**BASE, "num_attention_heads": 2, "num_key_value_heads": 1,
                                                          "intermediate_size": 96})
    path = save_model(hf, str(tmp_path / "odd"))
    with pytest.raises(ValueError, match="num_attention_heads=2 is not divisible by tensor_parallel_size=4"):
        LLM(path, tensor_parallel_size=4, **KW)


@pytest.mark.parametrize("kwargs, message", [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1"),
    ({"tensor_parallel_size": 2, "device": "cuda"}, "run on CPU \\(gloo\\) only so far"),
    ({"tensor_parallel_size": 3, "nnodes": 2, "distributed_init_method": "tcp://127.0.0.1:1"}, "multiple of nnodes"),
    ({"tensor_parallel_size": 2, "nnodes": 2}, "nnodes > 1 needs distributed_init_method"),
    ({"tensor_parallel_size": 2, "nnodes": 2, "node_rank": 2, "distributed_init_method": "tcp://h:1"},
     "node_rank must be in"),
])
def test_bad_parallel_options_are_refused(llama, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(llama[1], **{**KW, **kwargs})


def _workers(llm: LLM) -> list:
    return [proc for _, proc in llm.llm_engine.runner._procs]


def test_a_rank_killed_mid_run_stops_the_engine_naming_it(llama):
    """Rank 1 is killed between two steps of a running batch: the next step fails within seconds with an error that
    names the rank, the engine is dead for later calls, and shutdown leaves no process behind."""
    with LLM(llama[1], tensor_parallel_size=2, **KW) as llm:
        engine = llm.llm_engine
        worker = _workers(llm)[0]
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), p, SamplingParams(max_tokens=50, ignore_eos=True))
        for _ in range(3):
            engine.step()
        os.kill(worker.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"rank\(s\) 1 \(exit code -9\) died"):
            for _ in range(100):
                engine.step()
        assert time.monotonic() - start < 30
        with pytest.raises(EngineDeadError):
            llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(max_tokens=2))
    assert not worker.is_alive()


def test_workers_exit_when_rank_0_dies(llama):
    """The engine's process is killed outright: its worker sees the closed connection and exits on its own."""
    script = ("import os, sys\nsys.path.insert(0, 'tests')\nfrom stateserve import LLM\n"
              "if __name__ == '__main__':\n"
              f"    llm = LLM({llama[1]!r}, tensor_parallel_size=2, skip_tokenizer_init=True, "
              "kv_cache_memory_bytes=1 << 24)\n"
              "    print('WORKER', llm.llm_engine.runner._procs[0][1].pid, flush=True)\n"
              "    import time; time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        line = next(line for line in proc.stdout if line.startswith("WORKER"))
        pid = int(line.split()[1])
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.2)
        assert not _alive(pid), "the worker outlived rank 0"
    finally:
        proc.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _cli(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "stateserve.entrypoints.cli", *args], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "STATESERVE_DISABLE_TQDM": "1", **(env or {})})


def _greedy_text(model: str, prompt: str, max_tokens: int) -> str:
    with LLM(model, kv_cache_memory_bytes=1 << 24) as llm:
        return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0))[0].outputs[0].text


def test_cli_generate_and_two_node_launch_on_loopback():
    """`stateserve generate --tensor-parallel-size 2` on one host, then the same split over two 'nodes' (two
    processes meeting at a rendezvous address): both print one rank's text, and the worker node exits 0 when the
    engine's node is done."""
    model = demo_model("llama-demo")
    expected = _greedy_text(model, "The cat", 12)
    args = ["generate", "--model", model, "--prompt", "The cat", "--max-tokens", "12",
            "--kv-cache-memory-bytes", str(1 << 24), "--tensor-parallel-size", "2"]
    out = _cli(*args).communicate(timeout=300)[0]
    assert "Tensor parallelism: 2 ranks (gloo over loopback)" in out, out
    assert f"Output: {expected!r}" in out, out
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    multi = ["--nnodes", "2", "--distributed-init-method", f"tcp://127.0.0.1:{port}"]
    node1 = _cli("serve", model, "--tensor-parallel-size", "2", "--kv-cache-memory-bytes", str(1 << 24), *multi,
                 "--node-rank", "1")
    node0 = _cli(*args, *multi, "--node-rank", "0")
    out0 = node0.communicate(timeout=300)[0]
    out1 = node1.communicate(timeout=60)[0]
    assert node0.returncode == 0 and f"Output: {expected!r}" in out0, out0
    assert node1.returncode == 0, out1
    assert "node 1 of 2: running tensor-parallel ranks 1-1" in out1, out1


def test_server_with_two_ranks_answers_the_openai_client():
    import openai

    model = demo_model("llama-demo")
    expected = _greedy_text(model, "Once upon a time", 10)
    proc, url, lines = start_server(model, "--tensor-parallel-size", "2", "--kv-cache-memory-bytes", str(1 << 24))
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        done = client.completions.create(model=model, prompt="Once upon a time", max_tokens=10, temperature=0)
        assert done.choices[0].text == expected
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=10, temperature=0, stream=True))
        assert streamed == expected
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    assert proc.returncode == 0, "".join(lines)
    assert any("Tensor parallelism: 2 ranks" in line for line in lines)


def test_ranks_share_the_cores_within_the_thread_cap(monkeypatch):
    """Each local rank gets its share of the usable CPUs, at most STATESERVE_NUM_THREADS threads."""
    from stateserve import envs
    from stateserve.distributed import driver

    monkeypatch.setattr(driver.cpu_threads, "usable_cpus", lambda: frozenset(range(8)))
    monkeypatch.delenv("STATESERVE_NUM_THREADS", raising=False)
    envs.disable_envs_cache()
    try:
        assert driver._cpu_shares(2) == (4, [[0, 1, 2, 3], [4, 5, 6, 7]])
        monkeypatch.setenv("STATESERVE_NUM_THREADS", "1")
        assert driver._cpu_shares(2) == (1, [[0, 1, 2, 3], [4, 5, 6, 7]])
    finally:
        monkeypatch.undo()
        envs.disable_envs_cache()


def test_an_engine_failing_before_rank_0_loads_stops_its_workers(llama, monkeypatch):
    """The engine's start fails before rank 0 loaded the model (the workers are then inside the load's collectives,
    not reading messages): the error reaches the caller within seconds and no worker is left."""
    from stateserve.engine import llm_engine

    original, runners = llm_engine.build_runner, []

    def keep(*args, **kwargs):
        runners.append(original(*args, **kwargs))
        return runners[-1]

    def fail_before_loading(self, config, show_progress):
        raise RuntimeError("start failed before loading")

    monkeypatch.setattr(llm_engine, "build_runner", keep)
    monkeypatch.setattr(llm_engine.LLMEngine, "_start", fail_before_loading)
    errors = []

    def construct():
        try:
            LLM(llama[1], tensor_parallel_size=2, **KW)
        except RuntimeError as e:
            errors.append(e)

    thread = threading.Thread(target=construct, daemon=True)  # a hang fails this test, not the whole suite
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the engine's shutdown hung on workers that never loaded"
    assert len(errors) == 1 and "start failed before loading" in str(errors[0])
    assert runners and not any(proc.is_alive() for _, proc in runners[0]._procs)


def test_a_script_without_a_main_guard_fails_at_once_naming_the_cause(llama, tmp_path):
    """A script that builds a tensor-parallel LLM at its top level: each spawned rank imports it again and dies
    starting ranks of its own. Rank 0 sees the rank exit before it joined, stops at once and says what to do
    (it used to wait out the group's 300 s join timeout)."""
    script = tmp_path / "unguarded.py"
    script.write_text("from stateserve import LLM\n"
                      f"LLM({llama[1]!r}, tensor_parallel_size=2, skip_tokenizer_init=True, "
                      "kv_cache_memory_bytes=1 << 24)\n")
    start = time.monotonic()
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=REPO,
                         env={**os.environ, "STATESERVE_DISABLE_TQDM": "1"})
    log = out.stdout + out.stderr
    assert out.returncode != 0, log
    assert "rank 1 exited (code 1) before it joined the group" in log and 'if __name__ == "__main__":' in log, log
    assert time.monotonic() - start < 120, log


def test_each_rank_loads_its_share_without_holding_the_whole_model(tmp_path, tokenizer_dir):
    """`stateserve generate --tensor-parallel-size 2` on a 12-layer bfloat16 checkpoint: every rank reads the
    checkpoint a layer at a time and splits each layer as it is read (distributed/load.py), so its resident memory
    peaks near its half plus one layer, not at the whole model its rank used to load first (checked to fail with the
    whole-model load: ~1.5x the model there)."""
    cfg = dict(BASE, vocab_size=300, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
               num_attention_heads=12, num_key_value_heads=12)
    hf = build_hf_model(LlamaConfig, LlamaForCausalLM, **cfg).to(torch.bfloat16)
    path = save_model(hf, str(tmp_path / "llama"), tokenizer_dir)
    del hf
    out = _cli("generate", "--model", path, "--prompt", "hi", "--max-tokens", "2", "--dtype", "bfloat16",
               "--kv-cache-memory-bytes", str(1 << 24), "--tensor-parallel-size", "2").communicate(timeout=300)[0]
    pattern = (r"Tensor parallel rank (\d)/2: (\d+) layer parts split as they were read \(0 after the whole "
               r"checkpoint\); resident memory peaked ([\d.]+) GiB above the [\d.]+ GiB before loading \(the whole "
               r"model: ([\d.]+) GiB\)")
    ranks = {int(m.group(1)): (int(m.group(2)), float(m.group(3)), float(m.group(4)))
             for m in re.finditer(pattern, out)}
    assert sorted(ranks) == [0, 1], out
    for parts, peak, whole in ranks.values():
        assert parts == 24  # attention and MLP of each of the 12 layers
        assert 0.15 < whole < 0.2 and peak < 0.75 * whole, out
