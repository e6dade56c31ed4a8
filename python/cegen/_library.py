"""The kernels as ``torch.library`` custom ops, where the installed PyTorch has them.

With ``torch.library.custom_op`` (PyTorch >= 2.4) every launch is a registered operator
``cegen::<name>`` with a fake (meta) implementation, so ``torch.compile`` and CUDA graphs
can trace it, and the variants that write the gradient over the logits declare that
mutation (``mutates_args=("logits",)``). Autograd is not registered on the ops (PyTorch
refuses it for mutating ops); ``cegen.ops`` wraps them in a ``torch.autograd.Function``.

Without ``custom_op`` (e.g. PyTorch 1.13) the same Python functions are called directly.
Either way the implementation is ``cegen._kernels``: one kernel-calling path.
"""

# No `from __future__ import annotations`: custom_op infers each op's schema from the
# annotations, which must be real types.
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _kernels, _rescale
from ._kernels import KernelOptions

__all__ = [
    "HAS_CUSTOM_OP",
    "forward",
    "backward",
    "backward_overwrite",
    "fused",
    "fused_overwrite",
    "rescale_fused_gradient",
]

#: Whether the kernels are registered as ``torch.library`` custom ops.
HAS_CUSTOM_OP = hasattr(torch.library, "custom_op") and hasattr(torch.library, "register_fake")


def _options(ignore_index: Optional[int], label_smoothing: float, z_loss: float,
             label_layout: str, bundle: Optional[str],
             label_out_of_range: str, logit_scale: float,
        logit_softcap: float) -> KernelOptions:
    return _kernels.kernel_options(ignore_index, label_smoothing, z_loss, label_layout, bundle,
                                   label_out_of_range, logit_scale, logit_softcap)


# -- implementations (schema-friendly signatures: tensors and primitives only) -------------


def forward_impl(logits: Tensor, labels: Tensor, ignore_index: Optional[int],
                 label_smoothing: float, z_loss: float, label_layout: str,
                 bundle: Optional[str], label_out_of_range: str,
                 logit_scale: float,
        logit_softcap: float) -> Tuple[Tensor, Tensor, Tensor]:
    """Per-token (loss, lse, lse_low): lse's low part for the backward."""
    options = _options(ignore_index, label_smoothing, z_loss, label_layout, bundle,
                       label_out_of_range, logit_scale, logit_softcap)
    loss, lse, lse_low = _kernels.forward(logits, labels, options, low=True)
    return loss, lse, lse_low


def backward_impl(logits: Tensor, labels: Tensor, lse: Tensor, lse_low: Tensor,
                  grad_loss: Tensor, ignore_index: Optional[int], label_smoothing: float,
                  z_loss: float, label_layout: str, bundle: Optional[str],
                  label_out_of_range: str, logit_scale: float,
        logit_softcap: float) -> Tensor:
    """The gradient in a fresh tensor."""
    options = _options(ignore_index, label_smoothing, z_loss, label_layout, bundle,
                       label_out_of_range, logit_scale, logit_softcap)
    grad = _kernels.backward(logits, labels, lse, grad_loss, options, overwrite=False,
                             lse_low=lse_low)
    assert grad is not None
    return grad


def backward_overwrite_impl(logits: Tensor, labels: Tensor, lse: Tensor, lse_low: Tensor,
                            grad_loss: Tensor, ignore_index: Optional[int],
                            label_smoothing: float, z_loss: float, label_layout: str,
                            bundle: Optional[str], label_out_of_range: str,
                            logit_scale: float,
        logit_softcap: float) -> None:
    """The gradient written over ``logits``."""
    options = _options(ignore_index, label_smoothing, z_loss, label_layout, bundle,
                       label_out_of_range, logit_scale, logit_softcap)
    _kernels.backward(logits, labels, lse, grad_loss, options, overwrite=True,
                      lse_low=lse_low)


def fused_impl(logits: Tensor, labels: Tensor, weights: Tensor, ignore_index: Optional[int],
               label_smoothing: float, z_loss: float, label_layout: str,
               bundle: Optional[str], label_out_of_range: str,
               logit_scale: float,
        logit_softcap: float) -> Tuple[Tensor, Tensor, Tensor]:
    """(loss, lse, weighted gradient in a fresh tensor)."""
    options = _options(ignore_index, label_smoothing, z_loss, label_layout, bundle,
                       label_out_of_range, logit_scale, logit_softcap)
    loss, lse, grad = _kernels.fused(logits, labels, weights, options, overwrite=False)
    assert grad is not None
    return loss, lse, grad


