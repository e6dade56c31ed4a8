"""``cegen.cross_entropy``: fused softmax cross-entropy with autograd.

Two modes:

* forward + backward (default): the forward kernel returns the per-token loss and keeps the
  per-token log-sum-exp; ``loss.backward()`` launches the backward kernel with the upstream
  per-token gradient, read through its strides (the stride-0 gradient of ``loss.sum()``
  included) without a copy.
* fused (``grad_weights=`` given): the gradient weights are known when the forward runs, so
  one kernel computes the loss and ``grad_weights_t * dloss_t/dlogits``; backward rescales
  each row by ``g_t / grad_weights_t`` on the device, without a host synchronization
  (``cegen._rescale``; skipped when the upstream gradient is the weights tensor itself).

With ``overwrite_input=True`` the gradient is written over the logits' storage when
``cegen._ownership`` finds the logits exclusively owned; otherwise it goes to a fresh
buffer and an :class:`OverwriteRefusedWarning` says why, once per reason.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Optional, Tuple, Union

import torch
from torch.autograd.function import once_differentiable

from . import _kernels, _library, _rescale, _validate
from ._outputs import CrossEntropyResult, cross_entropy_outputs, two_kernel_gradient
from ._errors import CegenError, InvalidInputError
from ._kernels import KernelOptions, check_inputs, kernel_options
from ._ownership import bump_version, grant_overwrite, is_compiling
from ._rescale import upstream_is_weights
from ._runtime import Bundle

__all__ = ["cross_entropy", "cross_entropy_vouched", "CrossEntropyResult"]

#: (return_lse, return_entropy, return_argmax) when none is asked for.
_NO_RETURNS = (False, False, False)

GradWeights = Union[None, float, int, torch.Tensor]
BundleArg = Union[None, str, "os.PathLike[str]", Bundle]


def _op_args(options: KernelOptions) -> Tuple[Any, ...]:
    """The options as the custom ops' trailing arguments, in their schema's order."""
    return (options.ignore_index, options.label_smoothing, options.z_loss,
            options.label_layout, options.bundle, options.label_out_of_range,
            options.logit_scale, options.logit_softcap)


# The Functions take the options as separate primitives (not a KernelOptions object) so that
# torch.compile can treat them as constants.


class _CrossEntropyFunction(torch.autograd.Function):
    """Forward kernel now, backward kernel in ``backward``; outputs (loss, lse)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor,  # type: ignore[override]
                ignore_index: Optional[int], label_smoothing: float, z_loss: float,
                label_layout: str, bundle: Optional[str], label_out_of_range: str,
                logit_scale: float, logit_softcap: float,
                overwrite: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        op_args = (ignore_index, label_smoothing, z_loss, label_layout, bundle,
                   label_out_of_range, logit_scale, logit_softcap)
        loss, lse, lse_low = _library.forward(logits, labels, *op_args)
        ctx.save_for_backward(logits, labels, lse, lse_low)
        ctx.op_args = op_args
        ctx.overwrite = overwrite
        ctx.mark_non_differentiable(lse)
        return loss, lse

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor,  # type: ignore[override]
                 grad_lse: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
        return (two_kernel_gradient(ctx, grad_loss),) + (None,) * 10


