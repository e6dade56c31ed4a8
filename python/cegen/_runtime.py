"""ctypes binding of the runtime's C API (``runtime/include/ce/runtime/ce_runtime.h``).

This module knows nothing of PyTorch: it takes raw tensor descriptors
(:class:`TensorDesc`) and turns every non-OK ``ce_status`` into a :class:`CegenError`
subclass carrying ``ce_last_error_message()``. The runtime links neither MLIR nor LLVM,
so loading it keeps the trainer's process free of a second LLVM.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type

from . import _config
from ._errors import (
    BundleError,
    CegenError,
    InvalidInputError,
    LabelOutOfRangeError,
    RuntimeLibraryError,
    VariantNotFoundError,
)

__all__ = [
    "CE_MAX_RANK",
    "DType",
    "Device",
    "LabelLayout",
    "LabelPolicy",
    "TensorDesc",
    "Options",
    "Runtime",
    "Bundle",
    "get_runtime",
]

CE_MAX_RANK = 3
CE_RUNTIME_BUNDLE_VERSION = 5


class Status:
    """``ce_status`` values."""

    OK = 0
    INVALID_ARGUMENT = 1
    BUNDLE = 2
    VARIANT_NOT_FOUND = 3
    LABEL_OUT_OF_RANGE = 4
    NO_DEVICE = 5
    BACKEND = 6


class DType:
    """``ce_dtype`` values."""

    BF16 = 0
    F16 = 1
    F32 = 2
    I32 = 3
    I64 = 4


class Device:
    """``ce_device_type`` values."""

    HOST = 0
    CUDA = 1
    HIP = 2


class LabelLayout:
    """``ce_label_layout`` values."""

    BS = 0
    SB = 1


class LabelPolicy:
    """``ce_label_policy`` values (``ce_options.label_policy``, a run-time value): what a
    label outside ``[0, V)`` (``[0, shard_vocab)`` for a slice) that is not the
    ignore_index does."""

    #: ``CE_LABEL_POLICY_STRICT``: NaN loss and gradient row, ``CE_ERROR_LABEL_OUT_OF_RANGE``.
    STRICT = 0
    #: ``CE_LABEL_POLICY_MEGATRON``: Megatron-Core's semantics, the row maximum stands in
    #: for the target logit (loss ``lse - max``, gradient ``softmax``), no error.
    MEGATRON = 1


_STATUS_ERRORS: Dict[int, Type[CegenError]] = {
    Status.INVALID_ARGUMENT: InvalidInputError,
    Status.BUNDLE: BundleError,
    Status.VARIANT_NOT_FOUND: VariantNotFoundError,
    Status.LABEL_OUT_OF_RANGE: LabelOutOfRangeError,
}


class TensorDesc(ctypes.Structure):
    """``ce_tensor``: a strided view; strides in elements, 0 allowed for read-only inputs."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int),
        ("ndim", ctypes.c_int32),
        ("sizes", ctypes.c_int64 * CE_MAX_RANK),
        ("strides", ctypes.c_int64 * CE_MAX_RANK),
        ("device", ctypes.c_int),
        ("device_index", ctypes.c_int32),
    ]

    @classmethod
    def make(
        cls,
        data: int,
        dtype: int,
        sizes: Sequence[int],
        strides: Sequence[int],
        device: int = Device.HOST,
        device_index: int = 0,
    ) -> "TensorDesc":
        """Builds a descriptor; ``sizes`` and ``strides`` have the tensor's rank (<= 3)."""
        if len(sizes) != len(strides) or len(sizes) > CE_MAX_RANK:
            raise InvalidInputError(
                f"a tensor of rank {len(sizes)} cannot be described (at most {CE_MAX_RANK})"
            )
        desc = cls()
        desc.data = data
        desc.dtype = dtype
        desc.ndim = len(sizes)
        for index, (size, stride) in enumerate(zip(sizes, strides)):
            desc.sizes[index] = size
            desc.strides[index] = stride
        desc.device = device
        desc.device_index = device_index
        return desc


