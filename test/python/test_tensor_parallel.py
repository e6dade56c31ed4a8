"""cegen.vocab_parallel_cross_entropy: logits split over the vocabulary across ranks.

Three levels:

* :class:`TestCombine` checks :func:`cegen.combine_shard_stats` on statistics computed in
  float64 (no kernels): every option, the exact implicit one on confident rows, ties of
  the maximum across ranks, NaN and ``-inf`` slices.
* :class:`TestShardKernels` runs the real ``shard_stats`` and sharded backward kernels
  (host backend) in one process, one call per simulated rank, against the float64
  reference; and the function with no torch.distributed (a group of one).
* :class:`TestProcessGroups` starts real gloo groups of 2 and 4 processes on the CPU
  (``_tensor_parallel_worker.py``), every case batched into one run per group, and checks
  each rank's loss and gradient slice against the single-process (TP = 1) kernels and the
  float64 reference; and the Megatron stand-in at TP = 2.

The float64 reference (:func:`reference_tp`) is written from the formulas: Megatron-Core's
tensor-parallel label smoothing (``s = alpha V_local / (V_local - 1)``, each rank smoothing
towards the mean of its own slice, so the ranks' losses differ) and the global one (the
unsharded loss). Inputs are fresh random numbers each run (the seed is printed).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import shutil
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import _support as S
import torch

import cegen
from cegen import _config, _kernels
from _reference_outputs import argmax_acceptable, reference_outputs

#: A vocabulary every tested TP size divides (the slices are 67, 134 and 268 wide).
VOCAB = 4 * 67
WORKER = S.HERE / "_tensor_parallel_worker.py"
#: Seconds a process group may take for all its cases (kernels are built on the way).
GROUP_TIMEOUT_S = 600


# -- float64 references ----------------------------------------------------------------------


def token_rows(logits: torch.Tensor, label_layout: str) -> torch.Tensor:
    """The logits as token-major rows in the labels' order (a view)."""
    if logits.dim() == 3 and label_layout == "bs":
        return logits.transpose(0, 1)
    return logits


def reference_tp(logits: torch.Tensor, labels: torch.Tensor, *, world: int,
                 ignore_index: Optional[int] = None, label_smoothing: float = 0.0,
                 z_loss: float = 0.0, global_smoothing: bool = False, label_layout: str = "bs",
                 grad_loss: Optional[torch.Tensor] = None,
                 label_out_of_range: str = "error") -> Tuple[torch.Tensor, torch.Tensor]:
    """Every rank's loss (``[world, *tokens]``) and the gradient (the logits' shape; rank r's
    slice is d(sum grad_loss * loss_r)/d(its slice)), in float64.

    ``loss_r = (1 - s)(lse - x_y) + s (lse - mean) + z lse^2``, 0 for ignored tokens, with
    ``mean`` over the whole vocabulary and ``s = alpha V / (V - 1)`` (global smoothing), or
    over rank r's slice and ``s = alpha V_local / (V_local - 1)`` (Megatron-Core's TP).
    With ``label_out_of_range="megatron"`` a label outside ``[0, V)`` that is not ignored
    has ``x_y`` = the row maximum, a constant (Megatron-Core's: loss ``lse - max``, no
    one-hot term in the gradient).
    """
    x = token_rows(logits.detach().to(torch.float64), label_layout)
    vocab = x.shape[-1]
    local = vocab // world
    rows = x.reshape(-1, vocab).clone().requires_grad_(True)
    y = labels.reshape(-1).to(torch.int64)
    ignored = (y == ignore_index) if ignore_index is not None else torch.zeros_like(y, dtype=torch.bool)
    outside = torch.zeros_like(ignored)
    if label_out_of_range == "megatron":
        outside = ((y < 0) | (y >= vocab)) & ~ignored
    # lse = m + log1p(R), R summing all but one maximal element: -log p_y = (m - x_y) +
    # log1p(R) keeps its digits when p_y ~ 1, where lse - x_y would lose them to lse's rounding.
    top = rows.max(dim=-1).values
    shifted = torch.exp(rows - top.unsqueeze(-1))
    first_top = torch.zeros_like(rows, dtype=torch.bool).scatter_(
        1, rows.detach().argmax(dim=-1, keepdim=True), True)
    log1p_rest = torch.log1p(torch.where(first_top, torch.zeros_like(shifted), shifted).sum(dim=-1))
    lse = top + log1p_rest
    target = rows.gather(1, torch.where(ignored | outside, torch.zeros_like(y), y).unsqueeze(1)).squeeze(1)
    target = torch.where(outside, top.detach(), target)
    upstream = (torch.ones_like(lse) if grad_loss is None
                else grad_loss.detach().to(torch.float64).reshape(-1))
    losses, grad = [], torch.empty_like(rows)
    for rank in range(world):
        columns = slice(rank * local, (rank + 1) * local)
        loss = (top - target) + log1p_rest
        if label_smoothing:
            smoothing_vocab = vocab if global_smoothing else local
            mean = rows.mean(dim=-1) if global_smoothing else rows[:, columns].mean(dim=-1)
            s = label_smoothing * smoothing_vocab / (smoothing_vocab - 1)
            loss = (1 - s) * loss + s * (lse - mean)
        loss = loss + z_loss * lse * lse
        loss = torch.where(ignored, torch.zeros_like(loss), loss)
        (grad_rows,) = torch.autograd.grad(loss, rows, upstream, retain_graph=True)
        grad[:, columns] = grad_rows[:, columns]
        losses.append(loss.detach().reshape(labels.shape))
    grad = grad.reshape(x.shape)
    if logits.dim() == 3 and label_layout == "bs":
        grad = grad.transpose(0, 1)
    return torch.stack(losses), grad


def reference_stats(logits: torch.Tensor, labels: torch.Tensor, *, start: int, vocab: int,
                    ignore_index: Optional[int] = None, label_smoothing: float = 0.0,
                    label_layout: str = "bs", label_out_of_range: str = "error") -> torch.Tensor:
    """What ``shard_stats`` returns for a slice, computed in float64 and rounded once to
    float32: ``[*tokens, 4]`` = (max, sum exp(x - max) - 1, target or 0 or NaN, row sum).
    A label outside ``[0, vocab)``, not ignored, has target NaN, or 0 under "megatron"."""
    x = token_rows(logits.detach().to(torch.float64), label_layout)
    top = x.max(dim=-1).values
    # Elements equal to the maximum count as exact ones (an all -inf slice too), the kernels' rule.
    at_top = x == top.unsqueeze(-1)
    finite = torch.where(top == -math.inf, torch.zeros_like(top), top)
    terms = torch.where(at_top, torch.zeros_like(x), torch.exp(x - finite.unsqueeze(-1)))
    rest = terms.sum(dim=-1) + (at_top.sum(dim=-1) - 1)  # the integer part first: exact
    y = labels.to(torch.int64)
    local = y - start
    inside = (local >= 0) & (local < x.shape[-1])
    picked = x.gather(-1, torch.where(inside, local, torch.zeros_like(local)).unsqueeze(-1)).squeeze(-1)
    target = torch.where(inside, picked, torch.zeros_like(picked))
    ignored = (y == ignore_index) if ignore_index is not None else torch.zeros_like(inside)
    bad = ((y < 0) | (y >= vocab)) & ~ignored
    target = torch.where(ignored, torch.zeros_like(target), target)
    if label_out_of_range != "megatron":
        target = torch.where(bad, torch.full_like(target, math.nan), target)
    total = x.sum(dim=-1) if label_smoothing else torch.zeros_like(top)
    return torch.stack([top, rest, target, total], dim=-1).to(torch.float32)


