"""cegen: fused softmax cross-entropy kernels for PyTorch and Megatron-Core.

Quick start (host kernels, from the source tree with ``PYTHONPATH=python``)::

    import torch, cegen
    logits = torch.randn(2048, 32000, requires_grad=True)
    labels = torch.randint(0, 32000, (2048,))
    loss = cegen.cross_entropy(logits, labels)   # per-token fp32 loss, [2048]
    loss.mean().backward()

Kernels come from bundles written by ``ce-gen``: bundles made ahead of time
(``bundle=`` or ``cegen.configure(bundle_dirs=[...])``), or built by running ``ce-gen`` as
a subprocess into the on-disk cache (``cegen.configure(cache_dir=...)``, default
``~/.cache/cegen``). The runtime library ``libce_runtime.so`` is found next to the
package or in the build tree, or set with :func:`set_runtime_library`.

CUDA tensors run GPU kernels (``ce-gen --target=sm_90`` on an H100/H200) on the current
stream without synchronizing; a label out of range there is reported by a later call or by
:func:`check_labels` (see ``cegen._kernels``).

Under tensor parallelism, logits split over the vocabulary go to
:func:`vocab_parallel_cross_entropy` (one all-reduce of per-token shard statistics in the
forward, none in the backward; see ``cegen.tensor_parallel``).

The output layer and the loss together, so that the logits never exist in full:
:func:`linear_cross_entropy` (``cegen.linear``).
"""

from ._bundle_cache import find_ce_gen
from ._config import Config, configure, get_config, set_runtime_library
from ._errors import (
    BundleError,
    CeGenToolError,
    CegenError,
    InvalidInputError,
    LabelOutOfRangeError,
    RuntimeLibraryError,
    VariantNotFoundError,
)
from ._gradient_status import UnpredictedUpstreamError, ZeroWeightGradientError
from ._kernels import check_labels
from ._library import HAS_CUSTOM_OP
from ._ownership import OverwriteRefusedWarning, reset_overwrite_warnings
from ._runtime import Bundle, get_runtime, runtime_available
from ._variant import VariantKey
from .linear import linear_cross_entropy
from ._outputs import CrossEntropyResult
from .ops import cross_entropy
from .tensor_parallel import combine_shard_stats, vocab_parallel_cross_entropy

__version__ = "0.1.0"

__all__ = [
    "cross_entropy",
    "CrossEntropyResult",
    "linear_cross_entropy",
    "vocab_parallel_cross_entropy",
    "combine_shard_stats",
    "check_labels",
    "configure",
    "get_config",
    "Config",
    "set_runtime_library",
    "get_runtime",
    "runtime_available",
    "find_ce_gen",
    "open_bundle",
    "Bundle",
    "VariantKey",
    "HAS_CUSTOM_OP",
    "CegenError",
    "InvalidInputError",
    "LabelOutOfRangeError",
    "BundleError",
    "VariantNotFoundError",
    "RuntimeLibraryError",
    "CeGenToolError",
    "ZeroWeightGradientError",
    "UnpredictedUpstreamError",
    "OverwriteRefusedWarning",
    "reset_overwrite_warnings",
]


def open_bundle(directory: str) -> Bundle:
    """Opens a bundle made by ``ce-gen`` (to pass as ``bundle=`` or list its variants)."""
    from . import _validate

    return get_runtime().open_bundle(_validate.path("directory", directory).expanduser())
