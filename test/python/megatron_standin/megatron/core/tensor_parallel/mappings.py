"""Stand-in of the three autograd mappings of megatron.core.tensor_parallel.mappings that the
output layer uses, written for cegen's tests (not Megatron code; gloo-friendly collectives).

* ``copy_to_tensor_model_parallel_region``: identity forward, all-reduce (SUM) of the
  gradient over the tensor-parallel group in backward;
* ``gather_from_sequence_parallel_region``: all-gather along the first (sequence) dimension,
  and in backward the reduce-scatter of the gradient (sum over ranks, this rank's rows);
* ``gather_from_tensor_model_parallel_region``: all-gather along the last dimension, and in
  backward this rank's columns of the gradient.

A group that is not a torch.distributed group of more than one rank (a FakeProcessGroup,
or None) makes each of them the identity.
"""

import torch


def _rank_and_size(group):
    distributed = torch.distributed
    if (group is not None and distributed.is_available() and distributed.is_initialized()
            and isinstance(group, distributed.ProcessGroup) and group.size() > 1):
        return group.rank(), group.size()
    return 0, 1


def _all_gather(tensor, dim, group):
    _, size = _rank_and_size(group)
    if size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(size)]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _all_reduce(tensor, group):
    _, size = _rank_and_size(group)
    if size > 1:
        tensor = tensor.clone()
        torch.distributed.all_reduce(tensor, group=group)
    return tensor


def _own_part(tensor, dim, group):
    rank, size = _rank_and_size(group)
    return tensor.chunk(size, dim=dim)[rank].contiguous()


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _all_reduce(grad_output, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _all_gather(input_, 0, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _own_part(_all_reduce(grad_output, ctx.group), 0, ctx.group), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _all_gather(input_, -1, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _own_part(grad_output, -1, ctx.group), None


def copy_to_tensor_model_parallel_region(input_, group=None):
    return _CopyToModelParallelRegion.apply(input_, group)


def gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=None):
    assert tensor_parallel_output_grad, "the stand-in reproduces the reduce-scatter backward only"
    return _GatherFromSequenceParallelRegion.apply(input_, group)


def gather_from_tensor_model_parallel_region(input_, group=None):
    return _GatherFromModelParallelRegion.apply(input_, group)
