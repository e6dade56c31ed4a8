"""Stand-in of Transformer Engine's ``parallel_cross_entropy``, written for cegen's tests.

Per-token semantics of TE's triton kernels (``transformer_engine/pytorch/triton/
cross_entropy.py``), with the logits split over the vocabulary across
``dist_process_group`` as in TE (equal slices, global label ids):

* ``label == ignore_idx`` (-100 by default, and Megatron passes none): loss 0 and a zero
  gradient row;
* a label in ``[0, V)``: ``loss = lse - x_y``, gradient ``g * (softmax - [j == y])``;
* any other label (outside ``[0, V)``): TE's kernel takes the target logit as ``-inf``,
  so ``loss = +inf`` and the gradient is ``g * softmax`` with no one-hot term. A loss mask
  of 0 times +inf is NaN: this is not a contract a trainer can use, and cegen gives such
  tokens Megatron-Core's values instead (docs/megatron.md). The stand-in reproduces the
  +inf so that tests can document the difference.

Fp32 math (float64 logits stay float64). Label smoothing is not reproduced: Megatron calls
TE's loss with 0.0. Without a torch.distributed group of more than one rank (a
FakeProcessGroup, or none) it computes the single-rank loss.
"""

import torch

CALLS = {"parallel_cross_entropy": 0}


def _rank_and_size(group):
    distributed = torch.distributed
    if (group is not None and distributed.is_available() and distributed.is_initialized()
            and isinstance(group, distributed.ProcessGroup) and group.size() > 1):
        return group.rank(), group.size()
    return 0, 1


def _all_reduce(tensor, op, group, size):
    if size > 1:
        torch.distributed.all_reduce(tensor, op=op, group=group)
    return tensor


class _CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, reduce_loss, group, ignore_idx):
        if label_smoothing != 0.0 or reduce_loss:
            raise NotImplementedError("the TE stand-in reproduces label_smoothing=0.0, "
                                      "reduce_loss=False only (what Megatron passes)")
        rank, size = _rank_and_size(group)
        x = logits if logits.dtype == torch.float64 else logits.float()
        vocab_local = x.shape[-1]
        start = rank * vocab_local
        target = target.reshape(x.shape[:-1])
        row_max = _all_reduce(x.max(dim=-1)[0], torch.distributed.ReduceOp.MAX, group, size)
        exp = (x - row_max.unsqueeze(-1)).exp()
        sum_exp = _all_reduce(exp.sum(dim=-1), torch.distributed.ReduceOp.SUM, group, size)
        here = (target >= start) & (target < start + vocab_local)
        local = torch.where(here, target - start, torch.zeros_like(target)).long()
        picked = x.gather(-1, local.unsqueeze(-1)).squeeze(-1)
        # TE: X_y = -inf on every rank that does not hold the label, then a MAX over ranks.
        target_logit = torch.where(here, picked, torch.full_like(picked, -float("inf")))
        target_logit = _all_reduce(target_logit, torch.distributed.ReduceOp.MAX, group, size)
        loss = row_max + torch.log(sum_exp) - target_logit
        ignored = target == ignore_idx
        loss = torch.where(ignored, torch.zeros_like(loss), loss)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), here, local, ignored)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, here, local, ignored = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local.unsqueeze(-1), -here.to(grad.dtype).unsqueeze(-1))
        grad = torch.where(ignored.unsqueeze(-1), torch.zeros_like(grad), grad)
        grad = grad * grad_output.unsqueeze(-1)
        return grad.to(ctx.logits_dtype), None, None, None, None, None


def parallel_cross_entropy(_input, target, label_smoothing=0.0, reduce_loss=False,
                           dist_process_group=None, ignore_idx=-100):
    """Per-token loss (fp32, the target's shape) of vocabulary-sliced logits ``[..., V_local]``."""
    CALLS["parallel_cross_entropy"] += 1
    return _CrossEntropyFunction.apply(_input, target, label_smoothing, reduce_loss,
                                       dist_process_group, ignore_idx)
