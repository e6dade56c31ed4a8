"""TorchTitan integration: cegen's kernels as the loss a TrainSpec builds.

TorchTitan (pytorch/torchtitan, v0.1 to v0.2.2, the version Primus pins) names a model's loss
in its ``TrainSpec``: ``build_loss_fn(job_config, **kwargs)`` returns ``loss_fn(pred,
labels)``, which the trainer calls on the model's ``[B, S, V]`` logits and ``[B, S]`` labels.
:func:`build_cross_entropy_loss` is a drop-in for TorchTitan's
``build_cross_entropy_loss``; :func:`register_train_spec` registers a model's spec with it::

    # my_specs.py, imported by TorchTitan with --experimental.custom_import my_specs
    from cegen import torchtitan as cegen_titan
    cegen_titan.register_train_spec("llama3")   # "llama3_cegen": llama3 with cegen's loss

    # then: --model.name llama3_cegen

The loss keeps TorchTitan's conventions: the labels' ignore index (``IGNORE_INDEX``, -100)
gives loss 0 and no gradient, and the reduction is the one TorchTitan's own cross entropy
uses, found by calling it once at build time on a 3-token probe: ``sum`` in v0.2.2 (the
trainer divides by the global count of valid tokens), ``mean`` over the valid tokens in
v0.1 to v0.2.1. A label outside ``[0, V)`` that is not the ignore index is an error, as in
PyTorch's cross entropy (cegen's default ``label_out_of_range="error"``).

The ``[B, S, V]`` logits are read in place: cegen's 3-D kernels take ``[S, B, V]`` logits
with labels in either order, and cross entropy is per token, so the logits go in as they are
with their first dimension in the role of cegen's first and ``label_layout="sb"`` (labels
indexed like the logits' first two dimensions); no view, no copy, no transposed labels.
``[T, V]`` logits with ``[T]`` labels (what a caller that flattened them passes) go through
the flat kernels.

Supported: plain bf16/fp16/fp32 logits on the CPU or a CUDA GPU, int64/int32 labels, unit
vocabulary stride, the runtime library loadable, not while torch.compile traces. Everything
else, DTensor logits above all (TorchTitan's tensor parallelism with loss parallel shards the
vocabulary over a DTensor), calls TorchTitan's own loss (its builder's, compiled when the
job config compiles the loss) and logs the reason once (logger ``cegen.torchtitan``). cegen's
own path is never compiled: its kernels are fused already.

Overwrite-input (``job_config.cegen.overwrite_input``, default false: add the ``cegen``
section to the job config with ``--job.custom_config_module cegen.torchtitan``, which holds
:class:`JobConfig`) writes the gradient over the logits' storage. cegen vouches for one
reference beyond its own argument only when the caller is TorchTitan's
``Trainer.forward_backward_step`` (module ``torchtitan.train``): it keeps the logits in its
local ``pred`` and deletes it before ``loss.backward()`` (v0.1 to v0.2.2). Any other caller
must hand the logits over without keeping a reference (``loss_fn(model(x), labels)``), or
the request is refused with a warning (cegen._ownership's checks apply on top).

No environment variable enables or changes any of it. docs/torchtitan.md.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import sys
from typing import Any, Callable, Optional, Tuple

import torch

from ._log_once import LogOnce
from ._ownership import is_compiling
from ._runtime import runtime_available
from .ops import cross_entropy_vouched

__all__ = [
    "IGNORE_INDEX",
    "CegenConfig",
    "JobConfig",
    "build_cross_entropy_loss",
    "cegen_train_spec",
    "register_train_spec",
    "supported_case",
    "reset_fallback_log",
]

logger = logging.getLogger(__name__)

#: TorchTitan's ignore index (``torchtitan.components.loss.IGNORE_INDEX``, PyTorch's default).
IGNORE_INDEX = -100

#: Callers known to hold the logits in one local variable that they delete before the
#: backward pass: (module, function). TorchTitan's trainer, v0.1 to v0.2.2:
#: ``pred = model_parts[0](...); loss = self.loss_fn(pred, labels); ...; del pred;
#: loss.backward()``.
_VOUCHED_CALLERS = frozenset({("torchtitan.train", "forward_backward_step")})

_SUPPORTED_LOGITS = (torch.bfloat16, torch.float16, torch.float32)
_SUPPORTED_LABELS = (torch.int64, torch.int32)
_SUPPORTED_DEVICES = ("cpu", "cuda")


@dataclasses.dataclass
class CegenConfig:
    """The ``cegen`` section of TorchTitan's job config."""

    overwrite_input: bool = False
    """Write the loss gradient over the logits' storage (saves one [B, S, V] buffer); after
    the backward the logits hold the gradient. Honored only where the logits are exclusively
    owned (docs/torchtitan.md)."""


