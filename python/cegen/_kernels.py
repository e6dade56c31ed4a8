"""The one piece of code that launches cegen kernels on PyTorch tensors.

Both the ``torch.library`` custom ops and the plain ``torch.autograd.Function`` path call
these functions. They validate shapes, dtypes, strides and devices with messages that
name the offending argument, describe each tensor to the runtime as a strided view (no
copies, stride-0 upstream gradients included), allocate the outputs and launch.

Devices: CPU tensors run host kernels (target ``host``); CUDA tensors run GPU kernels for
their device's target (``sm_90`` for compute capability 9.0; on a ROCm build of PyTorch,
the device's ``gfx`` architecture) on ``torch.cuda.current_stream(device)``, without
synchronizing. Out-of-range labels on a GPU are therefore reported lazily: each forward
(and fused) call first polls, without blocking, for reports from kernels that already ran
on its stream, and :func:`check_labels` waits for the stream and reports everything.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import threading
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

import torch

from . import _bundle_cache, _gradient_status, _plans, _validate
from ._errors import InvalidInputError
from ._runtime import (CE_MAX_RANK, Device, DType, LabelLayout, LabelPolicy, Options,
                       TensorDesc, get_runtime)
from ._variant import VariantKey

__all__ = [
    "LABEL_OUT_OF_RANGE_POLICIES",
    "KernelOptions",
    "Shard",
    "shard_stats",
    "token_shape",
    "variant_layout",
    "forward",
    "backward",
    "fused",
    "poison_outputs",
    "device_target",
    "check_labels",
]

_LOGITS_DTYPES = {torch.bfloat16: ("bf16", DType.BF16), torch.float16: ("f16", DType.F16),
                  torch.float32: ("f32", DType.F32)}
_LABEL_DTYPES = {torch.int32: ("i32", DType.I32), torch.int64: ("i64", DType.I64)}
_ALL_DTYPES = {**_LOGITS_DTYPES, **_LABEL_DTYPES}

#: ``label_out_of_range`` values and the runtime's ``label_policy`` for each: "error" (a
#: label outside ``[0, V)`` that is not the ignore_index is bad input, reported) and
#: "megatron" (Megatron-Core's vocab-parallel semantics: the row maximum stands in for the
#: target logit, so the loss is ``lse - max`` and the gradient has no one-hot term).
LABEL_OUT_OF_RANGE_POLICIES = {"error": LabelPolicy.STRICT, "megatron": LabelPolicy.MEGATRON}


@dataclasses.dataclass(frozen=True)
class Shard:
    """A tensor-parallel vocabulary slice: the logits hold global ids
    ``[start, start + V_local)`` of ``vocab``; labels are global ids.

    ``global_smoothing`` smooths over ``vocab`` instead of ``V_local`` (Megatron's
    vocab-parallel behaviour, the default); see docs/tensor-parallel.md.
    """

    start: int
    vocab: int
    global_smoothing: bool = False

    def __post_init__(self) -> None:
        start, vocab = _validate.shard_bounds(self.start, self.vocab)
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "vocab", vocab)
        object.__setattr__(self, "global_smoothing",
                           _validate.flag("global_smoothing", self.global_smoothing))


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """The per-call options that select a kernel variant (besides dtypes and op).

    Attributes:
        ignore_index: labels equal to it get loss 0 and a zero gradient row; None: none.
        label_smoothing: alpha of Megatron's smoothing formula, in [0, 1).
        z_loss: coefficient of ``z * lse^2``, >= 0.
        label_layout: ``"bs"`` (labels [B,S]) or ``"sb"`` (labels [S,B]) for [S,B,V] logits;
            ignored for [N,V] logits.
        bundle: an explicit bundle directory, or None for the cache.
        shard: the logits' vocabulary slice (:func:`shard_stats` and :func:`backward`),
            or None.
        label_out_of_range: what a label outside ``[0, V)`` (the whole vocabulary of a
            shard) that is not the ignore_index does: ``"error"`` raises
            :class:`~cegen.LabelOutOfRangeError`; ``"megatron"`` gives it Megatron-Core's
            loss ``(1-s)(lse - max) + s(lse - mean) + z lse^2`` and gradient
            ``g (p (1 + 2 z lse) - s/V)``. A kernel argument: it selects no variant.
        logit_scale: every logit ``x`` is taken as ``z = logit_scale * x`` before the softmax
            (loss, lse, smoothing and z-loss are of z; the gradient is of x); finite, > 0.
            A kernel argument: it selects no variant (1 costs nothing).
        logit_softcap: every logit is ``z = cap * tanh(logit_scale * x / cap)`` (0.0: none;
            ``None`` is taken as 0.0); finite, > 0. A cap selects the softcap kernels
            (variant key ``softcap=on``), whose value is a kernel argument.
    """

    ignore_index: Optional[int] = None
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    label_layout: str = "bs"
    bundle: Optional[str] = None
    shard: Optional[Shard] = None
    label_out_of_range: str = "error"
    logit_scale: float = 1.0
    logit_softcap: float = 0.0

    def __post_init__(self) -> None:
        # Every value is checked and normalized by cegen._validate (a plain int, an f32-rounded
        # float, ...), so the custom ops and the variant key see canonical Python values.
        object.__setattr__(self, "ignore_index", _validate.ignore_index(self.ignore_index))
        object.__setattr__(self, "label_smoothing",
                           _validate.label_smoothing(self.label_smoothing))
        object.__setattr__(self, "z_loss", _validate.z_loss(self.z_loss))
        _validate.label_layout(self.label_layout)
        if self.bundle is not None:
            object.__setattr__(self, "bundle", str(_validate.path("bundle", self.bundle)))
        if self.shard is not None and not isinstance(self.shard, Shard):
            raise InvalidInputError(f"shard must be a cegen Shard or None, got {self.shard!r}")
        _validate.label_out_of_range(self.label_out_of_range)
        object.__setattr__(self, "logit_scale", _validate.logit_scale(self.logit_scale))
        if self.logit_softcap != 0.0:
            object.__setattr__(self, "logit_softcap",
                               _validate.logit_softcap(self.logit_softcap))
        # The kernels take y = x fl(s / cap): it must be a finite float32.
        if self.logit_softcap != 0.0 and not (self.logit_scale / self.logit_softcap
                                              <= _validate.F32_MAX):
            raise InvalidInputError(
                f"logit_scale / logit_softcap must be finite in float32, got "
                f"{self.logit_scale!r} / {self.logit_softcap!r}")

    def __hash__(self) -> int:
        # The fields' hash, computed once: every launch looks its plan up by a key that
        # holds the options (cegen._plans; host time). Not pickled (str hashes differ
        # between processes).
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.ignore_index, self.label_smoothing, self.z_loss,
                           self.label_layout, self.bundle, self.shard, self.label_out_of_range,
                           self.logit_scale, self.logit_softcap))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_hash", None)
        return state


#: The types whose values :func:`kernel_options` keeps: a Python call passes the same few
#: option values every step, so they are validated once per distinct value.
_PLAIN_OPTION_TYPES = (int, float, str, type(None))
_options_cache: Dict[Tuple[Any, ...], Tuple[Tuple[type, ...], KernelOptions]] = {}
_OPTIONS_CACHE_SIZE = 256


def kernel_options(ignore_index: Any, label_smoothing: Any, z_loss: Any, label_layout: Any,
                   bundle: Any, label_out_of_range: Any,
                   logit_scale: Any = 1.0, logit_softcap: Any = 0.0) -> KernelOptions:
    """``KernelOptions(...)`` of these values, validated once per distinct value: a host-time
    saving of the per-call path (the values are plain ints, floats and strings; anything
    else, e.g. a NumPy integer or a 0-d tensor, is validated every time)."""
    if logit_softcap is None:
        logit_softcap = 0.0
    values = (ignore_index, label_smoothing, z_loss, label_layout, bundle, label_out_of_range,
              logit_scale, logit_softcap)
    types = (type(ignore_index), type(label_smoothing), type(z_loss), type(label_layout),
             type(bundle), type(label_out_of_range), type(logit_scale), type(logit_softcap))
    try:
        entry = _options_cache.get(values)
    except TypeError:  # an unhashable value: validation says what is wrong with it
        entry = None
    # The types are compared too: True == 1 and 1 == 1.0 in a dict.
    if entry is not None and entry[0] == types:
        return entry[1]
    if not all(kind in _PLAIN_OPTION_TYPES for kind in types):
        return KernelOptions(*values[:5], label_out_of_range=label_out_of_range,
                             logit_scale=logit_scale, logit_softcap=logit_softcap)
    # -0.0 == 0.0 in a dict too: a float is made non-negative zero by adding 0.0.
    options = KernelOptions(ignore_index,
                            label_smoothing + 0.0 if types[1] is float else label_smoothing,
                            z_loss + 0.0 if types[2] is float else z_loss, label_layout,
                            bundle, label_out_of_range=label_out_of_range,
                            logit_scale=logit_scale,
                            logit_softcap=logit_softcap + 0.0
                            if types[7] is float else logit_softcap)
    if len(_options_cache) >= _OPTIONS_CACHE_SIZE:
        _options_cache.clear()
    _options_cache[values] = (types, options)
    return options


# -- test hook: poisoned outputs ----------------------------------------------------------

_poison = False


@contextlib.contextmanager
def poison_outputs(enabled: bool = True) -> Iterator[None]:
    """Fills every output buffer with NaN (or -1) before each launch; for tests."""
    global _poison
    previous, _poison = _poison, enabled
    try:
        yield
    finally:
        _poison = previous


def _empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    tensor = torch.empty(tuple(shape), dtype=dtype, device=device)
    if _poison:
        tensor.fill_(float("nan") if dtype.is_floating_point else -1)
    return tensor


def _empty_like(tensor: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(tensor)  # keeps a dense input's strides, e.g. a transposed view
    if _poison:
        out.fill_(float("nan"))
    return out


# -- validation and description -----------------------------------------------------------


_GPU_DEVICE_TYPE = Device.HIP if getattr(torch.version, "hip", None) else Device.CUDA


def _gpu_device_type() -> int:
    """The runtime's device type for torch's ``cuda`` tensors: HIP on a ROCm build."""
    return _GPU_DEVICE_TYPE


def _device_of(tensor: torch.Tensor, name: str) -> Tuple[int, int]:
    # is_cuda / is_cpu / get_device(): a tenth of the host time of tensor.device.type.
    if tensor.is_cuda:
        return _GPU_DEVICE_TYPE, tensor.get_device()
    if tensor.is_cpu:
        return Device.HOST, 0
    raise InvalidInputError(
        f"{name} is on device {tensor.device}; cegen runs on the CPU and on CUDA/ROCm GPUs"
    )


_targets: Dict[Tuple[str, int], str] = {}


def device_target(device: torch.device) -> str:
    """The bundle target of ``device``: ``host``, ``sm_<major><minor>`` or ``gfx...``."""
    if device.type == "cpu":
        return "host"
    index = device.index if device.index is not None else torch.cuda.current_device()
    target = _targets.get((device.type, index))
    if target is None:
        if _gpu_device_type() == Device.HIP:
            arch = getattr(torch.cuda.get_device_properties(index), "gcnArchName", "")
            target = arch.split(":")[0]
        else:
            major, minor = torch.cuda.get_device_capability(index)
            target = f"sm_{major}{minor}"
        _targets[(device.type, index)] = target
    return target


def describe(tensor: torch.Tensor, name: str) -> TensorDesc:
    """The runtime descriptor of ``tensor``: its data pointer, sizes and strides, as is."""
    if not isinstance(tensor, torch.Tensor):
        raise InvalidInputError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    entry = _ALL_DTYPES.get(tensor.dtype)
    if entry is None:
        raise InvalidInputError(f"{name} has unsupported dtype {tensor.dtype}")
    device, index = _device_of(tensor, name)
    shape = tensor.shape
    if len(shape) > CE_MAX_RANK:
        return TensorDesc.make(tensor.data_ptr(), entry[1], shape, tensor.stride(), device, index)
    # One constructor call (C-level field assignment): the per-launch host cost.
    return TensorDesc(tensor.data_ptr(), entry[1], len(shape), _Extents(*shape),
                      _Extents(*tensor.stride()), device, index)


_Extents = ctypes.c_int64 * CE_MAX_RANK
#: The module's own describe: a replaced one (a hook that records descriptors) turns the
#: launch plans off, so that it sees every tensor of every launch.
_DESCRIBE = describe


def token_shape(logits_shape: Sequence[int], label_layout: str) -> Tuple[int, ...]:
    """The per-token shape (of labels, loss, lse) for logits of ``logits_shape``."""
    if len(logits_shape) == 2:
        return (logits_shape[0],)
    if len(logits_shape) == 3:
        s, b = logits_shape[0], logits_shape[1]
        return (b, s) if label_layout == "bs" else (s, b)
    raise InvalidInputError(
        f"logits must be [N, V] or [S, B, V], got a tensor of shape {tuple(logits_shape)}"
    )


def variant_layout(logits_ndim: int, label_layout: str) -> str:
    """The variant key's ``layout`` field."""
    if logits_ndim == 2:
        return "flat"
    return "sbv_bs" if label_layout == "bs" else "sbv_sb"


