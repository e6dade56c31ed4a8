"""Stand-in of megatron.core.tensor_parallel: the unfused vocab-parallel cross entropy, the
output layer (ColumnParallelLinear) and the mappings it uses."""

from .cross_entropy import vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear
from .mappings import (copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
                       gather_from_tensor_model_parallel_region)

__all__ = ["vocab_parallel_cross_entropy", "ColumnParallelLinear",
           "copy_to_tensor_model_parallel_region", "gather_from_sequence_parallel_region",
           "gather_from_tensor_model_parallel_region"]
