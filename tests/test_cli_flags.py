"""`stateserve generate` and `stateserve serve` take every EngineConfig field as a flag with the dataclass's own
default, so the CLI and `LLM(...)` cannot drift apart (the CLI once defaulted --mamba-ssm-cache-dtype to float32
while EngineConfig and the README said auto)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from stateserve.config import EngineConfig
from stateserve.entrypoints.cli import build_parser, engine_kwargs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# EngineConfig fields with no engine flag, and why:
EXCLUDED = {
    "model": "each command names the model itself: positional on serve, --model on generate",
    "runner": "both commands generate text; the pooling runner is reached through LLM.embed",
}
# Where a command deliberately starts from another default than EngineConfig (checked in test_server.py too)
COMMAND_DEFAULTS = {"generate": {}, "serve": {"max_num_batched_tokens": 512}}
FIELDS = [f for f in dataclasses.fields(EngineConfig) if f.name not in EXCLUDED]


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _base_args(command: str) -> list[str]:
    return ["generate", "--prompt", "hi"] if command == "generate" else ["serve", "some/model"]


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_engine_config_field_is_a_flag_with_the_dataclass_default(command):
    assert set(EXCLUDED) <= {f.name for f in dataclasses.fields(EngineConfig)}  # no stale exclusion
    p = _subparser(command)
    by_dest = {a.dest: a for a in p._actions}
    for f in FIELDS:
        flag = "--" + f.name.replace("_", "-")
        action = by_dest.get(f.name)
        assert action is not None and flag in action.option_strings, f"{command} has no {flag}"
        assert action.help, f"{flag} has no help text"
        expected = COMMAND_DEFAULTS[command].get(f.name, f.default)
        assert p.get_default(f.name) == expected, (command, flag, p.get_default(f.name), expected)
        if isinstance(f.default, bool) or f.name == "enable_prefix_caching":
            assert isinstance(action, argparse.BooleanOptionalAction) and f"--no-{flag[2:]}" in action.option_strings
        if f.metadata.get("choices"):
            assert list(action.choices) == list(f.metadata["choices"]), flag


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_no_flags_give_exactly_the_engine_config_defaults(command):
    kwargs = engine_kwargs(build_parser().parse_args(_base_args(command)))
    assert set(kwargs) == {f.name for f in FIELDS}
    expected = dataclasses.replace(EngineConfig(model="m"), **COMMAND_DEFAULTS[command])
    assert EngineConfig(model="m", **kwargs) == expected
    assert kwargs["mamba_ssm_cache_dtype"] == "auto"


def test_flags_reach_engine_kwargs_with_their_types():
    argv = ["generate", "--prompt", "hi", "--mamba-ssm-cache-dtype", "float32", "--enforce-eager",
            "--no-enable-prefix-caching", "--max-model-len", "128", "--gpu-memory-utilization", "0.5",
            "--hf-overrides", '{"rope_theta": 5000.0, "num_hidden_layers": 1}', "--dtype", "bfloat16"]
    kwargs = engine_kwargs(build_parser().parse_args(argv))
    assert kwargs["mamba_ssm_cache_dtype"] == "float32" and kwargs["enforce_eager"] is True
    assert kwargs["enable_prefix_caching"] is False and kwargs["max_model_len"] == 128
    assert kwargs["gpu_memory_utilization"] == 0.5 and kwargs["dtype"] == "bfloat16"
    assert kwargs["hf_overrides"] == {"rope_theta": 5000.0, "num_hidden_layers": 1}
    for bad in (["--hf-overrides", "not json"], ["--hf-overrides", json.dumps([1, 2])],
                ["--mamba-ssm-cache-dtype", "float64"], ["--max-num-seqs", "many"]):
        with pytest.raises(SystemExit):  # argparse's usage error, before any engine is built
            build_parser().parse_args(["generate", "--prompt", "hi", *bad])


def _state_slots(*flags: str) -> int:
    """`stateserve generate` on the bundled demo model (a float32 Mamba2) run in bfloat16 with a 32 MiB cache: the
    number of state slots it reports tells which dtype the SSM states got (bfloat16 states: about twice as many)."""
    env = {**os.environ, "STATESERVE_CPU_KERNELS": "0", "STATESERVE_DISABLE_TQDM": "1"}
    env.pop("STATESERVE_CONFIGURE_LOGGING", None)
    env.pop("STATESERVE_LOG_LEVEL", None)
    cmd = [sys.executable, "-m", "stateserve.entrypoints.cli", "generate", "--prompt", "hi", "--max-tokens", "2",
           "--dtype", "bfloat16", "--kv-cache-memory-bytes", str(32 << 20), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^2 tokens in ", proc.stdout, re.M), proc.stdout
    return int(re.search(r"(\d+) state slots", proc.stdout).group(1))


def test_generate_end_to_end_keeps_the_api_default_for_ssm_states():
    explicit = _state_slots("--mamba-ssm-cache-dtype", "auto", "--enforce-eager")
    assert _state_slots() == explicit  # no flag = EngineConfig's default, "auto"
    assert _state_slots("--mamba-ssm-cache-dtype", "float32") < explicit  # the count does tell the dtypes apart


def test_generate_num_gpu_blocks_override_sizes_the_kv_cache():
    """`stateserve generate --num-gpu-blocks-override 8` on the bundled hybrid demo model (the default model, a
    Mamba2, has no KV cache to size) plans exactly 8 KV blocks, far fewer than its default budget would hold, and
    still generates; its log line says so."""
    from stateserve.assets import bundled_models

    model = bundled_models().get("hybrid-demo")
    if model is None:
        pytest.skip("the bundled hybrid demo model is missing")
    env = {**os.environ, "STATESERVE_CPU_KERNELS": "0", "STATESERVE_DISABLE_TQDM": "1"}
    env.pop("STATESERVE_CONFIGURE_LOGGING", None)
    env.pop("STATESERVE_LOG_LEVEL", None)
    cmd = [sys.executable, "-m", "stateserve.entrypoints.cli", "generate", "--model", model, "--prompt", "hi",
           "--prompt", "The quick brown fox", "--max-tokens", "3", "--num-gpu-blocks-override", "8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^6 tokens in ", proc.stdout, re.M), proc.stdout
    found = re.findall(r"Available KV cache memory: .*?; (\d+) KV blocks", proc.stdout + proc.stderr)
    assert found == ["8"], proc.stdout + proc.stderr