def check_inputs(logits: torch.Tensor, labels: torch.Tensor, options: KernelOptions) -> Tuple[int, ...]:
    """Validates logits and labels; returns the token shape."""
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise InvalidInputError("logits and labels must be torch.Tensor objects")
    if logits.dtype not in _LOGITS_DTYPES:
        raise InvalidInputError(
            f"logits dtype {logits.dtype} is not supported; use bfloat16, float16 or float32"
        )
    if labels.dtype not in _LABEL_DTYPES:
        raise InvalidInputError(f"labels dtype {labels.dtype} is not supported; use int64 or int32")
    shape = logits.shape  # read once: each .shape builds a torch.Size
    tokens = token_shape(shape, options.label_layout)
    vocab = shape[-1]
    if vocab < 1:
        raise InvalidInputError(f"logits have an empty vocabulary dimension: {tuple(shape)}")
    smoothing_vocab = vocab
    if options.shard is not None:
        if options.shard.start + vocab > options.shard.vocab:
            raise InvalidInputError(
                f"the logits' slice [{options.shard.start}, {options.shard.start} + "
                f"{vocab}) exceeds the shard's vocabulary of {options.shard.vocab}"
            )
        if options.shard.global_smoothing:
            smoothing_vocab = options.shard.vocab
    if options.label_smoothing > 0.0 and smoothing_vocab < 2:
        raise InvalidInputError("label smoothing needs a vocabulary of at least 2 entries")
    if labels.shape != tokens:
        layout = {2: "[N]", 3: "[B, S]" if options.label_layout == "bs" else "[S, B]"}
        raise InvalidInputError(
            f"labels of shape {tuple(labels.shape)} do not fit logits of shape "
            f"{tuple(logits.shape)}: expected {layout[logits.dim()]} = {tokens}"
            + (" (label_layout='" + options.label_layout + "')" if logits.dim() == 3 else "")
        )
    if vocab > 1 and logits.stride(-1) != 1:
        raise InvalidInputError(
            f"the vocabulary dimension of the logits must have stride 1, got strides "
            f"{tuple(logits.stride())}; pass logits.contiguous()"
        )
    if labels.device != logits.device:
        raise InvalidInputError(f"labels are on {labels.device} but logits are on {logits.device}")
    _device_of(logits, "logits")
    return tokens


