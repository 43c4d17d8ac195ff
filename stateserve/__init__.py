"""stateserve: an inference engine where decoders, state-space models and hybrids are first-class."""
from stateserve.engine.errors import EngineDeadError
from stateserve.logger import configure_logging
from stateserve.models.registry import ModelRegistry
from stateserve.outputs import CompletionOutput, EmbeddingRequestOutput, Logprob, RequestOutput
from stateserve.sampling_params import SamplingParams

# On the first import of the package (the imports above log nothing): without a handler, Python would drop every
# INFO line, the load report included. STATESERVE_CONFIGURE_LOGGING=0 leaves logging to the application.
configure_logging()


def __getattr__(name: str):
    if name == "LLM":  # lazy: importing stateserve should not import torch models eagerly
        from stateserve.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "EmbeddingRequestOutput",
           "ModelRegistry", "EngineDeadError"]
