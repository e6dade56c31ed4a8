"""Stand-in of flash-attention's ``flash_attn.losses.cross_entropy.CrossEntropyLoss`` over
``cegen.cross_entropy`` (issue 17). Not flash-attention code: its constructor arguments and
results, each computed by cegen, so that flash-attention's own test file
(tests/losses/test_cross_entropy.py, fetched, never committed) can run against cegen
(test/compat/run_flash_attn_tests.py).

flash-attention's semantics (flash_attn/ops/triton/cross_entropy.py) and how each maps:

- ``label_smoothing`` alpha is PyTorch's (the target gets ``1 - alpha + alpha/V``):
  ``loss = (1-alpha)(lse - x_y) + alpha (lse - mean x)``. cegen's is Megatron's,
  ``s = alpha' V/(V-1)`` in the same formula, so ``alpha' = alpha (V-1)/V`` with V the whole
  vocabulary.
- ``lse_square_scale`` is cegen's ``z_loss`` (``+ z lse^2`` per token, 0 for ignored tokens).
- ``ignore_index`` (default -100): loss 0 and a zero gradient row.
- ``reduction``: "mean" (sum over the tokens / the number of tokens not ignored), "sum",
  "none".
- ``inplace_backward``: cegen's ``overwrite_input``. cegen honours it only where its
  ownership check passes (never for a leaf, nor through this stand-in's extra references);
  otherwise it warns (``cegen.OverwriteRefusedWarning``) and writes the gradient to a fresh
  buffer: the same numbers.
- ``process_group``: ``cegen.vocab_parallel_cross_entropy`` with ``global_smoothing=True``
  (flash-attention smooths over the whole vocabulary; each rank holds an equal slice).
- ``logit_scale`` (logits times the scale before everything), ``return_z_loss`` (the z-loss
  term per token, not differentiable) and ``precomputed_lse`` (an lse input, used by
  flash-attention only when ``logit_scale == 1`` and ``label_smoothing == 0``; otherwise it
  ignores it, and so does this stand-in): where cegen cannot express one of them, the call
  raises :class:`NotExpressibleError` naming every reason, never computing something else.
  Whether cegen can is read from the entry point's signature at each call
  (``logit_scale``, ``return_lse`` of issue 17), so the stand-in uses them once they exist.

Differences that raise instead of computing: a label outside ``[0, V)`` that is not the
ignore_index (flash-attention drops its cross-entropy term; cegen raises
``cegen.LabelOutOfRangeError``), logits that are not 2-D (flash-attention asserts).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple, Union

import torch
import torch.nn as nn

import cegen

__all__ = ["CrossEntropyLoss", "NotExpressibleError", "NEEDS_LOGIT_SCALE",
           "NEEDS_Z_LOSS_RETURNED", "NEEDS_PRECOMPUTED_LSE"]

#: The reasons :class:`NotExpressibleError` gives, in the order they are checked.
NEEDS_LOGIT_SCALE = "needs logit_scale"
NEEDS_Z_LOSS_RETURNED = "needs the z-loss returned (the lse as an output)"
NEEDS_PRECOMPUTED_LSE = "needs a precomputed lse as an input"


class NotExpressibleError(NotImplementedError):
    """The call asks for something cegen cannot compute yet; ``reasons`` lists each, the
    first being the first of NEEDS_LOGIT_SCALE, NEEDS_Z_LOSS_RETURNED, NEEDS_PRECOMPUTED_LSE
    that applies."""

    def __init__(self, reasons: List[str]) -> None:
        self.reasons: Tuple[str, ...] = tuple(reasons)
        super().__init__("cegen cannot express this flash-attention CrossEntropyLoss call: "
                         + "; ".join(self.reasons))


_parameters_of: Dict[Callable[..., Any], FrozenSet[str]] = {}


def _accepts(entry: Callable[..., Any], name: str) -> bool:
    """Whether the cegen entry point takes the keyword ``name`` (cached per function)."""
    names = _parameters_of.get(entry)
    if names is None:
        names = frozenset(inspect.signature(entry).parameters)
        _parameters_of[entry] = names
    return name in names


class CrossEntropyLoss(nn.Module):
    """flash-attention's ``CrossEntropyLoss`` (same arguments and results), by cegen."""

    def __init__(
        self,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        logit_scale: float = 1.0,
        lse_square_scale: float = 0.0,
        inplace_backward: bool = False,
        process_group: Any = None,
        return_z_loss: bool = False,
    ) -> None:
        super().__init__()
        if reduction not in ["mean", "none", "sum"]:
            raise NotImplementedError("Only support reduction = 'mean' or 'none' or 'sum'")
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.logit_scale = logit_scale
        self.lse_square_scale = lse_square_scale
        self.inplace_backward = inplace_backward
        self.process_group = process_group
        self.return_z_loss = return_z_loss

    def _entry(self) -> Callable[..., Any]:
        # Looked up at each call (module attributes), so tests may replace them.
        if self.process_group is None:
            return cegen.cross_entropy
        return cegen.vocab_parallel_cross_entropy

    def missing(self, precomputed_lse: Optional[torch.Tensor] = None) -> List[str]:
        """What this call would need that cegen cannot do, in the order checked (empty: it can)."""
        entry = self._entry()
        reasons = []
        if self.logit_scale != 1.0 and not _accepts(entry, "logit_scale"):
            reasons.append(NEEDS_LOGIT_SCALE)
        if self.return_z_loss and not _accepts(entry, "return_lse"):
            reasons.append(NEEDS_Z_LOSS_RETURNED)
        # flash-attention reads the given lse only in this case and ignores it otherwise.
        if (precomputed_lse is not None and self.logit_scale == 1.0
                and self.label_smoothing == 0.0):
            reasons.append(NEEDS_PRECOMPUTED_LSE)
        return reasons

    def forward(self, input: torch.Tensor, target: torch.Tensor,
                precomputed_lse: Optional[torch.Tensor] = None
                ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """Loss of ``input`` (batch, vocab) against ``target`` (batch,); with
        ``return_z_loss`` the pair (loss, z_loss), reduced alike."""
        if input.dim() != 2 or target.shape != input.shape[:1]:
            raise ValueError("flash-attention's CrossEntropyLoss takes (batch, vocab) logits and "
                             f"(batch,) labels, not {tuple(input.shape)} and {tuple(target.shape)}")
        if not self.logit_scale > 0.0:
            raise ValueError(f"logit_scale must be positive, not {self.logit_scale}")
        reasons = self.missing(precomputed_lse)
        if reasons:
            raise NotExpressibleError(reasons)
        entry = self._entry()
        kwargs: Dict[str, Any] = dict(ignore_index=self.ignore_index, z_loss=self.lse_square_scale,
                                      overwrite_input=self.inplace_backward)
        vocab = input.shape[-1]
        if self.process_group is not None:
            kwargs.update(group=self.process_group, global_smoothing=True)
            vocab *= torch.distributed.get_world_size(self.process_group)
        if self.label_smoothing != 0.0:
            # PyTorch's alpha as Megatron's: (1 - s) with s = alpha' V / (V - 1) equals 1 - alpha.
            kwargs["label_smoothing"] = self.label_smoothing * (vocab - 1) / vocab
        if self.logit_scale != 1.0:
            kwargs["logit_scale"] = float(self.logit_scale)
        if self.return_z_loss:
            result = entry(input, target, return_lse=True, **kwargs)
            loss = result.loss
            z_loss = (self.lse_square_scale * result.lse.detach().square()).masked_fill(
                target == self.ignore_index, 0.0)
        else:
            loss = entry(input, target, **kwargs)
            z_loss = None
        loss = self._reduce(loss, target)
        if not self.return_z_loss:
            return loss
        return loss, self._reduce(z_loss, target)

    def _reduce(self, values: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.reduction == "mean":
            return values.sum() / (target != self.ignore_index).sum()
        if self.reduction == "sum":
            return values.sum()
        return values
