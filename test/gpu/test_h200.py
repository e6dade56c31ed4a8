#!/usr/bin/env python3
"""cegen's GPU tests: generated sm_90 kernels on CUDA tensors against a float64 reference.

Run on a machine with an NVIDIA GPU of compute capability 9.0 (H100/H200) and PyTorch, from
the repository root, with a runtime library and bundles built elsewhere (ce-gen needs LLVM,
which the GPU machine lacks)::

    python3 test/gpu/test_h200.py --runtime .dev/lib/libce_runtime.so \\
        --bundles .dev/bundles/dtypes .dev/bundles/options .dev/bundles/overwrite --out OUT

``test/gpu/prepare_device_run.sh`` builds both into ``.dev/``. Without a CUDA device the
script prints SKIP and exits 0, so CI may call it; ``unittest discover -s test/python``
does not collect it. ``--device cpu`` runs the numerical part on host bundles instead
(``ce-gen --target=host``), which checks this harness where no GPU is reachable.

What it checks (each part can be selected with ``--parts``):

numerics   every kernel of the bundles on the cases of test/runtime/NumericsTest.cpp:
           V in {1, 2, 7, 4095, 32000, 50257, 128256}, N = 0 and 1 and more, [S,B,V] with
           [B,S]/[S,B] labels, strided/padded/transposed views of every tensor, -inf rows,
           a confident row, +100 offsets, maxima past 2^24 and near 2^100, a half row
           near -1e30, a row whose plain sum overflows, ignored tokens and an all-ignored batch,
           per-token and stride-0 upstream gradients or weights (and a 0-d weight, which
           the runtime passes as per-token of stride 0), overwrite on/off. Option
           values are kernel arguments (bundle format version 3): each case draws its own,
           as NumericsTest does (an ignore_index of -100, -7 or class 3 on most cases;
           where the kernel computes them, smoothing in [0.01, 0.3] and z-loss in
           [1e-5, 1e-3], sometimes exactly 0), seeded by --seed, the key and the case, and
           named in every failure message. Outputs are poisoned (NaN) first and the padding
           around every view must survive.
           Tolerances as NumericsTest: loss, lse |k - r| <= 1e-5 max(1, |r|); gradient one
           ulp of the logits dtype (bf16, f16) or 1e-5 of the row's largest |r| (f32), plus
           4 f32 ulps of the terms fp32 cannot avoid rounding.
           With each kernel also: labels just past V, -1, huge and ignore_index + 1; the
           launch returns, the lazy check (ce_check_label_status) names the token and label,
           and the token's loss and gradient row are NaN.
large      N = 17000, V = 128256 bf16 (N*V > 2^31): forward, backward and fused, a sample of
           rows against the reference (rows around element 2^31 included), and timings.
streams    two threads launching forward+backward (autograd) on two streams at once; a bad
           label on one stream is reported on that stream only.
graph      forward+backward captured into a CUDA graph and replayed on fresh inputs; a bad
           label in a replay is reported; a capture whose kernels were never loaded.
python     cegen.cross_entropy on CUDA: autograd, fused weights, overwrite_input, the lazy
           label report of the next call and of cegen.check_labels().
async      a call made while the stream is busy returns at once (no host synchronization
           on the launch path); the host cost of a launch (C API and Python API).
probe      test/gpu/abi_probe.cu, a kernel written by hand to the ABI and built with nvcc
           here, through the numerical cases (no option values: the kernel reads none of
           its value arguments): the runtime checked apart from ce-gen. And the same
           bundle sealed as an older format version (1 to 4) is refused at open, naming
           its version and version 5 (this part runs with --device cpu too).

Results go to OUT/results.json and OUT/log.txt; the last lines printed are a summary table.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import math
import os
import random
import struct
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))

import torch  # noqa: E402

LOG_LINES: List[str] = []


def log(message: str = "") -> None:
    print(message, flush=True)
    LOG_LINES.append(message)


# -- variant keys and the option values of a case ---------------------------------------------


def to_f32(value: float) -> float:
    """`value` rounded to f32, as the C API's float fields (and so the kernels) take it."""
    return struct.unpack("<f", struct.pack("<f", float(value)))[0]


@dataclass(frozen=True)
class Key:
    """A kernel's variant key (bundle format version 3) and the option values one case runs
    it with. The key's fields say what the kernel computes (``smoothing_on``, ``z_loss_on``:
    whether it computes the term at all); the values are run-time arguments, drawn per case
    (:func:`draw_values`), and what the reference and ``Harness.options`` read. A kernel
    that computes a term also serves a coefficient of 0."""

    op: str
    logits: str
    labels: str
    layout: str
    smoothing_on: bool
    z_loss_on: bool
    overwrite: bool
    weights: str
    text: str
    #: A softcap kernel (key field ``softcap=on``, issue 17).
    softcap_on: bool = False
    # The run-time values of one case.
    ignore_index: Optional[int] = None
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    #: z = logit_scale * x (issue 17), f32 as the kernel receives it.
    logit_scale: float = 1.0
    #: z = cap tanh(logit_scale x / cap) on a softcap kernel (0: none), f32.
    logit_softcap: float = 0.0

    @staticmethod
    def parse(text: str) -> "Key":
        """A version 3 key as ``ce::KernelVariantKey::str()`` spells it, with the values
        none/0/0; anything else (a version 2 key with option values, or one with a ``shard``
        field or ``weights=scalar``, which no kernel has since every backward takes a
        vocabulary slice and a scalar weight is a per-token weight of stride 0) is an
        error."""
        names = ["op", "logits", "labels", "layout", "label_smoothing", "z_loss", "overwrite",
                 "weights"]
        items = [item.split("=", 1) for item in text.split(",")]
        softcap = items[-1] == ["softcap", "on"]  # the optional last field (issue 17)
        if softcap:
            items = items[:-1]
        got = [item[0] for item in items]
        if got != names or any(len(item) != 2 for item in items):
            raise ValueError(f"not a version 3 variant key: {text!r}")
        fields = dict(items)
        for name, allowed in (("label_smoothing", ("on", "off")), ("z_loss", ("on", "off")),
                              ("overwrite", ("0", "1")), ("weights", ("none", "token"))):
            if fields.get(name) not in allowed:
                raise ValueError(f"variant key {text!r}: {name}={fields.get(name)!r}")
        return Key(fields["op"], fields["logits"], fields["labels"], fields["layout"],
                   fields["label_smoothing"] == "on", fields["z_loss"] == "on",
                   fields["overwrite"] == "1", fields["weights"], text, softcap)

    def with_values(self, ignore_index: Optional[int], label_smoothing: float = 0.0,
                    z_loss: float = 0.0, logit_scale: float = 1.0,
                    logit_softcap: float = 0.0) -> "Key":
        """This kernel with a case's option values (f32, as the kernel receives them)."""
        if label_smoothing and not self.smoothing_on or z_loss and not self.z_loss_on:
            raise ValueError(f"{self.text} does not compute smoothing {label_smoothing} or "
                             f"z-loss {z_loss}")
        if bool(logit_softcap) != self.softcap_on:
            raise ValueError(f"{self.text} with logit_softcap {logit_softcap}")
        return dataclasses.replace(self, ignore_index=ignore_index,
                                   label_smoothing=to_f32(label_smoothing), z_loss=to_f32(z_loss),
                                   logit_scale=to_f32(logit_scale),
                                   logit_softcap=to_f32(logit_softcap))

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        """The logits z the kernel's statistics are of, in float64: ``s x``, or with a
        softcap ``cap tanh(s x / cap)`` (+-inf give +-cap, NaN stays)."""
        if not self.softcap_on:
            return x * self.logit_scale
        return self.logit_softcap * torch.tanh(x * (self.logit_scale / self.logit_softcap))

    def slope(self, x: torch.Tensor) -> torch.Tensor:
        """dz/dx of a softcap kernel: ``s (1 - tanh^2(s x / cap))``."""
        t = torch.tanh(x * (self.logit_scale / self.logit_softcap))
        return self.logit_scale * (1.0 - t * t)

    def z_atol(self) -> float:
        """How far an f32 z of a softcap kernel may be from float64's: 16 ulps of the cap
        (z = cap - 2 cap r, r = 1 / (1 + 2^(x k)), within about 6 ulps of the cap with the
        GPUs' approximate exp2 and reciprocal; docs/lowering.md); 0 without."""
        return self.logit_softcap * 2.0 ** -20 if self.softcap_on else 0.0

    def values_text(self) -> str:
        """The case's option values, as failure messages print them (NumericsTest's)."""
        ignore = "none" if self.ignore_index is None else str(self.ignore_index)
        return (f"ignore_index={ignore} label_smoothing={'%.9g' % self.label_smoothing} "
                f"z_loss={'%.9g' % self.z_loss} logit_scale={'%.9g' % self.logit_scale}"
                + (f" logit_softcap={'%.9g' % self.logit_softcap}" if self.softcap_on else ""))

    def forward_key(self) -> str:
        """The forward variant whose lse a backward of this key consumes."""
        fixed = {"op": "forward", "overwrite": "0", "weights": "none"}
        parts = [part.split("=", 1) for part in self.text.split(",")]
        return ",".join(f"{name}={fixed.get(name, value)}" for name, value in parts)


def make_key(op: str, logits: str, labels: str, layout: str, ignore_index: Optional[int] = -100,
             label_smoothing: float = 0.0, z_loss: float = 0.0, overwrite: bool = False,
             weights: str = "none") -> Key:
    """The key the runtime spells (cegen.VariantKey) for these values: smoothing and z-loss
    on where the coefficient is not 0, with the values attached."""
    from cegen import VariantKey

    key = Key.parse(str(VariantKey(op, logits, labels, layout, label_smoothing != 0.0,
                                   z_loss != 0.0, overwrite, weights)))
    return key.with_values(ignore_index, label_smoothing, z_loss)


def draw_values(key: Key, case: "Case", bad_label_case: bool, seed: int) -> Key:
    """`key` with the option values of one case, drawn as NumericsTest.cpp's drawOptions
    does, from a generator seeded with `seed` (so a run's seed replays them): an
    ignore_index on most cases (-100, -7, or class 3, whose tokens are then ignored, never
    in bad-label cases, where the label next to it must be an error), and a smoothing
    coefficient in [0.01, 0.3] or a z-loss in [1e-5, 1e-3] where the kernel computes one,
    sometimes exactly 0 (which an "on" kernel also serves)."""
    rng = random.Random(seed)
    ignore_index: Optional[int] = None
    if case.all_ignored or rng.random() < 0.75:
        pick = rng.random()
        ignore_index = (-100 if pick < 0.4 else
                        -7 if pick < 0.8 or bad_label_case or case.vocab <= 3 else 3)
    smoothing = 0.0
    if key.smoothing_on and rng.random() >= 0.1:
        smoothing = 0.01 + 0.29 * rng.random()
    z_loss = 0.0
    if key.z_loss_on and rng.random() >= 0.1:
        z_loss = 1e-5 * 100.0 ** rng.random()
    # The logit scale (every kernel takes one): 1 half of the time, else log-uniform in
    # [0.05, 20].
    logit_scale = 1.0
    if rng.random() >= 0.5:
        logit_scale = 0.05 * 400.0 ** rng.random()
    # A softcap kernel's cap: log-uniform in [1, 64] (NumericsTest's).
    cap = 64.0 ** rng.random() if key.softcap_on else 0.0
    return key.with_values(ignore_index, smoothing, z_loss, logit_scale, cap)


