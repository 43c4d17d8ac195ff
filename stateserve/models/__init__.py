"""Model definitions (one file per family), the architecture registry and the weight loader."""
from stateserve.models.registry import ModelRegistry

__all__ = ["ModelRegistry"]
