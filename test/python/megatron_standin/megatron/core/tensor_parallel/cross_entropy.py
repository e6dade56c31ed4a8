"""Reference vocab-parallel cross entropy for a single rank (TP size 1), written for tests.

Semantics of Megatron-Core's: fp32 math, labels outside the local vocabulary slice get a
target logit of 0 (so at TP size 1 an out-of-range label gives loss = lse), optional
label smoothing with s = alpha * V / (V - 1). Inputs [s, b, v] logits and [s, b] labels.
"""

import torch

CALLS = {"vocab_parallel_cross_entropy": 0}


def _single_rank_cross_entropy(logits, target, label_smoothing=0.0):
    x = logits.float()
    vocab = x.shape[-1]
    lse = torch.logsumexp(x, dim=-1)
    out_of_range = (target < 0) | (target >= vocab)
    safe = torch.where(out_of_range, torch.zeros_like(target), target)
    target_logit = x.gather(-1, safe.long().unsqueeze(-1)).squeeze(-1)
    target_logit = torch.where(out_of_range, torch.zeros_like(target_logit), target_logit)
    loss = lse - target_logit
    if label_smoothing > 0:
        smoothing = label_smoothing * vocab / (vocab - 1)
        loss = (1.0 - smoothing) * loss + smoothing * (lse - x.mean(dim=-1))
    return loss


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0, tp_group=None):
    """[s, b, v] logits, [s, b] target -> [s, b] fp32 loss."""
    CALLS["vocab_parallel_cross_entropy"] += 1
    return _single_rank_cross_entropy(vocab_parallel_logits, target, label_smoothing)