TORCH_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32,
                "i32": torch.int32, "i64": torch.int64}


# -- cases (NumericsTest.cpp's kCases) --------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    flat_tokens: int
    seq: int
    batch: int
    vocab: int
    views: bool
    special_rows: bool
    broadcast: bool
    all_ignored: bool
    #: CE_LABEL_POLICY_MEGATRON, with every third label outside [0, V).
    megatron_labels: bool = False
    #: A fused kernel's broadcast weight is a 0-d tensor (which the runtime passes as
    #: per-token weights of stride 0) instead of a token-shaped tensor of stride 0.
    scalar_weight: bool = False


CASES = [
    Case("empty", 0, 0, 3, 7, False, False, False, False),
    Case("vocab1", 1, 1, 1, 1, False, False, False, False),
    Case("vocab2", 37, 5, 7, 2, False, False, False, False),
    Case("views-vocab7", 45, 5, 9, 7, True, True, True, False),
    Case("vocab4095", 24, 4, 6, 4095, False, True, False, False),
    Case("views-vocab32000", 3, 1, 3, 32000, True, True, True, False, scalar_weight=True),
    Case("vocab50257", 2, 2, 1, 50257, False, True, False, False),
    Case("views-vocab128256", 2, 1, 2, 128256, True, False, False, False),
    Case("special-vocab32000", 9, 9, 1, 32000, False, True, False, False),
    Case("all-ignored", 16, 4, 4, 7, True, False, False, True),
    Case("megatron-labels-vocab7", 45, 5, 9, 7, True, True, True, False, True),
    Case("megatron-labels-vocab32000", 12, 3, 4, 32000, False, True, False, False, True),
]

PAD = 8          # elements of padding before and after every view
PAD_VALUE = -7777.0


# -- the float64 reference (test/runtime/Reference.cpp, vectorized) --------------------------


def smoothing_factor(alpha: float, vocab: int) -> float:
    return 0.0 if vocab <= 1 else alpha * vocab / (vocab - 1)


