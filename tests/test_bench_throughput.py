"""bench/throughput.py plumbing: workloads, useful-token counting, the roofline's byte count, the table, and
the stateserve and transformers runners end to end on a tiny model (padded batches must give each request
exactly the tokens it would get alone)."""
from __future__ import annotations

import argparse
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path[0:0] = [BENCH, os.path.join(BENCH, "peers")]
import machine_limits  # noqa: E402
import protocol  # noqa: E402
import throughput  # noqa: E402

from tests.utils import build_hf_model  # noqa: E402


def test_useful_tokens_cap_at_max_tokens_and_count_short_requests():
    prompts, max_tokens = [[1, 2, 3], [4]], [2, 5]
    # the first request produced a token past its max_tokens (a padded batch does), the second fell short
    assert protocol.useful_tokens(prompts, max_tokens, [[7, 8, 9], [1, 2]]) == (4, 4, 1)
    assert protocol.useful_tokens(prompts, max_tokens, [[7, 8], [1, 2, 3, 4, 5]]) == (4, 7, 0)


def test_workloads_are_seeded_and_in_range():
    serve = throughput.make_workload("base", "serve", 32000)
    assert serve == throughput.make_workload("base", "serve", 32000)
    assert len(serve["prompts"]) == 64
    assert all(32 <= len(p) <= 512 for p in serve["prompts"]) and all(16 <= m <= 256 for m in serve["max_tokens"])
    assert all(10 <= t < 31990 for p in serve["prompts"] for t in p)
    decode, prefill = (throughput.make_workload("base", w, 32000) for w in ("decode", "prefill"))
    assert [len(p) for p in decode["prompts"]] == [32] and decode["max_tokens"] == [128]
    assert [len(p) for p in prefill["prompts"]] == [4096] and prefill["max_tokens"] == [1]


def _tiny_llama(tmp_path) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = build_hf_model(LlamaConfig, LlamaForCausalLM, vocab_size=128, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=256, tie_word_embeddings=False)
    model.save_pretrained(tmp_path / "llama", safe_serialization=True)
    return str(tmp_path / "llama")


def test_weight_bytes_per_token_reads_one_embedding_row(tmp_path):
    folder = _tiny_llama(tmp_path)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    total = sum(p.numel() for p in model.parameters())
    expected = total - 128 * 64 + 64  # the embedding table contributes one row per token
    assert machine_limits.weight_bytes_per_token(folder, "float32") == expected * 4
    assert machine_limits.weight_bytes_per_token(folder, "bfloat16") == expected * 2


def test_format_table_ratios_and_errors():
    rows = [{"model": "llama", "dtype": "float32", "workload": "decode", "engine": "stateserve", "tok_s": 20.0,
             "of_roofline": 0.5, "agree_with_transformers": "8/8"},
            {"model": "llama", "dtype": "float32", "workload": "decode", "engine": "transformers", "tok_s": 10.0},
            {"model": "llama", "dtype": "float32", "workload": "decode", "engine": "vllm", "tok_s": None,
             "error": "timed out"}]
    table = throughput.format_table(rows, ["stateserve", "transformers", "vllm"])
    line = next(ln for ln in table.splitlines() if ln.startswith("llama"))
    assert "2.00x" in line and "50%" in line and "ss 8/8" in line and "n/a" in line
    assert "llama float32 decode vllm: timed out" in table


def test_runners_count_exact_tokens_and_agree(tmp_path):
    folder = _tiny_llama(tmp_path)
    # two requests of different lengths in one padded transformers batch; stateserve runs them together too
    work = {"prompts": [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22]], "max_tokens": [6, 3]}
    job = {"model": folder, "dtype": "float32", "threads": 1, "repeats": 1, "repo": os.path.dirname(BENCH),
           "max_model_len": 256, "workloads": {"serve": work}, "keep_outputs": True}
    outputs = {}
    for engine in ("stateserve", "transformers"):
        log = tmp_path / f"{engine}.log"
        entry = throughput.run_engine(engine, job, sys.executable, str(log), timeout=300)["workloads"]["serve"]
        assert "error" not in entry, (entry, log.read_text()[-2000:])
        assert (entry["prompt_tokens"], entry["output_tokens"], entry["short_requests"]) == (10, 9, 0)
        outputs[engine] = entry["outputs"]
    assert [len(o) for o in outputs["stateserve"]] == [6, 3]
    assert outputs["stateserve"] == outputs["transformers"]  # left padding changed no request's tokens


