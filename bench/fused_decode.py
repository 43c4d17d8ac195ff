"""One-request decode with the fused decode kernels (csrc mamba1_decode_ / mamba2_mixer_decode_: a Mamba or Mamba2
mixer from in_proj to out_proj in one call; decoder_layer_decode_: a whole Llama layer) against the same layers op
by op (the fused path switched off), alternating in one process so that the machine's drift hits both alike; checks
that both generate the same tokens.

    python bench/fused_decode.py [--models mamba,mamba2,llama] [--dtypes float32,bfloat16] [--rounds 4] [--tokens 128]

Prints generated tok/s of each round and the best of each variant.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import model_folder  # noqa: E402
from bench.machine_limits import DTYPES  # noqa: E402
from stateserve import LLM, SamplingParams  # noqa: E402
from stateserve.layers.mamba2_mixer import Mamba2Mixer  # noqa: E402
from stateserve.layers.selective_scan import MambaMixer  # noqa: E402
from stateserve.layers.decoder_layer import DecoderLayer  # noqa: E402

# the module class whose _fused_decode makes the difference, by model kind
FUSED_MODULES = {"mamba": MambaMixer, "mamba2": Mamba2Mixer, "llama": DecoderLayer}


def compare(kind: str, dtype: str, rounds: int, tokens: int) -> None:
    module = FUSED_MODULES[kind]
    fused = module._fused_decode
    variants = {"fused": fused, "op by op": lambda *args: None}
    llm = LLM(model_folder(kind, "base", DTYPES[dtype]), dtype=dtype, skip_tokenizer_init=True)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(100, 132))}
    rates: dict[str, list[float]] = {name: [] for name in variants}
    generated: dict[str, list[int]] = {}
    try:
        for _ in range(rounds):
            for name, fn in variants.items():
                module._fused_decode = fn
                start = time.perf_counter()
                out = llm.generate([prompt], params, use_tqdm=False)
                rates[name].append(tokens / (time.perf_counter() - start))
                generated[name] = list(out[0].outputs[0].token_ids)
    finally:
        module._fused_decode = fused
        llm.shutdown()
    for name, values in rates.items():
        print(f"{kind:7s} {dtype:9s} {name:9s} " + " ".join(f"{v:6.1f}" for v in values) + f"   best {max(values):6.1f}")
    print(f"{kind:7s} {dtype:9s} same tokens: {generated['fused'] == generated['op by op']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mamba,mamba2,llama")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    for kind in args.models.split(","):
        for dtype in args.dtypes.split(","):
            compare(kind, dtype, args.rounds, args.tokens)


if __name__ == "__main__":
    main()