@dataclasses.dataclass
class JobConfig:
    """For ``--job.custom_config_module cegen.torchtitan``: TorchTitan merges this into its
    JobConfig, which then has a ``cegen`` section (TOML ``[cegen]``, command line
    ``--cegen.overwrite_input``)."""

    cegen: CegenConfig = dataclasses.field(default_factory=CegenConfig)


# -- logging once per reason -------------------------------------------------------------------

_fallbacks = LogOnce(logger)


def reset_fallback_log() -> None:
    """Lets every fallback reason be logged again (for tests)."""
    _fallbacks.reset()


def _log_fallback(reason: str) -> None:
    _fallbacks.warn("cegen's cross entropy falls back to TorchTitan's own loss: %s", reason)


# -- dispatch ----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _dtensor_classes() -> Tuple[type, ...]:
    classes = []
    for path in ("torch.distributed.tensor", "torch.distributed._tensor"):
        try:
            module = __import__(path, fromlist=["DTensor"])
            classes.append(module.DTensor)
        except (ImportError, AttributeError):
            continue
    return tuple(classes)


def supported_case(pred: Any, labels: Any) -> Optional[str]:
    """Why cegen cannot compute this loss (the fallback reason), or None when it can."""
    if not isinstance(pred, torch.Tensor) or not isinstance(labels, torch.Tensor):
        return "the logits or labels are not tensors"
    if is_compiling():
        return "torch.compile is tracing the loss"
    dtensors = _dtensor_classes()
    if dtensors and isinstance(pred, dtensors):
        return ("the logits are a DTensor (tensor parallelism with loss parallel shards the "
                "vocabulary); cegen takes plain tensors")
    for name, tensor in (("logits", pred), ("labels", labels)):
        if type(tensor) is not torch.Tensor:
            return (f"the {name} are a {type(tensor).__name__}, a torch.Tensor subclass; "
                    "cegen takes plain tensors")
    if pred.dtype not in _SUPPORTED_LOGITS:
        return f"logits dtype {pred.dtype} is not supported (bf16, fp16, fp32 are)"
    if labels.dtype not in _SUPPORTED_LABELS:
        return f"labels dtype {labels.dtype} is not supported (int64, int32 are)"
    shapes_fit = ((pred.dim() == 3 and tuple(labels.shape) == tuple(pred.shape[:2]))
                  or (pred.dim() == 2 and tuple(labels.shape) == tuple(pred.shape[:1])))
    if not shapes_fit:
        return (f"shapes logits {tuple(pred.shape)} / labels {tuple(labels.shape)} are not "
                "[B, S, V] / [B, S] or [T, V] / [T]")
    if pred.device.type not in _SUPPORTED_DEVICES or labels.device != pred.device:
        return (f"logits on {pred.device} and labels on {labels.device}: this cegen build "
                f"launches on {', '.join(_SUPPORTED_DEVICES)} only")
    if pred.shape[-1] > 1 and pred.stride(-1) != 1:
        return "the logits' vocabulary dimension is not contiguous"
    if not runtime_available():
        return "the cegen runtime library (libce_runtime.so) cannot be found or loaded"
    return None


def _probe_reduction(titan_cross_entropy: Callable[..., torch.Tensor]) -> Tuple[Optional[str], Optional[str]]:
    """(reduction, None) from TorchTitan's own cross entropy on a 3-token probe whose middle
    token is ignored: ``sum`` gives the two other tokens' losses added, ``mean`` their mean
    (what no label smoothing, z-loss or other ignore index gives); or (None, the reason it is
    neither)."""
    rows = ((1.0, 0.0, 0), (4.0, 0.0, IGNORE_INDEX), (0.0, 3.0, 0))
    pred = torch.tensor([[[a, b] for a, b, _ in rows]])
    labels = torch.tensor([[label for _, _, label in rows]])
    losses = [math.log(math.exp(a) + math.exp(b)) - (a, b)[label]
              for a, b, label in rows if label != IGNORE_INDEX]
    try:
        with torch.no_grad():
            value = float(titan_cross_entropy(pred, labels))
    except Exception as error:  # its signature or conventions changed
        return None, f"TorchTitan's cross_entropy_loss could not be probed ({error})"
    for reduction, expected in (("sum", sum(losses)), ("mean", sum(losses) / len(losses))):
        if abs(value - expected) < 1e-5 * expected:
            return reduction, None
    return None, (f"TorchTitan's cross_entropy_loss gives {value} on the probe ({sum(losses)} "
                  f"with sum, {sum(losses) / len(losses)} with mean): an unknown reduction, "
                  "ignore index or option")


