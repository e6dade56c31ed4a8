"""Stand-in of Megatron-Core's ColumnParallelLinear as GPTModel's output layer uses it
(``megatron/core/tensor_parallel/layers.py``, read at d98e8a64), written for cegen's tests.

The weight is this rank's rows ``[V / TP, H]`` (``skip_weight_param_allocation``: none, the
caller passes ``weight=``, as GPTModel does with tied embeddings); ``forward(input_, weight,
runtime_gather_output)`` returns ``(output, output_bias)``. The input goes through
``copy_to_tensor_model_parallel_region`` (its gradient all-reduced, Megatron's
``allreduce_dgrad``) or, with sequence parallelism, ``gather_from_sequence_parallel_region``
(all-gather forward, reduce-scatter backward); ``gather_output`` (or
``runtime_gather_output``) all-gathers the logits over the vocabulary. The GEMM is
``torch.matmul``; the attributes cegen's patch reads are Megatron's names.
"""

from typing import Optional

import torch

from .mappings import (_rank_and_size, copy_to_tensor_model_parallel_region,
                       gather_from_sequence_parallel_region,
                       gather_from_tensor_model_parallel_region)


class ColumnParallelLinear(torch.nn.Module):
    def __init__(self, input_size, output_size, *, config, init_method=None, bias=True,
                 gather_output=False, skip_bias_add=False,
                 skip_weight_param_allocation: bool = False, tp_group=None,
                 output_dtype: Optional[torch.dtype] = None,
                 weight: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.config = config
        self.tp_group = tp_group
        self.output_dtype = output_dtype
        size = tp_group.size() if tp_group is not None else 1
        self.output_size_per_partition = output_size // size
        if skip_weight_param_allocation:
            self.weight = None
        else:
            if weight is None:  # stand-in only: the test's rows, else random ones
                weight = torch.randn(self.output_size_per_partition, input_size, dtype=dtype)
                weight = weight / input_size ** 0.5
            self.weight = torch.nn.Parameter(weight)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(self.output_size_per_partition,
                                                       dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.sequence_parallel = config.sequence_parallel and size > 1
        self.disable_grad_reduce = False
        self.explicit_expert_comm = False
        self.allreduce_dgrad = size > 1 and not self.sequence_parallel
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        self.gtp_remat_size = 1

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if weight is None:
            if self.weight is None:
                raise RuntimeError("weight was not supplied to ColumnParallelLinear forward pass "
                                   "and skip_weight_param_allocation is True.")
            weight = self.weight
        elif tuple(weight.shape) != (self.output_size_per_partition, self.input_size):
            raise RuntimeError(f"supplied weight's shape is {tuple(weight.shape)}")
        bias = self.bias if not self.skip_bias_add else None
        if self.sequence_parallel:
            total_input = gather_from_sequence_parallel_region(input_, True, self.tp_group)
        elif self.allreduce_dgrad and _rank_and_size(self.tp_group)[1] > 1:
            total_input = copy_to_tensor_model_parallel_region(input_, self.tp_group)
        else:
            total_input = input_
        output = torch.matmul(total_input, weight.t())
        if bias is not None:
            output = output + bias
        gather_output = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather_output:
            output = gather_from_tensor_model_parallel_region(output, self.tp_group)
        return output, (self.bias if self.skip_bias_add else None)