def test_cli_forwards_to_the_script(capsys):
    from stateserve.entrypoints import bench

    parser = argparse.ArgumentParser(prog="stateserve")
    bench.add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "throughput", "--help"])
    assert args.args == ["--help"]
    with pytest.raises(SystemExit) as e:
        args.func(args)
    assert e.value.code == 0 and "--vllm-python" in capsys.readouterr().out


def test_parse_args_rejects_unknowns():
    with pytest.raises(SystemExit):
        throughput.parse_args(["--models", "gpt9"])
    with pytest.raises(SystemExit):
        throughput.parse_args(["--engines", "vllm"])  # needs --vllm-python
    args = throughput.parse_args(["--size", "small", "--llamacpp-python", "/x/python"])
    assert args.engines == ["stateserve", "transformers", "llamacpp"] and args.timeout == 600.0


def test_stateserve_args_reach_only_our_runner():
    args = throughput.parse_args(["--stateserve-arg", "mamba_ssm_cache_dtype=auto",
                                  "--stateserve-arg", "max_num_seqs=32"])
    assert throughput.engine_kwargs("stateserve", args) == {
        "enable_prefix_caching": False, "mamba_ssm_cache_dtype": "auto", "max_num_seqs": 32}
    assert throughput.engine_kwargs("vllm", args) == {"enable_prefix_caching": False}
    with pytest.raises(SystemExit):
        throughput.parse_args(["--stateserve-arg", "no_equals_sign"])


def test_rounds_alternate_engines_and_keep_the_fastest_round(monkeypatch, tmp_path):
    """--rounds 3: the round engines run three times, in forward, reverse, forward order, the others once;
    per workload the fastest round's entry is kept, and a failed or short round never replaces a good one."""
    args = throughput.parse_args(["--size", "small", "--models", "llama", "--dtypes", "float32", "--workloads",
                                  "decode,serve", "--engines", "stateserve,transformers", "--rounds", "3",
                                  "--round-engines", "stateserve"])
    calls = []
    timings = {0: (2.0, 5.0), 1: (1.0, None), 2: (4.0, 1.0)}  # round -> (decode s, serve s); None: short

    def fake_run_one(engine, kind, dtype, job, args, pythons, log_dir, round_index):
        calls.append((engine, round_index))
        decode_s, serve_s = timings[round_index] if engine == "stateserve" else (3.0, 3.0)
        serve = {"elapsed_s": serve_s or 0.5, "output_tokens": 10, "prompt_tokens": 10}
        if serve_s is None:
            serve["short_requests"] = 1  # a round that stopped short: fast, but it never counts
        return {"workloads": {"decode": {"elapsed_s": decode_s, "output_tokens": 10, "prompt_tokens": 10},
                              "serve": serve}}, None

    monkeypatch.setattr(throughput, "run_one", fake_run_one)
    monkeypatch.setattr(throughput.machine_limits, "decode_roofline", lambda *a: {"max_tok_s": 100.0})
    rows = throughput.bench_one("llama", "float32", args.engines, args, {}, str(tmp_path))
    assert calls == [("stateserve", 0), ("transformers", 0), ("stateserve", 1), ("stateserve", 2)]
    speed = {(r["engine"], r["workload"]): r["tok_s"] for r in rows}
    assert speed[("stateserve", "decode")] == pytest.approx(10 / 1.0)  # round 2 of 3 was the fastest decode
    assert speed[("stateserve", "serve")] == pytest.approx(10 / 1.0)  # round 3; round 2's short run ignored
    assert speed[("transformers", "serve")] == pytest.approx(10 / 3.0)
    assert all(r.get("rounds") == 3 for r in rows if r["engine"] == "stateserve")
    by_workload = {r["workload"]: r for r in rows if r["engine"] == "stateserve"}
    assert by_workload["decode"]["round_elapsed_s"] == [2.0, 1.0, 4.0]
    assert by_workload["serve"]["round_elapsed_s"] == [5.0, 0.5, 1.0]  # the short round's time, recorded
    with pytest.raises(SystemExit):
        throughput.parse_args(["--rounds", "0"])
    with pytest.raises(SystemExit):
        throughput.parse_args(["--round-engines", "vllm"])  # not among the engines
