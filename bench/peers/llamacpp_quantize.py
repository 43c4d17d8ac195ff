"""Quantizes a float GGUF file with llama.cpp's own quantizer (llama-cpp-python's llama_model_quantize), as
`llama-quantize IN OUT TYPE` would: Q4_0 and Q4_K_M keep llama.cpp's default mixes (the output tensor at Q6_K,
Q4_K_M's chosen attn_v / ffn_down tensors at Q6_K). Run with the llama-cpp-python venv; never imported by stateserve.

    python llamacpp_quantize.py IN.gguf OUT.gguf q4_0|q4_k_m|q8_0
"""
from __future__ import annotations

import os
import sys

FTYPES = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}


def main() -> None:
    if len(sys.argv) != 4 or sys.argv[3] not in FTYPES:
        sys.exit(__doc__)
    import llama_cpp

    src, dst, kind = sys.argv[1:]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[kind])
    params.nthread = os.cpu_count() or 1
    status = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if status != 0:
        sys.exit(f"llama_model_quantize({src}, {kind}) failed with status {status}")


if __name__ == "__main__":
    main()