class _FusedCrossEntropyFunction(torch.autograd.Function):
    """One kernel computes loss and gradient; ``backward`` returns (rescales) it."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor,  # type: ignore[override]
                weights: torch.Tensor, ignore_index: Optional[int], label_smoothing: float,
                z_loss: float, label_layout: str, bundle: Optional[str],
                label_out_of_range: str, logit_scale: float, logit_softcap: float,
                overwrite: bool) -> torch.Tensor:
        op_args = (ignore_index, label_smoothing, z_loss, label_layout, bundle,
                   label_out_of_range, logit_scale, logit_softcap)
        if overwrite:
            loss, lse = _library.fused_overwrite(logits, labels, weights, *op_args)
            bump_version(logits)
            grad = logits.detach()
        else:
            loss, lse, grad = _library.fused(logits, labels, weights, *op_args)
        # Saved (not kept as an attribute) so that a later in-place change of the logits'
        # storage is caught by autograd's version check instead of returned as gradient.
        ctx.save_for_backward(grad, weights)
        ctx.label_layout, ctx.bundle = label_layout, bundle
        ctx.used = False
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        return _fused_backward(ctx, grad_loss, _library.rescale_fused_gradient, 12)


def _fused_backward(ctx: Any, grad_loss: torch.Tensor, rescale: Any,
                    outputs: int) -> Tuple[Optional[torch.Tensor], ...]:
    """The fused Functions' backward: the forward's gradient, rescaled by ``g / w`` on the
    device unless the upstream gradient is the weights tensor itself."""
    grad, weights = ctx.saved_tensors
    nones = (None,) * (outputs - 1)
    if not is_compiling():  # eager checks; a traced backward has no side effects
        if ctx.used:
            raise CegenError(
                "fused cross_entropy: backward ran twice over one forward "
                "(retain_graph=True); the gradient was computed once in the forward and "
                "is handed out once"
            )
        ctx.used = True
        if upstream_is_weights(grad_loss, weights):
            return (grad,) + nones
    rescale(grad, weights, grad_loss, ctx.label_layout, ctx.bundle)
    return (grad,) + nones


def _once_differentiable(fn: Any) -> Any:
    """torch's ``once_differentiable``, without its ``no_grad`` block when grad mode is
    already off: autograd runs a backward so unless ``create_graph=True`` (host time)."""
    guarded = once_differentiable(fn)

    @functools.wraps(fn)
    def backward(ctx: Any, *args: Any) -> Any:
        if torch.is_grad_enabled():
            return guarded(ctx, *args)
        return fn(ctx, *args)

    return backward


class _EagerCrossEntropy(torch.autograd.Function):
    """:class:`_CrossEntropyFunction` when nothing traces the call: the kernels called with
    the options already checked (no custom-op dispatch, no second validation: host time),
    one output (the lse is only saved)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor,  # type: ignore[override]
                options: KernelOptions, overwrite: bool) -> torch.Tensor:
        # lse's low part, for a backward whose error does not grow with |logits|.
        loss, lse, lse_low = _kernels.forward(logits, labels, options, True, True)
        ctx.save_for_backward(logits, labels, lse, lse_low)
        ctx.options = options
        ctx.overwrite = overwrite
        return loss

    @staticmethod
    @_once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        logits, labels, lse, lse_low = ctx.saved_tensors
        if ctx.overwrite:
            _kernels.backward(logits, labels, lse, grad_loss, ctx.options, True, True, lse_low)
            bump_version(logits)  # saved copies of the logits elsewhere now fail loudly
            grad = logits.detach()
        else:
            grad = _kernels.backward(logits, labels, lse, grad_loss, ctx.options, False, True,
                                     lse_low)
        return grad, None, None, None


