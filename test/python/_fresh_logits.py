"""Non-leaf logits that nothing else references, and where their gradient arrives.

Shared by test_overwrite.py and _tensor_parallel_worker.py: overwrite-input is only
granted for such logits, and the recorded pointers show whether the gradient was written
into the logits' own storage.
"""

from __future__ import annotations

from typing import List

import torch


class MakeLogits(torch.autograd.Function):
    """Identity into a fresh buffer that records where its output and its gradient live."""

    output_pointers: List[int] = []
    grad_pointers: List[int] = []

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        out = x.detach().clone()
        MakeLogits.output_pointers.append(out.data_ptr())
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        MakeLogits.grad_pointers.append(grad.data_ptr())
        return grad


def fresh_logits(x: torch.Tensor) -> torch.Tensor:
    """Non-leaf logits that nothing else references once the caller drops them."""
    return MakeLogits.apply(x)
