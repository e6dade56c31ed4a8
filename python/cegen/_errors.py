"""Exceptions raised by cegen's Python API.

Every failure of the runtime's C API arrives as a :class:`CegenError` carrying the
``ce_status`` and the runtime's message. Bad input (shapes, strides, dtypes, devices,
option values, labels out of range) is also a :class:`ValueError`, so callers that only
know the Python convention can catch it as such.
"""

from __future__ import annotations

from typing import Optional

__all__ = [
    "CegenError",
    "InvalidInputError",
    "LabelOutOfRangeError",
    "BundleError",
    "VariantNotFoundError",
    "RuntimeLibraryError",
    "CeGenToolError",
]


class CegenError(RuntimeError):
    """A failure reported by the cegen runtime or the kernel cache.

    Attributes:
        status: the ``ce_status`` code from ``ce_runtime.h`` (0 when the error was
            found on the Python side before any runtime call).
        status_name: the runtime's name for ``status`` (``ce_status_string``).
    """

    def __init__(self, message: str, status: int = 0, status_name: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.status_name = status_name


class InvalidInputError(CegenError, ValueError):
    """Wrong shapes, strides, dtypes, devices or option values (``CE_ERROR_INVALID_ARGUMENT``)."""


class LabelOutOfRangeError(InvalidInputError):
    """A label outside ``[0, V)`` that is not the ignore_index (``CE_ERROR_LABEL_OUT_OF_RANGE``)."""


class BundleError(CegenError):
    """A bundle directory is missing, truncated, corrupt or too new (``CE_ERROR_BUNDLE``)."""


class VariantNotFoundError(CegenError):
    """No kernel for the requested variant key (``CE_ERROR_VARIANT_NOT_FOUND``)."""


class RuntimeLibraryError(CegenError):
    """``libce_runtime.so`` could not be found or loaded."""


class CeGenToolError(CegenError):
    """``ce-gen`` could not be found, or it failed to build a requested kernel."""
