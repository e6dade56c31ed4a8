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

Cost: the ratio takes a few kernels over the ``N`` tokens, and the multiply one pass that
reads and writes the ``N x V`` gradient, also when every ratio is 1: with PyTorch's
operations alone the host cannot skip rows without reading the ratios back (a sync). A
device kernel that reads ``g_t`` and ``w_t`` per row and returns at once when they are
equal would make the common case cost one read of ``2N`` floats (docs/megatron.md,
"The fused gradient in training"). Callers that know ``g`` is ``w`` (the same tensor)
skip the call entirely (:func:`upstream_is_weights`).
"""

from __future__ import annotations

import torch

from . import _gradient_status

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
                           label_layout: str) -> None:
    """In place: ``grad`` (the fused kernel's ``w_t * dloss_t/dx``) becomes ``g_t * dloss_t/dx``.

    ``weights`` is 0-dim or has the tokens' shape; ``grad_loss`` has the tokens' shape (any
    strides, stride 0 included). No host synchronization.
    """
    g = grad_loss if grad_loss.dtype == torch.float32 else grad_loss.float()
    w = weights if weights.dtype == torch.float32 else weights.float()
    nonzero = g != 0
    ratio = torch.where(nonzero, g / w, 0.0)
    if grad.dtype == torch.bfloat16:
        # A bf16 ratio keeps the multiply in one dtype, which PyTorch vectorizes (a float32
        # ratio over bf16 rows runs at about a quarter of the bandwidth on the H200). bf16
        # has float32's range; the ratio's rounding (2^-9 relative) adds to the row's.
        ratio = ratio.to(torch.bfloat16)
    grad.mul_(_per_token_column(ratio, grad.dim(), label_layout))
    _gradient_status.record((w == 0) & nonzero)  # on the CPU this may raise: rows first