def _overwrite_setting(job_config: Any) -> bool:
    value = getattr(getattr(job_config, "cegen", None), "overwrite_input", False)
    if not isinstance(value, bool):
        raise ValueError(f"job_config.cegen.overwrite_input must be true or false, got {value!r}")
    return value


def _compiles_loss(job_config: Any) -> bool:
    compile_config = getattr(job_config, "compile", None)
    return bool(getattr(compile_config, "enable", False)
                and "loss" in (getattr(compile_config, "components", None) or ()))


def build_cross_entropy_loss(job_config: Any = None, *, overwrite_input: Optional[bool] = None,
                             **kwargs: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``TrainSpec.build_loss_fn``: TorchTitan's cross entropy computed by cegen's kernels.

    Args:
        job_config: TorchTitan's JobConfig (read: ``compile`` for the fallback, which
            TorchTitan's own builder makes, and ``cegen.overwrite_input`` if present).
        overwrite_input: overrides ``job_config.cegen.overwrite_input``.
        **kwargs: what the trainer passes (``parallel_dims=``), handed to TorchTitan's
            builder.

    Returns:
        ``loss_fn(pred, labels)``: the float32 scalar TorchTitan's cross entropy returns.
    """
    from torchtitan.components import loss as titan_loss

    fallback = titan_loss.build_cross_entropy_loss(job_config, **kwargs)
    reduction, probe_failure = _probe_reduction(titan_loss.cross_entropy_loss)
    ignore_index = getattr(titan_loss, "IGNORE_INDEX", IGNORE_INDEX)
    overwrite = _overwrite_setting(job_config) if overwrite_input is None else bool(overwrite_input)
    if _compiles_loss(job_config):
        logger.info("cegen's cross entropy runs its fused kernels uncompiled; the fallback is "
                    "TorchTitan's compiled loss")

    def cross_entropy_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # First statement: see cegen._ownership.
        python_refs = 0 if is_compiling() else sys.getrefcount(pred)
        reason = probe_failure or supported_case(pred, labels)
        if reason is not None:
            _log_fallback(reason)
            return fallback(pred, labels)
        caller = sys._getframe(1)
        vouched = 1 if (caller.f_globals.get("__name__"), caller.f_code.co_name) in _VOUCHED_CALLERS else 0
        del caller
        per_token = cross_entropy_vouched(
            pred, labels, python_refs=python_refs, vouched_refs=vouched,
            ignore_index=ignore_index, label_layout="sb", overwrite_input=overwrite)
        total = per_token.sum()
        if reduction == "mean":
            total = total / (labels != ignore_index).sum()
        return total

    cross_entropy_loss._cegen_fallback = fallback  # type: ignore[attr-defined]
    cross_entropy_loss._cegen_overwrite_input = overwrite  # type: ignore[attr-defined]
    cross_entropy_loss._cegen_reduction = reduction  # type: ignore[attr-defined]
    return cross_entropy_loss


# -- TrainSpecs --------------------------------------------------------------------------------


def cegen_train_spec(spec: Any) -> Any:
    """A copy of TorchTitan's ``TrainSpec`` with :func:`build_cross_entropy_loss` as its
    ``build_loss_fn``."""
    return dataclasses.replace(spec, build_loss_fn=build_cross_entropy_loss)


def register_train_spec(base_name: str, name: Optional[str] = None) -> str:
    """Registers ``base_name``'s TrainSpec with cegen's loss under ``name`` (default
    ``<base_name>_cegen``; ``name=base_name`` replaces the model's own for this process, as
    TorchTitan's registered specs take precedence). Idempotent. Returns the name."""
    from torchtitan.protocols import train_spec as titan_spec

    name = name or f"{base_name}_cegen"
    registered = getattr(titan_spec, "_extra_train_specs", {})
    if name in registered and registered[name].build_loss_fn is build_cross_entropy_loss:
        return name
    titan_spec.register_train_spec(name, cegen_train_spec(titan_spec.get_train_spec(base_name)))
    return name
