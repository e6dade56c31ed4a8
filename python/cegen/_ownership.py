"""May the gradient be written over the logits? The overwrite-input ownership check.

Writing the gradient into the logits' storage saves one ``N*V`` allocation, but anything
that reads those logits afterwards reads the gradient. ``overwrite_input=True`` is the
caller's promise that nothing will; this module refuses the request whenever it can see
that the promise cannot hold. The logits may be overwritten only when all of these hold:

1. they require grad and are not a leaf: a leaf is the caller's own data (a parameter or
   an input), and its ``.grad`` would alias its values;
2. they are not a view (``_base is None``), are contiguous, start at offset 0 of their
   storage, and the storage holds exactly their elements: no other tensor region lives in
   that memory;
3. no other tensor shares the storage (checked where PyTorch exposes the storage's use
   count, ``torch._C._storage_Use_Count``; PyTorch 1.13 does not);
4. no other Python reference to the logits object exists than those the caller vouches
   for: ``sys.getrefcount`` measured at the API's entry against the count of a temporary
   passed straight in (calibrated at import, so it follows the interpreter's conventions);
5. the operation that produced them did not save them for its own backward (e.g. ``exp``,
   ``softmax``), which would read the gradient instead of its output;
6. not while ``torch.compile`` traces (the Python objects being checked are not the ones
   that run).

What no check can see, autograd still catches: after the gradient is written the logits'
version counter is bumped, so any *other* autograd node that saved the logits fails
loudly ("modified by an inplace operation") instead of computing with the gradient. Plain
Python code that reads the logits through a view taken earlier (on PyTorch without the
storage use count) is the one case left to the caller's promise.

A refused request is not an error: the gradient goes to a fresh buffer and a
:class:`OverwriteRefusedWarning` says why, once per reason.
"""

from __future__ import annotations

import sys
import threading
import warnings
from typing import Dict, Optional, Set, Tuple

import torch

__all__ = [
    "OverwriteRefusedWarning",
    "TEMPORARY_REFCOUNT",
    "overwrite_refusal",
    "grant_overwrite",
    "warn_refused",
    "reset_overwrite_warnings",
    "bump_version",
]


class OverwriteRefusedWarning(UserWarning):
    """``overwrite_input=True`` was not honored; the gradient went to a fresh buffer."""


def _refcount_at_entry(obj: object) -> int:
    return sys.getrefcount(obj)


#: ``sys.getrefcount(logits)`` as the first statement of a function that was handed a
#: temporary (a tensor referenced by nothing else).
TEMPORARY_REFCOUNT: int = _refcount_at_entry(object())

_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _storage_nbytes(tensor: torch.Tensor) -> int:
    if hasattr(tensor, "untyped_storage"):
        return tensor.untyped_storage().nbytes()
    return tensor.storage().nbytes()  # PyTorch < 2.0


def _storage_users(tensor: torch.Tensor) -> Optional[int]:
    """How many tensors (and storage handles) hold the storage, where PyTorch says."""
    if _storage_use_count is None or not hasattr(tensor, "untyped_storage"):
        return None
    try:
        return int(_storage_use_count(tensor.untyped_storage()._cdata))
    except Exception:  # a private API: treat any change of it as "unknown"
        return None


def _expected_storage_users() -> Optional[int]:
    fresh = torch.empty(1)
    return _storage_users(fresh)


_EXPECTED_STORAGE_USERS = _expected_storage_users()


#: The ``_saved_*`` accessors of each autograd node type (PyTorch defines them on the
#: type): ``dir(node)`` on every call was most of the ownership check's host time.
_saved_accessors: Dict[type, Tuple[str, ...]] = {}


def _saved_names(node: object) -> Tuple[str, ...]:
    kind = type(node)
    names = _saved_accessors.get(kind)
    if names is None:
        names = tuple(name for name in dir(kind) if name.startswith("_saved_"))
        _saved_accessors[kind] = names
    own = getattr(node, "__dict__", None)  # a Python node's own attributes, if any
    if own:
        names += tuple(name for name in own if name.startswith("_saved_") and name not in names)
    return names


