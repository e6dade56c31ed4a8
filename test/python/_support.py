"""Shared helpers of cegen's Python tests: paths, skips, seeds and float64 references.

Run from the repository root::

    PYTHONPATH=python /usr/bin/python3 -m unittest discover -s test/python -v

The runtime library and ce-gen are found in ``build/`` (the package's default
discovery). Tests that launch kernels skip, with the reason, only when one of them has
not been built; every other test runs everywhere.

With ``CEGEN_TEST_INSTALLED=1`` (scripts/test_wheel.sh) the tests run against the
``cegen`` that Python finds installed (a wheel in a virtual environment), not this
checkout's ``python/``, and kernels may come from the package's prebuilt bundles alone.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import sys
import tempfile
import time
import unittest
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
STANDIN = HERE / "megatron_standin"

#: Whether the tests run against an installed cegen (scripts/test_wheel.sh sets it).
INSTALLED = os.environ.get("CEGEN_TEST_INSTALLED") == "1"

# Usable without PYTHONPATH too: the package from this checkout (unless the installed one
# is under test), and the Megatron stand-in.
if not INSTALLED and str(REPO / "python") not in sys.path:
    sys.path.insert(0, str(REPO / "python"))
if str(STANDIN) not in sys.path:
    sys.path.insert(0, str(STANDIN))

import torch  # noqa: E402

import cegen  # noqa: E402
from cegen import _bundle_cache, _config, _runtime  # noqa: E402

# A fresh seed per run, printed so that a failure can be replayed: set FIXED_SEED to it.
FIXED_SEED: Optional[int] = None
SEED = FIXED_SEED if FIXED_SEED is not None else int(time.time() * 1000) % (2 ** 31)
print(f"[cegen python tests] seed={SEED} torch={torch.__version__} "
      f"custom_op={cegen.HAS_CUSTOM_OP}", file=sys.stderr)

# Kernels built by ce-gen during the tests go to a private cache, removed at exit.
_CACHE = Path(tempfile.mkdtemp(prefix="cegen-test-cache-"))
atexit.register(shutil.rmtree, _CACHE, True)
cegen.configure(cache_dir=_CACHE)


def kernels_missing() -> Optional[str]:
    """Why kernels cannot be launched here (the runtime is not built, or neither ce-gen
    nor prebuilt kernels in the package are there), or None."""
    try:
        _runtime.get_runtime()
    except cegen.RuntimeLibraryError as error:
        looked = ", ".join(str(p) for p in _config.runtime_library_candidates())
        return f"libce_runtime.so is not built (looked at {looked}): {str(error).splitlines()[0]}"
    if _bundle_cache.find_ce_gen() is None and not _config.prebuilt_targets():
        looked = ", ".join(str(p) for p in _config.ce_gen_candidates())
        return f"ce-gen is not built (looked at {looked}) and the package has no prebuilt kernels"
    return None


_MISSING = kernels_missing()

#: Decorator for tests and test classes that launch kernels.
requires_kernels = unittest.skipIf(_MISSING is not None, _MISSING or "")


def generator(offset: int = 0) -> torch.Generator:
    """A generator seeded from the run's seed (``offset`` separates tests)."""
    return torch.Generator().manual_seed(SEED + offset)


def random_logits(shape: Tuple[int, ...], dtype: torch.dtype = torch.float32, *, scale: float = 3.0,
                  offset: int = 0) -> torch.Tensor:
    """Random logits with a spread that makes the softmax non-trivial."""
    values = torch.randn(shape, generator=generator(offset), dtype=torch.float64) * scale
    return values.to(dtype)


def random_labels(shape: Tuple[int, ...], vocab: int, dtype: torch.dtype = torch.int64, *,
                  offset: int = 1) -> torch.Tensor:
    """Random labels in [0, vocab)."""
    return torch.randint(0, vocab, shape, generator=generator(offset), dtype=torch.int64).to(dtype)


