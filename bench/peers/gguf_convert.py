"""Converts a Hugging Face folder to GGUF with llama.cpp's own convert_hf_to_gguf.py (from the
llama-cpp-python sdist, with its vendored gguf-py). Needs a Python with torch, numpy and pyyaml (the
project's own venv will do); it is never imported by stateserve.

The benchmark's random-weight folders carry no tokenizer. For Mamba and Mamba2 the converter already falls
back to the tokenizer list it ships (models/ggml-vocab-gpt-neox.gguf); for Llama it has no such fallback, so
this wrapper points it at its shipped Llama SentencePiece list (models/ggml-vocab-llama-spm.gguf, 32000
tokens) instead. Token ids are all the benchmark uses, so which vocabulary names them does not matter.

    python gguf_convert.py CONVERT_HF_TO_GGUF.py HF_FOLDER OUT.gguf f32|bf16
"""
from __future__ import annotations

import os
import runpy
import sys

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def main() -> None:
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    script, folder, out_path, outtype = sys.argv[1:]
    llama_cpp_dir = os.path.dirname(os.path.abspath(script))
    sys.path[0:0] = [llama_cpp_dir, os.path.join(llama_cpp_dir, "gguf-py")]  # [0] is where it finds models/
    import conversion.llama as llama_conversion

    original = llama_conversion.LlamaModel.set_vocab

    def set_vocab(self) -> None:  # type: ignore[no-untyped-def]
        if any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES):
            return original(self)
        vocab_size = self.hparams["vocab_size"]
        if vocab_size > 32000:
            raise ValueError(f"no tokenizer in {folder} and vocab_size {vocab_size} > 32000 (the shipped list)")
        self._set_vocab_builtin("llama-spm", vocab_size)

    llama_conversion.LlamaModel.set_vocab = set_vocab
    sys.argv = [script, folder, "--outfile", out_path, "--outtype", outtype]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