class Options(ctypes.Structure):
    """``ce_options``; fill with :meth:`Runtime.default_options`."""

    _fields_ = [
        ("has_ignore_index", ctypes.c_int32),
        ("ignore_index", ctypes.c_int64),
        ("label_smoothing", ctypes.c_float),
        ("z_loss", ctypes.c_float),
        ("overwrite_input", ctypes.c_int32),
        ("label_layout", ctypes.c_int),
        ("shard_start", ctypes.c_int64),
        ("shard_vocab", ctypes.c_int64),
        ("shard_global_smoothing", ctypes.c_int32),
        ("label_policy", ctypes.c_int),
        # const struct ce_tensor *: lse's low part (NULL: none). A void pointer so
        # that a plan points it at a descriptor it keeps (cegen._plans).
        ("lse_low", ctypes.c_void_p),
        # z = logit_scale * x before the softmax (1: none).
        ("logit_scale", ctypes.c_float),
        # z = logit_softcap * tanh(logit_scale * x / logit_softcap) (0: none); a cap selects
        # the softcap=on kernels.
        ("logit_softcap", ctypes.c_float),
        # Optional outputs of forward and fused (NULL: not computed).
        ("entropy", ctypes.c_void_p),
        ("argmax", ctypes.c_void_p),
    ]


_TensorPtr = ctypes.POINTER(TensorDesc)
_OptionsPtr = ctypes.POINTER(Options)


def _declare(lib: ctypes.CDLL) -> None:
    """Declares the C signatures so ctypes converts arguments and results correctly."""
    status = ctypes.c_int
    handle = ctypes.c_void_p
    lib.ce_options_init.argtypes = [_OptionsPtr]
    lib.ce_options_init.restype = None
    lib.ce_bundle_open.argtypes = [ctypes.c_char_p, ctypes.POINTER(handle)]
    lib.ce_bundle_open.restype = status
    lib.ce_bundle_close.argtypes = [handle]
    lib.ce_bundle_close.restype = None
    lib.ce_bundle_num_kernels.argtypes = [handle]
    lib.ce_bundle_num_kernels.restype = ctypes.c_int64
    lib.ce_bundle_kernel_key.argtypes = [handle, ctypes.c_int64]
    lib.ce_bundle_kernel_key.restype = ctypes.c_char_p
    lib.ce_bundle_kernel_target.argtypes = [handle, ctypes.c_int64]
    lib.ce_bundle_kernel_target.restype = ctypes.c_char_p
    lib.ce_forward.argtypes = [handle, _OptionsPtr] + [_TensorPtr] * 4 + [ctypes.c_void_p]
    lib.ce_forward.restype = status
    lib.ce_backward.argtypes = [handle, _OptionsPtr] + [_TensorPtr] * 5 + [ctypes.c_void_p]
    lib.ce_backward.restype = status
    lib.ce_fused.argtypes = [handle, _OptionsPtr] + [_TensorPtr] * 6 + [ctypes.c_void_p]
    lib.ce_fused.restype = status
    lib.ce_shard_stats.argtypes = [handle, _OptionsPtr] + [_TensorPtr] * 3 + [ctypes.c_void_p]
    lib.ce_shard_stats.restype = status
    if hasattr(lib, "ce_rescale"):  # a runtime older than the rescale kernel lacks it
        lib.ce_rescale.argtypes = [handle, _OptionsPtr] + [_TensorPtr] * 3 + [ctypes.c_void_p]
        lib.ce_rescale.restype = status
    lib.ce_check_label_status.argtypes = [ctypes.c_int, ctypes.c_int32, ctypes.c_void_p,
                                          ctypes.c_int32]
    lib.ce_check_label_status.restype = status
    lib.ce_last_error_message.argtypes = []
    lib.ce_last_error_message.restype = ctypes.c_char_p
    lib.ce_status_string.argtypes = [status]
    lib.ce_status_string.restype = ctypes.c_char_p


def _ref(desc: Optional[TensorDesc]) -> Any:
    # byref: a light reference the POINTER(TensorDesc) argument accepts (pointer() builds
    # a pointer object, a few times the host cost per argument).
    return None if desc is None else ctypes.byref(desc)


