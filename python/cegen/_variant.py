"""Kernel variant keys, spelled exactly as ``ce::KernelVariantKey::str()`` spells them.

``runtime/include/ce/runtime/VariantKey.h`` is the reference; ``docs/bundle-format.md``
documents the fields. Python needs the same string to tell which bundle holds a kernel
and to ask ``ce-gen`` for a missing one.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import List, Optional, Tuple

from . import _validate

__all__ = ["VariantKey", "format_f32", "to_f32"]

OPS = ("forward", "backward", "fused", "shard_stats")
LOGITS_TYPES = ("bf16", "f16", "f32")
LABEL_TYPES = ("i32", "i64")
LAYOUTS = ("flat", "sbv_bs", "sbv_sb")
WEIGHTS = ("none", "scalar", "token")


def to_f32(value: float) -> float:
    """Rounds a Python float to the nearest f32, as the C API's ``float`` fields do."""
    return struct.unpack("<f", struct.pack("<f", float(value)))[0]


def format_f32(value: float) -> str:
    """Prints an f32 with ``%.9g``, which reads back to the same bits (``formatF32``)."""
    return "%.9g" % to_f32(value)


@dataclasses.dataclass(frozen=True)
class VariantKey:
    """Everything that selects one compiled kernel (shapes and strides do not).

    Field values use the manifest's spelling, e.g. ``logits="bf16"``, ``layout="sbv_bs"``.
    """

    op: str
    logits: str
    labels: str
    layout: str
    ignore_index: Optional[int] = None
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    overwrite: bool = False
    weights: str = "none"
    #: ``(start, vocab, global_smoothing)`` of a tensor-parallel vocabulary slice, or None.
    shard: Optional[Tuple[int, int, bool]] = None

    def __post_init__(self) -> None:
        # The numbers as the kernels and ce-gen take them (cegen._validate's rules).
        object.__setattr__(self, "ignore_index", _validate.ignore_index(self.ignore_index))
        object.__setattr__(self, "label_smoothing", _validate.label_smoothing(self.label_smoothing))
        object.__setattr__(self, "z_loss", _validate.z_loss(self.z_loss))
        object.__setattr__(self, "overwrite", _validate.flag("overwrite", self.overwrite))
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
        if (self.op == "fused") != (self.weights != "none"):
            raise ValueError(
                f"variant key: weights={self.weights!r} does not fit op={self.op!r} "
                "(fused kernels take scalar or token weights, the others none)"
            )
        if self.op in ("forward", "shard_stats") and self.overwrite:
            raise ValueError(f"variant key: a {self.op} kernel writes no gradient to overwrite with")
        if (self.shard is not None) != (self.op == "shard_stats") and self.op != "backward":
            raise ValueError(f"variant key: op={self.op!r} does not fit shard={self.shard!r} "
                             "(shard_stats needs a shard; only it and backward take one)")
        if self.shard is not None:
            if not isinstance(self.shard, tuple) or len(self.shard) != 3:
                raise ValueError(f"variant key: shard must be (start, vocab, global_smoothing), "
                                 f"got {self.shard!r}")
            start, vocab = _validate.shard_bounds(self.shard[0], self.shard[1])
            object.__setattr__(self, "shard",
                               (start, vocab, _validate.flag("global_smoothing", self.shard[2])))

    def __str__(self) -> str:
        ignore = "none" if self.ignore_index is None else str(int(self.ignore_index))
        return (
            f"op={self.op},logits={self.logits},labels={self.labels},layout={self.layout},"
            f"ignore_index={ignore},label_smoothing={format_f32(self.label_smoothing)},"
            f"z_loss={format_f32(self.z_loss)},overwrite={1 if self.overwrite else 0},"
            f"weights={self.weights}"
            + ("" if self.shard is None else f",shard={self._shard_text()}")
        )

    def _shard_text(self) -> str:
        start, vocab, global_smoothing = self.shard  # type: ignore[misc]
        return f"{int(start)}/{int(vocab)}/{'global' if global_smoothing else 'local'}"

    def ce_gen_options(self) -> List[str]:
        """The ``ce-gen`` options that ask for exactly this kernel (target and output aside).

        One canonical key, as the runtime's "generate it with" hint (runtime/lib/Launch.cpp)
        and every manifest spell it; ce-gen checks it with the same rules as its lists.
        """
        return [f"--variant={self}"]
