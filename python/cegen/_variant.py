"""Kernel variant keys, spelled exactly as ``ce::KernelVariantKey::str()`` spells them.

``runtime/include/ce/runtime/VariantKey.h`` is the reference; ``docs/bundle-format.md``
documents the fields (bundle format version 3 and later). Python needs the same string to tell
which bundle holds a kernel and to ask ``ce-gen`` for a missing one. Option values
(ignore_index, the smoothing and z-loss coefficients, a shard's bounds and how it smooths)
are kernel arguments, not part of a key: a key says only whether smoothing and z-loss are
computed. Every backward and shard_stats kernel takes a vocabulary slice (an unsharded
backward is the slice [0, V) of V); a fused kernel's weights are per-token (a scalar weight
is passed with stride 0).
"""

from __future__ import annotations

import dataclasses
import struct
from typing import List

from . import _validate

__all__ = ["VariantKey", "format_f32", "rescale_key", "to_f32"]

OPS = ("forward", "backward", "fused", "shard_stats", "rescale")
LOGITS_TYPES = ("bf16", "f16", "f32")
LABEL_TYPES = ("i32", "i64")
LAYOUTS = ("flat", "sbv_bs", "sbv_sb")
WEIGHTS = ("none", "token")


def to_f32(value: float) -> float:
    """Rounds a Python float to the nearest f32, as the C API's ``float`` fields do."""
    return struct.unpack("<f", struct.pack("<f", float(value)))[0]


def format_f32(value: float) -> str:
    """Prints an f32 with ``%.9g``, which reads back to the same bits (``formatF32``)."""
    return "%.9g" % to_f32(value)


@dataclasses.dataclass(frozen=True)
class VariantKey:
    """Everything that selects one compiled kernel (shapes, strides and option values do not).

    Field values use the manifest's spelling, e.g. ``logits="bf16"``, ``layout="sbv_bs"``;
    ``label_smoothing`` and ``z_loss`` say whether the kernel computes the term.
    """

    op: str
    logits: str
    labels: str
    layout: str
    label_smoothing: bool = False
    z_loss: bool = False
    overwrite: bool = False
    weights: str = "none"
    #: Logit softcap kernels (issue 17): spelled ``,softcap=on`` last, left out when off.
    softcap: bool = False

    def __post_init__(self) -> None:
        for name in ("label_smoothing", "z_loss", "overwrite", "softcap"):
            object.__setattr__(self, name, _validate.flag(name, getattr(self, name)))
        for name, allowed in (
            ("op", OPS),
            ("logits", LOGITS_TYPES),
            ("labels", LABEL_TYPES),
            ("layout", LAYOUTS),
            ("weights", WEIGHTS),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"variant key field {name}={value!r}: expected one of {allowed}")
        if self.op == "rescale":
            if (self.labels, self.label_smoothing, self.z_loss, self.overwrite,
                    self.weights, self.softcap) != ("i64", False, False, True, "token", False):
                raise ValueError(
                    "variant key: op='rescale' has labels=i64, label_smoothing=off, "
                    "z_loss=off, overwrite=1, weights=token (it reads no labels and "
                    f"rescales in place), got {self}")
            return
        if (self.op == "fused") != (self.weights != "none"):
            raise ValueError(
                f"variant key: weights={self.weights!r} does not fit op={self.op!r} "
                "(fused kernels take token weights, the others none)"
            )
        if self.op in ("forward", "shard_stats") and self.overwrite:
            raise ValueError(f"variant key: a {self.op} kernel writes no gradient to overwrite with")
        if self.op == "shard_stats" and self.z_loss:
            raise ValueError("variant key: shard_stats kernels have no z-loss (it applies "
                             "after the shards' statistics are combined)")

    def __str__(self) -> str:
        return (
            f"op={self.op},logits={self.logits},labels={self.labels},layout={self.layout},"
            f"label_smoothing={'on' if self.label_smoothing else 'off'},"
            f"z_loss={'on' if self.z_loss else 'off'},overwrite={1 if self.overwrite else 0},"
            f"weights={self.weights}"
            + (",softcap=on" if self.softcap else "")
        )

    def serving_keys(self) -> List["VariantKey"]:
        """This key, then the keys whose kernels serve it too, in the runtime's order
        (``findServingKernel``): a coefficient of 0 is also served by a kernel that
        computes smoothing or a z-loss anyway."""
        if self.op == "rescale":
            return [self]
        keys = []
        for extra_smoothing, extra_z in ((False, False), (True, False), (False, True),
                                         (True, True)):
            if (extra_smoothing and self.label_smoothing) or (extra_z and self.z_loss):
                continue
            if extra_z and self.op == "shard_stats":
                continue
            keys.append(dataclasses.replace(self,
                                            label_smoothing=self.label_smoothing or extra_smoothing,
                                            z_loss=self.z_loss or extra_z))
        return keys

    def ce_gen_options(self) -> List[str]:
        """The ``ce-gen`` options that ask for exactly this kernel (target and output aside).

        One canonical key, as the runtime's "generate it with" hint (runtime/lib/Launch.cpp)
        and every manifest spell it; ce-gen checks it with the same rules as its lists.
        """
        return [f"--variant={self}"]


def rescale_key(logits: str, layout: str) -> VariantKey:
    """The key of the fused gradient's correction kernel (``ce_rescale``): it varies only in
    the gradient's dtype and the layout; its other fields have one canonical value."""
    return VariantKey(op="rescale", logits=logits, labels="i64", layout=layout,
                      overwrite=True, weights="token")
