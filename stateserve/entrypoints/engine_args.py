"""The engine's command-line flags, generated from EngineConfig's fields (shared by `generate` and `serve`)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from typing import Any, Callable


# EngineConfig fields that get no flag, and why (every other field does; tests/test_cli_flags.py checks both)
_NOT_FLAGS = {
    "model": "each command names the model itself (positional on serve, --model on generate)",
    "runner": "both commands generate text; the pooling runner is reached through LLM.embed",
}


def _json_object(text: str) -> dict:
    """--hf-overrides '{"num_hidden_layers": 2}': a JSON object, as vLLM's flag takes it."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


# Fields whose type argparse cannot take as it is: the dtype union is a name on the command line, the dict a JSON
# object. Any other type outside int/float/str/bool (optional or not) fails loudly in _engine_flags.
_CLI_TYPES: dict[str, Callable[[str], Any]] = {"dtype": str, "hf_overrides": _json_object,
                                               "speculative_config": _json_object}
# some Python versions (3.10) append the default to a BooleanOptionalAction's help themselves, later ones do not
_BOOL_HELP_HAS_DEFAULT = "%(default)" in (argparse.BooleanOptionalAction(["--x"], "x", default=False, help="").help
                                          or "")


def _engine_flags() -> list[tuple[dataclasses.Field, dict[str, Any]]]:
    """Each flagged EngineConfig field with its add_argument keywords, derived from the field itself: type from the
    annotation, default from the dataclass, help and choices from the field's metadata."""
    from stateserve.config import EngineConfig

    hints = typing.get_type_hints(EngineConfig)
    flags = []
    for f in dataclasses.fields(EngineConfig):
        if f.name in _NOT_FLAGS:
            continue
        if not f.metadata.get("help"):
            raise TypeError(f"EngineConfig.{f.name} has no help text: declare it with config._option(...)")
        hint = hints[f.name]
        # `X | None` takes X on the command line and keeps None as the default
        is_union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        kinds = [t for t in typing.get_args(hint) if t is not type(None)] if is_union else [hint]
        kw: dict[str, Any] = {"default": f.default, "help": f.metadata["help"].replace("%", "%%")}
        if f.name in _CLI_TYPES:
            kw["type"] = _CLI_TYPES[f.name]
        elif kinds == [bool]:
            kw["action"] = argparse.BooleanOptionalAction  # --x / --no-x
        elif len(kinds) == 1 and kinds[0] in (int, float, str):
            kw["type"] = kinds[0]
        else:
            raise TypeError(f"EngineConfig.{f.name}: no command-line form for {hint}; add one to _CLI_TYPES or a "
                            "reason to _NOT_FLAGS")
        if f.metadata.get("choices"):
            kw["choices"] = f.metadata["choices"]
        if f.default is not None and not ("action" in kw and _BOOL_HELP_HAS_DEFAULT):
            kw["help"] += " (default: %(default)s)"  # a None default is described in the help text's words
        flags.append((f, kw))
    return flags


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Every EngineConfig field but _NOT_FLAGS as a --flag (shared by generate and serve)."""
    for f, kw in _engine_flags():
        p.add_argument("--" + f.name.replace("_", "-"), **kw)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig keyword arguments the parsed engine flags give (every flagged field, set or not)."""
    return {f.name: getattr(args, f.name) for f, _ in _engine_flags()}


def default_model() -> str:
    from stateserve.assets import default_model_path

    return default_model_path()