class _EagerFusedCrossEntropy(torch.autograd.Function):
    """:class:`_FusedCrossEntropyFunction` when nothing traces the call (see
    :class:`_EagerCrossEntropy`)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor,  # type: ignore[override]
                weights: torch.Tensor, options: KernelOptions, overwrite: bool) -> torch.Tensor:
        loss, _, grad = _kernels.fused(logits, labels, weights, options, overwrite, True)
        if overwrite:
            bump_version(logits)
            grad = logits.detach()
        ctx.save_for_backward(grad, weights)
        ctx.label_layout, ctx.bundle = options.label_layout, options.bundle
        ctx.used = False
        return loss

    @staticmethod
    @_once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        return _fused_backward(ctx, grad_loss, _rescale.rescale_fused_gradient, 5)


def _c_apply(function: Any, active: Any = None, unwrap: Any = None) -> Any:
    """``function.apply`` without PyTorch's Python layer around the C++ one (since 2.0 a
    classmethod that binds default arguments and unwraps functorch's dead wrappers, a few
    microseconds of host time per call), for the eager Functions: their arguments are
    (logits, labels, [weights,] options, overwrite), with no defaults to bind. The Python
    apply still runs while functorch's transforms are active (``active`` and ``unwrap``:
    PyTorch's probe and unwrapping function, given by tests)."""
    base = getattr(torch._C, "_FunctionBase", None)
    descriptor = vars(base).get("apply") if base is not None else None
    if active is None:
        active = getattr(torch._C, "_are_functorch_transforms_active", None)
    if unwrap is None:
        unwrap = getattr(getattr(torch._C, "_functorch", None), "unwrap_if_dead", None)
    if descriptor is None or not hasattr(descriptor, "__get__") or active is None:
        return function.apply
    c_apply = descriptor.__get__(None, function)
    python_apply = function.apply
    if python_apply == c_apply:  # PyTorch < 2.0: apply is the C++ one
        return python_apply
    if unwrap is None:
        return python_apply

    def apply(logits: torch.Tensor, labels: torch.Tensor, *rest: Any) -> Any:
        if active():
            return python_apply(logits, labels, *rest)
        if len(rest) == 3:  # the fused Function: weights, options, overwrite
            rest = (unwrap(rest[0]),) + rest[1:]
        return c_apply(unwrap(logits), unwrap(labels), *rest)

    return apply


def _checked_weights(grad_weights: GradWeights) -> Union[None, float, torch.Tensor]:
    """``grad_weights`` checked: None, a float32-representable float, or a floating tensor."""
    if grad_weights is None:
        return None
    if isinstance(grad_weights, torch.Tensor) and grad_weights.dim() > 0:
        if not grad_weights.is_floating_point():
            raise InvalidInputError(f"grad_weights must be floating point, got {grad_weights.dtype}")
        return grad_weights
    if isinstance(grad_weights, torch.Tensor) and grad_weights.is_floating_point():
        return grad_weights  # a 0-d tensor: one weight for every token, as given
    return _validate.scalar_grad_weight(grad_weights)


def _weights_tensor(grad_weights: Union[float, torch.Tensor], logits: torch.Tensor) -> torch.Tensor:
    if isinstance(grad_weights, torch.Tensor):
        return grad_weights.detach()
    # torch.full launches a fill: torch.tensor(value, device=cuda) would copy from the host
    # and synchronize the stream.
    return torch.full((), grad_weights, dtype=torch.float32, device=logits.device)


_apply_eager = _c_apply(_EagerCrossEntropy)
_apply_eager_fused = _c_apply(_EagerFusedCrossEntropy)


def cross_entropy_vouched(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    python_refs: int,
    vouched_refs: int,
    ignore_index: Optional[int] = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    overwrite_input: bool = False,
    label_layout: str = "bs",
    grad_weights: GradWeights = None,
    bundle: BundleArg = None,
    label_out_of_range: str = "error",
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    return_lse: bool = False,
    return_entropy: bool = False,
    return_argmax: bool = False,
) -> Union[torch.Tensor, CrossEntropyResult]:
    """:func:`cross_entropy` for integrations that measured the logits' references themselves.

    ``python_refs`` is ``sys.getrefcount(logits)`` taken as the first statement of the
    integration's entry point, and ``vouched_refs`` the references the integration knows
    its caller holds and never reads again (see ``cegen._ownership``).
    """
    returns = _returns(return_lse, return_entropy, return_argmax)
    if is_compiling():
        return _traced_cross_entropy(logits, labels, ignore_index, label_smoothing, z_loss,
                                     overwrite_input, label_layout, grad_weights, bundle,
                                     label_out_of_range, logit_scale=logit_scale,
                                     logit_softcap=logit_softcap, returns=returns)
    return _eager_cross_entropy(logits, labels, python_refs, vouched_refs, ignore_index,
                                label_smoothing, z_loss, overwrite_input, label_layout,
                                grad_weights, bundle, label_out_of_range, 4, logit_scale,
                                logit_softcap, returns)