@dataclass
class Stats:
    max: torch.Tensor
    rest: torch.Tensor
    lse: torch.Tensor

    def log_prob(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """log p_label = (x_label - max) - log1p(rest), without rounding lse first."""
        target = x.gather(1, labels.clamp(0, x.shape[1] - 1)[:, None])[:, 0]
        return (target - self.max) - torch.log1p(self.rest)


def reference_stats(x: torch.Tensor) -> Stats:
    n, v = x.shape
    if n == 0:
        empty = x.new_zeros((0,))
        return Stats(empty, empty, empty)
    mx, argmax = x.max(dim=1)
    finite = torch.isfinite(mx)
    shift = torch.where(finite, mx, torch.zeros_like(mx))
    e = torch.exp(x - shift[:, None])
    e.scatter_(1, argmax[:, None], 0.0)
    rest = torch.where(finite, e.sum(dim=1), torch.zeros_like(mx))
    lse = torch.where(finite, mx + torch.log1p(rest), mx)
    return Stats(mx, rest, lse)


def ignored_mask(labels: torch.Tensor, ignore_index: Optional[int]) -> torch.Tensor:
    if ignore_index is None:
        return torch.zeros_like(labels, dtype=torch.bool)
    return labels == ignore_index


def absent_mask(labels: torch.Tensor, vocab: int, key: Key, megatron: bool) -> torch.Tensor:
    """Labels outside [0, V) under CE_LABEL_POLICY_MEGATRON (not the ignore_index)."""
    if not megatron:
        return torch.zeros_like(labels, dtype=torch.bool)
    return ((labels < 0) | (labels >= vocab)) & ~ignored_mask(labels, key.ignore_index)


def reference_loss(x: torch.Tensor, labels: torch.Tensor, stats: Stats, key: Key,
                   megatron: bool = False) -> torch.Tensor:
    n, v = x.shape
    ignored = ignored_mask(labels, key.ignore_index)
    loss = -stats.log_prob(x, labels)
    # Megatron-Core: an absent label's target logit is the row maximum.
    loss = torch.where(absent_mask(labels, v, key, megatron), torch.log1p(stats.rest), loss)
    s = smoothing_factor(key.label_smoothing, v)
    if s != 0.0:
        loss = (1.0 - s) * loss + s * (stats.lse - x.mean(dim=1))
    if key.z_loss != 0.0:
        loss = loss + key.z_loss * stats.lse * stats.lse
    return torch.where(ignored, torch.zeros_like(loss), loss)


def reference_grad(x: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                   target_log_prob: torch.Tensor, scale: torch.Tensor,
                   key: Key, megatron: bool = False,
                   exact: Optional[Stats] = None,
                   extra_ulps: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(gradient, term scale) per referenceGrad in Reference.cpp. ``exact``: the row's exact
    statistics, for the fused kernel, which keeps the maximum and the log of the sum apart:
    p_j = exp((x_j - max) - log1p(rest)) (a float64 lse near 2^100 has lost log1p(rest)),
    and only log1p(rest)'s ulps are allowed in each exponent, not |lse|'s."""
    n, v = x.shape
    s = smoothing_factor(key.label_smoothing, v)
    z_term = 2.0 * key.z_loss * lse
    z_scale = 1.0 + z_term
    uniform = s / v
    if exact is not None:
        log_sum = torch.log1p(exact.rest)
        exponent = (x - exact.max[:, None]) - log_sum[:, None]
        magnitude = log_sum.abs()[:, None]
    else:
        exponent = x - lse[:, None]
        magnitude = lse.abs()[:, None]
    if extra_ulps is not None:
        magnitude = magnitude + extra_ulps[:, None]
    p = torch.exp(exponent)
    grad = scale[:, None] * (p * z_scale[:, None] - uniform)
    p_error = torch.where(p == 0, torch.zeros_like(p),
                          p * (2.0 + magnitude + exponent.abs()))
    term = scale.abs()[:, None] * (p_error * z_scale.abs()[:, None] + uniform)
    safe = labels.clamp(0, v - 1)[:, None]
    p_minus_one = torch.expm1(target_log_prob)
    target_grad = scale * (p_minus_one * z_scale + z_term + s - uniform)
    target_slack = p_minus_one.abs()
    if extra_ulps is not None:
        target_slack = target_slack + torch.exp(target_log_prob) * extra_ulps
    target_term = scale.abs() * (target_slack * z_scale.abs() + z_term.abs() + s)
    # An absent label has no target element: its own value stays.
    absent = absent_mask(labels, v, key, megatron)
    target_grad = torch.where(absent, grad.gather(1, safe)[:, 0], target_grad)
    target_term = torch.where(absent, term.gather(1, safe)[:, 0], target_term)
    grad.scatter_(1, safe, target_grad[:, None])
    term.scatter_(1, safe, target_term[:, None])
    ignored = ignored_mask(labels, key.ignore_index)
    grad[ignored] = 0.0
    term[ignored] = 0.0
    return grad, term


def ulp_of(dtype: str, value: torch.Tensor) -> torch.Tensor:
    mantissa_bits, min_exponent = 23, -126
    if dtype == "bf16":
        mantissa_bits = 7
    elif dtype == "f16":
        mantissa_bits, min_exponent = 10, -14
    _, exponent = torch.frexp(value)
    exponent = (exponent.to(torch.float64) - 1).clamp(min=min_exponent)
    exponent = torch.where((value != 0) & torch.isfinite(value), exponent,
                           torch.full_like(exponent, min_exponent))
    return torch.pow(2.0, exponent - mantissa_bits)


def grad_tolerance(dtype: str, ref: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
    if dtype == "f32":
        row_max = ref.abs().amax(dim=1, keepdim=True) if ref.shape[1] else ref
        base = 1e-5 * row_max.expand_as(ref)
    else:
        base = ulp_of(dtype, ref)
    return base + 4.0 * term * 2.0 ** -24


# -- tensors with views and padding ----------------------------------------------------------


def packed_strides(shape: Sequence[int]) -> List[int]:
    strides, stride = [0] * len(shape), 1
    for i in reversed(range(len(shape))):
        strides[i] = stride
        stride *= max(shape[i], 1)
    return strides


class Buffer:
    """A view of `shape`/`strides` inside a padded buffer (padding PAD_VALUE)."""

    def __init__(self, dtype: torch.dtype, shape: Sequence[int], strides: Sequence[int],
                 device: torch.device, poison: bool = True):
        span = 0
        if all(size > 0 for size in shape):
            span = 1 + sum((size - 1) * stride for size, stride in zip(shape, strides))
        fill = PAD_VALUE if dtype.is_floating_point else -77
        self.storage = torch.full((span + 2 * PAD,), fill, dtype=dtype, device=device)
        self.view = self.storage.as_strided(tuple(shape), tuple(strides), PAD)
        if poison and span:
            self.view.fill_(float("nan") if dtype.is_floating_point else -1)
        self.shape, self.strides = list(shape), list(strides)

    def padding_intact(self) -> bool:
        mask = torch.ones_like(self.storage, dtype=torch.bool)
        mask.as_strided(tuple(self.shape), tuple(self.strides), PAD).fill_(False)
        fill = PAD_VALUE if self.storage.dtype.is_floating_point else -77
        return bool((self.storage[mask] == fill).all())


# -- one problem -----------------------------------------------------------------------------


class Problem:
    def __init__(self, key: Key, case: Case, device: torch.device, gen: torch.Generator):
        self.key, self.case, self.device = key, case, device
        self.vocab = v = case.vocab
        self.flat = key.layout == "flat"
        if self.flat:
            self.token_shape = [case.flat_tokens]
            self.n = case.flat_tokens
        else:
            self.seq, self.batch = case.seq, case.batch
            bs = key.layout == "sbv_bs"
            self.token_shape = [case.batch, case.seq] if bs else [case.seq, case.batch]
            self.n = case.seq * case.batch
        self.views = case.views
        n = self.n
        dtype = key.logits
        # Inputs, in float64 on the CPU, rounded to the logits dtype.
        sigma = torch.tensor([0.5 if t % 3 == 0 else 2.0 if t % 3 == 1 else 4.0 for t in range(n)],
                             dtype=torch.float64)
        x = torch.randn((n, v), generator=gen, dtype=torch.float64) * sigma[:, None]
        labels = torch.randint(0, max(v, 1), (n,), generator=gen)
        if key.ignore_index is not None:
            drop = torch.rand((n,), generator=gen) < 0.2
            if case.all_ignored:
                drop[:] = True
            labels[drop] = key.ignore_index
        x = self.round(x)
        outside = [-100, v, v + 5, -1, (1 << 40) if key.labels == "i64" else -2 ** 31]
        if case.special_rows and v >= 2:
            f16 = dtype == "f16"
            for t in range(min(n, 9)):
                label = int(torch.randint(0, v, (1,), generator=gen))
                labels[t] = label
                if t in (0, 1):
                    keep = int(torch.randint(0, v, (1,), generator=gen))
                    row = torch.full((v,), -math.inf, dtype=torch.float64)
                    row[keep] = float(self.round(torch.randn((1,), generator=gen,
                                                             dtype=torch.float64) * 2.0))
                    x[t] = row
                    labels[t] = keep if t == 0 else (keep + 1) % v
                elif t == 2:
                    others = torch.cat([x[t, :label], x[t, label + 1:]])
                    lse_others = float(torch.logsumexp(others, 0))
                    x[t, label] = float(self.round(torch.tensor([lse_others + math.log(1999.0)],
                                                                dtype=torch.float64)))
                elif t == 3:
                    x[t] = self.round(x[t] + 100.0)
                    # The label at the second largest value (NumericsTest's): the loss is
                    # of order s (x_max - x_y), so its tolerance sees s x_y - s max formed
                    # as two rounded products.
                    order = torch.argsort(x[t], descending=True)
                    top = float(x[t, order[0]])
                    below = [int(j) for j in order if float(x[t, j]) < top]
                    labels[t] = below[0] if below else int(order[min(1, v - 1)])
                elif t == 4:
                    # A maximum past 2^24 (swept again with exact subtractions):
                    # nine values 2^20 apart (f16: 1024), ties at the maximum,
                    # a row sum exact in f32.
                    unit, base = (1024.0, 58.0) if f16 else (2.0 ** 20, 29.0)
                    x[t] = self.round(unit * (base + x[t].round().clamp(-4, 4)))
                elif t == 5:
                    # Huge values 2^94 apart (f16: 512) around 2^100.
                    unit = 512.0 if f16 else 2.0 ** 94
                    x[t] = self.round(unit * (64.0 + x[t].round().clamp(-8, 8)))
                if t in (4, 5):
                    # The label at a maximum: the loss is log(ties), of order 1,
                    # so its 1e-5 tolerance sees the re-sweep's count of the
                    # maximum's ties (the workgroup's merges of the thread states);
                    # with another label the loss is about |max| and hides it.
                    labels[t] = int(torch.argmax(x[t]))
                if t == 6:
                    # A first half far below the rest: the running maximum
                    # starts below -2^24 and then grows.
                    x[t, :v // 2] = self.round(x[t, :v // 2] - 1.0e30)
                elif t == 7:
                    # Every other value near -FLT_MAX (f16: -65504): a small
                    # maximum, but the plain row sum overflows f32, so
                    # smoothing's mean comes from the shifted re-sweep.
                    x[t, ::2] = self.round(torch.full_like(x[t, ::2],
                                                           -65504.0 if f16 else -3.0e38))
                    labels[t] = min(v - 1, 1)
                elif t == 8 and not key.softcap_on:
                    # NumericsTest's row 8: two equal maxima first (thread 0's first
                    # vector), then terms of about e^-14.5 (gaps 14.5 / s, 10 % spread),
                    # the label at a maximum. A count of the maxima kept on a lane with
                    # its small terms rounded every term added after it (lse 1.4e-5 off
                    # at V = 32001 on the host before 3301e23).
                    gap = 14.5 / key.logit_scale
                    factor = torch.where(torch.arange(v) % 3 == 0, 2.0, 1.0)
                    spread = 1.0 + 0.1 * torch.rand((v,), generator=gen, dtype=torch.float64)
                    x[t] = self.round(1.0 - gap * factor * spread)
                    x[t, :2] = 1.0
                    labels[t] = label % 2
        if case.megatron_labels:
            # Megatron's SFT -100, V itself, past V, -1 and one far outside.
            for t in range(1, n, 3):
                labels[t] = outside[(t // 3) % len(outside)]
        self.x, self.labels = x, labels
        # The per-token scale: grad_loss (backward) or weights (fused).
        self.scale = torch.zeros((n,), dtype=torch.float64)
        self.scale_scalar = key.op == "fused" and case.broadcast and case.scalar_weight
        self.scale_broadcast = case.broadcast
        if key.op != "forward":
            common = float(torch.empty(1, dtype=torch.float32).uniform_(-2, 2, generator=gen))
            values = torch.empty((n,), dtype=torch.float32).uniform_(-2, 2, generator=gen)
            self.scale = (torch.full((n,), common, dtype=torch.float64) if self.scale_broadcast
                          else values.to(torch.float64))

    def round(self, values: torch.Tensor) -> torch.Tensor:
        return values.to(TORCH_DTYPES[self.key.logits]).to(torch.float64)

    # layouts (NumericsTest's Problem)
    def logits_shape(self) -> List[int]:
        return [self.n, self.vocab] if self.flat else [self.seq, self.batch, self.vocab]

    def token_strides(self, gap: int) -> List[int]:
        if not self.views:
            return packed_strides(self.token_shape)
        if len(self.token_shape) == 1:
            return [gap if gap else 2]
        if gap == 0:
            return [1, self.token_shape[0]]
        return [self.token_shape[1] * gap, gap]

    def logits_strides(self) -> List[int]:
        if not self.views:
            return packed_strides(self.logits_shape())
        row = self.vocab + 3
        return [row, 1] if self.flat else [row, self.seq * row, 1]

    def grad_strides(self) -> List[int]:
        if not self.views:
            return packed_strides(self.logits_shape())
        row = self.vocab + 1
        return [row, 1] if self.flat else [self.batch * row, row, 1]

    def token_index(self) -> torch.Tensor:
        """For each token t (row-major over the token shape), its logits row in [S*B] or N."""
        t = torch.arange(self.n)
        if self.flat:
            return t
        i0, i1 = t // self.token_shape[1], t % self.token_shape[1]
        s, b = (i1, i0) if self.key.layout == "sbv_bs" else (i0, i1)
        return s * self.batch + b

    def logits_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """The [N, V] rows of a logits-shaped tensor, in token order."""
        rows = tensor.reshape(-1, self.vocab) if tensor.is_contiguous() else \
            tensor.contiguous().reshape(-1, self.vocab)
        return rows[self.token_index().to(rows.device)]

    def token_values(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape(-1) if tensor.is_contiguous() else tensor.contiguous().reshape(-1)

    def to_logits_layout(self, rows: torch.Tensor) -> torch.Tensor:
        """[N, V] rows in token order -> logits-shaped tensor (packed)."""
        out = torch.empty((self.n, self.vocab), dtype=rows.dtype)
        out[self.token_index()] = rows
        return out.reshape(self.logits_shape())

    def where(self, t: int) -> str:
        if self.flat:
            return f"token {t} (n={t})"
        i0, i1 = t // self.token_shape[1], t % self.token_shape[1]
        if self.key.layout == "sbv_bs":
            return f"token {t} (b={i0}, s={i1})"
        return f"token {t} (s={i0}, b={i1})"


# -- the runtime, through cegen's ctypes binding ---------------------------------------------


class Harness:
    def __init__(self, runtime_path: Optional[str], bundle_dirs: Sequence[str],
                 device: torch.device):
        import cegen
        from cegen import _runtime

        self.cegen, self._runtime = cegen, _runtime
        if runtime_path:
            cegen.set_runtime_library(runtime_path)
        self.rt = _runtime.get_runtime()
        self.device = device
        self.gpu = device.type == "cuda"
        self.target = "host"
        if self.gpu:
            major, minor = torch.cuda.get_device_capability(device)
            self.target = f"sm_{major}{minor}"
        self.bundles = [self.rt.open_bundle(Path(d).resolve()) for d in bundle_dirs]
        self.kernels: Dict[str, object] = {}
        for bundle in self.bundles:
            for key, target in bundle.kernels():
                if target == self.target:
                    self.kernels.setdefault(key, bundle)
        self.device_type = _runtime.Device.CUDA if self.gpu else _runtime.Device.HOST
        self.index = (device.index or 0) if self.gpu else 0

    def desc(self, tensor: torch.Tensor, dtype: str):
        codes = {"bf16": 0, "f16": 1, "f32": 2, "i32": 3, "i64": 4}
        return self._runtime.TensorDesc.make(tensor.data_ptr(), codes[dtype], list(tensor.shape),
                                             list(tensor.stride()), self.device_type, self.index)

    def options(self, key: Key, overwrite: bool, megatron: bool = False):
        options = self.rt.default_options()
        options.label_policy = 1 if megatron else 0  # CE_LABEL_POLICY_MEGATRON
        if key.ignore_index is not None:
            options.has_ignore_index = 1
            options.ignore_index = key.ignore_index
        options.label_smoothing = key.label_smoothing
        options.z_loss = key.z_loss
        options.logit_scale = key.logit_scale
        options.logit_softcap = key.logit_softcap
        options.overwrite_input = 1 if overwrite else 0
        options.label_layout = 1 if key.layout == "sbv_sb" else 0
        return options

    def stream(self) -> Optional[int]:
        return torch.cuda.current_stream(self.device).cuda_stream if self.gpu else None

    def check_labels(self, wait: bool = True) -> None:
        self.rt.check_label_status(self.device_type, self.index, self.stream(), wait)

    def sync(self) -> None:
        if self.gpu:
            torch.cuda.synchronize(self.device)


class Report:
    def __init__(self) -> None:
        self.checks = 0
        self.failures = 0
        self.failed_kernels: Dict[str, int] = {}
        self.printed: Dict[str, int] = {}

    def check(self, ok: bool, kernel: str, case: str, describe: Callable[[], str]) -> None:
        self.checks += 1
        if ok:
            return
        self.failures += 1
        self.failed_kernels[kernel] = self.failed_kernels.get(kernel, 0) + 1
        name = f"{kernel}/{case}"
        count = self.printed.get(name, 0)
        self.printed[name] = count + 1
        if count < 4 and len(self.printed) < 400:
            log(f"    FAIL {case} [{kernel}]: {describe()}")


def fmt(value: float) -> str:
    return "%.9g" % value


def check_token_values(report: Report, p: Problem, what: str, kernel: torch.Tensor,
                       ref: torch.Tensor, exact_zero: torch.Tensor, case: str) -> None:
    k = kernel.to(torch.float64).cpu()
    # The output is f32: a reference past its range rounds to infinity.
    ref = torch.where(ref.abs() > torch.finfo(torch.float32).max,
                      ref.to(torch.float32).to(torch.float64), ref)
    # A softcap kernel's f32 z (Key.z_atol) moves the loss and lse by as much; the
    # smoothing mean and lse of the loss by as much again.
    tolerance = 1e-5 * ref.abs().clamp(min=1.0) + 2.0 * p.key.z_atol()
    finite = torch.isfinite(ref)
    ok = torch.where(finite, (k - ref).abs() <= tolerance,
                     torch.where(torch.isnan(ref), torch.isnan(k), k == ref))
    ok = torch.where(exact_zero, k == 0, ok)
    bad = (~ok).nonzero().flatten().tolist()
    report.check(not bad, p.key.text, case, lambda: (
        f"{what} of {len(bad)} tokens off; first {p.where(bad[0])} (label "
        f"{int(p.labels[bad[0]])}): kernel {fmt(float(k[bad[0]]))}, reference "
        f"{fmt(float(ref[bad[0]]))}"))


def check_outputs(report: Report, p: Problem, z: torch.Tensor, stats: Stats,
                  entropy: torch.Tensor, argmax: torch.Tensor, case: str) -> None:
    """The entropy (within 2e-5 max(1, H)) and argmax (exactly: the lowest index of the
    row's largest z, -1 for a NaN row) outputs against float64 (bundle format 5)."""
    # sum_j q_j (log S - (z_j - m)), q = exp(z - m) / S: lse - z_j would lose log S at
    # |z| near 1e30 (ties at the maximum: H = log(ties), lse = m in float64).
    lse = stats.lse
    finite = torch.isfinite(lse)
    shifted = z - torch.where(finite, z.max(dim=1).values, torch.zeros_like(lse))[:, None]
    w = torch.exp(shifted)
    total = w.sum(dim=1, keepdim=True)
    q = w / total
    terms = torch.where(q > 0, q * (torch.log(total) - shifted), torch.zeros_like(z))
    ref_h = torch.where(finite, terms.sum(dim=1), torch.full_like(lse, math.nan))
    k = entropy.to(torch.float64).cpu()
    # |dH| <= max_j |dz_j| sum_j p_j |z_j - mean z| <= z_atol 2 cap (a softcap kernel's).
    z_atol = p.key.z_atol()
    ok = torch.where(torch.isnan(ref_h), torch.isnan(k),
                     (k - ref_h).abs() <= 2e-5 * ref_h.abs().clamp(min=1.0)
                     + 2.0 * p.key.logit_softcap * z_atol)
    bad = (~ok).nonzero().flatten().tolist()
    if bad and os.environ.get("DEBUG_OUTPUTS"):
        t = bad[0]
        print("DEBUG", z.shape, z[t].min().item(), z[t].max().item(), lse[t].item(),
              torch.isinf(z[t]).sum().item(), terms[t].sum().item(), file=sys.stderr)
    report.check(not bad, p.key.text, case, lambda: (
        f"entropy of {len(bad)} tokens off; first {p.where(bad[0])}: kernel "
        f"{fmt(float(k[bad[0]]))}, reference {fmt(float(ref_h[bad[0]]))}"))
    top = z.max(dim=1, keepdim=True).values
    index = torch.arange(z.shape[1], dtype=torch.int64).expand_as(z)
    first = torch.where(z == top, index, torch.full_like(index, z.shape[1])).min(dim=1).values
    ref_a = torch.where(torch.isnan(z).any(dim=1), torch.full_like(first, -1), first)
    a = argmax.to(torch.int64).cpu()
    ok = a == ref_a
    if z_atol:
        # The f32 z of a softcap kernel ties where float64's differ by less than z_atol
        # (a cap saturates in f32 from s x / cap = 9, in float64 from 19): any index within
        # z_atol of the top that no lower index equals exactly in float64 is right.
        v = z.shape[1]
        chosen = z.gather(1, a.clamp(0, v - 1)[:, None])[:, 0]
        lower_tie = ((index < a[:, None]) & (z == chosen[:, None])).any(dim=1)
        near = (a >= 0) & (a < v) & (chosen >= top[:, 0] - z_atol) & ~lower_tie
        ok = torch.where(ref_a < 0, a == -1, near)
    bad = (~ok).nonzero().flatten().tolist()
    report.check(not bad, p.key.text, case, lambda: (
        f"argmax of {len(bad)} tokens off; first {p.where(bad[0])}: kernel "
        f"{int(a[bad[0]])}, reference {int(ref_a[bad[0]])}"))


def check_lse_low(report: Report, p: Problem, lse: torch.Tensor, low: torch.Tensor,
                  stats: Stats, case: str) -> None:
    """lse + lse_low against the float64 log-sum-exp: log(sum) to f32's precision at any
    row maximum (NumericsTest's checkLseLow)."""
    lse64, low64 = lse.to(torch.float64).cpu(), low.to(torch.float64).cpu()
    finite = torch.isfinite(stats.lse) & torch.isfinite(lse64)
    tolerance = 1e-5 * (stats.lse - stats.max).clamp(min=1.0) + p.key.z_atol()
    error = ((lse64 + low64) - stats.lse).abs()
    bad = (finite & ~(error <= tolerance)).nonzero().flatten().tolist()
    report.check(not bad, p.key.text, case, lambda: (
        f"lse + lse_low of {len(bad)} tokens off; first {p.where(bad[0])}: kernel "
        f"{fmt(float(lse64[bad[0]]))} + {fmt(float(low64[bad[0]]))}, reference "
        f"{fmt(float(stats.lse[bad[0]]))}"))


def check_grad(report: Report, p: Problem, kernel_rows: torch.Tensor, ref: torch.Tensor,
               term: torch.Tensor, case: str, flush: Optional[torch.Tensor] = None,
               rows: Optional[torch.Tensor] = None) -> None:
    """``flush``: a per-row absolute allowance (f32 subnormals flushed); ``rows``: the rows
    to check (all by default)."""
    if ref.numel() == 0:
        return
    k = kernel_rows.to(torch.float64).cpu()
    tolerance = grad_tolerance(p.key.logits, ref, term)
    if flush is not None:
        tolerance = tolerance + flush[:, None]
    # An infinite gradient must be the reference's exactly. A finite reference beyond the
    # logits dtype's range (f16 past 65520: a z-loss over logits near 65504 with a logit scale)
    # rounds to an infinity of its sign, which the kernel must then write.
    error = torch.where(k == ref, torch.zeros_like(k), (k - ref).abs())
    if p.key.logits != "f32":
        wide = (ref + torch.copysign(tolerance, ref)).to(TORCH_DTYPES[p.key.logits])
        rounded_away = torch.isinf(k) & torch.isinf(wide) & (torch.sign(k) == torch.sign(ref))
        error = torch.where(rounded_away, torch.zeros_like(error), error)
    bad_elements = ~(error <= tolerance)
    if rows is not None:
        bad_elements &= rows[:, None]
    bad_rows = bad_elements.any(dim=1).nonzero().flatten().tolist()
    for t in bad_rows[:3]:
        row_bad = bad_elements[t].nonzero().flatten()
        excess = (error[t] / tolerance[t].clamp(min=1e-300))
        excess[~bad_elements[t]] = -1
        excess[torch.isnan(excess)] = math.inf
        j = int(excess.argmax())
        report.check(False, p.key.text, case, lambda t=t, j=j, row_bad=row_bad: (
            f"grad of {p.where(t)} (label {int(p.labels[t])}): {len(row_bad)} of {p.vocab} "
            f"elements off; worst j={j}{' (target)' if j == int(p.labels[t]) else ''}: kernel "
            f"{fmt(float(k[t, j]))}, reference {fmt(float(ref[t, j]))}, tolerance "
            f"{fmt(float(tolerance[t, j]))}"))
    report.check(not bad_rows, p.key.text, case + "/grad-rows",
                 lambda: f"{len(bad_rows)} gradient rows off")


def run_case(h: Harness, report: Report, key: Key, case: Case, gen: torch.Generator) -> None:
    p = Problem(key, case, h.device, gen)
    dev = h.device
    n, v = p.n, p.vocab
    name = f"{case.name} ({key.values_text()})"
    ldt = TORCH_DTYPES[key.logits]
    # The references see z = s x in float64 (exact: a product of two f32s), or a softcap
    # kernel's z = cap tanh(s x / cap).
    z = key.transform(p.x)
    stats = reference_stats(z)

    logits = Buffer(ldt, p.logits_shape(), p.logits_strides(), dev, poison=False)
    logits_values = p.to_logits_layout(p.x).to(ldt)
    if logits.view.numel():
        logits.view.copy_(logits_values.to(dev))
    labels = Buffer(TORCH_DTYPES[key.labels], p.token_shape, p.token_strides(0), dev, poison=False)
    if n:
        labels.view.copy_(p.labels.reshape(p.token_shape).to(TORCH_DTYPES[key.labels]).to(dev))
    labels_before = labels.storage.clone()
    logits_before = logits.storage.clone()

    scale_buffer = None
    if key.op != "forward":
        if p.scale_scalar:
            scale_buffer = Buffer(torch.float32, [], [], dev, poison=False)
            scale_buffer.view.fill_(float(p.scale[0]) if n else 0.0)
        else:
            strides = [0] * len(p.token_shape) if p.scale_broadcast else p.token_strides(2)
            scale_buffer = Buffer(torch.float32, p.token_shape, strides, dev, poison=False)
            if n:
                if p.scale_broadcast:
                    scale_buffer.storage[PAD] = float(p.scale[0])
                else:
                    scale_buffer.view.copy_(p.scale.reshape(p.token_shape).to(torch.float32).to(dev))
        scale_before = scale_buffer.storage.clone()

    stream = h.stream()
    lse_used = stats.lse.clone()
    loss = lse = grad = lse_input = None
    # Every other case passes ce_options.lse_low (bundle format 4): forward and fused
    # write lse's low part, the backward reads it and is then checked against the exact
    # reference, as the fused kernel is (NumericsTest does the same on the host).
    with_low = bool(torch.randint(0, 2, (1,), generator=gen))
    low = Buffer(torch.float32, p.token_shape, p.token_strides(4), dev) if with_low else None
    low_desc = h.desc(low.view, "f32") if with_low else None
    # Every other forward and fused case also asks for the entropy and argmax (bundle
    # format 5), each poisoned; the others leave them out (their flags off).
    with_outputs = key.op != "backward" and bool(torch.randint(0, 2, (1,), generator=gen))
    entropy = argmax = None
    if with_outputs:
        entropy = Buffer(torch.float32, p.token_shape, p.token_strides(5), dev)
        argmax = Buffer(torch.int64, p.token_shape, p.token_strides(6), dev)
        argmax.view.fill_(-5)
    output_descs = ((h.desc(entropy.view, "f32"), h.desc(argmax.view, "i64"))
                    if with_outputs else None)

    def options(overwrite: bool, outputs: bool = True):  # type: ignore[no-untyped-def]
        opts = h.options(key, overwrite, case.megatron_labels)
        if low_desc is not None:
            opts.lse_low = ctypes.addressof(low_desc)
        if output_descs is not None and outputs:
            opts.entropy = ctypes.addressof(output_descs[0])
            opts.argmax = ctypes.addressof(output_descs[1])
        return opts

    try:
        if key.op == "forward":
            loss = Buffer(torch.float32, p.token_shape, p.token_strides(3), dev)
            lse = Buffer(torch.float32, p.token_shape, p.token_strides(2), dev)
            h.rt.forward(h.kernels[key.text], options(False),
                         h.desc(logits.view, key.logits),
                         h.desc(labels.view, key.labels), h.desc(loss.view, "f32"),
                         h.desc(lse.view, "f32"), stream)
        elif key.op == "backward":
            lse_input = Buffer(torch.float32, p.token_shape, p.token_strides(0), dev, poison=False)
            forward_text = key.forward_key()
            if forward_text in h.kernels and n:
                f_loss = Buffer(torch.float32, p.token_shape, packed_strides(p.token_shape), dev)
                f_lse = Buffer(torch.float32, p.token_shape, packed_strides(p.token_shape), dev)
                # The forward writes the low part straight into the backward's input.
                h.rt.forward(h.kernels[forward_text], options(False, outputs=False),
                             h.desc(logits.view, key.logits), h.desc(labels.view, key.labels),
                             h.desc(f_loss.view, "f32"), h.desc(f_lse.view, "f32"), stream)
                lse_used = p.token_values(f_lse.view).to(torch.float64).cpu()
            else:
                lse_used = stats.lse.to(torch.float32).to(torch.float64)
                if with_low and n:
                    exact_low = torch.where(torch.isfinite(lse_used), stats.lse - lse_used,
                                            torch.zeros_like(lse_used))
                    low.view.copy_(exact_low.reshape(p.token_shape).to(torch.float32).to(dev))
            if n:
                lse_input.view.copy_(lse_used.reshape(p.token_shape).to(torch.float32).to(dev))
            lse_input_before = lse_input.storage.clone()
            if with_low:
                h.sync()
                low_before = low.storage.clone()
                if n:
                    lse_used = lse_used + p.token_values(low.view).to(torch.float64).cpu()
            if not key.overwrite:
                grad = Buffer(ldt, p.logits_shape(), p.grad_strides(), dev)
            h.rt.backward(h.kernels[key.text], options(key.overwrite),
                          h.desc(logits.view, key.logits), h.desc(labels.view, key.labels),
                          h.desc(lse_input.view, "f32"), h.desc(scale_buffer.view, "f32"),
                          None if grad is None else h.desc(grad.view, key.logits), stream)
        else:
            loss = Buffer(torch.float32, p.token_shape, p.token_strides(3), dev)
            lse = Buffer(torch.float32, p.token_shape, p.token_strides(2), dev)
            if not key.overwrite:
                grad = Buffer(ldt, p.logits_shape(), p.grad_strides(), dev)
            h.rt.fused(h.kernels[key.text], options(key.overwrite),
                       h.desc(logits.view, key.logits), h.desc(labels.view, key.labels),
                       h.desc(scale_buffer.view, "f32"), h.desc(loss.view, "f32"),
                       h.desc(lse.view, "f32"), None if grad is None else h.desc(grad.view, key.logits),
                       stream)
        h.check_labels(wait=True)  # the GPU's report of this launch (host: nothing pending)
    except Exception as error:  # noqa: BLE001 - any runtime error is a failure of this case
        report.check(False, key.text, name, lambda: f"{type(error).__name__}: {error}")
        return
    h.sync()

    report.check(bool(torch.equal(labels.storage, labels_before)), key.text, name,
                 lambda: "labels were modified")
    if key.op == "backward":
        report.check(bool(torch.equal(lse_input.storage, lse_input_before)), key.text, name,
                     lambda: "lse (input) was modified")
        if with_low:
            report.check(bool(torch.equal(low.storage, low_before)), key.text, name,
                         lambda: "lse_low (input) was modified")
    if scale_buffer is not None:
        report.check(bool(torch.equal(scale_buffer.storage, scale_before)), key.text, name,
                     lambda: "grad_loss/weights were modified")
    if key.overwrite:
        report.check(logits.padding_intact(), key.text, name,
                     lambda: "bytes of the logits buffer outside the view were written")
    else:
        bits = torch.int32 if ldt == torch.float32 else torch.int16
        same = torch.equal(logits.storage.view(bits), logits_before.view(bits))
        report.check(bool(same), key.text, name, lambda: "logits were modified")

    if key.op != "backward":
        report.check(loss.padding_intact(), key.text, name, lambda: "loss padding written")
        report.check(lse.padding_intact(), key.text, name, lambda: "lse padding written")
        if n:
            ref_loss = reference_loss(z, p.labels, stats, key, case.megatron_labels)
            ignored = ignored_mask(p.labels, key.ignore_index)
            check_token_values(report, p, "loss", p.token_values(loss.view), ref_loss, ignored, name)
            check_token_values(report, p, "lse", p.token_values(lse.view), stats.lse,
                               torch.zeros_like(ignored), name)
        if with_low:
            report.check(low.padding_intact(), key.text, name, lambda: "lse_low padding written")
            if n:
                check_lse_low(report, p, p.token_values(lse.view), p.token_values(low.view),
                              stats, name)
        if with_outputs:
            report.check(entropy.padding_intact() and argmax.padding_intact(), key.text, name,
                         lambda: "entropy or argmax padding written")
            if n:
                check_outputs(report, p, z, stats, p.token_values(entropy.view),
                              p.token_values(argmax.view), name)
    if key.op != "forward" and n:
        written = logits if key.overwrite else grad
        if not key.overwrite:
            report.check(grad.padding_intact(), key.text, name, lambda: "grad padding written")
        # Given lse's low part the backward is as exact as the fused kernel.
        exact = key.op == "fused" or with_low
        if not exact:
            target = z.gather(1, p.labels.clamp(0, v - 1)[:, None])[:, 0] - lse_used
        else:
            target = stats.log_prob(z, p.labels)
        # The gradient of x is s times that of z. A backward given lse_low with s != 1:
        # the f32 low part holds s max's rounding and log(sum) together, to 2^-48 |lse|
        # (NumericsTest's extraExponentUlps); rows where that reaches 1/2 are not checked.
        extra = None
        if (key.op == "backward" and with_low and key.logit_scale != 1.0
                and not key.softcap_on):  # a softcap kernel's low part has no product
            extra = lse_used.abs() * 2.0 ** -24
        if key.softcap_on:
            # Every exponent of an f32 z is off by up to 2 z_atol: in units of the
            # exponent's 4 2^-24 allowance (reference_grad's magnitude).
            extra = torch.full_like(lse_used, key.z_atol() * 2.0 ** 23)
        # A softcap kernel's gradient of z, times dz/dx below; else of x = s times z's.
        z_scale = 1.0 if key.softcap_on else key.logit_scale
        ref, term = reference_grad(z, p.labels, lse_used, target, p.scale * z_scale,
                                   key, case.megatron_labels, exact=stats if exact else None,
                                   extra_ulps=extra)
        if key.softcap_on:
            slope = key.slope(p.x)
            # The f32 1 - t^2 is off by up to about 2^-20 where |t| nears 1 (times s):
            # |dL/dz| s 2^-19 in the tolerance's units (4 term 2^-24).
            term = term * slope + ref.abs() * key.logit_scale * 8.0
            ref = ref * slope
        # f32 p_j below 2^-126 flush to 0 (ex2.approx.ftz): |g s (1 + 2 z lse)| 2^-125; and
        # the gradient value itself, once below 2^-126, may be flushed by the FTZ multiplies
        # (bf16 has f32's exponent range): 2^-126 more.
        flush = ((p.scale * key.logit_scale).abs()
                 * (1.0 + 2.0 * key.z_loss * lse_used).abs().clamp(min=1.0) * 2.0 ** -125
                 + 2.0 ** -126)
        keep = torch.ones(n, dtype=torch.bool) if extra is None else extra * 2.0 ** -24 <= 0.5
        check_grad(report, p, p.logits_rows(written.view.cpu()), ref, term, name,
                   flush=flush, rows=keep)


#: The inputs of the bad-label cases (NumericsTest's kBadLabelSpec).
BAD_LABEL_CASE = Case("bad-label", 9, 3, 3, 7, False, False, False, False)


def bad_labels(key: Key) -> List[Tuple[int, int]]:
    """(token, label) of the bad-label cases of `key` (its values drawn as a bad-label
    case's): just past the last row, just before the first, far outside, and next to the
    ignore_index (compared exactly, not by range)."""
    return [(8, 7), (0, -1), (4, (1 << 40) if key.labels == "i64" else 12345),
            (5, key.ignore_index + 1 if key.ignore_index is not None else 99)]


def run_bad_label(h: Harness, report: Report, key: Key, bad_token: int, bad_label: int,
                  gen: torch.Generator) -> None:
    p = Problem(key, BAD_LABEL_CASE, h.device, gen)
    if key.ignore_index is not None:
        p.labels[p.labels == key.ignore_index] = 0
    p.labels[bad_token] = bad_label
    dev = h.device
    ldt = TORCH_DTYPES[key.logits]
    logits = p.to_logits_layout(p.x).to(ldt).to(dev)
    labels = p.labels.reshape(p.token_shape).to(TORCH_DTYPES[key.labels]).to(dev)
    loss = torch.full(p.token_shape, float("nan"), device=dev)
    lse = torch.full(p.token_shape, float("nan"), device=dev)
    grad = torch.zeros_like(logits)
    name = f"bad-label-{bad_label} ({key.values_text()})"
    stream = h.stream()
    try:
        if key.op == "forward":
            h.rt.forward(h.kernels[key.text], h.options(key, False), h.desc(logits, key.logits),
                         h.desc(labels, key.labels), h.desc(loss, "f32"), h.desc(lse, "f32"), stream)
        elif key.op == "backward":
            stats = reference_stats(key.transform(p.x))
            lse.copy_(stats.lse.reshape(p.token_shape).to(torch.float32).to(dev))
            scale = torch.full(p.token_shape, 1.0, device=dev)
            h.rt.backward(h.kernels[key.text], h.options(key, key.overwrite),
                          h.desc(logits, key.logits), h.desc(labels, key.labels),
                          h.desc(lse, "f32"), h.desc(scale, "f32"),
                          None if key.overwrite else h.desc(grad, key.logits), stream)
        else:
            # A 0-d weight with overwrite, per-token weights without.
            weights = (torch.tensor(1.0, device=dev) if key.overwrite
                       else torch.ones(p.token_shape, device=dev))
            h.rt.fused(h.kernels[key.text], h.options(key, key.overwrite),
                       h.desc(logits, key.logits), h.desc(labels, key.labels),
                       h.desc(weights, "f32"), h.desc(loss, "f32"), h.desc(lse, "f32"),
                       None if key.overwrite else h.desc(grad, key.logits), stream)
        h.check_labels(wait=True)
        error: Optional[BaseException] = None
    except Exception as caught:  # noqa: BLE001
        error = caught
    is_label_error = isinstance(error, h.cegen.LabelOutOfRangeError)
    message = str(error) if error else ""
    report.check(is_label_error, key.text, name, lambda: (
        f"label {bad_label} at {p.where(bad_token)}: expected LabelOutOfRangeError, got "
        f"{type(error).__name__ if error else 'no error'} {message}"))
    if not is_label_error:
        return
    expected = f"{p.where(bad_token)}: label {bad_label} is not in [0, 7)"
    report.check(expected in message, key.text, name,
                 lambda: f"message {message!r} lacks {expected!r}")
    h.sync()
    if key.op != "backward":
        value = float(p.token_values(loss)[bad_token])
        report.check(math.isnan(value), key.text, name,
                     lambda: f"loss of the bad {p.where(bad_token)} is {value}, not NaN")
    if key.op != "forward":
        written = logits if key.overwrite else grad
        row = p.logits_rows(written.cpu())[bad_token]
        report.check(bool(torch.isnan(row.to(torch.float64)).all()), key.text, name,
                     lambda: f"gradient row of the bad {p.where(bad_token)} is not NaN")


def mix(seed: int, text: str) -> int:
    value = seed ^ 0x9E3779B97F4A7C15
    for c in text.encode():
        value = ((value ^ c) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return value & 0x7FFFFFFFFFFFFFFF


def note_coverage(coverage: Optional[Dict[str, set]], key: Key) -> None:
    """Records which kinds of option value a case ran with (NumericsTest's coverage line)."""
    if coverage is None:
        return
    for field, value in (("ignore_index", "none" if key.ignore_index is None else "set"),
                         ("label_smoothing_value", "nonzero" if key.label_smoothing else "0"),
                         ("z_loss_value", "nonzero" if key.z_loss else "0"),
                         ("logit_scale", "drawn" if key.logit_scale != 1.0 else "1")):
        coverage.setdefault(field, set()).add(value)


def run_kernel(h: Harness, report: Report, text: str, cases: Sequence[Case], seed: int,
               bad_label_cases: bool = True, coverage: Optional[Dict[str, set]] = None) -> None:
    """Kernel `text` on every case of `cases`, each with option values of its own
    (:func:`draw_values`, seeded by `seed`, the key and the case), then on the bad-label
    cases (one draw of values for all four). The inputs of a case are seeded apart from its
    values, as NumericsTest's are."""
    key = Key.parse(text)
    for case in cases:
        case_key = draw_values(key, case, False, mix(seed, f"{text}/{case.name}/options"))
        note_coverage(coverage, case_key)
        gen = torch.Generator().manual_seed(mix(seed, text + "/" + case.name))
        run_case(h, report, case_key, case, gen)
    if not bad_label_cases:
        return
    bad_key = draw_values(key, BAD_LABEL_CASE, True, mix(seed, text + "/bad/options"))
    for token, label in bad_labels(bad_key):
        gen = torch.Generator().manual_seed(mix(seed, text + f"/bad-label-{label}"))
        run_bad_label(h, report, bad_key, token, label, gen)


def part_numerics(h: Harness, seed: int, results: Dict, filter_text: str) -> None:
    report = Report()
    matched = sorted(k for k in h.kernels if filter_text in k)
    # shard_stats kernels write a slice's statistics, not a loss: tp_h200.py's and
    # sanitize_h200.py's, not these cases'; rescale kernels scale a finished gradient:
    # bench/rescale_bench.py's and sanitize_rescale.py's (run as a fused kernel they fail).
    # (Backward kernels run here as the slice [0, V) of V, which the runtime passes to
    # every unsharded backward.)
    others = ("shard_stats", "rescale")
    keys = [k for k in matched if Key.parse(k).op not in others]
    if len(keys) < len(matched):
        log(f"numerics: {len(matched) - len(keys)} shard_stats and rescale kernels left to "
            f"their own checks")
    coverage: Dict[str, set] = {}
    start = time.time()
    for text in keys:
        before = report.failures
        t0 = time.time()
        run_kernel(h, report, text, CASES, seed, coverage=coverage)
        failed = report.failures - before
        log(f"[{'FAIL' if failed else ' ok '}] {text} ({time.time() - t0:.2f} s)")
    covered = {field: sorted(values) for field, values in sorted(coverage.items())}
    results["numerics"] = {
        "kernels": len(keys), "checks": report.checks, "failures": report.failures,
        "failed_kernels": len(report.failed_kernels), "seconds": round(time.time() - start, 1),
        "failed": sorted(report.failed_kernels)[:50], "coverage": covered,
        "pass": report.failures == 0 and len(keys) > 0,
    }
    log(f"coverage: {json.dumps(covered)}")
    log(f"numerics: {len(keys)} kernels, {report.checks} checks, {report.failures} failures in "
        f"{len(report.failed_kernels)} kernels, {time.time() - start:.1f} s (seed {seed})")


# -- large: N*V > 2^31 -----------------------------------------------------------------------


class SampledRows:
    """What the checks need to name a row of the large problem."""

    def __init__(self, key: Key, labels: torch.Tensor, vocab: int, rows: List[int]):
        self.key, self.labels, self.vocab, self.rows = key, labels, vocab, rows

    def where(self, t: int) -> str:
        return f"row {self.rows[t]}"


def part_large(h: Harness, seed: int, results: Dict) -> None:
    n, v = 17000, 128256
    dev = h.device
    fwd = make_key("forward", "bf16", "i64", "flat")
    bwd = make_key("backward", "bf16", "i64", "flat")
    fused = make_key("fused", "bf16", "i64", "flat", weights="token")
    missing = [k.text for k in (fwd, bwd, fused) if k.text not in h.kernels]
    if missing:
        results["large"] = {"pass": False, "error": f"bundles lack {missing}"}
        log(f"large: SKIPPED, bundles lack {missing}")
        return
    gen = torch.Generator(device=dev).manual_seed(seed)
    logits = (torch.randn((n, v), generator=gen, device=dev, dtype=torch.float32) * 2.0).to(torch.bfloat16)
    labels = torch.randint(0, v, (n,), generator=gen, device=dev)
    labels[torch.rand((n,), generator=gen, device=dev) < 0.05] = -100
    grad_loss = torch.empty((n,), device=dev).uniform_(-2, 2, generator=gen)
    loss = torch.full((n,), float("nan"), device=dev)
    lse = torch.full((n,), float("nan"), device=dev)
    grad = torch.full_like(logits, float("nan"))
    stream = h.stream()

    def forward() -> None:
        h.rt.forward(h.kernels[fwd.text], h.options(fwd, False), h.desc(logits, "bf16"),
                     h.desc(labels, "i64"), h.desc(loss, "f32"), h.desc(lse, "f32"), stream)

    def backward() -> None:
        h.rt.backward(h.kernels[bwd.text], h.options(bwd, False), h.desc(logits, "bf16"),
                      h.desc(labels, "i64"), h.desc(lse, "f32"), h.desc(grad_loss, "f32"),
                      h.desc(grad, "bf16"), stream)

    fused_loss = torch.full((n,), float("nan"), device=dev)
    fused_lse = torch.full((n,), float("nan"), device=dev)
    fused_grad = torch.full_like(logits, float("nan"))

    def fused_call() -> None:
        h.rt.fused(h.kernels[fused.text], h.options(fused, False), h.desc(logits, "bf16"),
                   h.desc(labels, "i64"), h.desc(grad_loss, "f32"), h.desc(fused_loss, "f32"),
                   h.desc(fused_lse, "f32"), h.desc(fused_grad, "bf16"), stream)

    forward()
    backward()
    fused_call()
    h.check_labels(wait=True)
    h.sync()
    boundary = (1 << 31) // v
    sample = sorted(set([0, 1, n - 2, n - 1, boundary - 1, boundary, boundary + 1] +
                        torch.randint(0, n, (57,), generator=torch.Generator().manual_seed(seed)).tolist()))
    rows = torch.tensor(sample)
    x = logits[rows.to(dev)].to(torch.float64).cpu()
    y = labels[rows.to(dev)].cpu()
    stats = reference_stats(x)
    report = Report()
    p = SampledRows(fwd, y, v, sample)
    scale = grad_loss[rows.to(dev)].to(torch.float64).cpu()
    ignored = ignored_mask(y, -100)
    for what, lv, sv, gv, key in (("forward/backward", loss, lse, grad, bwd),
                                  ("fused", fused_loss, fused_lse, fused_grad, fused)):
        p.key = key
        k_loss = lv[rows.to(dev)].cpu()
        k_lse = sv[rows.to(dev)].cpu()
        check_token_values(report, p, "loss", k_loss, reference_loss(x, y, stats, key), ignored, what)
        check_token_values(report, p, "lse", k_lse, stats.lse, torch.zeros_like(ignored), what)
        if key.op == "backward":
            lse_used = k_lse.to(torch.float64)
            target = x.gather(1, y.clamp(0, v - 1)[:, None])[:, 0] - lse_used
        else:
            lse_used = stats.lse
            target = stats.log_prob(x, y)
        ref, term = reference_grad(x, y, lse_used, target, scale, key)
        check_grad(report, p, gv[rows.to(dev)].cpu(), ref, term, what)
    all_written = bool(torch.isfinite(loss).all()) and bool(torch.isfinite(fused_loss).all())
    report.check(all_written, "large", "all-tokens", lambda: "a loss was not written (NaN left)")
    grad_written = not bool(torch.isnan(grad[-1]).any()) and not bool(torch.isnan(grad[boundary]).any())
    report.check(grad_written, "large", "all-rows", lambda: "gradient rows past 2^31 not written")

    timings = {}
    if h.gpu:
        for name, fn, nbytes in (("forward", forward, n * v * 2), ("backward", backward, 2 * n * v * 2),
                                 ("fused", fused_call, 2 * n * v * 2)):
            fn()
            torch.cuda.synchronize()
            times = []
            for _ in range(5):
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                fn()
                end.record()
                end.synchronize()
                times.append(begin.elapsed_time(end))
            ms = sorted(times)[len(times) // 2]
            timings[name] = {"ms": round(ms, 3), "GB/s": round(nbytes / ms / 1e6, 1)}
        copy_src = torch.empty(n * v * 2 // 4, dtype=torch.float32, device=dev)
        copy_dst = torch.empty_like(copy_src)
        copy_dst.copy_(copy_src)
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        copy_dst.copy_(copy_src)
        end.record()
        end.synchronize()
        ms = begin.elapsed_time(end)
        timings["d2d copy (same bytes as forward, read+write)"] = {
            "ms": round(ms, 3), "GB/s": round(2 * n * v * 2 / ms / 1e6, 1)}
        del copy_src, copy_dst
        h.check_labels(wait=True)
    results["large"] = {"n": n, "v": v, "rows_checked": len(sample), "checks": report.checks,
                        "failures": report.failures, "timings": timings,
                        "pass": report.failures == 0}
    log(f"large: N={n} V={v} bf16, {len(sample)} rows checked, {report.failures} failures; "
        f"timings {json.dumps(timings)}")


# -- probe: the runtime with a hand-written kernel --------------------------------------------


PROBE_KEY = ("op=forward,logits=f32,labels=i64,layout=flat,label_smoothing=off,z_loss=off,"
             "overwrite=0,weights=none")
#: The probe's bundle format version: the runtime reads only this one.
PROBE_VERSION = 5
#: The tensor arguments of the probe's kernel (format 4 added lse_low, format 5 the entropy
#: and argmax); the value arguments (BundleAbi.h's kValueRoles) follow them in the manifest.
PROBE_TENSOR_ARGS = [("logits", 2, "f32"), ("labels", 1, "i64"), ("loss", 1, "f32"),
                     ("lse", 1, "f32"), ("lse_low", 1, "f32"), ("entropy", 1, "f32"),
                     ("argmax", 1, "i64"), ("status", 1, "i64")]
PROBE_VALUE_ARGS = [("flags", 0, "i64"), ("ignore_index", 0, "i64"), ("label_smoothing", 0, "f32"),
                    ("z_loss", 0, "f32"), ("shard_start", 0, "i64"), ("shard_vocab", 0, "i64"),
                    ("logit_scale", 0, "f32"), ("logit_softcap", 0, "f32")]


def probe_manifest(ptx: bytes, version: int = PROBE_VERSION) -> str:
    """The text of the probe bundle's manifest, sealed as ce-gen seals one
    (``manifest_sha256``: the SHA-256 of the text with its own 64 digits as zeros)."""
    import hashlib

    zeros = "0" * 64
    manifest = {"format": "cegen-bundle", "version": version, "generator": "test_h200.py probe",
                "manifest_sha256": zeros,
                "objects": [{"file": "sm_90.ptx", "target": "sm_90", "kind": "ptx",
                             "sha256": hashlib.sha256(ptx).hexdigest()}],
                "kernels": [{"key": PROBE_KEY, "target": "sm_90", "object": "sm_90.ptx",
                             "symbol": "ce_probe_forward", "abi": "memref-descriptor-fields",
                             "args": [{"role": r, "rank": k, "dtype": d}
                                      for r, k, d in PROBE_TENSOR_ARGS + PROBE_VALUE_ARGS],
                             "launch": {"block_size": 256, "rows_per_block": 1,
                                        "lds_bytes": 0}}]}
    text = json.dumps(manifest, indent=1)
    digest = hashlib.sha256(text.encode()).hexdigest()
    assert text.count(zeros) == 1
    return text.replace(zeros, digest)


def probe_bundle(directory: Path, ptx: bytes, version: int = PROBE_VERSION) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sm_90.ptx").write_bytes(ptx)
    (directory / "manifest.json").write_text(probe_manifest(ptx, version))
    return directory


def probe_old_versions(h: Harness, report: Report, directory: Path, ptx: bytes) -> None:
    """The probe's bundle, sealed but with an older format version (1 and 2: kernels
    compiled with their option values; 3: no lse_low; 4: no entropy and argmax), is refused
    at open, the message naming its version and the one this runtime reads; the current
    version's bundle opens and lists the probe's kernel."""
    for version in range(1, PROBE_VERSION):
        message = ""
        try:
            h.rt.open_bundle(probe_bundle(directory / f"v{version}", ptx, version).resolve())
        except h.cegen.BundleError as error:
            message = str(error)
        expected = f"bundle format version {version} is older than version {PROBE_VERSION}"
        report.check(expected in message, "probe", f"version-{version}-refused",
                     lambda: f"opening a version {version} bundle: expected {expected!r}, got "
                             f"{message or 'no error'}")
    listed: List = []
    try:
        listed = h.rt.open_bundle(probe_bundle(directory / f"v{PROBE_VERSION}",
                                               ptx).resolve()).kernels()
    except Exception as error:  # noqa: BLE001 - the manifest written here must be valid
        listed = [f"{type(error).__name__}: {error}"]
    report.check(listed == [(PROBE_KEY, "sm_90")], "probe", f"version-{PROBE_VERSION}-opens",
                 lambda: f"the version {PROBE_VERSION} probe bundle lists {listed}")


def part_probe(h: Harness, seed: int, results: Dict, out: Path) -> None:
    """The runtime with abi_probe.cu's kernel, written by hand: its manifest (format version
    5) lists the value arguments after the tensors; the kernel declares the tensors and the
    flags only (the driver reads only the parameters a kernel declares), so it computes the
    plain loss of a call without ignore_index, smoothing, z-loss, a logit transform or
    Megatron's labels (the cases run with those values), and lse_low, the entropy and the
    argmax where the flags ask. Without a GPU (or nvcc) only the version checks run."""
    import shutil
    import subprocess
    import tempfile

    del out
    directory = Path(tempfile.mkdtemp(prefix="cegen-probe-"))
    report = Report()
    # A PTX module of an empty kernel, enough for the runtime's checks at open: the bundles
    # of the version checks are opened, never loaded.
    stub_ptx = (b".version 8.0\n.target sm_90\n.address_size 64\n\n"
                b".visible .entry ce_probe_forward()\n{\n\tret;\n}\n")
    probe_old_versions(h, report, directory / "versions", stub_ptx)
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc"
                                    if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if not h.gpu or nvcc is None:
        results["probe"] = {"checks": report.checks, "failures": report.failures,
                            "kernel": "skipped (no GPU)" if not h.gpu else "skipped (no nvcc)",
                            "pass": report.failures == 0}
        log(f"probe: {report.checks} version checks, {report.failures} failures; kernel "
            f"{results['probe']['kernel']}")
        return
    ptx = directory / "sm_90.ptx"
    started = time.time()
    subprocess.run([nvcc, "-ptx", "-arch=sm_90", "-o", str(ptx),
                    str(Path(__file__).with_name("abi_probe.cu"))], check=True)
    bundle = probe_bundle(directory / "bundle", ptx.read_bytes())
    compile_s = time.time() - started
    probe = Harness(None, [str(bundle)], h.device)
    key = Key.parse(PROBE_KEY)
    for case in CASES:
        if case.megatron_labels:
            continue  # the kernel reads no flags (its ignore_index is none: no token ignored)
        run_case(probe, report, key, case, torch.Generator().manual_seed(mix(seed, case.name)))
    for token, label in bad_labels(key):
        run_bad_label(probe, report, key, token, label,
                      torch.Generator().manual_seed(mix(seed, f"bad{label}")))
    results["probe"] = {"checks": report.checks, "failures": report.failures,
                        "nvcc_s": round(compile_s, 1), "pass": report.failures == 0}
    log(f"probe: {report.checks} checks, {report.failures} failures (nvcc {compile_s:.1f} s)")


# -- PyTorch-level parts (CUDA only) ---------------------------------------------------------


def torch_reference(logits: torch.Tensor, labels: torch.Tensor, key: Key,
                    label_layout: str = "bs") -> Tuple[torch.Tensor, torch.Tensor]:
    """(loss in the labels' shape, gradient of loss.sum() w.r.t. the logits) in float64."""
    x = logits.detach().to(torch.float64).cpu()
    y = labels.cpu()
    if x.dim() == 3:
        rows = x.reshape(-1, x.shape[-1])              # [S*B, V], s-major
        yy = (y.t() if label_layout == "bs" else y).reshape(-1)
    else:
        rows, yy = x, y
    stats = reference_stats(rows)
    loss = reference_loss(rows, yy, stats, key)
    grad, _ = reference_grad(rows, yy, stats.lse, stats.log_prob(rows, yy),
                             torch.ones_like(stats.lse), key)
    grad = grad.reshape(x.shape)
    if x.dim() == 3:
        loss = loss.reshape(x.shape[0], x.shape[1])
        loss = loss.t() if label_layout == "bs" else loss
    return loss, grad


def close(kernel: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float) -> bool:
    return bool(torch.allclose(kernel.detach().to(torch.float64).cpu(), ref, rtol=rtol, atol=atol,
                               equal_nan=True))


def part_streams(h: Harness, seed: int, results: Dict) -> None:
    cegen = h.cegen
    dev = h.device
    s_len, b_len, v = 64, 4, 4095
    failures: List[str] = []
    key = make_key("forward", "bf16", "i64", "sbv_bs")

    def worker(index: int, stream: torch.cuda.Stream) -> None:
        try:
            gen = torch.Generator(device=dev).manual_seed(seed + index)
            with torch.cuda.stream(stream):
                for iteration in range(12):
                    logits = (torch.randn((s_len, b_len, v), generator=gen, device=dev) * 3).to(
                        torch.bfloat16).requires_grad_()
                    labels = torch.randint(0, v, (b_len, s_len), generator=gen, device=dev)
                    labels[:, ::7] = -100
                    loss = cegen.cross_entropy(logits, labels, ignore_index=-100)
                    loss.sum().backward()
                    ref_loss, ref_grad = torch_reference(logits, labels, key)
                    if not close(loss, ref_loss, 1e-5, 1e-5):
                        failures.append(f"thread {index} iteration {iteration}: loss differs")
                    if not close(logits.grad, ref_grad, 1e-2, 1e-6):
                        failures.append(f"thread {index} iteration {iteration}: grad differs")
                # A bad label on this stream only (thread 0), reported on this stream only.
                if index == 0:
                    logits = torch.randn((s_len, b_len, v), device=dev).to(torch.bfloat16)
                    labels = torch.randint(0, v, (b_len, s_len), device=dev)
                    labels[1, 2] = v + 5
                    cegen.cross_entropy(logits, labels, ignore_index=-100)
                    try:
                        cegen.check_labels(dev)
                        failures.append("thread 0: the bad label was not reported")
                    except cegen.LabelOutOfRangeError as error:
                        if "token 66 (b=1, s=2): label 4100 is not in [0, 4095)" not in str(error):
                            failures.append(f"thread 0: unexpected message {error}")
                else:
                    cegen.check_labels(dev)
        except Exception as error:  # noqa: BLE001
            failures.append(f"thread {index}: {type(error).__name__}: {error}")

    streams = [torch.cuda.Stream(dev), torch.cuda.Stream(dev)]
    threads = [threading.Thread(target=worker, args=(i, streams[i])) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    torch.cuda.synchronize()
    results["streams"] = {"threads": 2, "iterations": 12, "failures": failures[:20],
                          "pass": not failures}
    log(f"streams: {'ok' if not failures else 'FAIL ' + '; '.join(failures[:5])}")


def part_graph(h: Harness, seed: int, results: Dict) -> None:
    from cegen import _library

    cegen = h.cegen
    dev = h.device
    s_len, b_len, v = 32, 4, 32000
    key = make_key("forward", "bf16", "i64", "sbv_bs")
    failures: List[str] = []
    # ..., label_out_of_range, logit_scale, logit_softcap
    args = (-100, 0.0, 0.0, "bs", None, "error", 1.0, 0.0)
    static_logits = torch.zeros((s_len, b_len, v), dtype=torch.bfloat16, device=dev)
    static_labels = torch.zeros((b_len, s_len), dtype=torch.int64, device=dev)
    static_grad_loss = torch.ones((b_len, s_len), device=dev)
    gen = torch.Generator(device=dev).manual_seed(seed)

    def fill() -> None:
        static_logits.copy_(torch.randn((s_len, b_len, v), generator=gen, device=dev) * 3)
        static_labels.copy_(torch.randint(0, v, (b_len, s_len), generator=gen, device=dev))
        static_labels[:, ::5] = -100
        static_grad_loss.uniform_(-2, 2, generator=gen)

    def step():
        loss, lse, lse_low = _library.forward(static_logits, static_labels, *args)
        grad = _library.backward(static_logits, static_labels, lse, lse_low, static_grad_loss,
                                 *args)
        return loss, grad

    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    fill()
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            static_loss, static_grad = step()
    except Exception as error:  # noqa: BLE001
        results["graph"] = {"pass": False, "error": f"capture failed: {error}"}
        log(f"graph: FAIL capture: {error}")
        return
    for replay in range(3):
        fill()
        graph.replay()
        torch.cuda.synchronize()
        ref_loss, ref_grad = torch_reference(static_logits, static_labels, key)
        g = static_grad_loss.to(torch.float64).cpu()
        ref_grad = ref_grad * g.t()[:, :, None]
        if not close(static_loss, ref_loss, 1e-5, 1e-5):
            failures.append(f"replay {replay}: loss differs")
        if not close(static_grad, ref_grad, 1e-2, 1e-6):
            failures.append(f"replay {replay}: grad differs")
    cegen.check_labels(dev)
    # A bad label in a replay: reported by a check on any stream of the device, per replay.
    for replay in range(2):
        fill()
        static_labels[2, 3] = v + 1
        graph.replay()
        torch.cuda.synchronize()
        try:
            cegen.check_labels(dev)
            failures.append(f"bad-label replay {replay}: not reported")
        except cegen.LabelOutOfRangeError as error:
            text = str(error)
            if "captured into a graph" not in text or "token 67 (b=2, s=3): label 32001" not in text:
                failures.append(f"bad-label replay {replay}: unexpected message {text}")
    # A capture of a bundle whose module was never loaded (it loads during the capture):
    # only the `options` bundle has this variant, and nothing above used it.
    fresh: Dict = {"pass": None}
    try:
        fresh_key = make_key("forward", "f16", "i64", "sbv_bs", None, 0.1, 1e-4)
        logits16 = (torch.randn((s_len, b_len, 4095), device=dev) * 2).to(torch.float16)
        labels16 = torch.randint(0, 4095, (b_len, s_len), device=dev)
        other = torch.cuda.CUDAGraph()
        with torch.cuda.graph(other):
            loss16, _, _ = _library.forward(logits16, labels16, None, fresh_key.label_smoothing,
                                         fresh_key.z_loss, "bs", None, "error", 1.0, 0.0)
        other.replay()
        torch.cuda.synchronize()
        ref16, _ = torch_reference(logits16, labels16, fresh_key, "bs")
        fresh = {"pass": close(loss16, ref16, 1e-5, 1e-5)}
    except Exception as error:  # noqa: BLE001
        fresh = {"pass": False, "error": f"{type(error).__name__}: {error}"}
    results["graph"] = {"replays": 3, "failures": failures, "capture_without_warmup": fresh,
                        "pass": not failures}
    log(f"graph: {'ok' if not failures else 'FAIL ' + '; '.join(failures)}; capture without "
        f"warm-up: {fresh}")


def part_python(h: Harness, seed: int, results: Dict) -> None:
    cegen = h.cegen
    dev = h.device
    failures: List[str] = []
    torch.manual_seed(seed)
    key = make_key("forward", "f32", "i64", "flat")
    # autograd, flat f32 with ignore_index
    logits = (torch.randn((300, 50257), device=dev) * 2).requires_grad_()
    labels = torch.randint(0, 50257, (300,), device=dev)
    labels[::9] = -100
    loss = cegen.cross_entropy(logits, labels, ignore_index=-100)
    loss.sum().backward()
    ref_loss, ref_grad = torch_reference(logits, labels, key)
    if not close(loss, ref_loss, 1e-5, 1e-5):
        failures.append("autograd: loss differs")
    if not close(logits.grad, ref_grad, 1e-4, 1e-7):
        failures.append("autograd: grad differs")
    # fused mode: the gradient computed in the forward, returned by backward.
    weights = torch.full((300,), 1.0 / 300, device=dev)
    logits2 = logits.detach().clone().requires_grad_()
    loss2 = cegen.cross_entropy(logits2, labels, ignore_index=-100, grad_weights=weights)
    (loss2 / 300).sum().backward()
    if not close(logits2.grad, ref_grad / 300, 1e-4, 1e-9):
        failures.append("fused: grad differs")
    # overwrite_input: the logits of a matmul, passed straight in, are exclusively owned
    # (the `overwrite` bundle has smoothing 0.1 and z-loss 1e-4 with overwrite).
    import warnings

    ow_key = make_key("backward", "f32", "i64", "flat", -100, 0.1, 1e-4, overwrite=True)
    hidden = torch.randn((128, 64), device=dev, requires_grad=True)
    weight = torch.randn((64, 4095), device=dev, requires_grad=True)
    labels3 = torch.randint(0, 4095, (128,), device=dev)
    refused: List[str] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = cegen.cross_entropy(hidden @ weight, labels3, ignore_index=-100,
                                      label_smoothing=0.1, z_loss=1e-4, overwrite_input=True)
            out.mean().backward()
        refused = [str(w.message) for w in caught if "Overwrite" in type(w.message).__name__]
        if refused:
            failures.append(f"overwrite_input refused: {refused[0]}")
        h64 = hidden.detach().to(torch.float64).cpu()
        _, ref_logit_grad = torch_reference(h64 @ weight.detach().to(torch.float64).cpu(),
                                            labels3, ow_key)
        ref_weight_grad = h64.t() @ (ref_logit_grad / 128)
        if not close(weight.grad, ref_weight_grad, 1e-4, 1e-6):
            failures.append("overwrite_input: weight grad differs")
    except Exception as error:  # noqa: BLE001
        failures.append(f"overwrite_input: {type(error).__name__}: {str(error)[:300]}")
    # Lazy label reports: the next call on the stream, and cegen.check_labels().
    bad = labels.clone()
    bad[17] = 50257 + 3
    cegen.cross_entropy(logits.detach(), bad, ignore_index=-100)
    torch.cuda.synchronize()
    try:
        cegen.cross_entropy(logits.detach(), labels, ignore_index=-100)
        failures.append("lazy report: the next call did not raise")
    except cegen.LabelOutOfRangeError as error:
        if "token 17 (n=17): label 50260 is not in [0, 50257)" not in str(error):
            failures.append(f"lazy report: unexpected message {error}")
    cegen.cross_entropy(logits.detach(), bad, ignore_index=-100)
    try:
        cegen.check_labels(dev)
        failures.append("check_labels: did not raise")
    except cegen.LabelOutOfRangeError:
        pass
    cegen.check_labels(dev)  # each report is made once
    results["python"] = {"failures": failures, "overwrite_refused": refused, "pass": not failures}
    log(f"python: {'ok' if not failures else 'FAIL ' + '; '.join(failures)}")


def part_async(h: Harness, seed: int, results: Dict) -> None:
    """The launch path does not wait for the GPU: a call made while the stream is busy
    returns long before the stream drains. Also the host cost of one launch."""
    cegen = h.cegen
    dev = h.device
    logits = torch.randn((2048, 32000), device=dev).to(torch.bfloat16)
    labels = torch.randint(0, 32000, (2048,), device=dev)
    cegen.cross_entropy(logits, labels, ignore_index=-100)  # loads the kernel
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time on this stream
    started = time.perf_counter()
    loss = cegen.cross_entropy(logits, labels, ignore_index=-100)
    call_ms = (time.perf_counter() - started) * 1e3
    pending = not torch.cuda.current_stream(dev).query()
    torch.cuda.synchronize()
    drained_ms = (time.perf_counter() - started) * 1e3
    # Host time per launch through the C API (ctypes included), and through the Python API,
    # on a problem small enough that the GPU keeps up with the launches.
    key = make_key("forward", "bf16", "i64", "flat")
    bundle = h.kernels[key.text]
    logits = logits[:64, :4095].contiguous()
    labels = labels[:64].remainder(4095)
    loss_out = torch.empty((64,), device=dev)
    lse_out = torch.empty((64,), device=dev)
    descs = (h.desc(logits, "bf16"), h.desc(labels, "i64"), h.desc(loss_out, "f32"),
             h.desc(lse_out, "f32"))
    options = h.options(key, False)
    stream = h.stream()
    for _ in range(10):
        h.rt.forward(bundle, options, *descs, stream)
    torch.cuda.synchronize()
    count = 2000
    started = time.perf_counter()
    for _ in range(count):
        h.rt.forward(bundle, options, *descs, stream)
    c_api_us = (time.perf_counter() - started) / count * 1e6
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(200):
        cegen.cross_entropy(logits, labels, ignore_index=-100)
    python_us = (time.perf_counter() - started) / 200 * 1e6
    torch.cuda.synchronize()
    h.check_labels(wait=True)
    ok = pending and call_ms < 100 and drained_ms > 300
    results["async"] = {"call_ms_while_busy": round(call_ms, 2), "stream_pending_after_call": pending,
                        "drained_ms": round(drained_ms, 1), "c_api_launch_us": round(c_api_us, 2),
                        "python_call_us": round(python_us, 1), "pass": bool(ok) and
                        bool(torch.isfinite(loss).all())}
    log(f"async: {json.dumps(results['async'])}")


# -- main ------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime", help="libce_runtime.so to load")
    parser.add_argument("--bundles", nargs="+", default=[], help="bundle directories")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="results directory")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (harness check)")
    parser.add_argument("--parts", default="probe,numerics,large,streams,graph,python,async",
                        help="probe, numerics (with the bad-label cases), large, streams, "
                             "graph, python, async")
    parser.add_argument("--filter", default="", help="only kernels whose key contains this")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()

    if args.device == "cuda" and not torch.cuda.is_available():
        print("SKIP: no CUDA device (test/gpu/test_h200.py runs on an H100/H200)")
        return 0
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    seed = args.seed if args.seed is not None else int(time.time() * 1000) % (2 ** 31)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: Dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "seed": seed,
                     "torch": torch.__version__, "command": " ".join(sys.argv)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        results["device"] = {"name": props.name, "capability": list(torch.cuda.get_device_capability(device)),
                             "memory_gib": round(props.total_memory / 2 ** 30, 1),
                             "cuda": torch.version.cuda}
    log(f"test_h200: seed {seed} (--seed to replay), torch {torch.__version__}, "
        f"device {results.get('device', 'cpu')}")
    h = Harness(args.runtime, args.bundles, device)
    log(f"{len(h.kernels)} {h.target} kernels in {len(h.bundles)} bundles")
    parts = args.parts.split(",")
    runners = {"probe": lambda: part_probe(h, seed, results, out),
               "numerics": lambda: part_numerics(h, seed, results, args.filter),
               "large": lambda: part_large(h, seed, results),
               "streams": lambda: part_streams(h, seed, results),
               "graph": lambda: part_graph(h, seed, results),
               "python": lambda: part_python(h, seed, results),
               "async": lambda: part_async(h, seed, results)}
    for part in parts:
        if part not in runners:
            continue
        if part in ("streams", "graph", "python", "async") and device.type != "cuda":
            continue
        if part in ("streams", "graph", "python", "async"):
            # These go through the package's bundle lookup.
            h.cegen.configure(bundle_dirs=[str(b.path) for b in h.bundles], run_ce_gen=False)
        started = time.time()
        try:
            runners[part]()
        except Exception as error:  # noqa: BLE001
            results[part] = {"pass": False, "error": f"{type(error).__name__}: {error}",
                             "traceback": traceback.format_exc()[-4000:]}
            log(f"{part}: ERROR {type(error).__name__}: {error}")
            log(traceback.format_exc()[-2000:])
        log(f"({part}: {time.time() - started:.1f} s)")
        with open(out / "results.json", "w") as stream:
            json.dump(results, stream, indent=1)
    with open(out / "log.txt", "w") as stream:
        stream.write("\n".join(LOG_LINES) + "\n")
    log("")
    log(f"{'part':<10} {'result':<6} detail")
    ok = True
    for part in parts:
        if part not in results:
            continue
        entry = results[part]
        passed = bool(entry.get("pass"))
        ok &= passed
        detail = {k: v for k, v in entry.items() if k in (
            "kernels", "checks", "failures", "timings", "error", "capture_without_warmup",
            "call_ms_while_busy", "c_api_launch_us", "python_call_us")}
        log(f"{part:<10} {'pass' if passed else 'FAIL':<6} {json.dumps(detail)[:300]}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