def _check_token_tensor(tensor: torch.Tensor, name: str, tokens: Tuple[int, ...],
                        device: torch.device) -> None:
    if tuple(tensor.shape) != tokens:
        raise InvalidInputError(f"{name} has shape {tuple(tensor.shape)}, expected {tokens}")
    if tensor.device != device:
        raise InvalidInputError(f"{name} is on {tensor.device} but logits are on {device}")


def _runtime_options(options: KernelOptions, overwrite: bool) -> Options:
    runtime_options = get_runtime().default_options()
    if options.ignore_index is not None:
        runtime_options.has_ignore_index = 1
        runtime_options.ignore_index = options.ignore_index
    runtime_options.label_smoothing = options.label_smoothing
    runtime_options.z_loss = options.z_loss
    runtime_options.logit_scale = options.logit_scale
    runtime_options.logit_softcap = options.logit_softcap
    runtime_options.overwrite_input = 1 if overwrite else 0
    runtime_options.label_layout = LabelLayout.BS if options.label_layout == "bs" else LabelLayout.SB
    if options.shard is not None:
        runtime_options.shard_start = options.shard.start
        runtime_options.shard_vocab = options.shard.vocab
        runtime_options.shard_global_smoothing = 1 if options.shard.global_smoothing else 0
    runtime_options.label_policy = LABEL_OUT_OF_RANGE_POLICIES[options.label_out_of_range]
    return runtime_options


