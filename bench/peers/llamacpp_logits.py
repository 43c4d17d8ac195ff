"""Logits of every position of fixed token ids under llama.cpp (llama-cpp-python's `Llama`, logits_all), for
bench/quantized.py's KL divergence; run with the llama.cpp venv's Python.

    python llamacpp_logits.py MODEL.gguf TOKENS.json OUT.npy THREADS
"""
from __future__ import annotations

import json
import sys


def main() -> None:
    import numpy as np
    from llama_cpp import Llama

    path, tokens_path, out_path, threads = sys.argv[1:]
    with open(tokens_path) as f:
        tokens = json.load(f)
    llm = Llama(model_path=path, n_ctx=len(tokens) + 16, n_batch=512, logits_all=True, n_threads=int(threads),
                verbose=False)
    llm.eval(tokens)
    np.save(out_path, np.asarray(llm.scores[:len(tokens)], dtype=np.float32))


if __name__ == "__main__":
    main()
