"""stateserve: an inference engine where decoders, state-space models and hybrids are first-class."""
from stateserve.models.registry import ModelRegistry
from stateserve.outputs import CompletionOutput, EmbeddingRequestOutput, Logprob, RequestOutput
from stateserve.sampling_params import SamplingParams


def __getattr__(name: str):
    if name == "LLM":  # lazy: importing stateserve should not import torch models eagerly
        from stateserve.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "EmbeddingRequestOutput",
           "ModelRegistry"]