def _returns(return_lse: Any, return_entropy: Any,
             return_argmax: Any) -> Tuple[bool, bool, bool]:
    """The ``return_*`` flags checked (bools)."""
    if return_lse is False and return_entropy is False and return_argmax is False:
        return _NO_RETURNS
    return (_validate.flag("return_lse", return_lse),
            _validate.flag("return_entropy", return_entropy),
            _validate.flag("return_argmax", return_argmax))


def _eager_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, python_refs: int,
                         vouched_refs: int, ignore_index: Any, label_smoothing: Any,
                         z_loss: Any, overwrite_input: Any, label_layout: Any,
                         grad_weights: GradWeights, bundle: BundleArg,
                         label_out_of_range: Any, stacklevel: int,
                         logit_scale: Any = 1.0,
                         logit_softcap: Any = None,
                         returns: Tuple[bool, bool, bool] = _NO_RETURNS
                         ) -> Union[torch.Tensor, CrossEntropyResult]:
    """The call when torch.compile is not tracing it (positional arguments: host time).
    ``stacklevel`` names the user's line in a refused-overwrite warning."""
    # Validated once per distinct option value (cegen._kernels.kernel_options): host time.
    options = kernel_options(ignore_index, label_smoothing, z_loss, label_layout,
                             bundle if bundle is None or type(bundle) is str
                             else _validate.bundle(bundle), label_out_of_range, logit_scale,
                             _validate.logit_softcap(logit_softcap))
    if type(overwrite_input) is not bool:
        overwrite_input = _validate.flag("overwrite_input", overwrite_input)
    if grad_weights is not None:
        grad_weights = _checked_weights(grad_weights)
    needs_grad = logits.requires_grad and torch.is_grad_enabled() if isinstance(
        logits, torch.Tensor) else False
    # _library.traced without its torch.compile probe (the caller made it).
    traced = type(logits) is not torch.Tensor or _library._dispatch_mode() is not None
    if overwrite_input or traced:
        # Checked before a refusal can warn (and before the custom ops, which check when
        # they run, for an eager error under a dispatch mode); otherwise the kernels check
        # once per call shape (cegen._plans).
        check_inputs(logits, labels, options)
    overwrite = overwrite_input and grant_overwrite(logits, True, python_refs, vouched_refs,
                                                    stacklevel=stacklevel)
    if returns is not _NO_RETURNS and any(returns):
        weights = None
        if needs_grad and grad_weights is not None:
            weights = (grad_weights if type(grad_weights) is torch.Tensor
                       and not grad_weights.requires_grad
                       else _weights_tensor(grad_weights, logits))
        return cross_entropy_outputs(logits, labels, _op_args(options), overwrite, weights,
                                     needs_grad, returns)
    if not traced:
        # Nothing traces this call: the kernels directly, with the options checked above.
        if not needs_grad:
            return _kernels.forward(logits, labels, options, True)[0]
        if grad_weights is not None:
            # A tensor that needs no gradient is passed as is (no detached alias): an
            # upstream gradient that is this tensor is then known to be the weights.
            weights = (grad_weights if type(grad_weights) is torch.Tensor
                       and not grad_weights.requires_grad
                       else _weights_tensor(grad_weights, logits))
            return _apply_eager_fused(logits, labels, weights, options, overwrite)
        return _apply_eager(logits, labels, options, overwrite)
    # A dispatch mode, fake or subclass tensors: through the custom ops.
    if needs_grad and grad_weights is not None:
        weights = _weights_tensor(grad_weights, logits)
        return _FusedCrossEntropyFunction.apply(logits, labels, weights, *_op_args(options), overwrite)
    if not needs_grad:
        loss, _, _ = _library.forward(logits, labels, *_op_args(options))
        return loss
    loss, _ = _CrossEntropyFunction.apply(logits, labels, *_op_args(options), overwrite)
    return loss


