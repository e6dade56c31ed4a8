"""The rules for the Python API's non-tensor arguments, each written once.

Every entry point (``cross_entropy``, ``vocab_parallel_cross_entropy``,
``linear_cross_entropy``, ``combine_shard_stats``, ``configure``, the Megatron settings)
checks its option values with the functions here, so that a bad value is an
:class:`~cegen.InvalidInputError` (a ``ValueError``) naming the argument, the value and
what is allowed, raised before anything runs: never a bare ``TypeError`` or
``OverflowError`` from deep inside, and never a value that ctypes would wrap or ``ce-gen``
refuse later.

What each kind of value accepts:

* integers (``ignore_index``, a shard's ``start`` and ``vocab``, ``chunk_tokens``,
  ``rank``): a Python ``int``, a NumPy integer, any other ``numbers.Integral``, or a 0-d
  integer tensor (whatever ``operator.index`` takes), returned as an ``int``; never a
  ``bool``, a float (``1.0`` included) or a string; within int64's range
  ``[-2**63, 2**63 - 1]`` (the C API's ``int64_t``), or narrower where the option says.
* real numbers (``label_smoothing``, ``z_loss``, a scalar ``grad_weights``): ``int``,
  ``float``, NumPy numbers, other ``numbers.Real``, or a 0-d real tensor; never a ``bool``
  or a string; checked *after rounding to float32*, which is what the kernels receive
  (so ``label_smoothing=0.99999999``, which rounds to 1, and ``z_loss=1e39``, which
  overflows float32, are refused), and returned rounded.
* flags (``overwrite_input``, ``global_smoothing``, ``run_ce_gen``): ``True`` or
  ``False`` (NumPy's bools too); a string such as ``"false"`` is refused, not taken as
  true.
* paths (``bundle``, the configured directories): a ``str`` or ``os.PathLike``, not
  empty, without NUL characters.
"""

from __future__ import annotations

import math
import numbers
import operator
import os
import struct
from pathlib import Path
from typing import Any, Mapping, Optional, Tuple

from ._errors import InvalidInputError

__all__ = [
    "INT64_MIN",
    "INT64_MAX",
    "F32_MAX",
    "integer",
    "real",
    "real_f32",
    "flag",
    "choice",
    "path",
    "ignore_index",
    "label_smoothing",
    "z_loss",
    "logit_scale",
    "label_layout",
    "label_out_of_range",
    "scalar_grad_weight",
    "bundle",
    "shard_bounds",
]

INT64_MIN = -(2 ** 63)
INT64_MAX = 2 ** 63 - 1
#: The largest finite float32, 3.4028234663852886e38.
F32_MAX = struct.unpack("<f", b"\xff\xff\x7f\x7f")[0]
#: The largest float32 below 1 (label smoothing's upper end after rounding).
_F32_BELOW_ONE = struct.unpack("<f", b"\xff\xff\x7f\x3f")[0]

LABEL_LAYOUTS: Mapping[str, str] = {"bs": "labels [B, S]", "sb": "labels [S, B]"}
#: ``label_out_of_range`` values and what each does with a label outside ``[0, V)`` that is
#: not the ignore_index.
LABEL_POLICIES: Mapping[str, str] = {
    "error": "such a label raises LabelOutOfRangeError",
    "megatron": "Megatron-Core's loss lse - max and softmax gradient for it",
}