class Runtime:
    """A loaded ``libce_runtime.so``."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self._lib = ctypes.CDLL(str(self.path))
        except OSError as error:
            raise RuntimeLibraryError(f"cannot load the cegen runtime {self.path}: {error}") from error
        try:
            _declare(self._lib)
        except AttributeError as error:
            raise RuntimeLibraryError(
                f"{self.path} does not export the cegen C API ({error})"
            ) from error

    # -- errors ---------------------------------------------------------------------------

    def last_error_message(self) -> str:
        """``ce_last_error_message()`` of this thread."""
        message = self._lib.ce_last_error_message()
        return message.decode("utf-8", "replace") if message else ""

    def status_string(self, status: int) -> str:
        """``ce_status_string(status)``."""
        name = self._lib.ce_status_string(status)
        return name.decode("utf-8", "replace") if name else f"status {status}"

    def check(self, status: int, what: str) -> None:
        """Raises the :class:`CegenError` subclass for ``status`` unless it is ``CE_OK``."""
        if status == Status.OK:
            return
        message = self.last_error_message() or "(the runtime gave no message)"
        name = self.status_string(status)
        error_type = _STATUS_ERRORS.get(status, CegenError)
        raise error_type(f"{what}: {message} [{name}]", status=status, status_name=name)

    # -- options and bundles --------------------------------------------------------------

    def default_options(self) -> Options:
        """``ce_options_init``: no ignore_index, no smoothing, no z-loss, [B,S] labels."""
        options = Options()
        self._lib.ce_options_init(ctypes.byref(options))
        return options

    def open_bundle(self, directory: Path) -> "Bundle":
        """Opens the bundle in ``directory`` (``docs/bundle-format.md``)."""
        handle = ctypes.c_void_p()
        status = self._lib.ce_bundle_open(os.fsencode(directory), ctypes.byref(handle))
        self.check(status, f"opening the kernel bundle {directory}")
        return Bundle(self, Path(directory), handle)

    # -- launches -------------------------------------------------------------------------

    def forward(
        self,
        bundle: "Bundle",
        options: Options,
        logits: TensorDesc,
        labels: TensorDesc,
        loss: TensorDesc,
        lse: TensorDesc,
        stream: Optional[int] = None,
    ) -> None:
        """``ce_forward``."""
        status = self._lib.ce_forward(
            bundle.handle, ctypes.byref(options), _ref(logits), _ref(labels), _ref(loss),
            _ref(lse), stream,
        )
        self.check(status, "cegen forward")

    def backward(
        self,
        bundle: "Bundle",
        options: Options,
        logits: TensorDesc,
        labels: TensorDesc,
        lse: TensorDesc,
        grad_loss: TensorDesc,
        grad: Optional[TensorDesc],
        stream: Optional[int] = None,
    ) -> None:
        """``ce_backward``; ``grad`` is None when the gradient overwrites the logits."""
        status = self._lib.ce_backward(
            bundle.handle, ctypes.byref(options), _ref(logits), _ref(labels), _ref(lse),
            _ref(grad_loss), _ref(grad), stream,
        )
        self.check(status, "cegen backward")

    def fused(
        self,
        bundle: "Bundle",
        options: Options,
        logits: TensorDesc,
        labels: TensorDesc,
        weights: TensorDesc,
        loss: TensorDesc,
        lse: TensorDesc,
        grad: Optional[TensorDesc],
        stream: Optional[int] = None,
    ) -> None:
        """``ce_fused``; ``grad`` is None when the gradient overwrites the logits."""
        status = self._lib.ce_fused(
            bundle.handle, ctypes.byref(options), _ref(logits), _ref(labels), _ref(weights),
            _ref(loss), _ref(lse), _ref(grad), stream,
        )
        self.check(status, "cegen fused forward+backward")

    def shard_stats(
        self,
        bundle: "Bundle",
        options: Options,
        logits: TensorDesc,
        labels: TensorDesc,
        stats: TensorDesc,
        stream: Optional[int] = None,
    ) -> None:
        """``ce_shard_stats``: partial statistics of a vocabulary slice."""
        status = self._lib.ce_shard_stats(
            bundle.handle, ctypes.byref(options), _ref(logits), _ref(labels), _ref(stats), stream,
        )
        self.check(status, "cegen shard statistics")

    def has_rescale(self) -> bool:
        """Whether this runtime library exports ``ce_rescale``."""
        return hasattr(self._lib, "ce_rescale")

    def rescale(
        self,
        bundle: "Bundle",
        options: Options,
        grad: TensorDesc,
        weights: TensorDesc,
        grad_loss: TensorDesc,
        stream: Optional[int] = None,
    ) -> None:
        """``ce_rescale``: the fused gradient's rows made those of ``grad_loss``, in place."""
        status = self._lib.ce_rescale(
            bundle.handle, ctypes.byref(options), _ref(grad), _ref(weights), _ref(grad_loss),
            stream,
        )
        self.check(status, "cegen fused-gradient rescale")

    def check_label_status(self, device: int, device_index: int, stream: Optional[int],
                           wait: bool) -> None:
        """``ce_check_label_status``: raises :class:`LabelOutOfRangeError` for the first
        unreported GPU launch on ``stream`` whose kernel met a bad label.

        With ``wait`` the stream is synchronized first; without, the call never blocks and
        sees the kernels that have finished.
        """
        status = self._lib.ce_check_label_status(device, device_index, stream, 1 if wait else 0)
        self.check(status, "cegen label check")


