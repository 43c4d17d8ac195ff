"""bench/spec_decode.py plumbing: --rounds runs the configurations in turns (rotated each round) and keeps, per
workload, the fastest round of each, with the speculation counters and every round's time on record."""
from __future__ import annotations

import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path[0:0] = [BENCH, os.path.join(BENCH, "peers")]
import spec_decode  # noqa: E402


def test_rounds_take_turns_and_keep_the_fastest_round(monkeypatch, tmp_path):
    args = spec_decode.parse_args(["--size", "small", "--models", "llama", "--workloads", "copy",
                                   "--concurrency", "1", "--configs", "ss,ss-ngram", "--rounds", "3"])
    calls = []
    # (config, round) -> seconds of the copy-1 workload; None: that round's process failed
    seconds = {("ss", 0): 2.0, ("ss", 1): 1.0, ("ss", 2): 3.0,
               ("ss-ngram", 0): 0.8, ("ss-ngram", 1): None, ("ss-ngram", 2): 0.5}

    def fake_run_config(config, model, job, args, log_dir, round_index=0):
        calls.append((config, round_index))
        elapsed = seconds[(config, round_index)]
        if elapsed is None:
            return {"workloads": {"copy-1": {"error": "exited"}}, "error": "exited"}
        entry = {"elapsed_s": elapsed, "output_tokens": 32, "runs_s": [elapsed], "outputs": [[5] * 32]}
        result = {"workloads": {"copy-1": entry}}
        if config == "ss-ngram":
            result["spec"] = {"copy-1": {"num_draft_tokens": 40, "num_accepted_tokens": 30, "num_verify_steps": 10}}
        return result

    monkeypatch.setattr(spec_decode, "run_config", fake_run_config)
    monkeypatch.setattr(spec_decode, "resolve_model", lambda name, args: str(tmp_path))
    monkeypatch.setattr(spec_decode, "make_prompts", lambda *a: [[1, 2, 3]])
    rows = spec_decode.bench_model("llama", args, str(tmp_path))
    assert calls == [("ss", 0), ("ss-ngram", 0), ("ss-ngram", 1), ("ss", 1), ("ss", 2), ("ss-ngram", 2)]
    cells = rows[0]["cells"]
    assert cells["ss"]["tok_s"] == pytest.approx(32 / 1.0)  # round 2's
    assert cells["ss-ngram"]["tok_s"] == pytest.approx(32 / 0.5)  # round 3's; round 2 failed
    assert cells["ss-ngram"]["error"] is None
    assert cells["ss-ngram"]["acceptance_rate"] == pytest.approx(0.75)
    assert rows[0]["spec_over_ss"] == pytest.approx(2.0)
    with pytest.raises(SystemExit):
        spec_decode.parse_args(["--rounds", "0"])


def test_a_configuration_failing_every_round_keeps_its_error(monkeypatch, tmp_path):
    args = spec_decode.parse_args(["--size", "small", "--models", "llama", "--workloads", "copy",
                                   "--concurrency", "1", "--configs", "ss", "--rounds", "2"])
    monkeypatch.setattr(spec_decode, "run_config",
                        lambda *a, **k: {"workloads": {"copy-1": {"error": "exited: boom"}}, "error": "exited: boom"})
    monkeypatch.setattr(spec_decode, "resolve_model", lambda name, args: str(tmp_path))
    monkeypatch.setattr(spec_decode, "make_prompts", lambda *a: [[1, 2, 3]])
    rows = spec_decode.bench_model("llama", args, str(tmp_path))
    assert rows[0]["cells"]["ss"]["error"] == "exited: boom"
    assert "tok_s" not in rows[0]["cells"]["ss"]


def test_speculative_outputs_are_checked_against_the_batch_invariant_baseline(monkeypatch, tmp_path):
    """ss-inv (plain decoding, batch_invariant=True) reaches its runner and is what ss-ngram's tokens must equal;
    plain ss may differ from both (another summation order) without a MISMATCH."""
    args = spec_decode.parse_args(["--size", "small", "--models", "llama", "--workloads", "copy",
                                   "--concurrency", "1", "--configs", "ss,ss-inv,ss-ngram"])
    outputs = {"ss": [[1, 2, 3]], "ss-inv": [[1, 2, 4]], "ss-ngram": [[1, 2, 4]]}
    kwargs = {}

    def fake_run_engine(engine, job, python, log_path, timeout, preload):
        config = "ss-ngram" if job["spec"] else ("ss-inv" if job["engine_kwargs"] else "ss")
        kwargs[config] = job["engine_kwargs"]
        return {"workloads": {"copy-1": {"elapsed_s": 1.0, "output_tokens": 3, "runs_s": [1.0],
                                         "outputs": outputs[config]}}}

    monkeypatch.setattr(spec_decode.throughput, "run_engine", fake_run_engine)
    monkeypatch.setattr(spec_decode, "resolve_model", lambda name, args: str(tmp_path))
    monkeypatch.setattr(spec_decode, "make_prompts", lambda *a: [[1, 2, 3]])
    rows = spec_decode.bench_model("llama", args, str(tmp_path))
    assert kwargs == {"ss": {}, "ss-inv": {"batch_invariant": True}, "ss-ngram": {}}
    cells = rows[0]["cells"]
    assert cells["ss-ngram"]["reference"] == "ss-inv" and cells["ss-ngram"]["differs_from_ss"] is None
    assert cells["ss-inv"]["differs_from_ss"]  # plain ss parted at token 2
    table = spec_decode.format_table(rows, args.configs)
    assert "ss-ngram == ss-inv" in table and "MISMATCH" not in table
    outputs["ss-ngram"] = [[1, 2, 5]]
    rows = spec_decode.bench_model("llama", args, str(tmp_path))
    assert "MISMATCH ss-ngram vs ss-inv" in spec_decode.format_table(rows, args.configs)
