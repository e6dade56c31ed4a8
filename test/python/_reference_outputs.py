"""Float64 references for issue 17's semantics: the logit transform (scale, softcap) and the
extra per-token outputs (lse, entropy, argmax), with the loss and gradient of the transformed
logits. Test support: the references the kernels will be compared with
(test/python/test_reference_outputs.py checks them against torch autograd).

Definitions (DESIGN.md section 1 and issue 17), per token row x of V logits:

- transform: ``z = cap * tanh(scale * x / cap)`` (the scale first, then the cap); without a
  cap ``z = scale * x``. ``dz/dx = scale * (1 - tanh^2(scale * x / cap))`` (``scale``
  without a cap).
- loss of z with Megatron's smoothing ``s = alpha V / (V - 1)`` (0 when V = 1):
  ``(1 - s)(lse - z_y) + s (lse - mean z) + z_loss * lse^2``; 0 for an ignored token. A
  label outside [0, V) that is not ignored raises ValueError with
  ``label_out_of_range="error"``; with ``"megatron"`` the row's maximum of z, a constant,
  stands in for ``z_y``.
- gradient, given the upstream per-token gradient g (1 when not given):
  ``dL/dz_j = g (p_j (1 + 2 z_loss lse) - (1 - s)[j == y] - s / V)``, ``p = exp(z - lse)``
  (no one-hot term for a ``"megatron"`` out-of-range label); ``dL/dx = dL/dz * dz/dx``; a
  zero row for an ignored token, whatever its logits (NaN included).
- ``lse = log sum_j exp(z_j)``.
- entropy ``H = lse - sum_j p_j z_j``, computed as ``sum_{q_j > 0} q_j (log S - (z_j -
  m))`` with m the row maximum, ``S = sum_j exp(z_j - m)``, ``q = exp(z - m) / S`` (no
  cancellation against a large lse, which would also absorb log S at |z| near 1e30; a ``-inf`` logit has p = 0 and adds nothing, so masked
  vocabulary entries give a finite H). Defined where lse is finite; NaN otherwise (a row
  with a NaN, a ``+inf`` z, which only an uncapped transform gives, or all ``-inf``).
- argmax: the index of the largest z, the lowest index on ties (ties of z: a softcap maps
  different large logits to the same z once tanh saturates). A row with a NaN z has no
  largest element: its argmax is -1 (decided here for issue 17's "NaN rows reported as
  such": -1 is never a label in [0, V), so ``argmax == label`` counts a NaN row as wrong,
  which NumPy's and PyTorch's convention, the first NaN's index, would not). An all
  ``-inf`` row has argmax 0 (all tie).
- lse, entropy and argmax depend on the logits only: an ignored token or a bad label gets
  its row's values too (the forward sweep reads every row).

Outputs are in the labels' layout (``[B, S]`` for ``[S, B, V]`` logits with
``label_layout="bs"``, ``[S, B]`` with ``"sb"``, ``[N]`` for ``[N, V]``), float64 (argmax
int64); the gradient in the logits' shape, float64.

A kernel computes z in f32: where two f64 values of z are closer than f32's rounding its
argmax may pick either; :func:`argmax_acceptable` says which answers are then right.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

__all__ = ["ReferenceOutputs", "transformed_logits", "transform_derivative",
           "reference_outputs", "argmax_acceptable"]


class ReferenceOutputs(NamedTuple):
    """Float64 loss, lse, entropy, int64 argmax (labels' layout), gradient (logits' shape)."""

    loss: torch.Tensor
    lse: torch.Tensor
    entropy: torch.Tensor
    argmax: torch.Tensor
    grad: torch.Tensor


def _check_transform(logit_scale: float, logit_softcap: Optional[float]) -> None:
    if not math.isfinite(logit_scale):
        raise ValueError(f"logit_scale must be finite, not {logit_scale}")
    if logit_softcap is not None and not (math.isfinite(logit_softcap) and logit_softcap != 0):
        raise ValueError(f"logit_softcap must be finite and non-zero, not {logit_softcap}")


def transformed_logits(logits: torch.Tensor, logit_scale: float = 1.0,
                       logit_softcap: Optional[float] = None) -> torch.Tensor:
    """``z = cap * tanh(scale * x / cap)`` (``scale * x`` without a cap), in float64."""
    _check_transform(logit_scale, logit_softcap)
    x = logits.detach().to(torch.float64)
    if logit_softcap is None:
        return logit_scale * x
    return logit_softcap * torch.tanh(logit_scale * x / logit_softcap)


def transform_derivative(logits: torch.Tensor, logit_scale: float = 1.0,
                         logit_softcap: Optional[float] = None) -> torch.Tensor:
    """``dz/dx = scale * (1 - tanh^2(scale * x / cap))`` (``scale`` without a cap), float64."""
    _check_transform(logit_scale, logit_softcap)
    x = logits.detach().to(torch.float64)
    if logit_softcap is None:
        return torch.full_like(x, logit_scale)
    t = torch.tanh(logit_scale * x / logit_softcap)
    return logit_scale * (1 - t * t)


def _token_rows(tensor: torch.Tensor, label_layout: str) -> torch.Tensor:
    """``[T, V]`` rows in the labels' order (a view: ``[S, B, V]`` with "bs" goes b-major)."""
    if tensor.dim() == 3 and label_layout == "bs":
        tensor = tensor.transpose(0, 1)
    return tensor.reshape(-1, tensor.shape[-1])