class Bundle:
    """An open kernel bundle; closed when garbage-collected or by :meth:`close`."""

    def __init__(self, runtime: Runtime, path: Path, handle: ctypes.c_void_p):
        self.runtime = runtime
        self.path = path
        self.handle = handle
        self._kernels: Optional[List[Tuple[str, str]]] = None
        self._kernel_set: set = set()

    def kernels(self) -> List[Tuple[str, str]]:
        """(variant key, target) of every kernel in this bundle, in manifest order."""
        if self._kernels is None:
            lib = self.runtime._lib
            count = lib.ce_bundle_num_kernels(self.handle)
            kernels = []
            for index in range(count):
                key = lib.ce_bundle_kernel_key(self.handle, index)
                target = lib.ce_bundle_kernel_target(self.handle, index)
                kernels.append((key.decode("utf-8", "replace") if key else "",
                                target.decode("utf-8", "replace") if target else ""))
            self._kernels = kernels
            self._kernel_set = set(kernels)
        return list(self._kernels)

    def keys(self, target: Optional[str] = None) -> List[str]:
        """The variant keys of the kernels for ``target`` (all targets: None), in order."""
        keys = [key for key, kernel_target in self.kernels()
                if target is None or kernel_target == target]
        return list(dict.fromkeys(keys))

    def targets(self) -> List[str]:
        """The targets this bundle has kernels for ("host", "sm_90", "gfx942", ...)."""
        return list(dict.fromkeys(target for _, target in self.kernels()))

    def has(self, key: object, target: str) -> bool:
        """Whether the bundle serves variant ``key`` for ``target``: holds its kernel, or for
        a :class:`VariantKey` one that serves it too (``VariantKey.serving_keys``, the
        runtime's own fallback)."""
        if self._kernels is None:
            self.kernels()
        serving = getattr(key, "serving_keys", None)
        candidates = serving() if serving is not None else [key]
        return any((str(candidate), target) in self._kernel_set for candidate in candidates)

    def __contains__(self, key: object) -> bool:
        return str(key) in self.keys()

    def close(self) -> None:
        """Releases the bundle (its kernels must not be launched afterwards)."""
        if self.handle:
            self.runtime._lib.ce_bundle_close(self.handle)
            self.handle = ctypes.c_void_p()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown may have torn ctypes down already
            pass

    def __repr__(self) -> str:
        return f"Bundle({str(self.path)!r})"


_runtime_lock = threading.Lock()
_runtime: Optional[Runtime] = None


def get_runtime() -> Runtime:
    """Loads the runtime library once: the configured path, next to the package, or build/."""
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            candidates = _config.runtime_library_candidates()
            path = _config.find_first(candidates)
            if path is None:
                looked = "\n  ".join(str(c) for c in candidates)
                raise RuntimeLibraryError(
                    f"cannot find {_config.RUNTIME_LIBRARY_NAME}; looked at:\n  {looked}\n"
                    "build the runtime (cmake --build build) or call "
                    "cegen.set_runtime_library(path)"
                )
            _runtime = Runtime(path)
        return _runtime


def runtime_available() -> bool:
    """Whether :func:`get_runtime` would find and load a runtime library."""
    try:
        get_runtime()
    except RuntimeLibraryError:
        return False
    return True


def _forget_runtime(old: _config.Config, new: _config.Config) -> None:
    global _runtime
    if (old.runtime_library, old.build_dir) != (new.runtime_library, new.build_dir):
        with _runtime_lock:
            _runtime = None


_config.add_config_listener(_forget_runtime)
