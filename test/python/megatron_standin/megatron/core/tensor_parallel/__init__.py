"""Stand-in of megatron.core.tensor_parallel: the unfused vocab-parallel cross entropy."""

from .cross_entropy import vocab_parallel_cross_entropy

__all__ = ["vocab_parallel_cross_entropy"]