def sft_labels(shape: Tuple[int, ...], vocab: int, dtype: torch.dtype = torch.int64, *,
               offset: int = 1) -> torch.Tensor:
    """Labels as Megatron's SFT datasets make them, plus every other kind of bad id.

    In-range ids; -100 for a prompt prefix of random length in each row of ``[B, S]``
    labels (a random quarter of ``[N]`` labels); and, at random other positions, each id
    outside ``[0, vocab)`` of another kind: -1, ``vocab``, ``vocab + 5`` and ``2**40``
    (int64) or ``2**31 - 1`` (int32).
    """
    labels = random_labels(shape, vocab, offset=offset)
    g = generator(offset + 50)
    if len(shape) == 2:
        rows, columns = shape
        prompt = torch.randint(1, max(2, columns // 3 + 1), (rows,), generator=g)
        labels[torch.arange(columns).unsqueeze(0) < prompt.unsqueeze(1)] = -100
    else:
        labels[torch.rand(shape, generator=g) < 0.25] = -100
    flat = labels.view(-1)
    specials = [-1, vocab, vocab + 5, 2 ** 40 if dtype == torch.int64 else 2 ** 31 - 1]
    candidates = (flat != -100).nonzero().squeeze(1)
    assert len(candidates) > len(specials), f"labels of shape {shape} are too small"
    picks = candidates[torch.randperm(len(candidates), generator=g)[:len(specials)]]
    for index, value in zip(picks.tolist(), specials):
        flat[index] = value
    return labels.to(dtype)


def reference(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: Optional[int] = None,
              label_smoothing: float = 0.0, z_loss: float = 0.0, label_layout: str = "bs",
              grad_loss: Optional[torch.Tensor] = None,
              label_out_of_range: str = "error") -> Tuple[torch.Tensor, torch.Tensor]:
    """Loss and gradient in float64 from DESIGN.md's formulas (Megatron's smoothing).

    ``s = alpha*V/(V-1)``; ``loss = (1-s)(lse - x_y) + s(lse - mean x) + z lse^2``; ignored
    tokens get loss 0. With ``label_out_of_range="megatron"`` a label outside ``[0, V)``
    that is not ignored has the row maximum, as a constant, for ``x_y`` (Megatron-Core's
    contract: loss ``lse - max``, no one-hot term in the gradient); with ``"error"`` every
    label must be in range or ignored. Returns (loss in the labels' shape, gradient in the
    logits' shape).
    """
    x = logits.detach().to(torch.float64)
    vocab = x.shape[-1]
    token_major = x.transpose(0, 1) if (x.dim() == 3 and label_layout == "bs") else x
    rows = token_major.reshape(-1, vocab).clone().requires_grad_(True)
    y = labels.reshape(-1).to(torch.int64)
    ignored = (y == ignore_index) if ignore_index is not None else torch.zeros_like(y, dtype=torch.bool)
    outside = torch.zeros_like(ignored)
    if label_out_of_range == "megatron":
        outside = ((y < 0) | (y >= vocab)) & ~ignored
    safe = torch.where(ignored | outside, torch.zeros_like(y), y)
    lse = torch.logsumexp(rows, dim=-1)
    target = rows.gather(1, safe.unsqueeze(1)).squeeze(1)
    target = torch.where(outside, rows.detach().max(dim=-1).values, target)
    s = label_smoothing * vocab / (vocab - 1) if label_smoothing > 0 else 0.0
    loss = (1 - s) * (lse - target) + s * (lse - rows.mean(dim=-1)) + z_loss * lse * lse
    loss = torch.where(ignored, torch.zeros_like(loss), loss)
    upstream = (torch.ones_like(loss) if grad_loss is None
                else grad_loss.detach().to(torch.float64).reshape(-1))
    (grad_rows,) = torch.autograd.grad(loss, rows, upstream)
    grad = grad_rows.reshape(token_major.shape)
    if x.dim() == 3 and label_layout == "bs":
        grad = grad.transpose(0, 1)
    return loss.detach().reshape(labels.shape), grad


#: (rtol, atol) of the gradient by logits dtype: one rounding to the dtype, plus the fp32
#: error of p = exp(x - lse) (|lse| * 2^-24 relative), which p - 1 exposes for the target.
GRAD_TOLERANCE = {torch.float32: (2e-5, 4e-6), torch.float16: (2e-3, 4e-6),
                  torch.bfloat16: (1.6e-2, 4e-6)}
#: (rtol, atol) of the fp32 loss by logits dtype (inputs are the same rounded values).
LOSS_TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-5, 1e-5),
                  torch.bfloat16: (1e-5, 1e-5)}


def assert_close(test: unittest.TestCase, actual: torch.Tensor, expected: torch.Tensor,
                 rtol: float, atol: float, what: str) -> None:
    """assert_close in float64 with the seed in the message."""
    try:
        torch.testing.assert_close(actual.detach().to(torch.float64), expected.detach().to(torch.float64),
                                   rtol=rtol, atol=atol)
    except AssertionError as error:
        test.fail(f"{what} (seed={SEED}): {error}")


@contextlib.contextmanager
def recorded_descriptors() -> Iterator[List[Tuple[str, Tuple[int, ...], Tuple[int, ...], int]]]:
    """Records (name, sizes, strides, data pointer) of every tensor described to the runtime."""
    from cegen import _kernels

    records: List[Tuple[str, Tuple[int, ...], Tuple[int, ...], int]] = []
    original = _kernels.describe

    def describe(tensor: torch.Tensor, name: str):  # type: ignore[no-untyped-def]
        records.append((name, tuple(tensor.shape), tuple(tensor.stride()), tensor.data_ptr()))
        return original(tensor, name)

    _kernels.describe = describe
    try:
        yield records
    finally:
        _kernels.describe = original


__all__ = [
    "REPO", "STANDIN", "SEED", "INSTALLED", "requires_kernels", "kernels_missing", "generator",
    "random_logits", "random_labels", "sft_labels", "reference", "assert_close", "recorded_descriptors",
    "GRAD_TOLERANCE", "LOSS_TOLERANCE",
]