def fused_overwrite_impl(logits: Tensor, labels: Tensor, weights: Tensor,
                         ignore_index: Optional[int], label_smoothing: float, z_loss: float,
                         label_layout: str, bundle: Optional[str],
                         label_out_of_range: str, logit_scale: float,
        logit_softcap: float) -> Tuple[Tensor, Tensor]:
    """(loss, lse); the weighted gradient is written over ``logits``."""
    options = _options(ignore_index, label_smoothing, z_loss, label_layout, bundle,
                       label_out_of_range, logit_scale, logit_softcap)
    loss, lse, _ = _kernels.fused(logits, labels, weights, options, overwrite=True)
    return loss, lse


def forward_outputs_impl(logits: Tensor, labels: Tensor, ignore_index: Optional[int],
                         label_smoothing: float, z_loss: float, label_layout: str,
                         bundle: Optional[str], label_out_of_range: str,
                         logit_scale: float,
                         logit_softcap: float) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Per-token (loss, lse, lse_low, entropy, argmax): :func:`forward_impl` and the
    outputs' sweep."""
    options = _options(ignore_index, label_smoothing, z_loss, label_layout, bundle,
                       label_out_of_range, logit_scale, logit_softcap)
    loss, lse, lse_low, entropy, argmax = _kernels.forward(
        logits, labels, options, low=True, entropy=True, argmax=True)
    return loss, lse, lse_low, entropy, argmax


def rescale_fused_gradient_impl(grad: Tensor, weights: Tensor, grad_loss: Tensor,
                                label_layout: str, bundle: Optional[str]) -> None:
    """The fused gradient ``w_t * dloss_t/dx`` made ``g_t * dloss_t/dx``, in place, on the
    device (``cegen._rescale``)."""
    _rescale.rescale_fused_gradient(grad, weights, grad_loss, label_layout, bundle)


# -- fake (meta) implementations: shapes and dtypes only -------------------------------------


def _token_outputs(logits: Tensor, label_layout: str, count: int = 2) -> Tuple[Tensor, ...]:
    tokens = _kernels.token_shape(logits.shape, label_layout)
    return tuple(logits.new_empty(tokens, dtype=torch.float32) for _ in range(count))


def forward_fake(logits: Tensor, labels: Tensor, ignore_index: Optional[int],
                 label_smoothing: float, z_loss: float, label_layout: str,
                 bundle: Optional[str], label_out_of_range: str,
                 logit_scale: float,
        logit_softcap: float) -> Tuple[Tensor, Tensor, Tensor]:
    """Fake of :func:`forward_impl`."""
    loss, lse, lse_low = _token_outputs(logits, label_layout, 3)
    return loss, lse, lse_low


def backward_fake(logits: Tensor, labels: Tensor, lse: Tensor, lse_low: Tensor,
                  grad_loss: Tensor, ignore_index: Optional[int], label_smoothing: float,
                  z_loss: float, label_layout: str, bundle: Optional[str],
                  label_out_of_range: str, logit_scale: float,
        logit_softcap: float) -> Tensor:
    """Fake of :func:`backward_impl`."""
    return torch.empty_like(logits)


def backward_overwrite_fake(logits: Tensor, labels: Tensor, lse: Tensor, lse_low: Tensor,
                            grad_loss: Tensor, ignore_index: Optional[int],
                            label_smoothing: float, z_loss: float, label_layout: str,
                            bundle: Optional[str], label_out_of_range: str,
                            logit_scale: float,
        logit_softcap: float) -> None:
    """Fake of :func:`backward_overwrite_impl`."""
    return None


def fused_fake(logits: Tensor, labels: Tensor, weights: Tensor, ignore_index: Optional[int],
               label_smoothing: float, z_loss: float, label_layout: str,
               bundle: Optional[str], label_out_of_range: str,
               logit_scale: float,
        logit_softcap: float) -> Tuple[Tensor, Tensor, Tensor]:
    """Fake of :func:`fused_impl`."""
    loss, lse = _token_outputs(logits, label_layout)
    return loss, lse, torch.empty_like(logits)


