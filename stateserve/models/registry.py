"""Architecture name (config.json `architectures[0]`) -> model class, imported lazily."""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any

_BUILTIN: dict[str, str] = {
    "LlamaForCausalLM": "stateserve.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "stateserve.models.llama:Qwen2ForCausalLM",
    "MambaForCausalLM": "stateserve.models.mamba:MambaForCausalLM",
    "FalconMambaForCausalLM": "stateserve.models.mamba:FalconMambaForCausalLM",
    "Mamba2ForCausalLM": "stateserve.models.mamba2:Mamba2ForCausalLM",
    "JambaForCausalLM": "stateserve.models.jamba:JambaForCausalLM",
    "BambaForCausalLM": "stateserve.models.bamba:BambaForCausalLM",
    "NemotronHForCausalLM": "stateserve.models.nemotron_h:NemotronHForCausalLM",
    "FalconH1ForCausalLM": "stateserve.models.falcon_h1:FalconH1ForCausalLM",
    "GraniteMoeHybridForCausalLM": "stateserve.models.granitemoehybrid:GraniteMoeHybridForCausalLM",
    "ZambaForCausalLM": "stateserve.models.zamba:ZambaForCausalLM",
    "Zamba2ForCausalLM": "stateserve.models.zamba2:Zamba2ForCausalLM",
    "Qwen3NextForCausalLM": "stateserve.models.qwen3_next:Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM": "stateserve.models.qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM": "stateserve.models.qwen3_5:Qwen3_5MoeForCausalLM",
    "OlmoHybridForCausalLM": "stateserve.models.olmo_hybrid:OlmoHybridForCausalLM",
    "Lfm2ForCausalLM": "stateserve.models.lfm2:Lfm2ForCausalLM",
    "Lfm2MoeForCausalLM": "stateserve.models.lfm2_moe:Lfm2MoeForCausalLM",
    "Lfm3ForCausalLM": "stateserve.models.lfm3:Lfm3ForCausalLM",
    "KimiLinearForCausalLM": "stateserve.models.kimi_linear:KimiLinearForCausalLM",
    "BailingHybridForCausalLM": "stateserve.models.bailing_hybrid:BailingHybridForCausalLM",
    "MiniMaxForCausalLM": "stateserve.models.minimax:MiniMaxForCausalLM",
    "RecurrentGemmaForCausalLM": "stateserve.models.recurrent_gemma:RecurrentGemmaForCausalLM",
    "xLSTMForCausalLM": "stateserve.models.xlstm:XLSTMForCausalLM",
    "BartForConditionalGeneration": "stateserve.models.bart:BartForConditionalGeneration",
    "T5ForConditionalGeneration": "stateserve.models.t5:T5ForConditionalGeneration",
    "WhisperForConditionalGeneration": "stateserve.models.whisper:WhisperForConditionalGeneration",
    "BertModel": "stateserve.models.bert:BertModel",
    "RobertaModel": "stateserve.models.bert:RobertaModel",
    "XLMRobertaModel": "stateserve.models.bert:XLMRobertaModel",
}

# architectures that are known and refused, with why (a clearer error than "not supported")
_REFUSED: dict[str, str] = {
    arch: (f"{arch} is a vision-language model (its config has a vision tower, vision_config); stateserve serves "
           f"only its text model: use a config.json made of its text_config with architectures ['{causal}'] "
           "(its model.language_model.* tensor names are accepted)")
    for arch, causal in (("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"),
                         ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"))
}


class _ModelRegistry:
    def __init__(self) -> None:
        self._entries: dict[str, str | type] = dict(_BUILTIN)

    def register_model(self, architecture: str, model: str | type) -> None:
        """Register an out-of-tree architecture: a class, or "package.module:ClassName" imported on first use."""
        if not isinstance(architecture, str) or not architecture:
            raise ValueError("register_model: architecture must be a non-empty string")
        if isinstance(model, str) and ":" not in model:
            raise ValueError(f"register_model: {model!r} must look like 'package.module:ClassName'")
        self._entries[architecture] = model

    def _available(self, entry: str | type) -> bool:
        if not isinstance(entry, str):
            return True
        try:  # an entry whose module is not present in this build is not offered
            return importlib.util.find_spec(entry.split(":")[0]) is not None
        except ModuleNotFoundError:
            return False

    def get_supported_archs(self) -> list[str]:
        return sorted(a for a, e in self._entries.items() if self._available(e))

    def is_registered(self, architecture: str) -> bool:
        return architecture in self._entries and self._available(self._entries[architecture])

    def resolve(self, architecture: str) -> type:
        entry = self._entries.get(architecture)
        if entry is None and architecture in _REFUSED:
            raise ValueError(_REFUSED[architecture])
        if entry is None or not self._available(entry):
            raise ValueError(f"architecture {architecture!r} is not supported; supported architectures: "
                             f"{', '.join(self.get_supported_archs())}")
        if isinstance(entry, str):
            module_name, cls_name = entry.split(":")
            entry = getattr(importlib.import_module(module_name), cls_name)
        return entry

    def architecture_of(self, hf_config: Any) -> str:
        archs = getattr(hf_config, "architectures", None) or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot choose a model class")
        return archs[0]


ModelRegistry = _ModelRegistry()
