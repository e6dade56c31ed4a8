"""Megatron-Core integration: cegen kernels in ``LanguageModule.compute_language_model_loss``.

Usage in a Megatron training script::

    from cegen import megatron as turbo_ce

    def extra_args(parser):
        return turbo_ce.add_turbo_ce_args(parser)

    # after Megatron parsed the arguments (initialize_megatron / get_args()):
    turbo_ce.install(get_args())
    pretrain(..., extra_args_provider=extra_args)

Megatron's contract (``megatron/core/models/common/language_module/language_module.py``):
``compute_language_model_loss(self, labels, logits)`` takes labels ``[B, S]`` and logits
``[S, B, V]`` and returns the per-token loss ``[B, S]`` in float32. The patched method
keeps that contract: the kernels read the ``[B, S]`` labels in place (no transposed copy)
and write the ``[B, S]`` loss directly. It runs cegen only when

* ``--use-turbo-cross-entropy`` is on (otherwise nothing is patched),
* ``config.cross_entropy_loss_fusion`` is on (the user asked for a fused loss),
* the tensor-parallel size is 1 (the logits hold the whole vocabulary), or it is larger and
  the module's tensor-parallel group is a ``torch.distributed`` process group: the logits
  then hold this rank's vocabulary slice and :func:`cegen.vocab_parallel_cross_entropy`
  combines the ranks' partial statistics over that group (one all-reduce),
* the logits are bf16/fp16/fp32 ``[S, B, V]`` with unit vocabulary stride, the labels
  int64/int32 ``[B, S]``, on the CPU or a CUDA (or ROCm) GPU,
* the runtime library can be loaded;

every other case calls the original implementation unchanged and logs why, once per
reason (logger ``cegen.megatron``). No environment variable enables or changes any of it.
Logit transforms of the model come before this method: MuP's ``_scale_logits`` in
GPTModel._postprocess and process_mtp_loss, a Megatron-Bridge Gemma output layer's softcap
in the layer, so the logits it receives are the ones the loss is of (docs/megatron.md,
"Logit scale and softcap").

Labels keep Megatron's contract too: Megatron accepts any label id, and its SFT datasets
label prompt tokens -100 and mask them with ``loss_mask``. With
``cross_entropy_fusion_impl="native"`` (Megatron-Core's own vocab-parallel loss) a label
outside ``[0, V)`` gets Core's values: ``loss = lse - max`` (its target logit is taken as
the row maximum) and the gradient ``softmax`` without a one-hot term
(``label_out_of_range="megatron"``). With ``"te"`` (Transformer Engine's
``parallel_cross_entropy``, whose ``ignore_idx`` is -100) a label -100 gets loss 0 and a
zero gradient row, as in TE, and any other label outside ``[0, V)`` Core's values (TE's
own loss there is +inf, which a zero ``loss_mask`` turns into NaN). docs/megatron.md.

With ``--turbo-ce-fuse-output-layer`` too, ``GPTModel._postprocess`` is patched as well: for
a training or evaluation step's main loss it computes the output layer and the loss together
with :func:`cegen.linear_cross_entropy` (chunks of tokens; the ``[s, b, v]`` logits never
exist), at any tensor-parallel size (the weight's vocabulary rows, ``d hidden`` reduced over
the group as ColumnParallelLinear's) and with sequence parallelism (Megatron's all-gather of
the hidden states, whose backward reduce-scatters), tied embeddings and a bias. It falls
back to the original post-processing, logged once per reason, for everything else: no
labels (the caller wants the logits), inference, MTP layers, an output_processor, gathered
logits (``runtime_gather_output``, ``parallel_output=False``), a MuP output multiplier that
is not a logit scale (MuP's ``mup_output_mult``, a finite number > 0, is applied in the
kernels as ``logit_scale``), the config logger, deferred embedding weight gradients,
full-iteration CUDA graphs, another output layer (a Megatron-Bridge Gemma output layer's
softcap among them) or loss, other dtypes. With ``--turbo-ce-fused-gradient`` (the default) and a
``loss_mask`` the forward finishes the gradients for the upstream gradient the step is
predicted to give, and the backward scales them by the factor it finds on the device between
that prediction and the gradient that arrives: three GEMMs instead of four. A ``loss_func``
whose upstream is not the loss mask times one factor (per-token weights) gets NaN weight
gradients and an error naming ``--no-turbo-ce-fused-gradient`` (docs/megatron.md).

``--turbo-ce-fused-gradient`` is on by default: the fused kernel computes the loss and its
gradient in the forward for the predicted upstream gradient, and cegen's ``rescale`` kernel
corrects on the device what the prediction got wrong (a wrong prediction costs a pass over the
rows that differ, never a wrong gradient).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import logging
import numbers
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Set, Tuple, Type

import torch

from . import _validate
from ._errors import InvalidInputError
from ._log_once import LogOnce
from ._ownership import is_compiling
from ._runtime import runtime_available
from .linear import linear_cross_entropy
from .ops import cross_entropy_vouched
from .tensor_parallel import vocab_parallel_cross_entropy_vouched

__all__ = [
    "TurboCESettings",
    "DEFAULTS_FILE",
    "add_turbo_ce_args",
    "load_settings",
    "settings_from_args",
    "install",
    "uninstall",
    "is_installed",
    "supported_case",
    "predicted_upstream",
    "reset_fallback_log",
]

logger = logging.getLogger(__name__)

#: The packaged defaults (lowest precedence).
DEFAULTS_FILE = Path(__file__).with_name("megatron_defaults.yaml")
#: The section of a YAML file that holds the settings (top-level keys are accepted too).
YAML_SECTION = "turbo_cross_entropy"
#: The option that names an experiment YAML on the command line.
YAML_OPTION = "--turbo-ce-yaml"

_LANGUAGE_MODULE_PATH = "megatron.core.models.common.language_module.language_module"
_GPT_MODEL_PATH = "megatron.core.models.gpt.gpt_model"


@dataclasses.dataclass(frozen=True)
class TurboCESettings:
    """The integration's settings (the training arguments, by their ``args`` names)."""

    use_turbo_cross_entropy: bool = False
    turbo_ce_overwrite_input: bool = False
    #: On by default: the fused kernel where Megatron's step makes the gradient predictable
    #: (the rescale kernel corrects a wrong prediction on the device; docs/megatron.md).
    turbo_ce_fused_gradient: bool = True
    turbo_ce_fuse_output_layer: bool = False