def random_case_inputs(shape: Tuple[int, ...], dtype: torch.dtype, *, offset: int,
                       label_layout: str = "bs", ignore_index: Optional[int] = None,
                       confident: bool = False, sft_labels: bool = False,
                       label_dtype: torch.dtype = torch.int64,
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits, labels and an upstream gradient (random, some zeros) for one case.

    ``sft_labels``: Megatron SFT labels with ids outside the vocabulary of every kind
    (``S.sft_labels``) instead of in-range ones."""
    logits = S.random_logits(shape, torch.float64, offset=offset)
    tokens = _kernels.token_shape(shape, label_layout)
    if sft_labels:
        labels = S.sft_labels(tokens, shape[-1], label_dtype, offset=offset + 1)
        weights = torch.rand(tokens, generator=S.generator(offset + 4))
        weights = torch.where(weights < 0.1, torch.zeros_like(weights), weights)
        return logits.to(dtype), labels, weights
    labels = S.random_labels(tokens, shape[-1], offset=offset + 1)
    if confident:  # p_y within ~1e-9 of 1: the loss lives in the digits the combine keeps
        rows = token_rows(logits, label_layout)
        margin = 22.0 + 4.0 * torch.rand(tokens, generator=S.generator(offset + 2), dtype=torch.float64)
        peak = rows.max(dim=-1).values + margin
        rows.scatter_(-1, labels.unsqueeze(-1), peak.unsqueeze(-1))
    if ignore_index is not None:
        dropped = torch.rand(tokens, generator=S.generator(offset + 3)) < 0.25
        labels = torch.where(dropped, torch.full_like(labels, ignore_index), labels)
    weights = torch.rand(tokens, generator=S.generator(offset + 4))
    weights = torch.where(weights < 0.1, torch.zeros_like(weights), weights)
    return logits.to(dtype), labels.to(label_dtype), weights


def combine_slices(stats: List[torch.Tensor], labels: torch.Tensor, rank: int, *, vocab: int,
                   ignore_index: Optional[int] = None, label_smoothing: float = 0.0,
                   z_loss: float = 0.0, global_smoothing: bool = False,
                   label_out_of_range: str = "error") -> Tuple[torch.Tensor, torch.Tensor]:
    return cegen.combine_shard_stats(
        torch.stack(stats), labels, ignore_index=ignore_index, label_smoothing=label_smoothing,
        z_loss=z_loss, vocab_local=vocab // len(stats), vocab=vocab,
        global_smoothing=global_smoothing, rank=rank, label_out_of_range=label_out_of_range)


class TestCombine(unittest.TestCase):
    """combine_shard_stats on float64 statistics rounded to float32 (no kernels)."""

    OPTIONS = [
        {},
        {"ignore_index": -100},
        {"label_smoothing": 0.1},
        {"label_smoothing": 0.1, "global_smoothing": True},
        {"z_loss": 1e-4},
        {"ignore_index": -100, "label_smoothing": 0.2, "z_loss": 1e-3, "global_smoothing": True},
    ]

    def check(self, logits: torch.Tensor, labels: torch.Tensor, world: int, rtol: float,
              atol: float, what: str, **options: Any) -> None:
        local = VOCAB // world
        stat_options = {k: v for k, v in options.items()
                        if k in ("ignore_index", "label_smoothing", "label_out_of_range")}
        stats = [reference_stats(logits[..., r * local:(r + 1) * local], labels, start=r * local,
                                 vocab=VOCAB, **stat_options) for r in range(world)]
        expected, _ = reference_tp(logits, labels, world=world, **options)
        lse_expected = torch.logsumexp(logits.to(torch.float64), dim=-1)
        for rank in range(world):
            loss, lse = combine_slices(stats, labels, rank, vocab=VOCAB, **options)
            self.assertEqual(loss.dtype, torch.float32)
            self.assertEqual(tuple(loss.shape), tuple(labels.shape))
            S.assert_close(self, loss, expected[rank], rtol, atol, f"{what} loss rank {rank}")
            S.assert_close(self, lse, lse_expected, 1e-6, 1e-6, f"{what} lse rank {rank}")

    def test_every_option_and_world_size(self) -> None:
        for world in (1, 2, 4):
            for index, options in enumerate(self.OPTIONS):
                with self.subTest(world=world, **options):
                    logits, labels, _ = random_case_inputs(
                        (24, VOCAB), torch.float32, offset=10 * index,
                        ignore_index=options.get("ignore_index"))
                    self.check(logits, labels, world, *S.LOSS_TOLERANCE[torch.float32], "random",
                               **options)

    def test_confident_rows_keep_their_digits(self) -> None:
        # loss ~ 1e-10: 1 + rest rounds to 1 in fp32, so the combine must never form it.
        logits, labels, _ = random_case_inputs((32, VOCAB), torch.float32, offset=70, confident=True)
        expected, _ = reference_tp(logits, labels, world=1)
        self.assertLess(float(expected.max()), 1e-7)
        for world in (2, 4):
            self.check(logits, labels, world, 1e-5, 0.0, f"confident world={world}")

    def test_maximum_tied_across_ranks(self) -> None:
        logits, labels, _ = random_case_inputs((16, VOCAB), torch.float32, offset=80)
        half = VOCAB // 2
        logits[:, 3] = logits[:, half + 5] = logits.max(dim=-1).values + 2.0  # exact tie
        self.check(logits, labels, 2, 1e-5, 1e-5, "tied maximum")

    def test_a_slice_of_minus_infinity(self) -> None:
        logits, labels, _ = random_case_inputs((8, VOCAB), torch.float32, offset=90)
        logits[:, :VOCAB // 4] = -math.inf
        labels = torch.clamp(labels, min=VOCAB // 4)
        self.check(logits, labels, 4, 1e-5, 1e-5, "-inf slice")

    def test_ignored_and_bad_labels(self) -> None:
        logits, labels, _ = random_case_inputs((6, VOCAB), torch.float32, offset=100)
        labels[1] = -100
        labels[2] = VOCAB + 7  # outside the vocabulary: NaN in every slot's target
        local = VOCAB // 2
        stats = [reference_stats(logits[:, r * local:(r + 1) * local], labels, start=r * local,
                                 vocab=VOCAB, ignore_index=-100) for r in range(2)]
        loss, lse = combine_slices(stats, labels, 0, vocab=VOCAB, ignore_index=-100, z_loss=1e-4)
        self.assertEqual(float(loss[1]), 0.0)
        self.assertTrue(math.isnan(float(loss[2])))
        self.assertTrue(bool(torch.isfinite(lse).all()))
        others = [0, 3, 4, 5]
        self.assertTrue(bool(torch.isfinite(loss[others]).all()))

    def test_megatron_policy_takes_the_maximum_as_target(self) -> None:
        # A label in no slice (-100, -1, V, V + 5, 2**40): statistics target 0, and the
        # combine takes the global maximum, so loss = lse - max = log1p(rest).
        option_sets = [{}, {"ignore_index": -100}, {"label_smoothing": 0.1},
                       {"label_smoothing": 0.1, "global_smoothing": True, "z_loss": 1e-4}]
        for world in (1, 2, 4):
            for index, options in enumerate(option_sets):
                with self.subTest(world=world, **options):
                    logits, labels, _ = random_case_inputs((24, VOCAB), torch.float32,
                                                           offset=500 + 10 * index, sft_labels=True)
                    self.check(logits, labels, world, *S.LOSS_TOLERANCE[torch.float32],
                               "megatron policy", label_out_of_range="megatron", **options)
        logits, labels, _ = random_case_inputs((24, VOCAB), torch.float32, offset=540,
                                               sft_labels=True)
        local = VOCAB // 2
        stats = [reference_stats(logits[:, r * local:(r + 1) * local], labels, start=r * local,
                                 vocab=VOCAB, label_out_of_range="megatron") for r in range(2)]
        loss, lse = combine_slices(stats, labels, 0, vocab=VOCAB, label_out_of_range="megatron")
        outside = (labels < 0) | (labels >= VOCAB)
        self.assertGreaterEqual(int(outside.sum()), 4)
        x = logits.to(torch.float64)
        expected = torch.logsumexp(x, dim=-1) - x.max(dim=-1).values
        S.assert_close(self, loss[outside], expected[outside], 1e-5, 1e-6, "lse - max")
        strict, _ = combine_slices(stats, labels, 0, vocab=VOCAB)  # target 0 taken as x_y
        self.assertFalse(torch.allclose(strict[outside], loss[outside]))

    def test_reference_is_megatron_cores(self) -> None:
        # reference_tp's "megatron" policy against the Megatron-Core stand-in (TP = 1).
        from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy_impl

        for smoothing in (0.0, 0.1):
            with self.subTest(label_smoothing=smoothing):
                logits, labels, weights = random_case_inputs((6, 5, VOCAB), torch.float64,
                                                             offset=560, sft_labels=True)
                expected_loss, expected_grad = reference_tp(
                    logits, labels, world=1, label_smoothing=smoothing, grad_loss=weights,
                    label_out_of_range="megatron")
                x = logits.clone().requires_grad_(True)
                core = vocab_parallel_cross_entropy_impl(x, labels.t().contiguous(), smoothing).t()
                (core * weights.to(torch.float64)).sum().backward()
                S.assert_close(self, expected_loss[0], core, 1e-12, 1e-12, "loss")
                S.assert_close(self, expected_grad, x.grad, 1e-12, 1e-12, "gradient")

    def test_rejects_mismatched_shapes(self) -> None:
        labels = torch.zeros(5, dtype=torch.int64)
        common = dict(ignore_index=None, label_smoothing=0.0, z_loss=0.0, vocab_local=4, vocab=8,
                      global_smoothing=False)
        with self.assertRaisesRegex(cegen.InvalidInputError, r"\[world, \*tokens, 4\]"):
            cegen.combine_shard_stats(torch.zeros(2, 5, 3), labels, rank=0, **common)
        with self.assertRaisesRegex(cegen.InvalidInputError, "do not fit"):
            cegen.combine_shard_stats(torch.zeros(2, 6, 4), labels, rank=0, **common)
        with self.assertRaisesRegex(cegen.InvalidInputError, "rank 2 has no slot"):
            cegen.combine_shard_stats(torch.zeros(2, 5, 4), labels, rank=2, **common)


# -- the kernels, one process ------------------------------------------------------------------


@S.requires_kernels
class TestShardKernels(unittest.TestCase):
    """shard_stats and the sharded backward on the host, every rank simulated in turn."""

    def options(self, start: int, z_loss: float = 0.0, **options: Any) -> _kernels.KernelOptions:
        global_smoothing = options.pop("global_smoothing", False)
        return _kernels.KernelOptions(
            z_loss=z_loss, shard=_kernels.Shard(start, VOCAB, global_smoothing), **options)

    def test_statistics_match_their_definition(self) -> None:
        logits, labels, _ = random_case_inputs((5, 4, VOCAB), torch.float32, offset=200,
                                               ignore_index=-100)
        world, local = 4, VOCAB // 4
        for rank in range(world):
            with self.subTest(rank=rank):
                piece = logits[..., rank * local:(rank + 1) * local].contiguous()
                options = self.options(rank * local, ignore_index=-100, label_smoothing=0.1)
                buffer = torch.zeros((world,) + tuple(labels.shape) + (4,))
                with _kernels.poison_outputs():
                    returned = _kernels.shard_stats(piece, labels, options, out=buffer[rank])
                self.assertEqual(returned.data_ptr(), buffer[rank].data_ptr())
                expected = reference_stats(piece, labels, start=rank * local, vocab=VOCAB,
                                           ignore_index=-100, label_smoothing=0.1)
                S.assert_close(self, buffer[rank], expected, 1e-5, 1e-5, "shard statistics")
                others = [r for r in range(world) if r != rank]
                self.assertTrue(bool((buffer[others] == 0).all()), "wrote outside its slot")
                fresh = _kernels.shard_stats(piece, labels, options)
                self.assertEqual(tuple(fresh.shape), tuple(labels.shape) + (4,))
                self.assertTrue(torch.equal(fresh, buffer[rank]))

    def test_label_outside_the_vocabulary(self) -> None:
        logits, labels, _ = random_case_inputs((6, VOCAB), torch.float32, offset=250)
        labels[4] = VOCAB + 1  # in no slice: every rank reports it
        local = VOCAB // 2
        for rank in range(2):
            piece = logits[:, rank * local:(rank + 1) * local].contiguous()
            # The message names the whole vocabulary, not the rank's slice.
            with self.subTest(rank=rank), self.assertRaisesRegex(
                    cegen.LabelOutOfRangeError, rf"label {VOCAB + 1} is not in \[0, {VOCAB}\)"):
                _kernels.shard_stats(piece, labels, self.options(rank * local))

    def test_label_outside_the_vocabulary_under_megatron_policy(self) -> None:
        logits, labels, _ = random_case_inputs((6, 5, VOCAB), torch.float32, offset=260,
                                               sft_labels=True)
        world, local = 2, VOCAB // 2
        for rank in range(world):
            with self.subTest(rank=rank):
                piece = logits[..., rank * local:(rank + 1) * local].contiguous()
                with _kernels.poison_outputs():
                    stats = _kernels.shard_stats(
                        piece, labels, self.options(rank * local, label_smoothing=0.1,
                                                    label_out_of_range="megatron"))
                expected = reference_stats(piece, labels, start=rank * local, vocab=VOCAB,
                                           label_smoothing=0.1, label_out_of_range="megatron")
                S.assert_close(self, stats, expected, 1e-5, 1e-5, "shard statistics")
                outside = (labels < 0) | (labels >= VOCAB)
                self.assertTrue(bool((stats[..., 2][outside] == 0).all()), "target of a bad label")

    def test_megatron_policy_simulated_ranks(self) -> None:
        cases = [
            ((33, VOCAB), torch.float32, "bs", torch.int64, {}),
            ((33, VOCAB), torch.bfloat16, "bs", torch.int32,
             {"ignore_index": -100, "label_smoothing": 0.1}),
            ((4, 6, VOCAB), torch.float16, "sb", torch.int64,
             {"label_smoothing": 0.1, "global_smoothing": True, "z_loss": 1e-4}),
            ((6, 4, VOCAB), torch.float32, "bs", torch.int32, {"z_loss": 1e-4}),
        ]
        for index, (shape, dtype, layout, label_dtype, options) in enumerate(cases):
            for world in (2, 4):
                with self.subTest(shape=shape, dtype=dtype, labels=label_dtype, world=world,
                                  **options):
                    self.simulate(shape, dtype, layout, world, 600 + 10 * index,
                                  dict(options, label_out_of_range="megatron"),
                                  sft_labels=True, label_dtype=label_dtype)

    def test_simulated_ranks_match_the_reference(self) -> None:
        cases = [
            ((33, VOCAB), torch.float32, "bs", {}),
            ((33, VOCAB), torch.bfloat16, "bs", {"ignore_index": -100, "label_smoothing": 0.1}),
            ((4, 6, VOCAB), torch.float16, "sb", {"label_smoothing": 0.1, "global_smoothing": True,
                                                  "z_loss": 1e-4}),
        ]
        for index, (shape, dtype, layout, options) in enumerate(cases):
            for world in (2, 4):
                with self.subTest(shape=shape, dtype=dtype, world=world, **options):
                    self.simulate(shape, dtype, layout, world, 300 + 10 * index, options)

    def simulate(self, shape: Tuple[int, ...], dtype: torch.dtype, layout: str, world: int,
                 offset: int, options: Dict[str, Any], sft_labels: bool = False,
                 label_dtype: torch.dtype = torch.int64) -> None:
        logits, labels, weights = random_case_inputs(shape, dtype, offset=offset, label_layout=layout,
                                                     ignore_index=options.get("ignore_index"),
                                                     sft_labels=sft_labels, label_dtype=label_dtype)
        local = VOCAB // world
        pieces = [logits[..., r * local:(r + 1) * local].contiguous() for r in range(world)]
        stats_options = {k: v for k, v in options.items() if k != "z_loss"}
        stats = []
        for rank, piece in enumerate(pieces):
            out = torch.zeros(tuple(labels.shape) + (4,))
            with _kernels.poison_outputs():
                _kernels.shard_stats(piece, labels, self.options(rank * local, label_layout=layout,
                                                                 **stats_options), out=out)
            stats.append(out)
        expected_loss, expected_grad = reference_tp(logits, labels, world=world, label_layout=layout,
                                                    grad_loss=weights, **options)
        grads = []
        for rank, piece in enumerate(pieces):
            loss, lse = combine_slices(stats, labels, rank, vocab=VOCAB, **options)
            S.assert_close(self, loss, expected_loss[rank], *S.LOSS_TOLERANCE[dtype], f"loss rank {rank}")
            with _kernels.poison_outputs():
                grads.append(_kernels.backward(piece, labels, lse, weights,
                                               self.options(rank * local, label_layout=layout, **options),
                                               overwrite=False))
        S.assert_close(self, torch.cat(grads, dim=-1), expected_grad, *S.GRAD_TOLERANCE[dtype], "gradient")

    def test_without_torch_distributed_is_a_group_of_one(self) -> None:
        self.assertFalse(torch.distributed.is_available() and torch.distributed.is_initialized())
        logits, labels, weights = random_case_inputs((5, 3, VOCAB), torch.float32, offset=400,
                                                     ignore_index=-100)
        options = dict(ignore_index=-100, label_smoothing=0.1, z_loss=1e-4)
        x = logits.clone().requires_grad_(True)
        with _kernels.poison_outputs():
            loss = cegen.vocab_parallel_cross_entropy(x, labels, **options)
            (loss * weights).sum().backward()
        y = logits.clone().requires_grad_(True)
        single = cegen.cross_entropy(y, labels, **options)
        (single * weights).sum().backward()
        S.assert_close(self, loss, single, 1e-6, 1e-6, "loss against cross_entropy")
        S.assert_close(self, x.grad, y.grad, *S.GRAD_TOLERANCE[torch.float32], "gradient against cross_entropy")
        with self.assertRaisesRegex(cegen.InvalidInputError, "torch.distributed is not initialized"):
            cegen.vocab_parallel_cross_entropy(x, labels, group=object())

    def test_overwrite_refused_by_the_same_ownership_checks(self) -> None:
        logits, labels, _ = random_case_inputs((6, VOCAB), torch.float32, offset=450)
        x = logits.clone().requires_grad_(True)
        cegen.reset_overwrite_warnings()
        with self.assertWarnsRegex(cegen.OverwriteRefusedWarning, "leaf") as caught:
            cegen.vocab_parallel_cross_entropy(x, labels, overwrite_input=True).sum().backward()
        self.assertEqual(Path(caught.filename).name, Path(__file__).name, "warning names the caller")
        self.assertTrue(torch.equal(x.detach(), logits), "a leaf was overwritten")
        _, expected = reference_tp(logits, labels, world=1)
        S.assert_close(self, x.grad, expected, *S.GRAD_TOLERANCE[torch.float32], "gradient")


# -- real process groups ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One call of vocab_parallel_cross_entropy that every rank of a group makes."""

    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    label_layout: str = "bs"
    ignore_index: Optional[int] = None
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    global_smoothing: bool = False
    overwrite: bool = False
    no_grad: bool = False
    confident: bool = False
    bad_label: bool = False
    #: Megatron SFT labels (-100 prompts, -1, V, V + 5, 2**40 or 2**31 - 1) under the
    #: "megatron" label policy.
    sft_labels: bool = False
    label_dtype: torch.dtype = torch.int64

    @property
    def label_out_of_range(self) -> str:
        return "megatron" if self.sft_labels else "error"

    def options(self) -> Dict[str, Any]:
        return dict(ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
                    z_loss=self.z_loss, global_smoothing=self.global_smoothing,
                    label_layout=self.label_layout, label_out_of_range=self.label_out_of_range)

    def single_process_options(self) -> Dict[str, Any]:
        return dict(ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
                    z_loss=self.z_loss, label_layout=self.label_layout,
                    label_out_of_range=self.label_out_of_range)

    @property
    def rank_losses_differ(self) -> bool:
        """Megatron's local smoothing: each rank's loss has its own slice's mean."""
        return bool(self.label_smoothing) and not self.global_smoothing


CASES = [
    Case("plain", (40, VOCAB), torch.float32),
    Case("ignore_index", (40, VOCAB), torch.float32, ignore_index=-100),
    Case("smoothing_local", (40, VOCAB), torch.float32, label_smoothing=0.1),
    Case("smoothing_global", (40, VOCAB), torch.float32, label_smoothing=0.1, global_smoothing=True),
    Case("z_loss", (40, VOCAB), torch.float32, z_loss=1e-4),
    Case("sbv_bs_bf16_all_options", (6, 5, VOCAB), torch.bfloat16, ignore_index=-100,
         label_smoothing=0.1, global_smoothing=True, z_loss=1e-4),
    Case("bf16", (40, VOCAB), torch.bfloat16),
    Case("sbv_sb_f16_smoothing_local", (5, 4, VOCAB), torch.float16, label_layout="sb",
         label_smoothing=0.1),
    Case("overwrite", (6, 5, VOCAB), torch.float32, ignore_index=-100, overwrite=True),
    Case("no_grad", (40, VOCAB), torch.float32, no_grad=True),
    Case("confident", (40, VOCAB), torch.float32, confident=True),
    Case("bad_label", (40, VOCAB), torch.float32, ignore_index=-100, bad_label=True),
    Case("sft_labels", (40, VOCAB), torch.float32, sft_labels=True),
    Case("sft_labels_sbv_bs_bf16_i32_overwrite", (6, 5, VOCAB), torch.bfloat16, sft_labels=True,
         label_dtype=torch.int32, overwrite=True),
    Case("sft_labels_sbv_bs_f16_overwrite", (6, 5, VOCAB), torch.float16, sft_labels=True,
         overwrite=True),
    Case("sft_labels_sbv_sb_f16_i32_smoothing_local", (5, 4, VOCAB), torch.float16,
         label_layout="sb", label_smoothing=0.1, sft_labels=True, label_dtype=torch.int32),
    Case("sft_labels_ignore_z_loss_global", (40, VOCAB), torch.float32, ignore_index=-100,
         label_smoothing=0.1, global_smoothing=True, z_loss=1e-4, sft_labels=True),
    Case("sft_labels_no_grad", (40, VOCAB), torch.bfloat16, sft_labels=True, no_grad=True),
]
#: Cases the TP = 4 run repeats over two TP = 2 groups of its ranks.
SUBGROUP_CASES = ("plain", "smoothing_local", "sft_labels")
BAD_LABEL = VOCAB + 3


def materialize(case: Case, offset: int) -> Dict[str, Any]:
    logits, labels, weights = random_case_inputs(case.shape, case.dtype, offset=offset,
                                                 label_layout=case.label_layout,
                                                 ignore_index=case.ignore_index,
                                                 confident=case.confident,
                                                 sft_labels=case.sft_labels,
                                                 label_dtype=case.label_dtype)
    if case.bad_label:
        labels.view(-1)[7] = BAD_LABEL
    options = case.options()
    if case.overwrite:
        options["overwrite_input"] = True
    return {"name": case.name, "logits": logits, "labels": labels, "weights": weights,
            "options": options, "no_grad": case.no_grad}


def outputs_inputs(tokens: int = 11, vocab: int = 256) -> Dict[str, Any]:
    """Logits for the outputs case: random rows and a tie across slices (ids 5 and 200:
    ranks 0 and 1 at TP = 2, 0 and 3 at TP = 4), a NaN, a -inf slice, an all -inf row,
    a large offset; labels with one outside the vocabulary (Megatron's contract)."""
    x = S.random_logits((tokens, vocab), torch.float32, offset=1900)
    x[0, 5] = x[0, 200] = x[0].max() + 1.0
    x[1, 150] = math.nan
    x[2, : vocab // 2] = -math.inf
    x[3] = -math.inf
    x[4] += 1.0e4
    labels = S.random_labels((tokens,), vocab, offset=1901)
    labels[5] = vocab + 3
    return {"logits": x, "labels": labels, "logit_scale": 0.75}


def megatron_inputs(seq: int = 7, batch: int = 3, hidden_size: int = 16) -> Dict[str, torch.Tensor]:
    hidden = S.random_logits((seq, batch, hidden_size), scale=1.0, offset=900)
    weight = S.random_logits((VOCAB, hidden_size), scale=hidden_size ** -0.5, offset=901)
    labels = S.random_labels((batch, seq), VOCAB, offset=902)
    mask = (torch.rand((batch, seq), generator=S.generator(903)) > 0.25).float()
    # SFT: -100 prompts and ids outside the vocabulary; the loss mask keeps the vocabulary
    # ids; "sft_weights" (random, > 0 everywhere) also weighs the tokens the mask drops.
    sft_labels = S.sft_labels((batch, seq), VOCAB, offset=904)
    sft_mask = ((sft_labels >= 0) & (sft_labels < VOCAB)).float()
    sft_weights = torch.rand((batch, seq), generator=S.generator(905)) + 0.25
    # Only what real SFT batches hold: -100 and vocabulary ids (TE's loss is finite there).
    prompt_labels = torch.where(sft_mask.bool() | (sft_labels == -100), sft_labels,
                                torch.zeros_like(sft_labels))
    return {"hidden": hidden, "weight": weight, "labels": labels, "mask": mask,
            "sft_labels": sft_labels, "sft_mask": sft_mask, "sft_weights": sft_weights,
            "prompt_labels": prompt_labels}


def output_layer_inputs(seq: int = 8, batch: int = 3, hidden_size: int = 16) -> Dict[str, torch.Tensor]:
    """GPTModel's post-processing at TP = 2: a sequence that two ranks split (sequence
    parallelism), the weight and bias of the whole vocabulary (each rank takes its rows),
    labels (plain and Megatron's SFT ids), a loss mask and an upstream gradient."""
    labels = S.random_labels((batch, seq), VOCAB, offset=922)
    mask = (torch.rand((batch, seq), generator=S.generator(923)) > 0.25).float()
    mask[0, 0] = 1.0
    return {"hidden": S.random_logits((seq, batch, hidden_size), torch.float64, scale=1.0, offset=920),
            "weight": S.random_logits((VOCAB, hidden_size), torch.float64,
                                      scale=hidden_size ** -0.5, offset=921),
            "bias": S.random_logits((VOCAB,), torch.float64, scale=0.5, offset=924),
            "labels": labels, "sft_labels": S.sft_labels((batch, seq), VOCAB, offset=925),
            "mask": mask,
            "upstream": torch.rand((batch, seq), generator=S.generator(926), dtype=torch.float64) + 0.25}


def reference_output_layer(spec: Dict[str, torch.Tensor], variant: Dict[str, Any]) -> Dict[str, Any]:
    """TP = 1 in float64 from the formulas: logits ``h W^T (+ b)``, Megatron-Core's loss
    (a label outside the vocabulary: ``lse - max``; with ``te`` -100 gets loss 0), and the
    upstream gradient of the worker's step (``upstream``, or Megatron's training step:
    ``1024 * mask / mask.sum()``). Loss [b, s], d hidden [s, b, h], d weight, d bias."""
    hidden = spec["hidden"].clone().requires_grad_(True)
    weight = spec["weight"].clone().requires_grad_(True)
    bias = spec["bias"].clone().requires_grad_(True) if variant.get("bias") else None
    labels = spec[variant.get("labels", "labels")]
    logits = hidden @ weight.t() + (0 if bias is None else bias)  # [s, b, v]
    rows = logits.transpose(0, 1)  # [b, s, v]
    inside = (labels >= 0) & (labels < VOCAB)
    top = rows.max(dim=-1).values.detach()
    target = rows.gather(-1, labels.clamp(0, VOCAB - 1).unsqueeze(-1)).squeeze(-1)
    loss = torch.logsumexp(rows, dim=-1) - torch.where(inside, target, top)
    if variant.get("impl") == "te":
        loss = torch.where(labels == -100, torch.zeros_like(loss), loss)
    if variant.get("fused_gradient"):
        upstream = 1024.0 * spec["mask"].double() / spec["mask"].sum()
    else:
        upstream = spec["upstream"]
    (loss * upstream).sum().backward()
    return {"loss": loss.detach(), "grad_hidden": hidden.grad, "grad_weight": weight.grad,
            "grad_bias": None if bias is None else bias.grad}


def start_group(world: int, inputs: Path, directory: Path) -> Dict[str, Any]:
    """Starts one gloo group of ``world`` worker processes (:func:`collect` waits for them).

    The rendezvous store is a TCPStore held by this process on a port the operating system
    picks (bound to port 0): every group of every concurrent test run gets its own port
    atomically, so there is no port to guess and no collision to retry.
    """
    store = torch.distributed.TCPStore("127.0.0.1", 0, None, True,
                                       datetime.timedelta(seconds=GROUP_TIMEOUT_S),
                                       wait_for_workers=False)
    outputs = [directory / f"world{world}-rank{rank}.pt" for rank in range(world)]
    logs = [open(directory / f"world{world}-rank{rank}.log", "w+", encoding="utf-8")
            for rank in range(world)]
    processes = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "--rank", str(rank), "--world", str(world),
             "--port", str(store.port), "--inputs", str(inputs), "--output", str(outputs[rank]),
             "--cache-dir", str(_config.get_config().resolved_cache_dir())],
            stdin=subprocess.DEVNULL, stdout=logs[rank], stderr=subprocess.STDOUT,
            cwd=str(S.REPO))
        for rank in range(world)
    ]
    return {"store": store, "processes": processes, "logs": logs, "outputs": outputs}


