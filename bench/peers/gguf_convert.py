"""Converts a Hugging Face folder to GGUF with llama.cpp's own convert_hf_to_gguf.py (from the
llama-cpp-python sdist, with its vendored gguf-py). Needs a Python with torch, numpy and pyyaml (the
project's own venv will do); it is never imported by stateserve.

The benchmark's random-weight folders carry no tokenizer. For Mamba and Mamba2 the converter already falls
back to the tokenizer list it ships (models/ggml-vocab-gpt-neox.gguf); for Llama and the other families (Qwen3.5,
Kimi Linear, ...: their converters read a BPE or SentencePiece tokenizer) it has no such fallback, so this wrapper
points them at its shipped Llama SentencePiece list (models/ggml-vocab-llama-spm.gguf, 32000 tokens) instead.
Token ids are all the benchmark uses, so which vocabulary names them does not matter.

    python gguf_convert.py CONVERT_HF_TO_GGUF.py HF_FOLDER OUT.gguf f32|bf16
"""
from __future__ import annotations

import os
import runpy
import sys

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def _no_mtp(folder: str) -> list[str]:
    """--no-mtp for a Qwen3.5 / Qwen3-Next folder without multi-token-prediction layers (the converter otherwise
    insists on counting some)."""
    import json

    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    qwen = any(a.startswith(("Qwen3_5", "Qwen3Next")) for a in config.get("architectures", []))
    return ["--no-mtp"] if qwen and not config.get("mtp_num_hidden_layers") else []


def main() -> None:
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    script, folder, out_path, outtype = sys.argv[1:]
    llama_cpp_dir = os.path.dirname(os.path.abspath(script))
    sys.path[0:0] = [llama_cpp_dir, os.path.join(llama_cpp_dir, "gguf-py")]  # [0] is where it finds models/
    import conversion.base as base
    import conversion.llama as llama_conversion

    has_tokenizer = any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES)

    def builtin_when_bare(original):  # type: ignore[no-untyped-def]
        def set_vocab(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            if has_tokenizer:
                return original(self, *args, **kwargs)
            vocab_size = self.hparams.get("vocab_size") or self.hparams["text_config"]["vocab_size"]
            if vocab_size > 32000:
                raise ValueError(f"no tokenizer in {folder} and vocab_size {vocab_size} > 32000 (the shipped list)")
            self._set_vocab_builtin("llama-spm", vocab_size)
        return set_vocab

    llama_conversion.LlamaModel.set_vocab = builtin_when_bare(llama_conversion.LlamaModel.set_vocab)
    for name in ("_set_vocab_gpt2", "_set_vocab_qwen", "_set_vocab_sentencepiece"):
        setattr(base.TextModel, name, builtin_when_bare(getattr(base.TextModel, name)))
    sys.argv = [script, folder, "--outfile", out_path, "--outtype", outtype, *_no_mtp(folder)]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