_SETTING_NAMES = tuple(field.name for field in dataclasses.fields(TurboCESettings))
#: Each setting's value where neither a YAML file nor the namespace gives one.
_SETTING_DEFAULTS = {field.name: field.default for field in dataclasses.fields(TurboCESettings)}


# -- settings: defaults YAML < experiment YAML < command line ----------------------------


def _read_yaml(path: Path) -> Mapping[str, Any]:
    """The mapping in a settings YAML; every failure is an InvalidInputError naming the file."""
    try:
        import yaml  # PyYAML; only needed when a YAML file is read
    except ImportError as error:
        raise InvalidInputError(
            f"cannot read turbo cross-entropy settings from {path}: PyYAML is not installed "
            f"(pip install pyyaml, or Debian's python3-yaml)") from error
    try:
        with open(path, "rb") as stream:
            raw = stream.read()
    except OSError as error:
        raise InvalidInputError(
            f"cannot read turbo cross-entropy settings from {path}: {error}") from error
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidInputError(
            f"cannot read turbo cross-entropy settings from {path}: it is not UTF-8 text "
            f"(byte 0x{raw[error.start]:02x} at offset {error.start}: {error.reason})"
        ) from error
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise InvalidInputError(f"{path} is not valid YAML: {error}") from error
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InvalidInputError(
            f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def _settings_in(data: Mapping[str, Any], path: Path) -> Dict[str, bool]:
    """The settings a YAML mapping gives: its section, else matching top-level keys."""
    found: Dict[str, Any] = {}
    section = data.get(YAML_SECTION)
    if section is not None:
        if not isinstance(section, dict):
            raise InvalidInputError(f"{path}: '{YAML_SECTION}' must be a mapping")
        for key, value in section.items():
            name = str(key).replace("-", "_")
            if name not in _SETTING_NAMES:
                raise InvalidInputError(
                    f"{path}: unknown setting '{key}' in '{YAML_SECTION}'; known: {list(_SETTING_NAMES)}"
                )
            found[name] = value
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in _SETTING_NAMES:
            found.setdefault(name, value)
    for name, value in found.items():
        if not isinstance(value, bool):
            raise InvalidInputError(f"{path}: '{name}' must be true or false, got {value!r}")
    return found


def load_settings(experiment_yaml: Optional["str | Path"] = None,
                  defaults_yaml: Path = DEFAULTS_FILE) -> TurboCESettings:
    """The settings from the defaults YAML, overridden by an experiment YAML if given."""
    values: Dict[str, bool] = {}
    values.update(_settings_in(_read_yaml(defaults_yaml), defaults_yaml))
    if experiment_yaml is not None:
        path = Path(experiment_yaml).expanduser()
        values.update(_settings_in(_read_yaml(path), path))
    return TurboCESettings(**values)


def _peek_option(argv: Sequence[str], option: str) -> Optional[str]:
    """The value of ``option`` in ``argv`` (``--opt V`` or ``--opt=V``), the last one wins."""
    value = None
    for index, token in enumerate(argv):
        if token == option and index + 1 < len(argv):
            value = argv[index + 1]
        elif token.startswith(option + "="):
            value = token[len(option) + 1:]
    return value


def add_turbo_ce_args(parser: argparse.ArgumentParser, *,
                      experiment_yaml: Optional["str | Path"] = None,
                      argv: Optional[Sequence[str]] = None) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: declares the turbo cross-entropy arguments.

    The arguments' defaults come from ``megatron_defaults.yaml``, overridden by the
    experiment YAML (``experiment_yaml``, or ``--turbo-ce-yaml PATH`` found in ``argv``,
    which defaults to ``sys.argv[1:]``); the command line overrides both, in either
    direction (``--use-turbo-cross-entropy`` / ``--no-use-turbo-cross-entropy``).
    """
    if experiment_yaml is None:
        experiment_yaml = _peek_option(sys.argv[1:] if argv is None else argv, YAML_OPTION)
    settings = load_settings(experiment_yaml)
    group = parser.add_argument_group(
        title="turbo cross entropy", description="cegen's fused softmax cross-entropy kernels"
    )
    group.add_argument(
        YAML_OPTION, type=str, default=None, metavar="PATH",
        help="Experiment YAML with turbo cross-entropy settings (a 'turbo_cross_entropy' "
             "section or top-level keys); it overrides megatron_defaults.yaml and the command "
             "line overrides it.",
    )
    group.add_argument(
        "--use-turbo-cross-entropy", action=argparse.BooleanOptionalAction,
        default=settings.use_turbo_cross_entropy,
        help="Compute the language-model loss with cegen's fused cross-entropy kernels when "
             "the case is supported (--cross-entropy-loss-fusion, bf16/fp16/fp32 logits; "
             "any tensor-parallel size); other cases keep Megatron's implementation.",
    )
    group.add_argument(
        "--turbo-ce-overwrite-input", action=argparse.BooleanOptionalAction,
        default=settings.turbo_ce_overwrite_input,
        help="Write the loss gradient over the logits' storage (saves one [s, b, v] buffer); "
             "after the backward pass the logits hold the gradient.",
    )
    group.add_argument(
        "--turbo-ce-fused-gradient", action=argparse.BooleanOptionalAction,
        default=settings.turbo_ce_fused_gradient,
        help="Compute the loss and its gradient in one kernel in the forward, for the "
             "upstream gradient the training step is predicted to give (loss mask, token "
             "count, micro-batches, loss scale); the backward corrects each row on the device "
             "by the gradient that arrives (docs/megatron.md, 'The fused gradient'). On by "
             "default; --no-turbo-ce-fused-gradient turns it off.",
    )
    group.add_argument(
        "--turbo-ce-fuse-output-layer", action=argparse.BooleanOptionalAction,
        default=settings.turbo_ce_fuse_output_layer,
        help="Compute GPTModel's output layer and the loss together (cegen.linear_cross_entropy: "
             "chunks of tokens, the [s, b, v] logits never in memory) where the case is "
             "supported; other cases run GPTModel's post-processing unchanged "
             "(docs/megatron.md, 'The fused output layer').",
    )
    return parser


def settings_from_args(args: Any = None) -> TurboCESettings:
    """Settings from a parsed namespace (``None``: Megatron's ``get_args()``)."""
    if isinstance(args, TurboCESettings):
        return args
    if args is None:
        from megatron.training import get_args  # type: ignore[import-not-found]

        args = get_args()
    # Flags only: a string such as "false" from a hand-made namespace must not turn them on.
    # A namespace without a setting (no add_turbo_ce_args) gets the setting's default.
    values = {name: _validate.flag(f"args.{name}", getattr(args, name, _SETTING_DEFAULTS[name]))
              for name in _SETTING_NAMES}
    return TurboCESettings(**values)


# -- dispatch -------------------------------------------------------------------------------

_SUPPORTED_LOGITS = (torch.bfloat16, torch.float16, torch.float32)
_SUPPORTED_LABELS = (torch.int64, torch.int32)
_SUPPORTED_DEVICES = ("cpu", "cuda")

_fallbacks = LogOnce(logger)


def reset_fallback_log() -> None:
    """Lets every fallback reason be logged again (for tests)."""
    _fallbacks.reset()


def _log_fallback(reason: str) -> None:
    _fallbacks.warn("turbo cross-entropy falls back to Megatron's implementation: %s", reason)


def _group_size(group: Any) -> Optional[int]:
    size = getattr(group, "size", None)
    if callable(size):
        try:
            return int(size())
        except Exception:
            pass
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        return int(distributed.get_world_size(group=group))
    return None


def _parallel_state_group() -> Any:
    """``parallel_state``'s tensor-parallel group, where Megatron initialized one."""
    try:
        from megatron.core import parallel_state  # type: ignore[import-not-found]

        return parallel_state.get_tensor_model_parallel_group(check_initialized=False)
    except Exception:  # no Megatron, or one without this function
        return None


def _tensor_parallel_group(module: Any) -> Any:
    """The group Megatron's loss reduces over: ``self.tp_group`` (set by LanguageModule from
    ``pg_collection.tp``, or parallel_state's group when that is None), else
    ``pg_collection.tp``, else parallel_state's group."""
    group = getattr(module, "tp_group", None)
    if group is None:
        group = getattr(getattr(module, "pg_collection", None), "tp", None)
    if group is None:
        group = _parallel_state_group()
    return group


def _tensor_parallel_plan(module: Any) -> Tuple[Optional[str], Any]:
    """(fallback reason, group): group None runs the whole-vocabulary kernels (TP size 1),
    a group runs the vocab-parallel path over it; a reason says why neither can run."""
    config_size = getattr(getattr(module, "config", None), "tensor_model_parallel_size", None)
    config_size = config_size if isinstance(config_size, int) else None
    group = _tensor_parallel_group(module)
    group_size = _group_size(group) if group is not None else None
    tp_size = max([size for size in (config_size, group_size) if size is not None], default=1)
    if tp_size == 1:
        return None, None
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()):
        return f"tensor-parallel size is {tp_size} but torch.distributed is not initialized", None
    if group is None:
        return (f"tensor-parallel size is {tp_size} but no tensor-parallel process group was "
                "found (self.tp_group, pg_collection.tp, parallel_state)"), None
    if not isinstance(group, distributed.ProcessGroup):
        return (f"tensor-parallel size is {tp_size} but the tensor-parallel group is a "
                f"{type(group).__name__}, not a torch.distributed ProcessGroup"), None
    if config_size is not None and group_size != config_size:
        return (f"tensor-parallel size is {config_size} in the config but the tensor-parallel "
                f"group has {group_size} ranks"), None
    return None, group


def _module_plan(module: Any) -> Tuple[Optional[str], Any]:
    """(fallback reason, tensor-parallel group or None) from the module alone: its config
    asks for a fused loss and its tensor-parallel group can be used."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "cross_entropy_loss_fusion"):
        return "the module's config has no cross_entropy_loss_fusion field", None
    if not config.cross_entropy_loss_fusion:
        return "cross_entropy_loss_fusion is off (enable --cross-entropy-loss-fusion)", None
    return _tensor_parallel_plan(module)


def _plan(module: Any, labels: Any, logits: Any) -> Tuple[Optional[str], Any]:
    """(fallback reason, tensor-parallel group or None); see :func:`supported_case`."""
    reason, group = _module_plan(module)
    if reason is not None:
        return reason, None
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        return "labels or logits are not tensors", None
    if logits.dtype not in _SUPPORTED_LOGITS:
        return f"logits dtype {logits.dtype} is not supported (bf16, fp16, fp32 are)", None
    if labels.dtype not in _SUPPORTED_LABELS:
        return f"labels dtype {labels.dtype} is not supported (int64, int32 are)", None
    if logits.dim() != 3 or labels.dim() != 2 or tuple(labels.shape) != (logits.shape[1], logits.shape[0]):
        return (f"shapes labels {tuple(labels.shape)} / logits {tuple(logits.shape)} are not "
                "[b, s] / [s, b, v]"), None
    if logits.device.type not in _SUPPORTED_DEVICES or labels.device != logits.device:
        return (f"logits on {logits.device} and labels on {labels.device}: this cegen build "
                f"launches on {', '.join(_SUPPORTED_DEVICES)} only"), None
    if logits.shape[-1] > 1 and logits.stride(-1) != 1:
        return "the logits' vocabulary dimension is not contiguous", None
    if not runtime_available():
        return "the cegen runtime library (libce_runtime.so) cannot be found or loaded", None
    return None, group


def supported_case(module: Any, labels: Any, logits: Any) -> Optional[str]:
    """Why cegen cannot compute this loss (the fallback reason), or None when it can."""
    return _plan(module, labels, logits)[0]


#: References to the logits that Megatron's callers of compute_language_model_loss hold
#: and never read after the backward pass: the local variable ``logits`` in
#: GPTModel._postprocess (``mtp_logits`` in process_mtp_loss). Its readers after the loss
#: (MTP acceptance counts) run in the forward, before the gradient is written.
_MEGATRON_CALLER_REFS = 1

#: Transformer Engine's ``parallel_cross_entropy`` ignore_idx, as Megatron calls it
#: (``te_parallel_cross_entropy`` passes no ignore_idx, so TE's default).
_TE_IGNORE_INDEX = -100


def _label_options(module: Any) -> Dict[str, Any]:
    """The label semantics of the implementation the module's config selects.

    Megatron-Core's native loss accepts every label id: one outside the vocabulary gets
    ``lse - max`` and a softmax gradient. TE's ignores -100 (loss 0, zero gradient row);
    for other ids outside the vocabulary TE's loss is +inf (times a zero loss mask: NaN),
    so cegen keeps Core's values there.
    """
    impl = getattr(getattr(module, "config", None), "cross_entropy_fusion_impl", "native")
    ignore_index = _TE_IGNORE_INDEX if impl == "te" else None
    return {"ignore_index": ignore_index, "label_out_of_range": "megatron"}


# -- the fused gradient: the upstream gradient predicted at forward time --------------------

#: The GPTModel method that calls compute_language_model_loss for the main loss with
#: ``loss_mask`` among its arguments (multi-token prediction calls it from elsewhere).
_MAIN_LOSS_CALLER = "_postprocess"


def _num_microbatches() -> Optional[int]:
    """Megatron's current number of micro-batches, where Megatron says it."""
    try:
        from megatron.core.num_microbatches_calculator import (  # type: ignore[import-not-found]
            get_num_microbatches,
        )
    except Exception:  # an older Megatron, or none
        return None
    try:
        return int(get_num_microbatches())
    except Exception:  # not initialized (no training loop)
        return None


def _caller_loss_mask(caller: Any, labels: torch.Tensor) -> Optional[torch.Tensor]:
    """``loss_mask`` of GPTModel._postprocess, the caller of the main loss, if it is one."""
    if caller is None or caller.f_code.co_name != _MAIN_LOSS_CALLER:
        return None
    mask = caller.f_locals.get("loss_mask")
    if not isinstance(mask, torch.Tensor) or mask.numel() != labels.numel():
        return None
    return mask


def predicted_upstream(module: Any, labels: torch.Tensor,
                       loss_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """The upstream gradient of the main loss's unmasked tokens in Megatron-Core's training
    step, as a 0-d float32 tensor on the labels' device (no host synchronization).

    Megatron's ``loss_func`` (pretrain_gpt.py) sums ``losses * loss_mask``; the schedule
    (``forward_step_calc_loss``) divides by ``clamp(num_tokens, 1)`` and the number of
    micro-batches unless ``calculate_per_token_loss``; ``backward_step`` multiplies by the
    loss scale (``config.grad_scale_func``, the optimizer's ``scale_loss``). Autograd then
    gives token t ``((scale / micro_batches) / num_tokens) * loss_mask_t``: this returns the
    factor, computed with the same operations in the same order, so it is bitwise the one
    autograd computes. A masked token's upstream gradient is 0, not this value: the fused
    backward's rescale (``g_t / w_t`` = 0) zeroes its row, and any other difference is
    corrected the same way (cegen._rescale). Never 0, so no token is left without its
    gradient.
    """
    config = getattr(module, "config", None)
    grad_scale_func = getattr(config, "grad_scale_func", None)
    if grad_scale_func is not None:  # as schedules._compute_loss_scale
        scale = grad_scale_func(torch.ones(1, device=labels.device))
        if not isinstance(scale, torch.Tensor):  # a number: made on the device, no copy
            scale = torch.full((1,), float(scale), device=labels.device)
        scale = scale.reshape(()).float()
    else:
        scale = torch.ones((), device=labels.device)
    if getattr(config, "calculate_per_token_loss", False):
        return scale
    micro_batches = _num_microbatches() or 1
    if loss_mask is None:  # a guess (every token counted); the rescale makes it right
        return (scale / micro_batches) / labels.numel()
    num_tokens = loss_mask.view(-1).float().sum().clone().detach().to(torch.int)
    return (scale / micro_batches) / torch.clamp(num_tokens, min=1)


def _make_patched(original: Callable[..., torch.Tensor],
                  settings: TurboCESettings) -> Callable[..., torch.Tensor]:
    @functools.wraps(original)
    def compute_language_model_loss(self: Any, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        python_refs = 0 if is_compiling() else sys.getrefcount(logits)  # see cegen._ownership
        reason, tp_group = _plan(self, labels, logits)
        if reason is not None:
            _log_fallback(reason)
            return original(self, labels, logits)
        # The logits are already transformed (MuP's multiplier by _scale_logits before the
        # call): no logit_scale here, which would apply it twice.
        label_options = _label_options(self)
        if tp_group is not None:
            # Vocab-parallel logits: this rank's slice; labels are global ids. Megatron's
            # loss here has no label smoothing or z-loss.
            return vocab_parallel_cross_entropy_vouched(
                logits, labels, python_refs=python_refs, vouched_refs=_MEGATRON_CALLER_REFS,
                group=tp_group, label_layout="bs",
                overwrite_input=settings.turbo_ce_overwrite_input, **label_options,
            )
        grad_weights = None
        if (settings.turbo_ce_fused_gradient and torch.is_grad_enabled()
                and logits.requires_grad and not is_compiling()):
            # One kernel for loss and gradient, for the upstream gradient predicted now;
            # only for the main loss (the caller that holds loss_mask), whose logits
            # nothing reads after the loss: with overwrite the gradient is written now.
            caller = sys._getframe(1)
            loss_mask = _caller_loss_mask(caller, labels)
            del caller
            if loss_mask is not None:
                grad_weights = predicted_upstream(self, labels, loss_mask)
        return cross_entropy_vouched(
            logits, labels, python_refs=python_refs, vouched_refs=_MEGATRON_CALLER_REFS,
            label_layout="bs", overwrite_input=settings.turbo_ce_overwrite_input,
            grad_weights=grad_weights, **label_options,
        )

    compute_language_model_loss._cegen_original = original  # type: ignore[attr-defined]
    compute_language_model_loss._cegen_settings = settings  # type: ignore[attr-defined]
    return compute_language_model_loss


#: The code of the patched compute_language_model_loss (every closure of _make_patched
#: shares it): how the fused output layer tells that the loss in place is cegen's.
_PATCHED_LOSS_CODE = _make_patched(lambda self, labels, logits: logits, TurboCESettings()).__code__


def _is_cegen_loss(function: Any) -> bool:
    return getattr(function, "__code__", None) is _PATCHED_LOSS_CODE


# -- the fused output layer: GPTModel._postprocess without the [s, b, v] logits ------------

_POSTPROCESS = "_postprocess"


def _log_output_layer_fallback(reason: str) -> None:
    _fallbacks.warn("turbo cross-entropy does not fuse the output layer with the loss "
                    "(GPTModel's post-processing runs unchanged): %s", reason,
                    key="output layer: ")


def _inference_active() -> bool:
    """Megatron-Core's process-wide inference flag (InferenceMode), where it exists."""
    try:
        from megatron.core.inference.utils import InferenceMode  # type: ignore[import-not-found]

        return bool(InferenceMode.is_active())
    except Exception:  # an older Megatron, or none
        return False


@dataclasses.dataclass(frozen=True)
class _OutputLayerPlan:
    """What the fused output layer and loss take from GPTModel._postprocess's call."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    labels: torch.Tensor
    loss_mask: Optional[torch.Tensor]
    group: Any
    #: Megatron's gather_from_sequence_parallel_region under sequence parallelism.
    gather_sequence: Optional[Callable[..., torch.Tensor]]
    #: MuP's output multiplier (``_scale_logits``), applied in the kernels; 1 without MuP.
    logit_scale: float = 1.0


def _mup_logit_scale(module: Any) -> Tuple[Optional[str], float]:
    """(fallback reason, logit scale): the factor GPTModel._postprocess's
    ``self._scale_logits`` multiplies the output layer's logits by before the loss.

    Megatron-Core's ``LanguageModule._scale_logits`` (language_module.py, read at d98e8a64)
    returns ``logits * config.mup_output_mult`` when ``config.use_mup`` is on and the
    multiplier is not 1 (TransformerConfig sets it to ``1 / mup_width_mult`` when left at
    1), else the logits unchanged. cegen applies that factor as ``logit_scale`` (z = s x
    before the softmax, the gradients those of the unscaled logits' GEMMs) where it is one
    (finite, > 0 in float32); a ``_scale_logits`` of another class or instance is not known.
    """
    config = getattr(module, "config", None)
    if not getattr(config, "use_mup", False):
        return None, 1.0
    owner = next((klass for klass in type(module).__mro__ if "_scale_logits" in vars(klass)),
                 None)
    if ("_scale_logits" in vars(module) or owner is None
            or owner.__name__ != "LanguageModule" or owner.__module__ != _LANGUAGE_MODULE_PATH):
        where = "the instance" if "_scale_logits" in vars(module) else (
            "no class" if owner is None else f"{owner.__module__}.{owner.__qualname__}")
        return (f"MuP (use_mup): _scale_logits is defined by {where}, not Megatron-Core's "
                "LanguageModule: its transform of the logits is not known"), 1.0
    multiplier = getattr(config, "mup_output_mult", 1.0)
    what = (f"MuP (use_mup): mup_output_mult={multiplier!r} is not a logit scale cegen can "
            "apply (a finite real number > 0 in float32)")
    if isinstance(multiplier, bool) or not isinstance(multiplier, numbers.Real):
        return what, 1.0
    if multiplier == 1.0:  # Megatron's own test: no multiplication at all
        return None, 1.0
    try:
        return None, _validate.logit_scale(multiplier)
    except InvalidInputError:
        return what, 1.0


def _output_layer_plan(module: Any, arguments: Mapping[str, Any],
                       ) -> Tuple[Optional[str], Optional[_OutputLayerPlan]]:
    """(fallback reason, plan) for a call of GPTModel._postprocess; (None, None) where
    there is nothing to fuse (a pipeline stage without the output layer)."""
    if not getattr(module, "post_process", True):
        return None, None
    config = getattr(module, "config", None)
    labels = arguments.get("labels")
    if labels is None:
        return "no labels: the caller gets the logits", None
    if (_inference_active() or arguments.get("inference_context") is not None
            or arguments.get("inference_params") is not None):
        return "inference: the logits are the output", None
    if arguments.get("mtp_in_postprocess") or getattr(config, "mtp_num_layers", None):
        return ("multi-token prediction (MTP layers) computes its losses from the output "
                "layer's logits"), None
    if arguments.get("output_processor") is not None:
        return "an output_processor is given the output layer", None
    reason, logit_scale = _mup_logit_scale(module)
    if reason is not None:
        return reason, None
    if getattr(config, "config_logger_dir", ""):
        return "the config logger records the logits (config_logger_dir)", None
    if is_compiling():
        return "torch.compile is tracing GPTModel's post-processing", None
    if getattr(config, "cuda_graph_impl", None) == "full_iteration":
        # No schedule of linear_cross_entropy reads a device value on the host, but none has
        # been captured in a CUDA graph yet.
        return "full-iteration CUDA graphs (cuda_graph_impl='full_iteration')", None
    if not _is_cegen_loss(getattr(type(module), "compute_language_model_loss", None)):
        return ("compute_language_model_loss is not cegen's (a subclass or another patch "
                "replaced it): its loss is not the one cegen would fuse"), None
    reason, group = _module_plan(module)
    if reason is not None:
        return reason, None
    layer = getattr(module, "output_layer", None)
    try:
        from megatron.core.tensor_parallel import (  # type: ignore[import-not-found]
            ColumnParallelLinear,
        )
    except Exception:
        return "megatron.core.tensor_parallel.ColumnParallelLinear cannot be imported", None
    if type(layer) is not ColumnParallelLinear:
        return (f"the output layer is a {_class_description(type(layer))}, not Megatron-Core's "
                "ColumnParallelLinear"), None
    gather_output = arguments.get("runtime_gather_output")
    if gather_output is None:
        gather_output = getattr(layer, "gather_output", False)
    if gather_output:
        return ("the logits are gathered over the tensor-parallel ranks "
                "(runtime_gather_output, or parallel_output=False)"), None
    if getattr(getattr(layer, "config", config), "defer_embedding_wgrad_compute", False):
        return ("defer_embedding_wgrad_compute keeps the output layer's input and gradient "
                "for a later weight-gradient GEMM"), None
    if getattr(layer, "gtp_remat_size", 1) != 1:
        return "the output weight is rematerialized across ranks (gtp_weight_remat_size)", None
    if getattr(layer, "disable_grad_reduce", False) or getattr(layer, "explicit_expert_comm", False):
        return ("the output layer does not reduce its input gradient over the tensor-parallel "
                "group (disable_grad_reduce, expert communication)"), None
    if group is not None and getattr(layer, "tp_group", group) is not group:
        return "the output layer's tensor-parallel group is not the module's", None
    hidden = arguments.get("hidden_states")
    if getattr(module, "share_embeddings_and_output_weights", False):
        weight = module.shared_embedding_or_output_weight()
    else:
        weight = getattr(layer, "weight", None)
    bias = None if getattr(layer, "skip_bias_add", False) else getattr(layer, "bias", None)
    if not all(isinstance(t, torch.Tensor) for t in (hidden, weight, labels)):
        return "the hidden states, the output weight or the labels are not tensors", None
    if hidden.dtype not in _SUPPORTED_LOGITS:
        return f"hidden states of dtype {hidden.dtype} are not supported (bf16, fp16, fp32 are)", None
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        return (f"the hidden states ({hidden.dtype}) and the output layer's weight "
                f"({weight.dtype})" + ("" if bias is None else f" and bias ({bias.dtype})")
                + " differ in dtype"), None
    output_dtype = getattr(layer, "output_dtype", None)
    if output_dtype is not None and output_dtype != hidden.dtype:
        return f"the output layer makes {output_dtype} logits from {hidden.dtype} (logit_dtype)", None
    if labels.dtype not in _SUPPORTED_LABELS:
        return f"labels dtype {labels.dtype} is not supported (int64, int32 are)", None
    sequence_parallel = group is not None and bool(getattr(layer, "sequence_parallel", False))
    sequence = hidden.shape[0] * (_group_size(group) if sequence_parallel else 1) if hidden.dim() == 3 else -1
    if (hidden.dim() != 3 or labels.dim() != 2 or weight.dim() != 2
            or weight.shape[1] != hidden.shape[-1]
            or tuple(labels.shape) != (hidden.shape[1], sequence)):
        return (f"shapes hidden {tuple(hidden.shape)} / weight {tuple(weight.shape)} / labels "
                f"{tuple(labels.shape)} are not [s, b, h] / [v, h] / [b, s]"
                + (" (s split over the tensor-parallel ranks)" if sequence_parallel else "")), None
    if (hidden.device.type not in _SUPPORTED_DEVICES or labels.device != hidden.device
            or weight.device != hidden.device):
        return (f"hidden states on {hidden.device}, weight on {weight.device} and labels on "
                f"{labels.device}: this cegen build launches on "
                f"{', '.join(_SUPPORTED_DEVICES)} only"), None
    if not runtime_available():
        return "the cegen runtime library (libce_runtime.so) cannot be found or loaded", None
    gather_sequence = None
    if sequence_parallel:
        try:
            from megatron.core.tensor_parallel import (  # type: ignore[import-not-found]
                gather_from_sequence_parallel_region as gather_sequence,
            )
        except Exception:
            return ("sequence parallelism needs megatron.core.tensor_parallel's "
                    "gather_from_sequence_parallel_region, which cannot be imported"), None
    loss_mask = arguments.get("loss_mask")
    if not isinstance(loss_mask, torch.Tensor) or loss_mask.numel() != labels.numel():
        loss_mask = None
    return None, _OutputLayerPlan(hidden, weight, bias, labels, loss_mask, group,
                                  gather_sequence, logit_scale)


def _class_description(cls: Type[Any]) -> str:
    """The class's name, with the classes mixed into it where it takes its base's name
    (Megatron-Bridge's ``extend_instance``: Gemma's softcapped output layer is a class named
    ColumnParallelLinear over ``(Gemma2OutputLayer, ColumnParallelLinear)``)."""
    bases = [base for base in cls.__bases__ if base.__name__ != cls.__name__]
    if len(bases) == len(cls.__bases__):
        return cls.__name__
    return f"{cls.__name__} with {', '.join(base.__name__ for base in bases)} mixed in"


def _fused_output_layer_loss(module: Any, plan: _OutputLayerPlan,
                             settings: TurboCESettings) -> torch.Tensor:
    """The per-token loss ``[b, s]`` of the output layer's logits, a chunk of tokens at a
    time (cegen.linear_cross_entropy), as Megatron's output layer + loss would give it."""
    hidden = plan.hidden
    if plan.gather_sequence is not None:
        # The output layer's all-gather of the sequence; its backward is the reduce-scatter
        # that sums each rank's share of d hidden, as ColumnParallelLinear's does.
        hidden = plan.gather_sequence(hidden, tensor_parallel_output_grad=True,
                                      group=plan.group)
    grad_weights: Any = None
    if (settings.turbo_ce_fused_gradient and torch.is_grad_enabled()
            and (hidden.requires_grad or plan.weight.requires_grad)
            and plan.loss_mask is not None):
        # The upstream gradient Megatron's step will give each token, loss_mask x c (c: the
        # token count, micro-batches, loss scale): the forward finishes the gradients, and the
        # backward finds on the device the one factor between this prediction and the
        # loss_func's loss_mask x c' (1 when predicted right) and scales d weight by it: three
        # GEMMs. An upstream that is not loss_mask times one number (a loss_func with per-token
        # weights) gets NaN d weight and an UnpredictedUpstreamError naming
        # --no-turbo-ce-fused-gradient; never a wrong gradient. Without a loss mask nothing is
        # predicted (the schedule that recomputes the logits: four GEMMs, any upstream).
        factor = predicted_upstream(module, plan.labels, plan.loss_mask)
        grad_weights = factor * plan.loss_mask.reshape(plan.labels.shape).float()
    return linear_cross_entropy(
        hidden, plan.weight, plan.labels, bias=plan.bias, label_layout="bs",
        grad_weights=grad_weights, tp_group=plan.group,
        reduce_grad_hidden=plan.gather_sequence is None, logit_scale=plan.logit_scale,
        **_label_options(module))


def _make_fused_postprocess(original: Callable[..., Any],
                            settings: TurboCESettings) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _postprocess(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            arguments = signature.bind(self, *args, **kwargs).arguments
        except TypeError:  # not the signature read at install: Megatron's own error
            return original(self, *args, **kwargs)
        reason, plan = _output_layer_plan(self, arguments)
        if plan is None:
            if reason is not None:
                _log_output_layer_fallback(reason)
            return original(self, *args, **kwargs)
        return _fused_output_layer_loss(self, plan, settings)

    _postprocess._cegen_original = original  # type: ignore[attr-defined]
    _postprocess._cegen_settings = settings  # type: ignore[attr-defined]
    return _postprocess


#: The GPTModel classes whose _postprocess install() replaced (uninstall restores them).
_patched_models: Set[Type[Any]] = set()


def _gpt_model_class() -> Type[Any]:
    import importlib

    return importlib.import_module(_GPT_MODEL_PATH).GPTModel


def _language_module_class() -> Type[Any]:
    import importlib

    return importlib.import_module(_LANGUAGE_MODULE_PATH).LanguageModule


def is_installed(language_module_cls: Optional[Type[Any]] = None) -> bool:
    """Whether ``compute_language_model_loss`` is patched."""
    cls = language_module_cls or _language_module_class()
    return hasattr(cls.__dict__.get("compute_language_model_loss"), "_cegen_original")


def install(args: Any = None, *, language_module_cls: Optional[Type[Any]] = None,
            gpt_model_cls: Optional[Type[Any]] = None) -> bool:
    """Patches ``LanguageModule.compute_language_model_loss`` when the settings enable it,
    and with ``--turbo-ce-fuse-output-layer`` also ``GPTModel._postprocess``.

    Args:
        args: Megatron's parsed arguments, a :class:`TurboCESettings`, or None for
            ``megatron.training.get_args()``.
        language_module_cls: the class to patch (default: Megatron-Core's LanguageModule).
        gpt_model_cls: the model class whose ``_postprocess`` the fused output layer
            replaces (default: Megatron-Core's GPTModel).

    Returns:
        Whether the patch is in place. With ``--use-turbo-cross-entropy`` off nothing is
        patched (a previous patch is removed) and Megatron runs exactly as without cegen.
    """
    settings = settings_from_args(args)
    cls = language_module_cls or _language_module_class()
    uninstall(cls, gpt_model_cls)
    if not settings.use_turbo_cross_entropy:
        logger.info("turbo cross-entropy is off (--use-turbo-cross-entropy not given)")
        return False
    original = cls.compute_language_model_loss
    cls.compute_language_model_loss = _make_patched(original, settings)
    if settings.turbo_ce_fuse_output_layer:
        model_cls = gpt_model_cls or _gpt_model_class()
        model_cls._postprocess = _make_fused_postprocess(model_cls._postprocess, settings)
        _patched_models.add(model_cls)
    logger.info("turbo cross-entropy installed on %s.compute_language_model_loss "
                "(overwrite_input=%s, fused_gradient=%s, fuse_output_layer=%s)", cls.__name__,
                settings.turbo_ce_overwrite_input, settings.turbo_ce_fused_gradient,
                settings.turbo_ce_fuse_output_layer)
    return True


def uninstall(language_module_cls: Optional[Type[Any]] = None,
              gpt_model_cls: Optional[Type[Any]] = None) -> None:
    """Restores the original ``compute_language_model_loss`` if it was patched, and every
    ``_postprocess`` the fused output layer replaced (and ``gpt_model_cls``'s)."""
    cls = language_module_cls or _language_module_class()
    current = cls.__dict__.get("compute_language_model_loss")
    original = getattr(current, "_cegen_original", None)
    if original is not None:
        cls.compute_language_model_loss = original
    models = set(_patched_models) | ({gpt_model_cls} if gpt_model_cls is not None else set())
    for model_cls in models:
        current = model_cls.__dict__.get(_POSTPROCESS)
        original = getattr(current, "_cegen_original", None)
        if original is not None:
            setattr(model_cls, _POSTPROCESS, original)
    _patched_models.clear()