def _key(op: str, logits: torch.Tensor, labels: torch.Tensor, options: KernelOptions,
         overwrite: bool = False, weights: str = "none") -> VariantKey:
    return VariantKey(
        op=op,
        logits=_LOGITS_DTYPES[logits.dtype][0],
        labels=_LABEL_DTYPES[labels.dtype][0],
        layout=variant_layout(logits.dim(), options.label_layout),
        label_smoothing=options.label_smoothing != 0.0,
        z_loss=options.z_loss != 0.0,
        overwrite=overwrite,
        weights="token" if weights == "scalar" else weights,
        softcap=options.logit_softcap != 0.0,
    )


# (op, dtypes, rank, options, overwrite, weights, device) -> (bundle generation, bundle,
# runtime options): the variant key, the bundle lookup and the ce_options struct of a call
# made before. The runtime only reads the struct (const ce_options *).
_launches: Dict[Tuple[Any, ...], Tuple[int, Any, Options]] = {}
_launches_lock = threading.Lock()


def _launch(op: str, logits: torch.Tensor, labels: torch.Tensor, options: KernelOptions,
            device: Tuple[int, int], overwrite: bool = False,
            weights: str = "none") -> Tuple[Any, Options]:
    """The open bundle holding this call's kernel and its ``ce_options``, cached per call
    shape; a lookup that fails raises as :func:`cegen._bundle_cache.bundle_for` does."""
    key = (op, logits.dtype, labels.dtype, logits.dim(), options, overwrite, weights, device)
    generation = _bundle_cache.generation
    entry = _launches.get(key)
    if entry is not None and entry[0] == generation:
        return entry[1], entry[2]
    bundle = _bundle_cache.bundle_for(
        _key(op, logits, labels, options, overwrite=overwrite, weights=weights),
        options.bundle, device_target(logits.device))
    runtime_options = _runtime_options(options, overwrite)
    with _launches_lock:
        if len(_launches) >= _OPTIONS_CACHE_SIZE:
            _launches.clear()
        _launches[key] = (generation, bundle, runtime_options)
    return bundle, runtime_options


def _refuse_shard(options: KernelOptions, what: str) -> None:
    if options.shard is not None:
        raise InvalidInputError(
            f"{what} cannot run on a vocabulary slice: its loss needs every rank's "
            "statistics; use shard_stats, combine them across ranks "
            "(cegen.tensor_parallel), then backward"
        )


