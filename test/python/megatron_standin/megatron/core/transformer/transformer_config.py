"""Stand-in of Megatron-Core's TransformerConfig: only the fields the loss path reads.

Written for cegen's tests; field names and defaults follow Megatron-Core's
``megatron/core/transformer/transformer_config.py`` / ``model_parallel_config.py``.
"""

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass
class TransformerConfig:
    """The loss-relevant subset of Megatron-Core's TransformerConfig."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    virtual_pipeline_model_parallel_size: Optional[int] = None
    cross_entropy_loss_fusion: bool = False
    cross_entropy_fusion_impl: str = "native"  # 'native' or 'te'
    calculate_per_token_loss: bool = False
    # ModelParallelConfig: set by megatron.training to the optimizer's scale_loss.
    grad_scale_func: Optional[Callable] = None
    # What GPTModel's post-processing and its output layer read.
    gradient_accumulation_fusion: bool = False
    defer_embedding_wgrad_compute: bool = False
    mtp_num_layers: Optional[int] = None
    use_mup: bool = False
    mup_output_mult: float = 1.0
    config_logger_dir: str = ""
    cuda_graph_impl: str = "none"