def collect(group: Dict[str, Any], world: int, deadline: float) -> List[Dict[str, Any]]:
    """Each rank's results, once every process of ``group`` exited; raises with the logs'
    tails for a process that failed or outlived ``deadline`` (then all are killed)."""
    failures = []
    for rank, process in enumerate(group["processes"]):
        try:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in group["processes"]:
                if other.poll() is None:
                    other.kill()
                    other.wait()
            failures.append(f"rank {rank} did not finish within {GROUP_TIMEOUT_S} s")
            break
    for rank, (process, log) in enumerate(zip(group["processes"], group["logs"])):
        log.seek(0)
        text = log.read()
        log.close()
        if process.returncode != 0:
            tail = "\n".join(text.splitlines()[-40:])
            failures.append(f"world {world} rank {rank} exited {process.returncode}:\n{tail}")
    if failures:
        raise AssertionError("\n\n".join(failures))
    return [torch.load(path) for path in group["outputs"]]


@S.requires_kernels
@unittest.skipUnless(torch.distributed.is_available() and torch.distributed.is_gloo_available(),
                     "this PyTorch has no torch.distributed with gloo")
class TestProcessGroups(unittest.TestCase):
    """gloo groups of 2 and 4 CPU processes, all cases in one run per group."""

    WORLDS = (2, 4)
    results: Dict[int, List[Dict[str, Any]]]
    inputs: Dict[str, Dict[str, Any]]

    @classmethod
    def setUpClass(cls) -> None:
        directory = Path(tempfile.mkdtemp(prefix="cegen-tp-test-"))
        cls.addClassCleanup(shutil.rmtree, directory, True)
        cases = [materialize(case, 1000 + 20 * index) for index, case in enumerate(CASES)]
        cls.inputs = {case["name"]: case for case in cases}
        cls.results = {}
        cls.megatron = megatron_inputs()
        cls.output_layer = output_layer_inputs()
        path = directory / "inputs.pt"
        cls.outputs = outputs_inputs()
        # The same rows through a softcap (issue 17): row 4's offset saturates every z to
        # the cap (a tie over the whole vocabulary: id 0, entropy log V).
        cls.outputs_softcap = dict(cls.outputs, logit_softcap=6.0)
        torch.save({"cases": cases, "subgroup_cases": SUBGROUP_CASES, "megatron": cls.megatron,
                    "megatron_output_layer": cls.output_layer, "outputs": cls.outputs,
                    "outputs_softcap": cls.outputs_softcap}, path)
        deadline = time.monotonic() + GROUP_TIMEOUT_S
        groups = {world: start_group(world, path, directory) for world in cls.WORLDS}  # concurrently
        failures = []
        for world in cls.WORLDS:  # every group is waited for (or killed), even after a failure
            try:
                cls.results[world] = collect(groups[world], world, deadline)
            except AssertionError as error:
                failures.append(str(error))
        if failures:
            raise AssertionError("\n\n".join(failures))
        cls.single = {case.name: cls.single_process(case) for case in CASES
                      if not case.bad_label and not case.no_grad}

    @classmethod
    def single_process(cls, case: Case) -> Tuple[torch.Tensor, torch.Tensor]:
        """TP = 1: cegen.cross_entropy on the whole vocabulary."""
        data = cls.inputs[case.name]
        x = data["logits"].clone().requires_grad_(True)
        loss = cegen.cross_entropy(x, data["labels"], **case.single_process_options())
        (loss * data["weights"]).sum().backward()
        return loss.detach(), x.grad

    def check_case(self, case: Case, world: int, ranks: List[Dict[str, Any]]) -> None:
        data = self.inputs[case.name]
        dtype = case.dtype
        expected_loss, expected_grad = reference_tp(
            data["logits"], data["labels"], world=world, grad_loss=data["weights"], **case.options())
        for rank, result in enumerate(ranks):
            self.assertNotIn("error", result, result.get("traceback"))
            rtol, atol = (1e-5, 0.0) if case.confident else S.LOSS_TOLERANCE[dtype]
            S.assert_close(self, result["loss"], expected_loss[rank], rtol, atol,
                           f"{case.name} world={world} rank={rank} loss vs float64")
        losses = [result["loss"] for result in ranks]
        if case.rank_losses_differ:
            self.assertFalse(torch.equal(losses[0], losses[1]),
                             "local smoothing gave every rank the same loss")
        else:
            for rank, loss in enumerate(losses[1:], start=1):
                self.assertTrue(torch.equal(loss, losses[0]), f"rank {rank}'s loss differs from rank 0's")
            if case.name in self.single:
                rtol, atol = (1e-5, 0.0) if case.confident else (1e-5, 1e-5)
                S.assert_close(self, losses[0], self.single[case.name][0], rtol, atol,
                               f"{case.name} world={world} loss vs TP=1")
        if case.no_grad:
            return
        grad = torch.cat([result["grad"] for result in ranks], dim=-1)
        self.assertEqual(grad.dtype, dtype)
        S.assert_close(self, grad, expected_grad, *S.GRAD_TOLERANCE[dtype],
                       f"{case.name} world={world} gradient vs float64")
        if case.name in self.single and not case.rank_losses_differ:
            S.assert_close(self, grad, self.single[case.name][1], *S.GRAD_TOLERANCE[dtype],
                           f"{case.name} world={world} gradient vs TP=1")
        for rank, result in enumerate(ranks):
            self.assertEqual(result["refused"], [], f"rank {rank}")
            self.assertEqual(result["in_place"], case.overwrite,
                             f"rank {rank}: gradient in the logits' storage")

    def test_cases(self) -> None:
        for case in CASES:
            if case.bad_label:
                continue
            for world in self.WORLDS:
                with self.subTest(case=case.name, world=world):
                    self.check_case(case, world, [ranks[case.name] for ranks in self.results[world]])

    def test_two_groups_of_two_in_a_world_of_four(self) -> None:
        for name in SUBGROUP_CASES:
            case = next(c for c in CASES if c.name == name)
            results = [r["pairs/" + name] for r in self.results[4]]
            with self.subTest(case=name):
                self.check_case(case, 2, results[:2])
                self.check_case(case, 2, results[2:])

    def test_outputs_over_the_whole_vocabulary(self) -> None:
        # lse, entropy and the global argmax (issue 17) of every rank against float64, the
        # same on every rank; ties across slices go to the lower id, a NaN gives -1; with a
        # softcap too (every statistic of z).
        for name in ("outputs", "outputs_softcap"):
            with self.subTest(name):
                self.check_outputs(name, getattr(self, name))

    def check_outputs(self, name: str, spec: Dict[str, Any]) -> None:
        cap = spec.get("logit_softcap")
        ref = reference_outputs(spec["logits"], spec["labels"], logit_scale=spec["logit_scale"],
                                logit_softcap=cap, label_out_of_range="megatron")
        # z in float32 is a few ulps of the cap off z in float64 (test_logit_softcap).
        z_atol = 0.0 if cap is None else cap * 2.0 ** -20
        finite = torch.isfinite(ref.lse)
        if cap is not None:
            self.assertEqual(ref.argmax[4].item(), 0, "row 4 saturates: a tie at id 0")
        for world in self.WORLDS:
            ranks = [r[name] for r in self.results[world]]
            for rank, result in enumerate(ranks):
                what = f"world={world} rank={rank}"
                self.assertNotIn("error", result, result.get("traceback"))
                if cap is None:
                    argmax_ok = torch.equal(result["argmax"], ref.argmax)
                else:
                    argmax_ok = bool(argmax_acceptable(
                        spec["logits"], result["argmax"], atol=z_atol, logit_scale=spec["logit_scale"],
                        logit_softcap=cap).all()) and result["argmax"][4].item() == 0
                self.assertTrue(argmax_ok, f"argmax {what}: {result['argmax'].tolist()} vs "
                                           f"{ref.argmax.tolist()}")
                self.assertTrue(torch.equal(torch.isnan(result["entropy"]), ~finite), what)
                S.assert_close(self, result["entropy"][finite], ref.entropy[finite], 2e-5,
                               2e-5 + 4 * z_atol, "entropy " + what)
                S.assert_close(self, result["lse"][finite], ref.lse[finite], 1e-6,
                               1e-6 + z_atol, "lse " + what)
                for output in ("loss", "lse", "entropy", "argmax"):
                    self.assertTrue(torch.equal(result[output].nan_to_num(7.0),
                                                ranks[0][output].nan_to_num(7.0)),
                                    f"{output} {what} differs from rank 0")
            grad = torch.cat([r["grad"] for r in ranks], dim=-1)
            rows = finite.nonzero().flatten()
            rtol, atol = S.GRAD_TOLERANCE[torch.float32]
            if cap is not None:
                atol += spec["logit_scale"] * 2.0 ** -19  # the f32 1 - t^2
            S.assert_close(self, grad[rows], ref.grad[rows], rtol, atol,
                           f"{name} gradient world={world}")

    def test_bad_label_raises_on_every_rank(self) -> None:
        for world in self.WORLDS:
            for rank, ranks in enumerate(self.results[world]):
                result = ranks["bad_label"]
                self.assertEqual(result.get("error"), "LabelOutOfRangeError", f"world {world} rank {rank}")
                self.assertIn(str(BAD_LABEL), result["message"])

    def test_megatron_standin_at_tp2(self) -> None:
        from cegen import megatron as turbo_ce
        from megatron.core.models.gpt.gpt_model import TinyGPTModel
        from megatron.core.process_groups_config import FakeProcessGroup, ProcessGroupCollection
        from megatron.core.transformer.transformer_config import TransformerConfig

        # TP = 1 in this process: Megatron's own (stand-in) loss on the whole vocabulary.
        data = self.megatron
        turbo_ce.uninstall()
        config = TransformerConfig(tensor_model_parallel_size=1, cross_entropy_loss_fusion=True)
        groups = ProcessGroupCollection(tp=FakeProcessGroup(1), cp=FakeProcessGroup(1),
                                        pp=FakeProcessGroup(1), embd=None)
        module = TinyGPTModel(config, hidden_size=data["hidden"].shape[-1], vocab_size=VOCAB,
                              pg_collection=groups, output_weight=data["weight"].clone())
        loss = module(data["hidden"], data["labels"])
        ((loss * data["mask"]).sum() / data["mask"].sum()).backward()
        expected_loss, expected_grad = loss.detach(), module.output_weight.grad

        ranks = [r["megatron"] for r in self.results[2]]
        for run in ("patched", "patched_overwrite", "patched_parallel_state", "original"):
            with self.subTest(run=run):
                for rank, result in enumerate(ranks):
                    step = result[run]
                    S.assert_close(self, step["loss"], expected_loss, 1e-5, 1e-5, f"{run} rank {rank} loss")
                    if run != "original":
                        self.assertEqual(step["original_calls"], 0, f"{run} fell back: {step['logged']}")
                        self.assertEqual(step["logged"], [])
                        self.assertEqual(step["refused"], [])
                grad = torch.cat([result[run]["grad"] for result in ranks], dim=0)
                S.assert_close(self, grad, expected_grad, 1e-4, 1e-6, f"{run} weight gradient")
        for rank, result in enumerate(ranks):
            step = result["fake_group"]
            self.assertEqual(step["original_calls"], 1)
            self.assertEqual(len(step["logged"]), 1)
            self.assertRegex(step["logged"][0], "tensor-parallel size is 2 but the tensor-parallel "
                                                "group is a FakeProcessGroup")


    def test_megatron_standin_sft_labels_at_tp2(self) -> None:
        # SFT batches at TP = 2: -100 prompts and other ids outside the vocabulary, native
        # (Megatron-Core's semantics) and te (TE's -100, Core's for the others), reduced by
        # the loss mask or by weights on every token; against the TP = 1 stand-in in float64.
        from cegen import megatron as turbo_ce
        from megatron.core.models.gpt.gpt_model import TinyGPTModel
        from megatron.core.process_groups_config import FakeProcessGroup, ProcessGroupCollection
        from megatron.core.transformer.transformer_config import TransformerConfig

        data = self.megatron
        turbo_ce.uninstall()

        def reference(labels: torch.Tensor, weights: torch.Tensor, impl: str):  # type: ignore[no-untyped-def]
            config = TransformerConfig(tensor_model_parallel_size=1, cross_entropy_loss_fusion=True)
            groups = ProcessGroupCollection(tp=FakeProcessGroup(1), cp=FakeProcessGroup(1),
                                            pp=FakeProcessGroup(1), embd=None)
            module = TinyGPTModel(config, hidden_size=data["hidden"].shape[-1], vocab_size=VOCAB,
                                  pg_collection=groups,
                                  output_weight=data["weight"].to(torch.float64).clone())
            loss = module(data["hidden"].to(torch.float64), labels)  # Core's, in float64
            if impl == "te":  # TE's ignore_idx
                loss = torch.where(labels == -100, torch.zeros_like(loss), loss)
            ((loss * weights).sum() / weights.sum()).backward()
            return loss.detach(), module.output_weight.grad

        ranks = [r["megatron"] for r in self.results[2]]
        runs = {"sft_{}": ("sft_labels", "sft_mask"), "sft_{}_overwrite": ("sft_labels", "sft_mask"),
                "sft_{}_weighted": ("sft_labels", "sft_weights"),
                "prompts_{}": ("prompt_labels", "sft_weights"),
                "prompts_{}_original": ("prompt_labels", "sft_weights")}
        checks = [(name.format(impl), impl, labels, weights)
                  for impl in ("native", "te") for name, (labels, weights) in runs.items()]
        checks.append(("sft_native_original", "native", "sft_labels", "sft_weights"))
        for run, impl, labels, weights in checks:
            with self.subTest(run=run):
                expected_loss, expected_grad = reference(data[labels], data[weights], impl)
                for rank, result in enumerate(ranks):
                    step = result[run]
                    self.assertTrue(bool(torch.isfinite(step["loss"]).all()), f"{run} rank {rank}")
                    S.assert_close(self, step["loss"], expected_loss, 1e-5, 1e-5, f"{run} rank {rank} loss")
                    if not run.endswith("_original"):
                        self.assertEqual(step["original_calls"], 0, f"{run} fell back: {step['logged']}")
                        self.assertEqual(step["logged"], [])
                        self.assertEqual(step["refused"], [])
                grad = torch.cat([result[run]["grad"] for result in ranks], dim=0)
                S.assert_close(self, grad, expected_grad, 1e-4, 1e-6, f"{run} weight gradient")
                if impl == "te":
                    ignored = data[labels] == -100
                    self.assertTrue(all(bool((r[run]["loss"][ignored] == 0).all()) for r in ranks))

    def test_megatron_fused_output_layer_at_tp2(self) -> None:
        # --turbo-ce-fuse-output-layer at TP = 2 in the stand-in's GPTModel: each rank's
        # loss, d hidden (its sequence rows under sequence parallelism), d weight and d bias
        # rows against the stand-in's unfused post-processing in float64 at TP = 2, and that
        # against TP = 1 in float64.
        from _tensor_parallel_worker import OUTPUT_LAYER_VARIANTS

        ranks = [r["megatron_output_layer"] for r in self.results[2]]
        for name, variant in OUTPUT_LAYER_VARIANTS.items():
            with self.subTest(variant=name):
                expected = reference_output_layer(self.output_layer, variant)
                seq = expected["grad_hidden"].shape[0] // 2
                rows = VOCAB // 2
                for rank, result in enumerate(ranks):
                    self.assertNotIn("error", result[name], result[name].get("traceback"))
                    fused, unfused = result[name]["fused"], result[name]["unfused"]
                    self.assertEqual(fused["output_layer_runs"], 0,
                                     f"rank {rank} fell back: {fused['logged']}")
                    self.assertEqual(fused["logged"], [])
                    self.assertEqual(unfused["output_layer_runs"], 1)
                    self.assertEqual(fused["recomputes"],
                                     0 if variant.get("fused_gradient") else 1,
                                     f"rank {rank}: backward recomputes")
                    hidden_rows = (slice(rank * seq, (rank + 1) * seq)
                                   if variant.get("sequence_parallel") else slice(None))
                    mine = slice(rank * rows, (rank + 1) * rows)
                    for what, field, want in (
                            ("loss", "loss", expected["loss"]),
                            ("d hidden", "grad_hidden", expected["grad_hidden"][hidden_rows]),
                            ("d weight", "grad_weight", expected["grad_weight"][mine]),
                            ("d bias", "grad_bias",
                             None if expected["grad_bias"] is None else expected["grad_bias"][mine])):
                        if want is None:
                            self.assertIsNone(fused[field])
                            continue
                        scale = max(1.0, float(want.abs().max()))
                        # 1e-6: Megatron's step reduces the float64 loss in float32.
                        S.assert_close(self, unfused[field], want, 1e-6, 1e-9 * scale,
                                       f"{name} rank {rank} {what}: unfused TP=2 vs TP=1")
                        S.assert_close(self, fused[field], unfused[field], 1e-5, 1e-6 * scale,
                                       f"{name} rank {rank} {what}: fused vs unfused")


if __name__ == "__main__":
    unittest.main()