def _stream(device: torch.device) -> Optional[int]:
    """The stream a launch goes on: the device's current stream, None on the host."""
    if device.type == "cpu":
        return None  # host kernels run synchronously on the calling thread
    return torch.cuda.current_stream(device).cuda_stream


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream_at(where: Tuple[int, int]) -> Optional[int]:
    """:func:`_stream` for a ``(device type, index)`` from :func:`_device_of`."""
    if where[0] == Device.HOST:
        return None
    if _raw_stream is not None:
        return _raw_stream(where[1])  # the current stream's handle, no Stream object made
    return torch.cuda.current_stream(where[1]).cuda_stream


def _poll_labels(device: torch.device, runtime: Any = None, where: Optional[Tuple[int, int]] = None,
                 stream: Optional[int] = None) -> None:
    """Raises for bad labels that earlier GPU kernels on this stream reported, and for
    fused gradients that earlier backwards could not compute (``cegen._gradient_status``);
    never blocks (see :func:`check_labels`). ``runtime``, ``where`` (device type and
    index) and ``stream`` may be passed when the caller has them."""
    _gradient_status.poll(device)
    if where is None:
        if device.type == "cpu":
            return
        where = _device_of_device(device)
    kind, index = where
    if kind == Device.HOST:
        return
    (runtime or get_runtime()).check_label_status(
        kind, index, stream if stream is not None else _stream(device), wait=False)


def _device_of_device(device: torch.device) -> Tuple[int, int]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _gpu_device_type(), index


def check_labels(device: Optional[torch.device] = None, wait: bool = True) -> None:
    """Reports labels out of range met by cegen's GPU kernels (CPU calls report at once).

    Waits for the current stream of ``device`` (default: the current CUDA device) and
    raises :class:`~cegen.LabelOutOfRangeError` naming the first launch since the last
    check whose kernel met a label outside ``[0, V)`` that is not the ignore_index (the
    token, its label, the variant); each report is made once. Launches made with
    ``label_out_of_range="megatron"`` report nothing: such a label is valid there. With
    ``wait=False`` it never blocks and sees the kernels that have finished. Launches
    captured into a CUDA graph report each replay that meets a bad label.
    """
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type == "cpu":
        return
    kind, index = _device_of_device(device)
    get_runtime().check_label_status(kind, index, _stream(device), wait=wait)


# -- launches ------------------------------------------------------------------------------
#
# forward, backward and fused run a launch through a plan (cegen._plans) keyed by what
# their checks and descriptors read: on a miss the inputs are checked, the kernel looked
# up and every tensor described; on a hit only the data pointers are written. A hook on
# `describe` (tests and benches record the descriptors) makes every call a miss.

_F32 = torch.float32


def _plan_for(plans: Dict[Tuple[Any, ...], _plans.Plan],
              key: Optional[Tuple[Any, ...]]) -> Optional[_plans.Plan]:
    """The plan kept under ``key``, None on a miss (also while ``describe`` is hooked)."""
    plan = plans.get(key) if key is not None else None
    if plan is None or plan.generation != _bundle_cache.generation or describe is not _DESCRIBE:
        return None
    return plan


def _new_plan(plans: Dict[Tuple[Any, ...], _plans.Plan], key: Optional[Tuple[Any, ...]],
              tokens: Tuple[int, ...], logits: torch.Tensor) -> _plans.Plan:
    plan = _plans.Plan(_bundle_cache.generation, tokens, logits.device,
                       _device_of(logits, "logits"))
    if describe is _DESCRIBE:
        _plans.store(plans, key, plan)
    return plan


def _launch_plan(plan: _plans.Plan, what: str, poll: bool) -> None:
    """Calls the plan's entry point (its descriptors hold this call's data pointers) on
    the current stream, after the label poll when ``poll``."""
    where = plan.where
    stream = None if not plan.gpu else (
        _raw_stream(where[1]) if _raw_stream is not None else _stream_at(where))
    if poll:
        _gradient_status.poll(plan.device)
        if plan.gpu:  # Runtime.check_label_status(..., wait=False), called directly
            status = plan.check_labels(where[0], where[1], stream, 0)
            if status:
                plan.runtime.check(status, "cegen label check")
    status = plan.entry(plan.bundle.handle, plan.options_address, *plan.addresses, stream)
    if status:
        plan.runtime.check(status, what)


def _extras(tokens: Tuple[int, ...], device: Any, low: bool, entropy: bool,
            argmax: bool) -> Tuple[Optional[torch.Tensor], ...]:
    """lse_low, entropy (fp32) and argmax (int64) of the labels' shape, each None unless
    asked for (poisoned under :func:`poison_outputs`)."""
    def make(wanted: bool, dtype: torch.dtype) -> Optional[torch.Tensor]:
        return torch.empty(tokens, dtype=dtype, device=device) if wanted else None
    extras = (make(low, _F32), make(entropy, _F32), make(argmax, torch.int64))
    _poisoned_extras(extras)
    return extras


