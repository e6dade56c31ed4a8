"""Reference vocab-parallel cross entropy, written for cegen's tests (not Megatron code).

Semantics of Megatron-Core's ``megatron/core/tensor_parallel/cross_entropy.py``: each rank
of the tensor-parallel group holds the logits of an equal vocabulary slice (global ids
``[rank * V_local, (rank + 1) * V_local)``), labels are global ids; fp32 math (float64
logits stay float64: the tests' reference); a MAX all-reduce of the row maxima, then SUM
all-reduces of the target logit and of the sums of exponentials, both shifted by the row
maximum. The target logit is 0 on ranks that do not hold the label, so a label outside
the vocabulary (any id: -100, -1, V + 5, 2**40) has shifted target 0, i.e. its target
logit is taken as the row maximum: loss = lse - max, and its gradient has no one-hot term.
Label smoothing uses the local slice: ``s = alpha * V_local / (V_local - 1)`` and the mean
log-probability of the rank's own slice. Backward: ``g * (softmax - (1 - s) [j == label]
- s / V_local)`` on the local slice, no communication. Without a torch.distributed group
of more than one rank (a FakeProcessGroup, or none) it computes the single-rank loss.
"""

import torch

CALLS = {"vocab_parallel_cross_entropy": 0}


def _rank_and_size(tp_group):
    distributed = torch.distributed
    if (tp_group is not None and distributed.is_available() and distributed.is_initialized()
            and isinstance(tp_group, distributed.ProcessGroup) and tp_group.size() > 1):
        return tp_group.rank(), tp_group.size()
    return 0, 1


def _all_reduce(tensor, op, tp_group, size):
    if size > 1:
        torch.distributed.all_reduce(tensor, op=op, group=tp_group)
    return tensor


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, tp_group):
        rank, size = _rank_and_size(tp_group)
        x = logits if logits.dtype == torch.float64 else logits.float()
        vocab_local = x.shape[-1]
        start = rank * vocab_local
        row_max = _all_reduce(x.max(dim=-1)[0], torch.distributed.ReduceOp.MAX, tp_group, size)
        shifted = x - row_max.unsqueeze(-1)
        elsewhere = (target < start) | (target >= start + vocab_local)
        local = torch.where(elsewhere, torch.zeros_like(target), target - start).long()
        predicted = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1)
        predicted = torch.where(elsewhere, torch.zeros_like(predicted), predicted)
        predicted = _all_reduce(predicted, torch.distributed.ReduceOp.SUM, tp_group, size)
        exp = shifted.exp()
        sum_exp = _all_reduce(exp.sum(dim=-1), torch.distributed.ReduceOp.SUM, tp_group, size)
        loss = torch.log(sum_exp) - predicted
        softmax = exp / sum_exp.unsqueeze(-1)
        smoothing = 0.0
        if label_smoothing > 0:
            smoothing = label_smoothing * vocab_local / (vocab_local - 1)
            loss = (1.0 - smoothing) * loss - smoothing * torch.log(softmax).mean(dim=-1)
        ctx.save_for_backward(softmax, elsewhere, local)
        ctx.smoothing, ctx.vocab_local, ctx.logits_dtype = smoothing, vocab_local, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, elsewhere, local = ctx.saved_tensors
        grad = softmax.clone()
        hit = (1.0 - ctx.smoothing) * (~elsewhere).to(grad.dtype)
        grad.scatter_add_(-1, local.unsqueeze(-1), -hit.unsqueeze(-1))
        if ctx.smoothing:
            grad -= ctx.smoothing / ctx.vocab_local
        grad *= grad_output.unsqueeze(-1)
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy_impl(vocab_parallel_logits, target, label_smoothing=0.0,
                                      tp_group=None):
    """[s, b, v_local] logits, [s, b] global target -> [s, b] fp32 loss."""
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, tp_group)


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0, tp_group=None):
    """[s, b, v_local] logits, [s, b] global target -> [s, b] fp32 loss."""
    CALLS["vocab_parallel_cross_entropy"] += 1
    return vocab_parallel_cross_entropy_impl(vocab_parallel_logits, target, label_smoothing, tp_group)
