"""``cegen.CrossEntropyResult`` and the autograd Functions of a cross entropy that also
returns the log-sum-exp, the entropy or the argmax (``return_lse``, ``return_entropy``,
``return_argmax`` of :func:`cegen.cross_entropy`).

The lse is the forward's (or fused kernel's) own; the entropy and argmax come from the
forward kernel's statistics sweep, only when one of them is asked for (bundle format 5's
optional outputs, flag bits 4 and 5), so a call that asks for them with ``grad_weights``
takes the forward and backward kernels instead of the fused one (whose outputs would cost a
sweep of their own). Only the loss is differentiable. With
``overwrite_input`` the outputs are of the logits as they were before the gradient
replaced them. The kernels are called through ``cegen._library``'s entries, so that
torch.compile traces the same Functions over the registered custom ops.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

from . import _library
from ._ownership import bump_version

__all__ = ["CrossEntropyResult", "cross_entropy_outputs", "two_kernel_gradient"]


class CrossEntropyResult(NamedTuple):
    """What :func:`cegen.cross_entropy` returns when a ``return_*`` flag is set: each in the
    labels' layout, the ones not asked for None. ``loss`` (fp32) is differentiable;
    ``lse`` (fp32, of the transformed logits z), ``entropy`` (fp32, ``sum_j p_j (lse -
    z_j)``, NaN where lse is not finite) and ``argmax`` (int64, the lowest index of the
    row's largest z, -1 for a row with a NaN) are not. Every row gets its lse, entropy
    and argmax, ignored tokens included."""

    loss: torch.Tensor
    lse: Optional[torch.Tensor]
    entropy: Optional[torch.Tensor]
    argmax: Optional[torch.Tensor]


def two_kernel_gradient(ctx: Any, grad_loss: torch.Tensor) -> torch.Tensor:
    """The backward kernel's gradient from what a two-kernel forward saved (logits, labels,
    lse, lse_low; ``ctx.op_args``, ``ctx.overwrite``): written over the logits under
    overwrite (their version bumped), else into a fresh tensor."""
    logits, labels, lse, lse_low = ctx.saved_tensors
    if ctx.overwrite:
        _library.backward_overwrite(logits, labels, lse, lse_low, grad_loss, *ctx.op_args)
        bump_version(logits)  # saved copies of the logits elsewhere now fail loudly
        return logits.detach()
    return _library.backward(logits, labels, lse, lse_low, grad_loss, *ctx.op_args)


class _OutputsFunction(torch.autograd.Function):
    """Forward kernel (with the outputs' sweep where ``sweep``) now, backward kernel in
    ``backward``; outputs (loss, lse, entropy, argmax), entropy and argmax None without
    the sweep."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor,  # type: ignore[override]
                overwrite: bool, sweep: bool, *op_args: Any) -> Tuple[Any, ...]:
        if sweep:
            loss, lse, lse_low, entropy, argmax = _library.forward_outputs(
                logits, labels, *op_args)
        else:
            loss, lse, lse_low = _library.forward(logits, labels, *op_args)
            entropy = argmax = None
        ctx.save_for_backward(logits, labels, lse, lse_low)
        ctx.op_args = op_args
        ctx.overwrite = overwrite
        ctx.mark_non_differentiable(*(t for t in (lse, entropy, argmax) if t is not None))
        return loss, lse, entropy, argmax

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor,  # type: ignore[override]
                 *unused: Any) -> Tuple[Optional[torch.Tensor], ...]:
        return (two_kernel_gradient(ctx, grad_loss),) + (None,) * (3 + len(ctx.op_args))


class _FusedOutputsFunction(torch.autograd.Function):
    """The fused kernel computes the loss, the gradient and the lse (the forward's own);
    ``backward`` returns (rescales) the gradient as the plain fused Function does."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor,  # type: ignore[override]
                weights: torch.Tensor, overwrite: bool, *op_args: Any) -> Tuple[Any, ...]:
        if overwrite:
            loss, lse = _library.fused_overwrite(logits, labels, weights, *op_args)
            bump_version(logits)
            grad = logits.detach()
        else:
            loss, lse, grad = _library.fused(logits, labels, weights, *op_args)
        ctx.save_for_backward(grad, weights)
        ctx.label_layout, ctx.bundle = op_args[3], op_args[4]
        ctx.inputs = 4 + len(op_args)
        ctx.used = False
        ctx.mark_non_differentiable(lse)
        return loss, lse

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor,  # type: ignore[override]
                 *unused: Any) -> Tuple[Optional[torch.Tensor], ...]:
        from .ops import _fused_backward  # the plain fused Function's backward
        return _fused_backward(ctx, grad_loss, _library.rescale_fused_gradient, ctx.inputs)


def cross_entropy_outputs(logits: torch.Tensor, labels: torch.Tensor, op_args: Tuple[Any, ...],
                          overwrite: bool, weights: Optional[torch.Tensor], needs_grad: bool,
                          returns: Tuple[bool, bool, bool]) -> CrossEntropyResult:
    """The loss and the outputs ``returns`` = (lse, entropy, argmax) asks for; ``weights``
    (a tensor) selects the fused kernel, ``needs_grad`` whether autograd records the call.
    The options are checked and the overwrite granted by the caller."""
    want_lse, want_entropy, want_argmax = returns
    sweep = want_entropy or want_argmax
    if not needs_grad:
        if sweep:
            loss, lse, _, entropy, argmax = _library.forward_outputs(logits, labels, *op_args)
        else:
            loss, lse, _ = _library.forward(logits, labels, *op_args)
            entropy = argmax = None
    elif weights is not None and not sweep:
        loss, lse = _FusedOutputsFunction.apply(logits, labels, weights, overwrite, *op_args)
        entropy = argmax = None
    else:
        # With the entropy or argmax, also where grad_weights would select the fused
        # kernel: the forward kernel accumulates them in its statistics sweep, and the
        # backward kernel follows in autograd's backward. The fused kernel takes them in a
        # sweep of their own (a third read of each row): 1.5x against 1.9x the fused
        # kernel's time at 8192x128256 on the H200 (docs/perf-log/2026-12-02-1942-*).
        loss, lse, entropy, argmax = _OutputsFunction.apply(
            logits, labels, overwrite, sweep, *op_args)
    return CrossEntropyResult(loss, lse if want_lse else None,
                              entropy if want_entropy else None,
                              argmax if want_argmax else None)