def _poisoned_extras(extras: Sequence[Optional[torch.Tensor]]) -> None:
    """NaN in the fp32 extras and -2 (no index: never an argmax) in argmax."""
    if not _poison:
        return
    for tensor in extras:
        if tensor is not None:
            tensor.fill_(-2 if tensor.dtype == torch.int64 else float("nan"))


def _set_extras(plan: _plans.Plan, extras: Sequence[Optional[torch.Tensor]]) -> None:
    """Writes this call's extras' data pointers into the plan's descriptors."""
    for desc, tensor in zip((plan.low_desc, plan.entropy_desc, plan.argmax_desc), extras):
        if tensor is not None:
            desc.data = tensor.data_ptr()


def _described_extras(extras: Sequence[Optional[torch.Tensor]]) -> Tuple[Any, ...]:
    return tuple(None if tensor is None else describe(tensor, name)
                 for tensor, name in zip(extras, ("lse_low", "entropy", "argmax")))


def forward(logits: torch.Tensor, labels: torch.Tensor, options: KernelOptions,
            checked: bool = False, low: bool = False, entropy: bool = False,
            argmax: bool = False) -> Tuple[torch.Tensor, ...]:
    """Per-token loss and lse (fp32, the labels' shape, contiguous), then, each where
    asked for, lse's low part (``low``: ``lse + lse_low`` is the log-sum-exp to twice
    f32's precision; :func:`backward` takes it so that its gradient's error does not
    grow with the logits' magnitude), the entropy of softmax(z) (fp32) and the argmax
    (int64: the lowest index of the row's largest logit, -1 for a NaN row). The inputs
    are checked once per call shape (``checked`` is accepted for callers that checked
    them: a plan's key stands for the checks)."""
    if options.shard is not None:
        _refuse_shard(options, "the forward")
    try:
        key: Optional[Tuple[Any, ...]] = (
            "forward", options, low, entropy, argmax, logits.dtype, logits.shape,
            logits.stride(),
            logits.device, labels.dtype, labels.shape, labels.stride(), labels.device)
    except Exception:  # not tensors (the checks below say so), or no strides
        key = None
    plans = _plans.thread_plans()
    plan = _plan_for(plans, key)
    if plan is None:
        tokens = check_inputs(logits, labels, options)
        plan = _new_plan(plans, key, tokens, logits)
        loss = _empty(tokens, _F32, plan.device)
        lse = _empty(tokens, _F32, plan.device)
        extras = _extras(tokens, plan.device, low, entropy, argmax)
        if loss.numel() == 0:
            return (loss, lse) + tuple(t for t in extras if t is not None)
        bundle, runtime_options = _launch("forward", logits, labels, options, plan.where)
        plan.set_launch(bundle, runtime_options, "ce_forward", (
            describe(logits, "logits"), describe(labels, "labels"), describe(loss, "loss"),
            describe(lse, "lse")), *_described_extras(extras))
    else:
        loss = torch.empty(plan.tokens, dtype=_F32, device=plan.device)
        lse = torch.empty_like(loss)  # parses fewer arguments than torch.empty
        extras = ((torch.empty_like(loss) if low else None,) if not (entropy or argmax)
                  else _extras(plan.tokens, plan.device, low, entropy, argmax))
        if plan.bundle is None:
            _poisoned_extras(extras[:1])
            return (_poisoned(loss), _poisoned(lse)) + tuple(
                t for t in extras if t is not None)
        if _poison:
            _poisoned(loss)
            _poisoned(lse)
            _poisoned_extras(extras[:1])
    descs = plan.descs
    descs[0].data = logits.data_ptr()
    descs[1].data = labels.data_ptr()
    descs[2].data = loss.data_ptr()
    descs[3].data = lse.data_ptr()
    _set_extras(plan, extras)
    _launch_plan(plan, "cegen forward", poll=True)
    return (loss, lse) + tuple(t for t in extras if t is not None)


