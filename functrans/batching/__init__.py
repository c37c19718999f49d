"""The vmap engine: BatchedTensor, the dispatcher, the rule registry, the fallback."""
from .api import vmap
from .batched_tensor import BatchedTensor
from . import rules  # noqa: F401  (importing registers every built-in rule)

__all__ = ["vmap", "BatchedTensor"]