def _is_tensor(value: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(value, torch.Tensor)


def _torch() -> Any:
    import sys

    return sys.modules.get("torch")


def _is_bool(value: Any) -> bool:
    kind = type(value)
    if kind is bool or (kind.__module__ == "numpy" and kind.__name__ in ("bool_", "bool")):
        return True  # Python's and NumPy's bools (numpy.bool_, called numpy.bool in 2.x)
    return _is_tensor(value) and value.dtype == _torch().bool


def _describe(value: Any) -> str:
    if _is_tensor(value):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _refuse(name: str, what: str, value: Any, note: str = "") -> InvalidInputError:
    return InvalidInputError(f"{name} must be {what}, got {_describe(value)}{note}")


def _range_text(low: Optional[int], high: Optional[int]) -> str:
    return f"[{INT64_MIN if low is None else low}, {INT64_MAX if high is None else high}]"


def integer(name: str, value: Any, low: Optional[int] = None, high: Optional[int] = None,
            *, allow_none: bool = False) -> Optional[int]:
    """``value`` as an ``int`` in ``[low, high]`` (default: int64's range); None passes
    when ``allow_none``."""
    low = INT64_MIN if low is None else max(low, INT64_MIN)
    high = INT64_MAX if high is None else min(high, INT64_MAX)
    what = f"an integer in {_range_text(low, high)}" + (" or None" if allow_none else "")
    if value is None and allow_none:
        return None
    if value is None or _is_bool(value) or isinstance(value, (str, bytes)):
        raise _refuse(name, what, value)
    if _is_tensor(value) and value.dim() != 0:
        raise _refuse(name, what, value)
    try:
        number = operator.index(value)
    except TypeError:
        raise _refuse(name, what, value) from None
    if not low <= number <= high:
        raise _refuse(name, what, value)
    return number


def _to_f32(value: float) -> Optional[float]:
    """``value`` rounded to float32, None when it overflows."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return None


def _real(name: str, value: Any, what: str) -> float:
    if value is None or _is_bool(value) or isinstance(value, (str, bytes)):
        raise _refuse(name, what, value)
    if _is_tensor(value):
        if value.dim() != 0 or value.is_complex():
            raise _refuse(name, what, value)
        return float(value)
    if not isinstance(value, numbers.Real):
        raise _refuse(name, what, value)
    try:
        return float(value)
    except (OverflowError, ValueError):  # an int or Fraction too large for a float
        raise _refuse(name, what, value) from None


def real(name: str, value: Any, low: float, high: float, *, low_open: bool = False,
         what: Optional[str] = None) -> float:
    """``value`` as a float in ``[low, high]`` (``(low, high]`` with ``low_open``)."""
    if what is None:
        what = f"a real number in {'(' if low_open else '['}{low:g}, {high:g}]"
    number = _real(name, value, what)
    if not (low < number if low_open else low <= number) or not number <= high:
        raise _refuse(name, what, value)
    return number


def real_f32(name: str, value: Any, low: float, high: float, *, high_open: bool = False,
             what: Optional[str] = None) -> float:
    """``value`` rounded to float32, in ``[low, high]`` (``[low, high)`` with
    ``high_open``) after the rounding."""
    if what is None:
        closing = ")" if high_open else "]"
        what = f"a real number in [{low:g}, {high:g}{closing}"
    number = _real(name, value, what)
    rounded = _to_f32(number) if math.isfinite(number) else None
    if rounded is None or rounded < low or rounded > high or (high_open and rounded == high):
        note = ""
        if rounded is not None and number != rounded and low <= number < high:
            note = f", which rounds to {rounded:.9g} in float32"
        raise _refuse(name, what, value, note)
    return rounded


def flag(name: str, value: Any) -> bool:
    """``value`` as a ``bool``: only True or False (NumPy's too) are accepted."""
    if not _is_bool(value) or _is_tensor(value):
        raise _refuse(name, "True or False", value)
    return bool(value)


def choice(name: str, value: Any, choices: Mapping[str, str]) -> str:
    """``value`` when it is one of ``choices`` (value -> what it means)."""
    if not isinstance(value, str) or value not in choices:
        listed = " or ".join(f"{key!r} ({meaning})" for key, meaning in choices.items())
        raise _refuse(name, listed, value)
    return value


def path(name: str, value: Any, *, allow_none: bool = False) -> Optional[Path]:
    """``value`` as a ``Path``: a non-empty ``str`` or ``os.PathLike`` without NUL."""
    what = "a path (str or os.PathLike)" + (" or None" if allow_none else "")
    if value is None and allow_none:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise _refuse(name, what, value)
    text = os.fspath(value)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if text == "" or "\0" in text:
        raise _refuse(name, what + ", not empty and without NUL characters", value)
    return Path(text)


# -- the options of the loss functions, each defined once ---------------------------------


def ignore_index(value: Any) -> Optional[int]:
    """Labels equal to it get loss 0 and a zero gradient row; None: none."""
    return integer("ignore_index", value, allow_none=True)


def label_smoothing(value: Any) -> float:
    """Alpha of Megatron's smoothing formula, in [0, 1) after rounding to float32."""
    return real_f32("label_smoothing", value, 0.0, 1.0, high_open=True,
                    what=f"a real number in [0, 1) (at most {_F32_BELOW_ONE:.9g} in float32)")


def z_loss(value: Any) -> float:
    """The coefficient of ``z * lse^2``: finite, >= 0, representable in float32."""
    return real_f32("z_loss", value, 0.0, F32_MAX,
                    what=f"a finite real number in [0, {F32_MAX:.9g}] (the largest float32)")


#: The smallest positive float32 (a subnormal), 2^-149.
_F32_TINY = struct.unpack("<f", b"\x01\x00\x00\x00")[0]


def logit_scale(value: Any) -> float:
    """The logit scale s (every logit x is taken as ``z = s * x``): finite, > 0,
    representable in float32 (a value that rounds to 0 is refused)."""
    return real_f32("logit_scale", value, _F32_TINY, F32_MAX,
                    what=f"a finite real number > 0 and at most {F32_MAX:.9g} (the largest "
                         "float32)")


def logit_softcap(value: Any) -> float:
    """The logit softcap (every logit is ``z = cap * tanh(s * x / cap)``): None for none
    (returned as 0.0), else finite, > 0, representable in float32."""
    if value is None:
        return 0.0
    return real_f32("logit_softcap", value, _F32_TINY, F32_MAX,
                    what=f"None (no softcap) or a finite real number > 0 and at most "
                         f"{F32_MAX:.9g} (the largest float32)")


def label_layout(value: Any) -> str:
    """``"bs"`` or ``"sb"``: the labels' layout for ``[S, B, V]`` logits."""
    return choice("label_layout", value, LABEL_LAYOUTS)


def label_out_of_range(value: Any) -> str:
    """``"error"`` or ``"megatron"``."""
    return choice("label_out_of_range", value, LABEL_POLICIES)


def scalar_grad_weight(value: Any) -> float:
    """A number given as ``grad_weights``: every token's upstream gradient, finite in
    float32."""
    return real_f32("grad_weights", value, -F32_MAX, F32_MAX,
                    what=f"a finite real number in float32's range [-{F32_MAX:.9g}, "
                         f"{F32_MAX:.9g}] or a floating-point tensor")


def bundle(value: Any) -> Optional[str]:
    """``bundle=``: None, a bundle directory, or a :class:`cegen.Bundle` (its directory)."""
    from ._runtime import Bundle  # here: _runtime imports _config, which imports this

    if value is None:
        return None
    if isinstance(value, Bundle):
        return str(value.path)
    checked = path("bundle", value)
    if checked is None:  # pragma: no cover - path() returns None only with allow_none
        raise _refuse("bundle", "a bundle directory or a cegen Bundle", value)
    return str(checked)


def shard_bounds(start: Any, vocab: Any) -> Tuple[int, int]:
    """A vocabulary slice's ``start`` in ``[0, vocab)`` and ``vocab`` >= 1."""
    vocab = integer("shard vocab", vocab, 1)
    start = integer("shard start", start, 0, vocab - 1)
    return start, vocab  # type: ignore[return-value]