def _poisoned(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if _poison and tensor is not None:
        tensor.fill_(float("nan"))
    return tensor


def backward(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
             grad_loss: torch.Tensor, options: KernelOptions,
             overwrite: bool, checked: bool = False,
             lse_low: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """The gradient w.r.t. the logits for the upstream per-token ``grad_loss``.

    ``lse_low`` (optional, fp32, the labels' shape): lse's low part, as :func:`forward`
    with ``low`` returns it; with it the gradient's error does not grow with the logits'
    magnitude (without it, ``|lse|`` times 2^-24 in every exponent).

    ``grad_loss`` may have any strides, 0 included (``loss.sum()``'s gradient); it is
    described as is. With ``overwrite`` the gradient is written over ``logits`` and None
    is returned; the caller has checked that the logits may be overwritten. ``checked``:
    the tensors are a forward's (``lse`` the forward's own), checked then, and
    ``grad_loss`` comes from autograd, which checks its shape and device (host time: the
    plan's key then leaves those out).
    """
    try:
        if checked:
            key: Optional[Tuple[Any, ...]] = (
                "backward, checked", options, overwrite, logits.dtype, logits.shape,
                logits.stride(), logits.device, labels.dtype, labels.stride(), lse.stride(),
                grad_loss.dtype, grad_loss.stride(),
                None if lse_low is None else lse_low.stride())
        else:
            key = ("backward", options, overwrite, logits.dtype, logits.shape,
                   logits.stride(), logits.device, labels.dtype, labels.shape,
                   labels.stride(), labels.device, lse.dtype, lse.shape, lse.stride(),
                   lse.device, grad_loss.dtype, grad_loss.shape, grad_loss.stride(),
                   grad_loss.device) + (
                       (None,) if lse_low is None else
                       (lse_low.dtype, lse_low.shape, lse_low.stride(), lse_low.device))
    except Exception:  # not tensors (the checks below say so), or no strides
        key = None
    plans = _plans.thread_plans()
    plan = _plan_for(plans, key)
    if plan is None:
        if checked:
            tokens = token_shape(logits.shape, options.label_layout)
        else:
            tokens = check_inputs(logits, labels, options)
            _check_token_tensor(lse, "lse", tokens, logits.device)
            _check_token_tensor(grad_loss, "grad_loss", tokens, logits.device)
            if lse.dtype != torch.float32:
                raise InvalidInputError(f"lse must be float32, got {lse.dtype}")
            if lse_low is not None:
                _check_token_tensor(lse_low, "lse_low", tokens, logits.device)
                if lse_low.dtype != torch.float32:
                    raise InvalidInputError(f"lse_low must be float32, got {lse_low.dtype}")
        if grad_loss.dtype != torch.float32:
            grad_loss = grad_loss.float()  # the kernels read an fp32 upstream gradient
        plan = _new_plan(plans, key, tokens, logits)
        grad = None if overwrite else _empty_like(logits)
        if lse.numel() == 0:
            return grad
        bundle, runtime_options = _launch("backward", logits, labels, options, plan.where,
                                          overwrite=overwrite)
        plan.set_launch(bundle, runtime_options, "ce_backward", (
            describe(logits, "logits"), describe(labels, "labels"), describe(lse, "lse"),
            describe(grad_loss, "grad_loss"), None if grad is None else describe(grad, "grad")),
            None if lse_low is None else describe(lse_low, "lse_low"))
    else:
        if grad_loss.dtype != torch.float32:
            grad_loss = grad_loss.float()  # strides as the plan's: the key holds the input's
        grad = None if overwrite else torch.empty_like(logits)
        if plan.bundle is None:
            return _poisoned(grad)
        if _poison and grad is not None:
            grad.fill_(float("nan"))
    descs = plan.descs
    descs[0].data = logits.data_ptr()
    descs[1].data = labels.data_ptr()
    descs[2].data = lse.data_ptr()
    descs[3].data = grad_loss.data_ptr()
    if grad is not None:
        descs[4].data = grad.data_ptr()
    if lse_low is not None:
        plan.low_desc.data = lse_low.data_ptr()
    _launch_plan(plan, "cegen backward", poll=False)
    return grad


def fused(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
          options: KernelOptions, overwrite: bool, checked: bool = False,
          low: bool = False, entropy: bool = False,
          argmax: bool = False) -> Tuple[Optional[torch.Tensor], ...]:
    """Loss, lse and the gradient ``weights_t * dloss_t/dlogits`` in one kernel (and,
    each where asked for, lse's low part, the entropy and the argmax last, as
    :func:`forward` returns them).

    ``weights`` is a 0-dim fp32 tensor (one weight for every token) or a per-token fp32
    tensor of the labels' shape with any strides. With ``overwrite`` the gradient is
    written over ``logits`` and None is returned in its place. The inputs are checked
    once per call shape (``checked`` as for :func:`forward`).
    """
    if options.shard is not None:
        _refuse_shard(options, "the fused forward+backward")
    try:
        key: Optional[Tuple[Any, ...]] = (
            "fused", options, overwrite, low, entropy, argmax, logits.dtype, logits.shape,
            logits.stride(),
            logits.device, labels.dtype, labels.shape, labels.stride(), labels.device,
            weights.dtype, weights.shape, weights.stride(), weights.device)
    except Exception:  # not tensors (the checks below say so), or no strides
        key = None
    plans = _plans.thread_plans()
    plan = _plan_for(plans, key)
    if plan is None:
        tokens = check_inputs(logits, labels, options)
        if weights.dim() == 0:
            kind = "scalar"
            if weights.device != logits.device:
                raise InvalidInputError(
                    f"weights are on {weights.device} but logits are on {logits.device}")
        else:
            kind = "token"
            _check_token_tensor(weights, "grad_weights", tokens, logits.device)
        if weights.dtype != torch.float32:
            weights = weights.float()
        plan = _new_plan(plans, key, tokens, logits)
        loss = _empty(tokens, _F32, plan.device)
        lse = _empty(tokens, _F32, plan.device)
        extras = _extras(tokens, plan.device, low, entropy, argmax)
        grad = None if overwrite else _empty_like(logits)
        if loss.numel() == 0:
            return (loss, lse, grad) + tuple(t for t in extras if t is not None)
        bundle, runtime_options = _launch("fused", logits, labels, options, plan.where,
                                          overwrite=overwrite, weights=kind)
        plan.set_launch(bundle, runtime_options, "ce_fused", (
            describe(logits, "logits"), describe(labels, "labels"),
            describe(weights, "grad_weights"), describe(loss, "loss"), describe(lse, "lse"),
            None if grad is None else describe(grad, "grad")), *_described_extras(extras))
    else:
        if weights.dtype != torch.float32:
            weights = weights.float()  # strides as the plan's: the key holds the input's
        loss = torch.empty(plan.tokens, dtype=_F32, device=plan.device)
        lse = torch.empty_like(loss)  # parses fewer arguments than torch.empty
        extras = ((torch.empty_like(loss) if low else None,) if not (entropy or argmax)
                  else _extras(plan.tokens, plan.device, low, entropy, argmax))
        grad = None if overwrite else torch.empty_like(logits)
        if plan.bundle is None:
            _poisoned_extras(extras[:1])
            return (_poisoned(loss), _poisoned(lse), _poisoned(grad)) + tuple(
                t for t in extras if t is not None)
        if _poison:
            for tensor in (loss, lse, grad):
                _poisoned(tensor)
            _poisoned_extras(extras[:1])
    descs = plan.descs
    descs[0].data = logits.data_ptr()
    descs[1].data = labels.data_ptr()
    descs[2].data = weights.data_ptr()
    descs[3].data = loss.data_ptr()
    descs[4].data = lse.data_ptr()
    if grad is not None:
        descs[5].data = grad.data_ptr()
    _set_extras(plan, extras)
    _launch_plan(plan, "cegen fused forward+backward", poll=True)
    return (loss, lse, grad) + tuple(t for t in extras if t is not None)


def shard_stats(logits: torch.Tensor, labels: torch.Tensor, options: KernelOptions,
                out: Optional[torch.Tensor] = None, entropy: Optional[torch.Tensor] = None,
                argmax: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The partial statistics of the vocabulary slice ``options.shard`` (``ce_shard_stats``).

    Returns (or fills ``out``, any strides) an fp32 tensor of the labels' shape followed
    by 4: per token the slice's max ``m``, ``sum_j exp(x_j - m) - 1``, the target logit
    when the label falls in the slice (0 elsewhere or when ignored; for a label outside
    ``[0, vocab)`` NaN, or 0 with ``label_out_of_range="megatron"``), and the slice's row
    sum with label smoothing (else 0). ``entropy`` (fp32) and ``argmax`` (int64), token
    shaped, any strides, get the slice's entropy of softmax(z) and the global id of its
    largest z (-1 for a NaN) where given.
    ``options.z_loss`` must be 0: the z-loss applies to the combined log-sum-exp.
    """
    if options.shard is None:
        raise InvalidInputError("shard_stats needs options.shard (the logits' vocabulary slice)")
    if options.z_loss != 0.0:
        raise InvalidInputError("shard_stats takes no z_loss: it applies after the combine")
    tokens = check_inputs(logits, labels, options)
    shape = tokens + (4,)
    if out is None:
        out = _empty(shape, torch.float32, logits.device)
    else:
        if tuple(out.shape) != shape or out.dtype != torch.float32:
            raise InvalidInputError(
                f"out must be float32 of shape {shape}, got {out.dtype} {tuple(out.shape)}")
        if out.device != logits.device:
            raise InvalidInputError(f"out is on {out.device} but logits are on {logits.device}")
        if _poison:
            out.fill_(float("nan"))
    if out.numel() == 0:
        return out
    where = _device_of(logits, "logits")
    bundle, runtime_options = _launch("shard_stats", logits, labels, options, where)
    outputs = (("entropy", entropy), ("argmax", argmax))
    descs = {name: describe(tensor, name) for name, tensor in outputs if tensor is not None}
    if descs:
        # The shared options struct of this variant is not changed: a copy points at the
        # outputs' descriptors (kept alive until the call returns).
        own = type(runtime_options)()
        ctypes.memmove(ctypes.addressof(own), ctypes.addressof(runtime_options),
                       ctypes.sizeof(own))
        for name, desc in descs.items():
            setattr(own, name, ctypes.addressof(desc))
        runtime_options = own
    stream = _stream_at(where)
    _poll_labels(logits.device, bundle.runtime, where, stream)
    bundle.runtime.shard_stats(
        bundle, runtime_options, describe(logits, "logits"), describe(labels, "labels"),
        describe(out, "stats"), stream,
    )
    return out
