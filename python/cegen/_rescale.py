"""The fused path's backward: ``w_t * dloss_t/dlogits`` made ``g_t * dloss_t/dlogits`` on the device.

The fused kernel writes, in the forward, the gradient for the per-token weights ``w`` the
caller promised (``grad_weights=``). Autograd later delivers the real upstream gradient
``g``. :func:`rescale_fused_gradient` multiplies each gradient row by ``g_t / w_t``
without reading anything back to the host, so it never synchronizes and a CUDA graph
captures it:

* ``g_t == w_t``: the ratio is exactly 1 (IEEE division), the row is unchanged;
* ``g_t == 0``: the ratio is 0, the row becomes 0 (a masked token), whatever ``w_t`` was;
* ``w_t == 0`` and ``g_t != 0``: the kernel never computed that row (it wrote
  ``0 * dloss/dx``); the ratio is +-inf, so the row becomes NaN, and the token is counted
  for a lazy :class:`~cegen._gradient_status.ZeroWeightGradientError`
  (``cegen._gradient_status``): a wrong gradient is never returned silently.

Cost: the work is done by cegen's own ``rescale`` kernel (``ce_rescale``, the dialect's
``ce.rescale``) where the bundles have it: one workgroup per row reads ``g_t`` and ``w_t``
and returns at once when they are equal, so a correct prediction costs one read of ``2N``
floats, and a row that differs is read and written once. Without that kernel (a bundle
made before it, a runtime without ``ce_rescale``) the same arithmetic runs as PyTorch
operations: the ratio takes a few kernels over the ``N`` tokens and the multiply one pass
that reads and writes the whole ``N x V`` gradient, also where every ratio is 1 (logged
once). Callers that know ``g`` is ``w`` (the same tensor) skip the call entirely
(:func:`upstream_is_weights`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Dict, Optional, Tuple

import torch

from . import _errors, _gradient_status
from ._log_once import LogOnce
from ._variant import rescale_key

_fallbacks = LogOnce(logging.getLogger("cegen"))

__all__ = ["rescale_fused_gradient", "upstream_is_weights"]


def _per_token_column(values: torch.Tensor, logits_ndim: int, label_layout: str) -> torch.Tensor:
    """Per-token ``values`` shaped to broadcast over the logits' vocabulary dimension."""
    if logits_ndim == 3 and label_layout == "bs" and values.dim() == 2:
        values = values.transpose(0, 1)  # [B,S] -> [S,B], a view
    return values.unsqueeze(-1)


def upstream_is_weights(grad_loss: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether ``grad_loss`` is the weights' own memory, read the same way (so equal to
    them): decided from metadata, without reading a value."""
    if grad_loss is weights:
        return True
    return (weights.dim() == grad_loss.dim() and weights.dtype == grad_loss.dtype
            and weights.device == grad_loss.device
            and weights.data_ptr() == grad_loss.data_ptr()
            and weights.shape == grad_loss.shape and weights.stride() == grad_loss.stride())


def rescale_fused_gradient(grad: torch.Tensor, weights: torch.Tensor, grad_loss: torch.Tensor,
                           label_layout: str, bundle: Optional[str] = None) -> None:
    """In place: ``grad`` (the fused kernel's ``w_t * dloss_t/dx``) becomes ``g_t * dloss_t/dx``.

    ``weights`` is 0-dim or has the tokens' shape; ``grad_loss`` has the tokens' shape (any
    strides, stride 0 included). ``bundle``: the directory the caller's fused kernel came
    from (``bundle=`` of :func:`cegen.cross_entropy`), searched for the rescale kernel first,
    as the other kernels are. No host synchronization.
    """
    g = grad_loss if grad_loss.dtype == torch.float32 else grad_loss.float()
    w = weights if weights.dtype == torch.float32 else weights.float()
    if not _rescale_with_kernel(grad, w, g, label_layout, bundle):
        _rescale_with_torch(grad, w, g, label_layout)
    _gradient_status.record((w == 0) & (g != 0))  # on the CPU this may raise: rows first


# (dtype, ndim, label_layout, device, bundle, cache generation) -> (bundle, ce_options) of the
# rescale kernel, or None
# where none is available (then PyTorch's operations do it).
_kernels_found: Dict[Tuple[Any, ...], Optional[Tuple[Any, Any]]] = {}
_kernels_lock = threading.Lock()


def _rescale_kernel(grad: torch.Tensor, label_layout: str,
                    bundle_dir: Optional[str]) -> Optional[Tuple[Any, Any]]:
    from . import _bundle_cache, _kernels
    from ._runtime import LabelLayout, get_runtime

    where = (grad.dtype, grad.dim(), label_layout, grad.device, bundle_dir,
             _bundle_cache.generation)
    if where in _kernels_found:
        return _kernels_found[where]
    found: Optional[Tuple[Any, Any]] = None
    try:
        runtime = get_runtime()
        if not runtime.has_rescale():
            raise RuntimeError(f"the runtime library {runtime.path} has no ce_rescale")
        key = rescale_key(_kernels._LOGITS_DTYPES[grad.dtype][0],
                          _kernels.variant_layout(grad.dim(), label_layout))
        target = _kernels.device_target(grad.device)
        bundle = None
        if bundle_dir is not None:
            # The caller's bundle first (a machine without ce-gen ships its own kernels);
            # one made before the rescale kernel leaves it to the cache.
            try:
                bundle = _bundle_cache.bundle_for(key, bundle_dir, target)
            except _errors.VariantNotFoundError:
                bundle = None
        if bundle is None:
            bundle = _bundle_cache.bundle_for(key, None, target)
        options = runtime.default_options()
        options.label_layout = LabelLayout.BS if label_layout == "bs" else LabelLayout.SB
        found = (bundle, options)
    except Exception as error:  # no kernel: the PyTorch path computes the same rows
        _fallbacks.warn(
            "cegen: the fused gradient's correction runs as PyTorch operations (a full "
            "pass over the gradient): %s",
            f"no rescale kernel for {grad.dtype} gradients, labels {label_layout}, on "
            f"{grad.device}: {error}")
    with _kernels_lock:
        _kernels_found[where] = found
    return found


def _rescale_with_kernel(grad: torch.Tensor, w: torch.Tensor, g: torch.Tensor,
                         label_layout: str, bundle_dir: Optional[str] = None) -> bool:
    """``ce_rescale`` on ``grad`` in place; False when no rescale kernel is available."""
    from . import _kernels
    from ._runtime import get_runtime

    if grad.numel() == 0:
        return True
    found = _rescale_kernel(grad, label_layout, bundle_dir)
    if found is None:
        return False
    bundle, options = found
    # Names of their own: tests that record descriptors tell this call from the
    # forward's and backward's kernels.
    get_runtime().rescale(bundle, options, _kernels.describe(grad, "rescale grad"),
                          _kernels.describe(w, "rescale weights"),
                          _kernels.describe(g, "rescale grad_loss"),
                          _kernels._stream(grad.device))
    return True


def _rescale_with_torch(grad: torch.Tensor, w: torch.Tensor, g: torch.Tensor,
                        label_layout: str) -> None:
    nonzero = g != 0
    ratio = torch.where(nonzero, g / w, 0.0)
    if grad.dtype == torch.bfloat16:
        # A bf16 ratio keeps the multiply in one dtype, which PyTorch vectorizes (a float32
        # ratio over bf16 rows runs at about a quarter of the bandwidth on the H200). bf16
        # has float32's range; the ratio's rounding (2^-9 relative) adds to the row's.
        ratio = ratio.to(torch.bfloat16)
    grad.mul_(_per_token_column(ratio, grad.dim(), label_layout))
