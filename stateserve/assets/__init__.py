"""Bundled demo models (trained by scripts/train_demo_models.py)."""
from __future__ import annotations

import os

MODELS_DIR = os.path.join(os.path.dirname(__file__), "models")


def bundled_models() -> dict[str, str]:
    if not os.path.isdir(MODELS_DIR):
        return {}
    return {name: os.path.join(MODELS_DIR, name) for name in sorted(os.listdir(MODELS_DIR))
            if os.path.isfile(os.path.join(MODELS_DIR, name, "config.json"))}


def default_model_path() -> str:
    models = bundled_models()
    if not models:
        raise ValueError("no bundled demo model found; pass --model PATH to a Hugging Face model folder")
    for preferred in ("mamba2", "hybrid", "llama"):
        for name, path in models.items():
            if preferred in name:
                return path
    return next(iter(models.values()))