def fused_overwrite_fake(logits: Tensor, labels: Tensor, weights: Tensor,
                         ignore_index: Optional[int], label_smoothing: float, z_loss: float,
                         label_layout: str, bundle: Optional[str],
                         label_out_of_range: str, logit_scale: float,
        logit_softcap: float) -> Tuple[Tensor, Tensor]:
    """Fake of :func:`fused_overwrite_impl`."""
    loss, lse = _token_outputs(logits, label_layout)
    return loss, lse


def _argmax_output(logits: Tensor, label_layout: str) -> Tensor:
    tokens = _kernels.token_shape(logits.shape, label_layout)
    return logits.new_empty(tokens, dtype=torch.int64)


def forward_outputs_fake(logits: Tensor, labels: Tensor, ignore_index: Optional[int],
                         label_smoothing: float, z_loss: float, label_layout: str,
                         bundle: Optional[str], label_out_of_range: str,
                         logit_scale: float,
                         logit_softcap: float) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Fake of :func:`forward_outputs_impl`."""
    loss, lse, lse_low, entropy = _token_outputs(logits, label_layout, 4)
    return loss, lse, lse_low, entropy, _argmax_output(logits, label_layout)


def rescale_fused_gradient_fake(grad: Tensor, weights: Tensor, grad_loss: Tensor,
                                label_layout: str, bundle: Optional[str]) -> None:
    """Fake of :func:`rescale_fused_gradient_impl`."""
    return None


# -- registration ---------------------------------------------------------------------------

_SPECS = (
    # (name, implementation, fake, mutated arguments)
    ("forward", forward_impl, forward_fake, ()),
    ("backward", backward_impl, backward_fake, ()),
    ("backward_overwrite", backward_overwrite_impl, backward_overwrite_fake, ("logits",)),
    ("fused", fused_impl, fused_fake, ()),
    ("fused_overwrite", fused_overwrite_impl, fused_overwrite_fake, ("logits",)),
    ("forward_outputs", forward_outputs_impl, forward_outputs_fake, ()),
)

# Device work on PyTorch tensors around the kernels (no cegen kernel, no label policy).
_TENSOR_SPECS = (
    ("rescale_fused_gradient", rescale_fused_gradient_impl, rescale_fused_gradient_fake,
     ("grad",)),
)


def _register() -> dict:
    ops = {}
    for name, impl, fake, mutates in _SPECS + _TENSOR_SPECS:
        if HAS_CUSTOM_OP:
            op = torch.library.custom_op(f"cegen::{name}", mutates_args=mutates)(impl)
            op.register_fake(fake)
            ops[name] = op
        else:
            ops[name] = impl
    return ops


_OPS = _register()

_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)
try:
    from torch.utils._python_dispatch import _get_current_dispatch_mode as _dispatch_mode
except ImportError:  # PyTorch without Python dispatch modes
    def _dispatch_mode() -> None:  # type: ignore[misc]
        return None


def traced(tensor: Tensor) -> bool:
    """Whether a call on ``tensor`` may be traced (torch.compile, export, a fake or proxy
    tensor, a dispatch mode): then it goes through the registered custom op, otherwise
    straight to the implementation. Both run the same code; the direct call saves the
    custom op's dispatch, tens of microseconds of host time per call."""
    return type(tensor) is not torch.Tensor or _is_compiling() or _dispatch_mode() is not None


def _entry(name: str, impl):  # type: ignore[no-untyped-def]
    op = _OPS[name]
    if op is impl:  # no custom ops in this PyTorch: the implementation is the entry
        return impl

    def call(first: Tensor, *args):  # type: ignore[no-untyped-def]
        return op(first, *args) if traced(first) else impl(first, *args)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = impl.__doc__
    call.op = op  # type: ignore[attr-defined]
    return call


forward = _entry("forward", forward_impl)
backward = _entry("backward", backward_impl)
backward_overwrite = _entry("backward_overwrite", backward_overwrite_impl)
fused = _entry("fused", fused_impl)
fused_overwrite = _entry("fused_overwrite", fused_overwrite_impl)
rescale_fused_gradient = _entry("rescale_fused_gradient", rescale_fused_gradient_impl)
forward_outputs = _entry("forward_outputs", forward_outputs_impl)