def _traced_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: Any,
                          label_smoothing: Any, z_loss: Any, overwrite_input: Any,
                          label_layout: Any, grad_weights: GradWeights, bundle: BundleArg,
                          label_out_of_range: Any, stacklevel: int = 4,
                          logit_scale: Any = 1.0,
                          logit_softcap: Any = None,
                          returns: Tuple[bool, bool, bool] = _NO_RETURNS
                          ) -> Union[torch.Tensor, CrossEntropyResult]:
    """What torch.compile traces: the autograd Functions over the custom ops, nothing else.

    No Python-side checks or caches here (dynamo would have to trace them; it graph-breaks
    on some): the custom ops' implementations make every check when the compiled graph
    runs them, and their fake implementations check the shapes while tracing. Overwrite
    is refused (the traced tensors are not the ones that run)."""
    if overwrite_input:
        grant_overwrite(logits, True, 0, 0, stacklevel=stacklevel)  # warns why it is refused
    if bundle is not None and not isinstance(bundle, str):
        bundle = _validate.bundle(bundle)
    op_args = (ignore_index, float(label_smoothing), float(z_loss), label_layout, bundle,
               label_out_of_range, float(logit_scale), float(_validate.logit_softcap(logit_softcap)))
    if any(returns):
        needs_grad = torch.is_grad_enabled() and logits.requires_grad
        weights = None
        if needs_grad and grad_weights is not None:
            weights = (grad_weights.detach() if isinstance(grad_weights, torch.Tensor)
                       else torch.full((), float(grad_weights), dtype=torch.float32,
                                       device=logits.device))
        return cross_entropy_outputs(logits, labels, op_args, False, weights, needs_grad,
                                     returns)
    if not (torch.is_grad_enabled() and logits.requires_grad):
        loss, _, _ = _library.forward(logits, labels, *op_args)
        return loss
    if grad_weights is not None:
        if isinstance(grad_weights, torch.Tensor):
            weights = grad_weights.detach()
        else:
            weights = torch.full((), float(grad_weights), dtype=torch.float32,
                                 device=logits.device)
        return _FusedCrossEntropyFunction.apply(logits, labels, weights, *op_args, False)
    loss, _ = _CrossEntropyFunction.apply(logits, labels, *op_args, False)
    return loss


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: Optional[int] = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    overwrite_input: bool = False,
    label_layout: str = "bs",
    grad_weights: GradWeights = None,
    bundle: BundleArg = None,
    label_out_of_range: str = "error",
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    return_lse: bool = False,
    return_entropy: bool = False,
    return_argmax: bool = False,
) -> Union[torch.Tensor, CrossEntropyResult]:
    """Per-token softmax cross-entropy (fp32), differentiable w.r.t. ``logits``.

    Args:
        logits: ``[N, V]`` or ``[S, B, V]`` (bfloat16, float16, float32) on the CPU or a
            CUDA device (kernels for its target, on its current stream); the
            vocabulary dimension must have stride 1, the others may be anything (a
            transposed ``[B, S, V]`` tensor passes as ``logits.transpose(0, 1)``).
        labels: int64 or int32; ``[N]``, or for 3-D logits ``[B, S]`` (``label_layout="bs"``,
            Megatron's) or ``[S, B]`` (``"sb"``); any strides, read in place.
        ignore_index: labels equal to it get loss 0 and a zero gradient row.
        label_smoothing: alpha in [0, 1) with Megatron's formula
            ``s = alpha*V/(V-1)``, ``loss = (1-s)(lse - x_y) + s(lse - mean x)``.
        z_loss: adds ``z_loss * lse^2`` per token.
        overwrite_input: write the gradient over the logits' storage (saves an ``N*V``
            buffer) when the logits are exclusively owned; the logits then hold the
            gradient. Otherwise a warning says why not and a fresh buffer is used.
        label_layout: ``"bs"`` or ``"sb"``, see ``labels``.
        grad_weights: fused mode: the gradient each token's loss will receive (a number, or
            a per-token tensor of the labels' shape), known now; the forward kernel then
            computes the gradient too. Backward rescales it if the upstream gradient differs.
        bundle: a bundle directory (or :class:`cegen.Bundle`) made by ``ce-gen`` to take the
            kernels from; by default the cache finds or builds them.
        label_out_of_range: what a label outside ``[0, V)`` that is not the ignore_index
            does. ``"error"`` (the default: such a label is a bug in the caller's data)
            raises :class:`~cegen.LabelOutOfRangeError`. ``"megatron"`` computes what
            Megatron-Core's cross entropy computes for it, the row maximum ``m`` standing
            in for the target logit: ``loss = (1-s)(lse - m) + s(lse - mean x) + z lse^2``
            and gradient ``g (p (1 + 2 z lse) - s/V)``, no one-hot term (docs/megatron.md).
        logit_scale: every logit ``x`` is taken as ``z = logit_scale * x`` before the
            softmax (flash-attention's ``logit_scale``, an output multiplier): the loss,
            lse, smoothing mean and z-loss are of z, and the gradient is of x
            (``logit_scale`` times that of z). Finite and > 0; a kernel argument, so 1 costs
            nothing.
        logit_softcap: ``None`` (no softcap) or a cap: every logit is then
            ``z = logit_softcap * tanh(logit_scale * x / logit_softcap)`` (Gemma's final
            softcap; the scale first), the loss, lse, smoothing mean and z-loss are of z
            and the gradient carries ``dz/dx = logit_scale * (1 - tanh^2)``. Finite and
            > 0. A cap selects the softcap kernels (variant key ``softcap=on``).
        return_lse: also return each token's log-sum-exp of z (the forward's own, no
            extra work), e.g. for z-loss reporting.
        return_entropy: also return each token's entropy of softmax(z),
            ``sum_j p_j (lse - z_j)`` (NaN where lse is not finite): RL and distillation.
        return_argmax: also return each token's predicted class, the lowest index of the
            row's largest z (-1 for a row with a NaN): token accuracy and MTP acceptance
            as ``(argmax == labels)`` over the tokens that count, readable after the
            gradient overwrote the logits. The entropy and argmax cost one more read of
            each row in the forward kernel (from L2 where it still is).

    Returns:
        The per-token loss, float32, in the labels' shape (``[B, S]`` for Megatron); with
        any ``return_*`` flag a :class:`cegen.CrossEntropyResult` ``(loss, lse, entropy,
        argmax)`` instead, each in the labels' shape, the ones not asked for None, only
        the loss differentiable. Every token gets its row's lse, entropy and argmax,
        ignored ones included.

    Raises:
        InvalidInputError (a ValueError): wrong shapes, strides, dtypes, devices, options.
        LabelOutOfRangeError (a ValueError): with ``label_out_of_range="error"``, a label
            outside [0, V) not the ignore_index; on a GPU reported lazily, by a later call
            or by :func:`cegen.check_labels`.
        CegenError: any other failure of the runtime or of building kernels.
    """
    # First statement: see cegen._ownership. Skipped while torch.compile traces (the
    # traced objects are not the ones that run, and overwrite is then refused anyway).
    compiling = is_compiling()
    python_refs = 0 if compiling else sys.getrefcount(logits)
    returns = (_NO_RETURNS if return_lse is False and return_entropy is False
               and return_argmax is False
               else _returns(return_lse, return_entropy, return_argmax))
    if compiling:
        return _traced_cross_entropy(logits, labels, ignore_index, label_smoothing, z_loss,
                                     overwrite_input, label_layout, grad_weights, bundle,
                                     label_out_of_range, stacklevel=3,
                                     logit_scale=logit_scale, logit_softcap=logit_softcap,
                                     returns=returns)
    return _eager_cross_entropy(logits, labels, python_refs, 0, ignore_index, label_smoothing,
                                z_loss, overwrite_input, label_layout, grad_weights, bundle,
                                label_out_of_range, 3, logit_scale, logit_softcap, returns)