def _producer_saved_logits(logits: torch.Tensor) -> Optional[str]:
    """The name of the producing autograd node when it saved the logits themselves."""
    node = logits.grad_fn
    if node is None:
        return None
    saved = []
    for name in _saved_names(node):
        try:
            saved.append(getattr(node, name))
        except Exception:  # already freed, or not a tensor accessor
            continue
    saved.extend(getattr(node, "saved_tensors", ()) or ())  # custom autograd.Functions
    pointer = logits.data_ptr()
    for value in saved:
        if isinstance(value, torch.Tensor) and value.numel() > 0 and value.data_ptr() == pointer:
            return type(node).__name__
    return None


_compiling_probe = getattr(getattr(torch, "compiler", None), "is_compiling", None)


def is_compiling() -> bool:
    """Whether torch.compile (dynamo) is tracing the caller."""
    return bool(_compiling_probe()) if _compiling_probe is not None else False


def overwrite_refusal(logits: torch.Tensor, python_refs: int, vouched_refs: int = 0) -> Optional[str]:
    """Why the gradient may not be written over ``logits``, or None when it may.

    Args:
        logits: the logits handed to the loss.
        python_refs: ``sys.getrefcount(logits)`` measured as the first statement of the
            public entry point the caller called.
        vouched_refs: references the caller knows about and vouches for (e.g. Megatron's
            local variable ``logits`` that its loss caller never reads again).
    """
    if is_compiling():
        return "overwrite_input is not honored while torch.compile traces the loss"
    if not logits.requires_grad:
        return None  # no gradient will be written anywhere; nothing to refuse
    if logits.grad_fn is None:
        return ("the logits are a leaf tensor (the caller's own data, e.g. a parameter or an "
                "input); overwriting them would destroy it and alias its .grad")
    if logits._base is not None:
        return "the logits are a view of another tensor"
    if not logits.is_contiguous():
        return "the logits are not contiguous"
    if logits.storage_offset() != 0 or _storage_nbytes(logits) != logits.numel() * logits.element_size():
        return "the logits do not own their whole storage (it holds other data too)"
    users = _storage_users(logits)
    if users is not None and _EXPECTED_STORAGE_USERS is not None and users > _EXPECTED_STORAGE_USERS:
        return "other tensors (views or aliases) share the logits' storage"
    if python_refs > TEMPORARY_REFCOUNT + vouched_refs:
        return ("another Python reference to the logits exists (a variable, container or "
                "attribute still holds them); pass the logits without keeping them, or "
                "delete the other reference first")
    producer = _producer_saved_logits(logits)
    if producer is not None:
        return (f"the operation that produced the logits ({producer}) saved them for its own "
                "backward, which would read the gradient")
    return None


def grant_overwrite(logits: torch.Tensor, overwrite_input: bool, python_refs: int,
                    vouched_refs: int = 0, stacklevel: int = 1) -> bool:
    """Whether a loss entry point writes the gradient over ``logits``.

    True when the caller asked for it, a gradient will be computed and
    :func:`overwrite_refusal` finds nothing against it; a refused request warns once per
    reason (``stacklevel`` as for :func:`warnings.warn` called where this function is
    called: 1 names the caller) and returns False.
    """
    if not (overwrite_input and torch.is_grad_enabled() and logits.requires_grad):
        return False
    reason = overwrite_refusal(logits, python_refs, vouched_refs)
    if reason is None:
        return True
    warn_refused(reason, stacklevel=stacklevel + 2)
    return False


_warned: Set[str] = set()
_warned_lock = threading.Lock()


def warn_refused(reason: str, stacklevel: int = 3) -> None:
    """Warns once per distinct reason that overwrite_input was not honored."""
    with _warned_lock:
        if reason in _warned:
            return
        _warned.add(reason)
    warnings.warn(
        f"cegen: overwrite_input=True not honored, the gradient gets a fresh buffer: {reason}",
        OverwriteRefusedWarning,
        stacklevel=stacklevel,
    )


def reset_overwrite_warnings() -> None:
    """Lets every refusal reason warn again (for tests)."""
    with _warned_lock:
        _warned.clear()


_increment_version = getattr(getattr(torch.autograd, "graph", None), "increment_version", None)


def bump_version(tensor: torch.Tensor) -> None:
    """Marks ``tensor`` as modified in place, so autograd rejects stale saved copies of it."""
    if _increment_version is not None:
        _increment_version(tensor)
        return
    # PyTorch < 2.1: an in-place metadata no-op on an alias that shares the version counter.
    alias = tensor.detach()
    with torch.no_grad():
        alias.as_strided_(alias.size(), alias.stride(), alias.storage_offset())