def _entropy(z: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``sum_j q_j (log S - (z_j - m))`` with m the row maximum, ``q = exp(z - m) / S``:
    every term non-negative, and exact where lse would absorb log S (z near 1e30 with
    ties at the maximum: lse - z_j is 0 in float64 there, the entropy log(ties) is not);
    NaN where lse is not finite."""
    finite = torch.isfinite(lse)
    top = torch.where(finite, z.max(dim=-1).values, torch.zeros_like(lse)).unsqueeze(1)
    shifted = z - top
    w = torch.exp(shifted)
    total = w.sum(dim=-1, keepdim=True)
    q = w / total
    terms = torch.where(q > 0, q * (torch.log(total) - shifted), torch.zeros_like(q))
    return torch.where(finite, terms.sum(dim=-1), torch.full_like(lse, math.nan))


def _row_argmax(z: torch.Tensor) -> torch.Tensor:
    """Lowest index of each row's maximum; -1 for a row with a NaN."""
    vocab = z.shape[-1]
    top = z.max(dim=-1, keepdim=True).values
    index = torch.arange(vocab, dtype=torch.int64).expand_as(z)
    first = torch.where(z == top, index, torch.full_like(index, vocab)).min(dim=-1).values
    return torch.where(torch.isnan(z).any(dim=-1), torch.full_like(first, -1), first)


def reference_outputs(logits: torch.Tensor, labels: torch.Tensor, *,
                      ignore_index: Optional[int] = None, label_smoothing: float = 0.0,
                      z_loss: float = 0.0, logit_scale: float = 1.0,
                      logit_softcap: Optional[float] = None, label_layout: str = "bs",
                      grad_loss: Optional[torch.Tensor] = None,
                      label_out_of_range: str = "error") -> ReferenceOutputs:
    """Loss, lse, entropy, argmax and gradient in float64 from the module's definitions,
    the gradient in closed form (the chain rule through the transform, no autograd)."""
    if label_out_of_range not in ("error", "megatron"):
        raise ValueError(f"label_out_of_range must be 'error' or 'megatron', not {label_out_of_range!r}")
    x = _token_rows(logits.detach().to(torch.float64), label_layout)
    vocab = x.shape[-1]
    z = transformed_logits(x, logit_scale, logit_softcap)
    y = labels.reshape(-1).to(torch.int64)
    if y.shape[0] != z.shape[0]:
        raise ValueError(f"{y.shape[0]} labels for {z.shape[0]} rows of logits")
    ignored = (y == ignore_index) if ignore_index is not None else torch.zeros_like(y, dtype=torch.bool)
    outside = ((y < 0) | (y >= vocab)) & ~ignored
    if label_out_of_range == "error" and bool(outside.any()):
        raise ValueError(f"labels outside [0, {vocab}) that are not the ignore_index: "
                         f"{y[outside].tolist()[:8]}")
    safe = torch.where(ignored | outside, torch.zeros_like(y), y)

    lse = torch.logsumexp(z, dim=-1)
    target = z.gather(1, safe.unsqueeze(1)).squeeze(1)
    target = torch.where(outside, z.max(dim=-1).values, target)
    s = label_smoothing * vocab / (vocab - 1) if vocab > 1 else 0.0
    loss = (1 - s) * (lse - target) + s * (lse - z.mean(dim=-1)) + z_loss * lse * lse
    loss = torch.where(ignored, torch.zeros_like(loss), loss)

    p = torch.exp(z - lse.unsqueeze(1))
    entropy = _entropy(z, lse)
    argmax = _row_argmax(z)

    g = (torch.ones_like(loss) if grad_loss is None
         else grad_loss.detach().to(torch.float64).reshape(-1))
    dz = g.unsqueeze(1) * (p * (1 + 2 * z_loss * lse.unsqueeze(1)) - s / vocab)
    hit = (~ignored & ~outside).to(torch.float64) * g * (1 - s)
    dz = dz.scatter_add(1, safe.unsqueeze(1), -hit.unsqueeze(1))
    grad_rows = dz * transform_derivative(x, logit_scale, logit_softcap)
    grad_rows = torch.where(ignored.unsqueeze(1), torch.zeros_like(grad_rows), grad_rows)

    if logits.dim() == 3 and label_layout == "bs":
        sequence, batch = logits.shape[0], logits.shape[1]
        grad = grad_rows.reshape(batch, sequence, vocab).transpose(0, 1)
    else:
        grad = grad_rows.reshape(logits.shape)
    shape = labels.shape
    return ReferenceOutputs(loss.reshape(shape), lse.reshape(shape), entropy.reshape(shape),
                            argmax.reshape(shape), grad)


def argmax_acceptable(logits: torch.Tensor, argmax: torch.Tensor, *, atol: float,
                      logit_scale: float = 1.0, logit_softcap: Optional[float] = None,
                      label_layout: str = "bs") -> torch.Tensor:
    """Per token (labels' layout), whether ``argmax`` (a kernel's) is a right answer when z is
    known to within ``atol``: -1 exactly for a row with a NaN z; otherwise an index in
    [0, V) whose z is within ``atol`` of the row's maximum and no lower index with exactly
    the same z (equal logits, or a softcap saturated in float64, are equal in any kernel's
    f32 too: the lowest index must win; near-ties within ``atol`` may go either way)."""
    x = _token_rows(logits.detach().to(torch.float64), label_layout)
    z = transformed_logits(x, logit_scale, logit_softcap)
    vocab = z.shape[-1]
    a = argmax.reshape(-1).to(torch.int64)
    nan_row = torch.isnan(z).any(dim=-1)
    in_range = (a >= 0) & (a < vocab)
    chosen = z.gather(1, a.clamp(0, vocab - 1).unsqueeze(1)).squeeze(1)
    top = z.max(dim=-1).values
    near_top = (chosen >= top - atol) | (chosen == top)  # == for an all -inf or +inf maximum
    index = torch.arange(vocab).unsqueeze(0)
    lower_tie = ((index < a.unsqueeze(1)) & (z == chosen.unsqueeze(1))).any(dim=-1)
    ok = torch.where(nan_row, a == -1, in_range & near_top & ~lower_tie)
    return ok.reshape(argmax.shape)
