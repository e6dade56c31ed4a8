"""cegen.linear_cross_entropy on the host kernels against a float64 reference.

The reference is the unchunked computation in float64: logits = h W^T + b, Megatron's
smoothing and the z-loss as in DESIGN.md, autograd for the gradients. Chunks are forced
small, so that a chunk of one token, a last partial chunk and ignored tokens across a
chunk boundary all occur; both schedules are covered (grad_weights known in the forward,
and the backward that recomputes each chunk's logits), with upstream gradients that match
the weights, are a multiple of them (Megatron's loss mask times another factor, zeros
included), differ from them otherwise (d weight NaN and a lazy UnpredictedUpstreamError, or
with grad_weights_exact=True recomputed), are stride-0 and are zero.

Vocab-parallel weights (:class:`VocabParallelTest`): gloo groups of 2 and 3 CPU processes
(test_tensor_parallel.py's worker, cases in _linear_parallel_cases.py), equal and unequal
slices, against the float64 reference on the unsharded weight (each rank's loss, d hidden
summed over the ranks, each rank's d weight and d bias slice) and against TP = 1.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
import time
import unittest
import weakref
from pathlib import Path
from unittest import mock

import torch

import _support as S
from _support import SEED, kernels_missing

import cegen
from cegen import _gradient_status, linear
import _linear_parallel_cases as cases

SKIP = kernels_missing()


def reference(hidden, weight, bias, labels, *, ignore_index=None, label_smoothing=0.0,
              z_loss=0.0, label_out_of_range="error"):
    """Per-token float64 loss of rows [N, H]; labels [N]."""
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    vocab = logits.shape[-1]
    lse = torch.logsumexp(logits, dim=-1)
    inside = (labels >= 0) & (labels < vocab)
    target = logits.gather(-1, labels.clamp(0, vocab - 1)[:, None])[:, 0]
    if label_out_of_range == "megatron":
        # Core's predicted logit 0 after the max shift: the maximum stands in for the
        # target, as a constant (Core's gradient is the softmax, no one-hot term).
        target = torch.where(inside, target, logits.max(dim=-1)[0].detach())
    loss = lse - target
    if label_smoothing:
        s = label_smoothing * vocab / (vocab - 1)
        loss = (1 - s) * loss + s * (lse - logits.mean(dim=-1))
    if z_loss:
        loss = loss + z_loss * lse * lse
    if ignore_index is not None:
        loss = torch.where(labels == ignore_index, torch.zeros_like(loss), loss)
    return loss


@contextlib.contextmanager
def counting_recomputes():
    """The backward's recomputations, in order: "all" (every gradient) or "d weight" (the
    fused schedule's d hidden rescaled, d weight and d bias recomputed)."""
    calls = []
    real = linear._recompute_grads

    def counted(*args, **kwargs):
        calls.append("all" if kwargs.get("grad_hidden") is None else "d weight")
        return real(*args, **kwargs)

    with mock.patch.object(linear, "_recompute_grads", counted):
        yield calls


@unittest.skipIf(SKIP is not None, SKIP or "")
class LinearCrossEntropyTest(unittest.TestCase):
    def setUp(self) -> None:
        self.gen = torch.Generator().manual_seed(SEED)

    def problem(self, n=11, h=16, v=37, with_bias=True):
        hidden = torch.randn((n, h), generator=self.gen, dtype=torch.float64)
        weight = torch.randn((v, h), generator=self.gen, dtype=torch.float64) * 0.5
        bias = torch.randn((v,), generator=self.gen, dtype=torch.float64) if with_bias else None
        labels = torch.randint(0, v, (n,), generator=self.gen)
        return hidden, weight, bias, labels

    def run_both(self, hidden, weight, bias, labels, upstream, *, chunk, grad_weights=None,
                 backward_with=None, report=False, grad_weights_exact=False, **options):
        """(ours, reference) of loss and the gradients of hidden, weight, bias.
        ``backward_with``: the very tensor our loss's backward gets (default: a float32
        copy of ``upstream``). ``report``: the backward's lazy report is held back (on the
        CPU it would raise from the backward, before the gradients are delivered) and
        returned third: the exception :func:`check_fused_gradients` raises, or None."""
        ref_inputs = [t.clone().requires_grad_(True) if t is not None else None
                      for t in (hidden, weight, bias)]
        ref_loss = reference(ref_inputs[0], ref_inputs[1], ref_inputs[2], labels, **options)
        ref_loss.backward(upstream)
        ours_inputs = [t.float().clone().requires_grad_(True) if t is not None else None
                       for t in (hidden, weight, bias)]
        loss = cegen.linear_cross_entropy(ours_inputs[0], ours_inputs[1], labels,
                                          bias=ours_inputs[2], chunk_tokens=chunk,
                                          grad_weights=grad_weights,
                                          grad_weights_exact=grad_weights_exact, **options)
        if backward_with is None:
            backward_with = upstream.float()
            if upstream.numel() and all(stride == 0 for stride in upstream.stride()):
                # stays a broadcast (float() of one would be a contiguous copy)
                backward_with = upstream.as_strided((), (), upstream.storage_offset()).float(
                    ).expand(upstream.shape)
        if not report:
            loss.backward(backward_with)
        else:
            with mock.patch.object(_gradient_status, "poll", lambda device: None):
                loss.backward(backward_with)
            try:
                _gradient_status.check_fused_gradients(torch.device("cpu"))
                raised = None
            except cegen.CegenError as error:
                raised = error
        ours = [loss] + [t.grad if t is not None else None for t in ours_inputs]
        refs = [ref_loss] + [t.grad if t is not None else None for t in ref_inputs]
        return (ours, refs, raised) if report else (ours, refs)

    def assert_close(self, ours, refs, what):
        names = ("loss", "d hidden", "d weight", "d bias")
        for name, got, want in zip(names, ours, refs):
            if want is None:
                continue
            self.assertIsNotNone(got, f"{what}: no {name}")
            scale = max(1.0, float(want.abs().max()))
            error = float((got.double() - want).abs().max())
            self.assertLessEqual(error, 2e-5 * scale, f"{what}: {name} off by {error} (seed {SEED})")

    def test_chunk_boundaries_and_schedules(self):
        hidden, weight, bias, labels = self.problem()
        labels[2] = labels[3] = -100  # ignored tokens on both sides of a boundary (chunk 3)
        n = labels.shape[0]
        upstream = torch.rand((n,), generator=self.gen, dtype=torch.float64) + 0.5
        for chunk in (1, 3, 4, n, n + 5):
            for schedule in ("recompute", "fused-match", "fused-equal", "fused-multiple",
                             "fused-scalar", "fused-exact", "fused-exact-differ"):
                with self.subTest(chunk=chunk, schedule=schedule):
                    grad_weights, g, backward_with, exact = None, upstream, None, False
                    if schedule == "fused-match":  # the backward gets grad_weights itself
                        grad_weights = backward_with = upstream.float()
                    elif schedule in ("fused-equal", "fused-exact"):  # equal values, other memory
                        grad_weights = upstream.float()
                        exact = schedule == "fused-exact"
                    elif schedule == "fused-multiple":  # g = grad_weights / 2 (r = 0.5)
                        grad_weights = (upstream * 2).float()
                    elif schedule == "fused-exact-differ":  # not a multiple: exact recomputes
                        grad_weights = (upstream * upstream).float()
                        exact = True
                    elif schedule == "fused-scalar":
                        grad_weights, g = 1.0 / n, torch.full((n,), 1.0 / n, dtype=torch.float64)
                    with counting_recomputes() as calls:
                        ours, refs = self.run_both(hidden, weight, bias, labels, g, chunk=chunk,
                                                   grad_weights=grad_weights,
                                                   backward_with=backward_with,
                                                   grad_weights_exact=exact,
                                                   ignore_index=-100, label_smoothing=0.1,
                                                   z_loss=1e-3)
                    self.assert_close(ours, refs, f"chunk {chunk}, {schedule}")
                    # fused-scalar: 1/N meets a contiguous upstream of 1/N (as loss.mean()
                    # gives): checked on the device, one factor, no recompute.
                    expected = {"recompute": ["all"], "fused-exact": ["d weight"],
                                "fused-exact-differ": ["d weight"]}.get(schedule, [])
                    self.assertEqual(calls, expected, f"chunk {chunk}, {schedule}: recomputes")
                    self.assertTrue(bool((ours[0][2:4] == 0).all()), "ignored tokens' loss")

    def test_stride0_and_zero_upstream(self):
        hidden, weight, bias, labels = self.problem(with_bias=False)
        n = labels.shape[0]
        for name, g in (("stride-0 ones", torch.ones((), dtype=torch.float64).expand(n)),
                        ("zeros", torch.zeros((n,), dtype=torch.float64))):
            with self.subTest(upstream=name):
                ours, refs = self.run_both(hidden, weight, None, labels, g, chunk=4)
                self.assert_close(ours, refs, name)

    def test_fused_upstreams_without_reading(self):
        """The fused schedule for upstream gradients the forward did not see, zero weights
        and zero upstreams included, each against float64: what the default backward makes
        of each (the forward's d weight, scaled by the one factor it finds on the device, or
        NaN and a report where there is none) and what grad_weights_exact=True makes of it
        (the recomputations each one needs)."""
        hidden, weight, bias, labels = self.problem()
        labels[2] = labels[3] = -100
        n = labels.shape[0]
        upstream = torch.rand((n,), generator=self.gen, dtype=torch.float64) + 0.5
        zero_weights = upstream.float().clone()
        zero_weights[[1, 5, 6]] = 0.0  # tokens 5 and 6 straddle a boundary of chunk 3
        mask = torch.ones((n,))
        mask[[0, 5, 6, 10]] = 0.0  # the first token masked: the factor's token is a later one
        soft_mask = torch.rand((n,), generator=self.gen) * 0.9 + 0.05  # not 0 or 1: rounding
        soft_mask[[4, 9]] = 0.0
        broadcast = torch.full((), 0.5).expand(n)
        ones = torch.ones((), dtype=torch.float64).expand(n)
        zeros = torch.zeros((n,), dtype=torch.float64)
        cases = [
            # (name, grad_weights, upstream float64 (None: the backward's tensor), the
            #  backward's tensor, default: "scaled" or "error", exact's recomputes)
            ("zero weights, other upstream", zero_weights, upstream, None, "error", ["d weight"]),
            ("zero weights, upstream is grad_weights", zero_weights, None, zero_weights,
             "scaled", []),
            ("weight 0, loss.sum()", 0.0, ones, None, "scaled", []),
            ("0-d tensor weight, stride-0 upstream", torch.full((), 0.25),
             torch.full((), 0.7, dtype=torch.float64).expand(n), None, "scaled", []),
            ("broadcast weights, stride-0 upstream", broadcast,
             torch.full((), 3.0, dtype=torch.float64).expand(n), None, "scaled", []),
            ("broadcast weights, zero stride-0 upstream", broadcast,
             torch.zeros((), dtype=torch.float64).expand(n), None, "scaled", []),
            ("token weights, stride-0 upstream", upstream.float(), ones, None, "error",
             ["d weight"]),
            ("number weight, token upstream", 1.0 / n, upstream, None, "error", ["d weight"]),
            ("number weight, contiguous upstream of one value", 0.25,
             torch.full((n,), 0.75, dtype=torch.float64), None, "scaled", ["d weight"]),
            ("zero weights, zero upstream", zero_weights, zeros, None, "scaled", ["d weight"]),
            ("all weights 0, zero upstream", torch.zeros((n,)), zeros, None, "scaled",
             ["d weight"]),
            ("all weights 0, other upstream", torch.zeros((n,)), upstream, None, "error",
             ["d weight"]),
            # Megatron's step: loss_mask * c against the predicted loss_mask * c'
            ("mask * 3 against mask / 7", mask / 7, None, mask * 3, "scaled", ["d weight"]),
            ("mask * 0.5 against mask * 0.5", mask * 0.5, None, mask * 0.5, "scaled",
             ["d weight"]),
            ("mask * 3 against mask / 7, masked token's upstream 1e-30", mask / 7, None,
             torch.where(torch.arange(n) == 10, torch.full((n,), 1e-30), mask * 3), "error",
             ["d weight"]),
            ("soft mask * 3 against soft mask / 7", soft_mask / 7, None, soft_mask * 3,
             "scaled", ["d weight"]),
            ("mask * 3 against mask / 7, one token 1e-5 off", mask / 7, None,
             torch.where(torch.arange(n) == 7, mask * 3 * (1 + 1e-5), mask * 3), "error",
             ["d weight"]),
        ]
        for name, grad_weights, g, backward_with, default, exact_recomputes in cases:
            if g is None:
                g = backward_with.double()
            for exact in (False, True):
                with self.subTest(case=name, exact=exact):
                    with counting_recomputes() as calls:
                        ours, refs, raised = self.run_both(
                            hidden, weight, bias, labels, g, chunk=3, grad_weights=grad_weights,
                            backward_with=backward_with, report=True, grad_weights_exact=exact,
                            ignore_index=-100, label_smoothing=0.1, z_loss=1e-3)
                    if exact or default == "scaled":
                        self.assertIsNone(raised, f"{name}: reported")
                        self.assert_close(ours, refs, name)
                        self.assertEqual(calls, exact_recomputes if exact else [],
                                         f"{name}: recomputes")
                        continue
                    self.assertEqual(calls, [], f"{name}: recomputes")
                    self.assertIsInstance(raised, _gradient_status.UnpredictedUpstreamError,
                                          f"{name}: not reported")
                    self.assertRegex(str(raised), r"grad_weights_exact=True")
                    # d hidden right (rescaled per token); d weight and d bias all NaN
                    self.assert_close(ours[:2], refs[:2], name)
                    for what, grad in (("d weight", ours[2]), ("d bias", ours[3])):
                        self.assertTrue(bool(torch.isnan(grad).all()), f"{name}: {what} not NaN")

    def test_upstream_not_a_multiple_is_reported(self):
        """Where the upstream gradient is not grad_weights times one factor: on the CPU the
        backward raises UnpredictedUpstreamError (counted tokens, where, how to switch the
        prediction off), reported once; a NaN upstream is no such report (every gradient is
        NaN then anyway) but its d weight is NaN all the same."""
        hidden, weight, _, labels = self.problem(with_bias=False)
        n = labels.shape[0]
        weights = torch.rand((n,), generator=self.gen) + 0.5
        upstream = weights * 2
        upstream[[3, 8]] *= 1.5  # two tokens off the common factor
        h, w = (t.float().clone().requires_grad_(True) for t in (hidden, weight))
        loss = cegen.linear_cross_entropy(h, w, labels, chunk_tokens=4, grad_weights=weights)
        with self.assertRaisesRegex(
                _gradient_status.UnpredictedUpstreamError,
                r"upstream gradient of 2 token\(s\) \(linear_cross_entropy backward \d+ on cpu\) "
                r"was not grad_weights times.*grad_weights_exact=True.*leave grad_weights out.*"
                r"--no-turbo-ce-fused-gradient"):
            loss.backward(upstream)
        _gradient_status.check_fused_gradients(torch.device("cpu"))  # reported once
        nan_upstream = weights * 2
        nan_upstream[5] = float("nan")
        ours, refs, raised = self.run_both(hidden, weight, None, labels, nan_upstream.double(),
                                           chunk=4, grad_weights=weights, report=True)
        self.assertIsNone(raised, "a NaN upstream reported as a wrong prediction")
        self.assertTrue(bool(torch.isnan(ours[2]).all()), "d weight of a NaN upstream")
        self.assertTrue(bool(torch.isnan(refs[2]).all()), "the reference's d weight")

    def test_report_of_both_kinds_at_once(self):
        """cegen._gradient_status holding a zero-weight count and a linear one when it
        polls: one error, of the first kind, whose message has both counts."""
        device = torch.device("cpu")
        with mock.patch.dict(_gradient_status._states, clear=True):
            state = _gradient_status._state(device, create=True)
            for count, kind, where in ((2, _gradient_status.LINEAR_UPSTREAM, "linear 3"),
                                       (5, _gradient_status.ZERO_WEIGHT, "fused 4")):
                slot = _gradient_status._new_slots(device, 1)[0]
                slot.word.fill_(count)
                slot.kind, slot.where = kind, where
                state.pending.append(slot)
            with self.assertRaisesRegex(
                    _gradient_status.ZeroWeightGradientError,
                    r"non-zero for 5 token\(s\) whose grad_weights entry was 0 \(fused 4\).*; "
                    r"and linear_cross_entropy: the upstream gradient of 2 token\(s\) "
                    r"\(linear 3\)"):
                _gradient_status.poll(device)
            _gradient_status.poll(device)  # reported once

    def test_reduction(self):
        hidden, weight, bias, labels = self.problem()
        n = labels.shape[0]
        options = dict(ignore_index=-100, label_smoothing=0.1, z_loss=1e-3)
        for reduction in ("mean", "sum"):
            for ignored, chunk, factor in (([2, 3], 3, 0.7), ([], 4, 1.0), (list(range(n)), 5, 2.0),
                                           ([0], 1, 0.0)):
                with self.subTest(reduction=reduction, ignored=len(ignored), chunk=chunk,
                                  factor=factor):
                    case_labels = labels.clone()
                    case_labels[ignored] = -100
                    refs = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
                    per_token = reference(*refs, case_labels, **options)
                    count = max(1, n - len(ignored))
                    ref = per_token.sum() / (count if reduction == "mean" else 1)
                    (ref * factor).backward()
                    ours_in = [t.float().clone().requires_grad_(True) for t in (hidden, weight, bias)]
                    with counting_recomputes() as calls:
                        loss = cegen.linear_cross_entropy(
                            ours_in[0], ours_in[1], case_labels, bias=ours_in[2],
                            chunk_tokens=chunk, reduction=reduction, **options)
                        self.assertEqual(tuple(loss.shape), ())
                        (loss * factor).backward()
                    self.assertEqual(calls, [], "a reduced loss recomputes nothing")
                    self.assert_close([loss] + [t.grad for t in ours_in],
                                      [ref.detach()] + [t.grad for t in refs],
                                      f"{reduction}, {len(ignored)} ignored")
        # without ignore_index a mean is over every token; a second backward recomputes
        refs = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
        reference(*refs, labels).mean().backward(torch.tensor(2.0, dtype=torch.float64))
        ours_in = [t.float().clone().requires_grad_(True) for t in (hidden, weight, bias)]
        loss = cegen.linear_cross_entropy(ours_in[0], ours_in[1], labels, bias=ours_in[2],
                                          chunk_tokens=4, reduction="mean")
        with counting_recomputes() as calls:
            loss.backward(retain_graph=True)
            loss.backward()
        self.assertEqual(calls, ["all"])
        self.assert_close([None] + [t.grad for t in ours_in], [None] + [t.grad for t in refs],
                          "mean, two backward passes")

    def test_one_chunk_of_logits_at_a_time(self):
        """No chunk's logits are alive when the next chunk's are made, in the forward and in
        the backward's recomputation (the memory target: d weight + one chunk)."""
        hidden, weight, bias, labels = self.problem()
        alive = []
        real = linear._logits_of

        def watched(*args):
            self.assertEqual([ref for ref in alive if ref() is not None], [],
                             "a previous chunk's logits are still alive")
            logits = real(*args)
            alive.append(weakref.ref(logits))
            return logits

        upstream = torch.rand((labels.shape[0],), generator=self.gen) + 0.5
        with mock.patch.object(linear, "_logits_of", watched):
            for grad_weights in (None, upstream, 0.5):
                with self.subTest(grad_weights=type(grad_weights).__name__):
                    alive.clear()
                    h, w, b = (t.float().clone().requires_grad_(True) for t in (hidden, weight, bias))
                    loss = cegen.linear_cross_entropy(h, w, labels, bias=b, chunk_tokens=3,
                                                      grad_weights=grad_weights,
                                                      grad_weights_exact=True)
                    # not grad_weights' tensor: with grad_weights_exact, every schedule
                    # recomputes
                    loss.backward(upstream * 2)
                    self.assertGreater(len(alive), 4)

    def test_forward_gradients_released_before_the_recompute(self):
        """A backward that recomputes d weight (grad_weights_exact=True) releases the
        forward's d weight (and d bias) before it allocates its own: never two at once."""
        hidden, weight, bias, labels = self.problem()
        made = []
        real = linear._zero_grads

        def watched(*args):
            alive = [ref for ref in made if ref() is not None]
            self.assertEqual(alive, [], "the forward's d weight is still alive")
            grads = real(*args)
            made.append(weakref.ref(grads[1]))
            return grads

        upstream = torch.rand((labels.shape[0],), generator=self.gen) + 0.5
        for grad_weights in (upstream, 0.5):
            with self.subTest(grad_weights=type(grad_weights).__name__):
                made.clear()
                h, w, b = (t.float().clone().requires_grad_(True) for t in (hidden, weight, bias))
                with mock.patch.object(linear, "_zero_grads", watched):
                    loss = cegen.linear_cross_entropy(h, w, labels, bias=b, chunk_tokens=3,
                                                      grad_weights=grad_weights,
                                                      grad_weights_exact=True)
                    loss.backward(upstream * 2)  # not grad_weights' tensor: d weight recomputed
                self.assertEqual(len(made), 2)

    def test_megatron_layout_and_labels(self):
        s_len, b_len, h, v = 5, 3, 8, 29
        hidden = torch.randn((s_len, b_len, h), generator=self.gen, dtype=torch.float64)
        weight = torch.randn((v, h), generator=self.gen, dtype=torch.float64)
        labels = torch.randint(0, v, (b_len, s_len), generator=self.gen)
        labels[0, :2] = -100
        labels[1, 3] = v + 5
        h32 = hidden.float().requires_grad_(True)
        w32 = weight.float().requires_grad_(True)
        loss = cegen.linear_cross_entropy(h32, w32, labels, chunk_tokens=4,
                                          label_out_of_range="megatron")
        self.assertEqual(tuple(loss.shape), (b_len, s_len))
        upstream = torch.rand((b_len, s_len), generator=self.gen)
        loss.backward(upstream)
        rows_h = hidden.clone().requires_grad_(True)
        rows_w = weight.clone().requires_grad_(True)
        ref = reference(rows_h.reshape(-1, h), rows_w, None, labels.t().reshape(-1),
                        label_out_of_range="megatron").view(s_len, b_len).t()
        ref.backward(upstream.double())
        self.assert_close([loss, h32.grad, w32.grad], [ref, rows_h.grad, rows_w.grad],
                          "[S, B, H] with [B, S] labels, Megatron's labels")

    def test_bad_input(self):
        hidden, weight, _, labels = self.problem(with_bias=False)
        h32, w32 = hidden.float(), weight.float()
        cases = [
            (lambda: cegen.linear_cross_entropy(h32, w32[:, :3], labels), "weight must be [V, H]"),
            (lambda: cegen.linear_cross_entropy(h32, w32.double(), labels), "must match hidden"),
            (lambda: cegen.linear_cross_entropy(h32, w32, labels[:3]), "do not fit hidden"),
            (lambda: cegen.linear_cross_entropy(h32, w32, labels, chunk_tokens=0),
             "chunk_tokens must be an integer in [1, 9223372036854775807] or None, got 0"),
            (lambda: cegen.linear_cross_entropy(h32, w32, labels, grad_weights="x"),
             "grad_weights must be a finite real number in float32's range"),
            (lambda: cegen.linear_cross_entropy(h32, w32, labels, reduction="avg"),
             "reduction must be 'none', 'mean' or 'sum', got 'avg'"),
            (lambda: cegen.linear_cross_entropy(h32, w32, labels, reduction="mean",
                                                grad_weights=1.0),
             "grad_weights is for reduction='none'"),
            (lambda: cegen.linear_cross_entropy(h32, w32, labels, grad_weights=1.0,
                                                grad_weights_exact="yes"),
             "grad_weights_exact must be True or False"),
        ]
        for call, message in cases:
            with self.subTest(message=message):
                with self.assertRaisesRegex(cegen.InvalidInputError, re.escape(message)):
                    call()
        bad = labels.clone()
        bad[0] = 10 ** 6
        with self.assertRaises(cegen.LabelOutOfRangeError):
            cegen.linear_cross_entropy(h32, w32, bad)




def reference_sharded(hidden, weight, bias, labels, upstream, bounds, *, ignore_index=None,
                      label_smoothing=0.0, z_loss=0.0, global_smoothing=True,
                      label_out_of_range="error"):
    """Float64, rows [N, H], labels [N], the vocabulary split at ``bounds``: every rank's
    loss ``[world, N]``, d hidden (``sum_r G_r W_r``), each rank's share ``G_r W_r``, and
    d weight and d bias of the whole weight (rank r's rows are its slice's), where ``G_r``
    is the gradient of ``sum upstream * loss_r`` w.r.t. rank r's logits. With
    ``global_smoothing`` every ``loss_r`` is the unsharded loss; otherwise rank r smooths
    towards its own slice's mean with ``s = alpha V_r / (V_r - 1)`` (Megatron-Core's)."""
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    logits = logits.detach().requires_grad_(True)
    vocab = logits.shape[-1]
    lse = torch.logsumexp(logits, dim=-1)
    inside = (labels >= 0) & (labels < vocab)
    target = logits.gather(-1, labels.clamp(0, vocab - 1)[:, None])[:, 0]
    if label_out_of_range == "megatron":
        target = torch.where(inside, target, logits.max(dim=-1)[0].detach())
    grad_logits = torch.zeros_like(logits)
    losses = []
    for start, end in bounds:
        loss = lse - target
        if label_smoothing:
            width = vocab if global_smoothing else end - start
            mean = logits.mean(dim=-1) if global_smoothing else logits[:, start:end].mean(dim=-1)
            s = label_smoothing * width / (width - 1)
            loss = (1 - s) * loss + s * (lse - mean)
        if z_loss:
            loss = loss + z_loss * lse * lse
        if ignore_index is not None:
            loss = torch.where(labels == ignore_index, torch.zeros_like(loss), loss)
        (grad,) = torch.autograd.grad(loss, logits, upstream, retain_graph=True)
        grad_logits[:, start:end] = grad[:, start:end]
        losses.append(loss.detach())
    shares = [grad_logits[:, a:b] @ weight[a:b] for a, b in bounds]
    return {"loss": torch.stack(losses), "grad_hidden": grad_logits @ weight, "shares": shares,
            "grad_weight": grad_logits.t() @ hidden, "grad_bias": grad_logits.sum(dim=0)}


#: Tokens, hidden size and a vocabulary that 2 and 3 ranks split evenly (21 and 14 ids).
N, H, V = 11, 16, 42


def parallel_cases():
    """The calls every rank makes: chunks of 1 token, 3 (ignored tokens 2 and 3 on both
    sides of the first boundary), 4 (a last partial chunk of 3) and more than N; every
    schedule; equal and unequal slices; Megatron's smoothing; [S, B, H] with Megatron's
    labels; d hidden left unreduced; a bad label."""
    c = cases.case
    made = [c(f"chunk{chunk}-{schedule}", schedule=schedule, chunk=chunk)
            for chunk in (1, 3, 4, N + 5)
            for schedule in ("recompute", "fused-match", "fused-differ", "mean")]
    made += [c("fused-exact", schedule="fused-exact", chunk=3),
             c("sbh-fused-exact", schedule="fused-exact", chunk=4, layout="sbh")]
    made += [
        c("sum", schedule="sum", chunk=3, bias=False),
        c("zeros", schedule="zeros", chunk=4),
        c("fused-twice", schedule="fused-twice", chunk=3),
        c("no-grad", schedule="no-grad", chunk=4),
        c("plain-options", schedule="recompute", chunk=3, label_smoothing=0.0, z_loss=0.0,
          bias=False),
        c("local-smoothing-recompute", schedule="recompute", chunk=3, global_smoothing=False),
        c("local-smoothing-fused", schedule="fused-match", chunk=4, global_smoothing=False),
        c("sbh-sft-recompute", schedule="recompute", chunk=4, layout="sbh", labels="sft",
          bias=False, ignore_index=None),
        c("sbh-sft-fused", schedule="fused-match", chunk=5, layout="sbh", labels="sft",
          bias=False, ignore_index=None),
        c("unreduced-recompute", schedule="recompute", chunk=3, reduce_grad_hidden=False),
        c("unreduced-fused", schedule="fused-match", chunk=3, reduce_grad_hidden=False),
        c("bad-label", schedule="recompute", chunk=3, labels="bad"),
    ]
    made += [c(f"uneven-{schedule}", schedule=schedule, chunk=3, uneven=True)
             for schedule in ("recompute", "fused-match", "mean", "no-grad")]
    made.append(c("uneven-local-smoothing", schedule="fused-match", chunk=4, uneven=True,
                  global_smoothing=False))
    made += [c("reduced", schedule="reduced", chunk=3),
             c("reduced-uneven-local-smoothing", schedule="reduced", chunk=4, uneven=True,
               global_smoothing=False)]
    return made


def parallel_spec():
    gen = torch.Generator().manual_seed(SEED + 7)
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[2] = labels[3] = -100
    bad = labels.clone()
    bad[5] = V + 3
    seq, batch = 4, 3
    return {
        "hidden": torch.randn((N, H), generator=gen, dtype=torch.float64),
        "weight": torch.randn((V, H), generator=gen, dtype=torch.float64) * 0.5,
        "bias": torch.randn((V,), generator=gen, dtype=torch.float64),
        "labels": labels, "bad_labels": bad,
        "upstream": torch.rand((N,), generator=gen, dtype=torch.float64) + 0.5,
        "hidden_sbh": torch.randn((seq, batch, H), generator=gen, dtype=torch.float64),
        "labels_bs": torch.randint(0, V, (batch, seq), generator=gen),
        "sft_labels_bs": S.sft_labels((batch, seq), V, offset=SEED % 1000),
        "upstream_bs": torch.rand((batch, seq), generator=gen, dtype=torch.float64) + 0.5,
        "cases": parallel_cases(),
    }


def as_rows(case, data):
    """(hidden [N, H], labels [N], upstream [N]) in token order s * B + b."""
    hidden, labels, upstream = data["hidden"], data["labels"], data["upstream"]
    if case["layout"] == "sbh":
        return (hidden.reshape(-1, hidden.shape[-1]), labels.t().reshape(-1),
                upstream.t().reshape(-1))
    return hidden, labels, upstream


def loss_rows(case, loss):
    return loss.t().reshape(-1) if case["layout"] == "sbh" else loss


@S.requires_kernels
@unittest.skipUnless(torch.distributed.is_available() and torch.distributed.is_gloo_available(),
                     "this PyTorch has no torch.distributed with gloo")
class VocabParallelTest(unittest.TestCase):
    """gloo groups of 2 and 3 CPU processes, every case in one run per group."""

    WORLDS = (2, 3)

    @classmethod
    def setUpClass(cls):
        import test_tensor_parallel as tp_test

        directory = Path(tempfile.mkdtemp(prefix="cegen-linear-tp-test-"))
        cls.addClassCleanup(shutil.rmtree, directory, True)
        cls.spec = parallel_spec()
        path = directory / "inputs.pt"
        torch.save({"linear": cls.spec}, path)
        deadline = time.monotonic() + tp_test.GROUP_TIMEOUT_S
        groups = {world: tp_test.start_group(world, path, directory) for world in cls.WORLDS}
        cls.results, failures = {}, []
        for world in cls.WORLDS:  # every group is waited for (or killed), even after a failure
            try:
                cls.results[world] = [r["linear"] for r in tp_test.collect(groups[world], world,
                                                                            deadline)]
            except AssertionError as error:
                failures.append(str(error))
        if failures:
            raise AssertionError("\n\n".join(failures))

    def close(self, got, want, what, scale_floor=1.0):
        self.assertIsNotNone(got, f"{what}: missing")
        scale = max(scale_floor, float(want.abs().max()))
        error = float((got.double() - want).abs().max())
        self.assertLessEqual(error, 2e-5 * scale, f"{what}: off by {error} (seed {SEED})")

    def expected(self, case, world):
        data = cases.inputs_of(self.spec, case)
        hidden, labels, upstream = as_rows(case, data)
        bounds = cases.slice_bounds(V, world, case["uneven"])
        if case["schedule"] == "fused-twice":  # two backward passes: the gradients add up
            upstream = 2 * upstream
        ref = reference_sharded(hidden, self.spec["weight"],
                                self.spec["bias"] if case["bias"] else None, labels, upstream,
                                bounds, **case["options"])
        return bounds, ref

    def test_against_float64_on_the_unsharded_weight(self):
        for world in self.WORLDS:
            for case in self.spec["cases"]:
                if case["labels"] == "bad":
                    continue
                with self.subTest(world=world, case=case["name"]):
                    self.check(case, world, [ranks[case["name"]] for ranks in self.results[world]])

    def check(self, case, world, ranks):
        bounds, ref = self.expected(case, world)
        name, schedule = case["name"], case["schedule"]
        shares = []
        for rank, result in enumerate(ranks):
            what = f"{name} world={world} rank={rank}"
            self.assertNotIn("error", result, result.get("traceback"))
            self.close(loss_rows(case, result["loss"]), ref["loss"][rank], f"{what} loss")
            if schedule == "no-grad":
                self.assertIsNone(result["grad_hidden"])
                continue
            grad_hidden = result["grad_hidden"].reshape(-1, H)
            if case["reduce_grad_hidden"]:
                self.close(grad_hidden, ref["grad_hidden"], f"{what} d hidden")
            else:
                self.close(grad_hidden, ref["shares"][rank], f"{what} d hidden share")
                shares.append(grad_hidden.double())
            start, end = bounds[rank]
            self.assertEqual(tuple(result["grad_weight"].shape), (end - start, H))
            self.close(result["grad_weight"], ref["grad_weight"][start:end], f"{what} d weight")
            if case["bias"]:
                self.close(result["grad_bias"], ref["grad_bias"][start:end], f"{what} d bias")
            # The forward's gradients are the answer when the upstream is grad_weights' own
            # memory, or a multiple of it (each rank finds the factor on the device): no
            # recompute; without grad_weights, with grad_weights_exact ("fused-exact") and
            # in the second backward of "fused-twice" (the first released them): one.
            expected_recomputes = 1 if schedule in ("recompute", "sum", "zeros", "fused-twice",
                                                    "fused-exact") else 0
            self.assertEqual(result["recomputes"], expected_recomputes, f"{what} recomputes")
            if schedule == "reduced":  # the mean of the tokens not ignored (upstream: 1/count)
                data = cases.inputs_of(self.spec, case)
                self.close(result["reduced"], (ref["loss"][rank] * data["upstream"]).sum(),
                           f"{what} mean")
        if shares:
            self.close(sum(shares), ref["grad_hidden"], f"{name} world={world} sum of shares")
        if not case["options"]["global_smoothing"] and case["options"]["label_smoothing"]:
            self.assertFalse(torch.equal(ranks[0]["loss"], ranks[1]["loss"]),
                             "Megatron's smoothing gave every rank the same loss")

    def test_equal_to_tp1(self):
        for case in self.spec["cases"]:
            options = case["options"]
            if (case["labels"] == "bad" or not case["reduce_grad_hidden"]
                    or (options["label_smoothing"] and not options["global_smoothing"])):
                continue
            single = cases.run_one(self.spec, dict(case, uneven=False), 0, 1, None)
            self.assertNotIn("error", single, single.get("traceback"))
            for world in self.WORLDS:
                ranks = [r[case["name"]] for r in self.results[world]]
                bounds = cases.slice_bounds(V, world, case["uneven"])
                with self.subTest(world=world, case=case["name"]):
                    for rank, result in enumerate(ranks):
                        self.assertNotIn("error", result, result.get("traceback"))
                        self.close(result["loss"], single["loss"], f"rank {rank} loss vs TP=1")
                        if case["schedule"] != "no-grad":
                            self.close(result["grad_hidden"], single["grad_hidden"],
                                       f"rank {rank} d hidden vs TP=1")
                    if case["schedule"] == "no-grad":
                        continue
                    self.assertEqual([b[0] for b in bounds[1:]], [b[1] for b in bounds[:-1]])
                    self.close(torch.cat([r["grad_weight"] for r in ranks]),
                               single["grad_weight"], "d weight vs TP=1")

    def test_bad_label_raises_on_every_rank(self):
        for world in self.WORLDS:
            for rank, ranks in enumerate(self.results[world]):
                result = ranks["bad-label"]
                self.assertEqual(result.get("error"), "LabelOutOfRangeError",
                                 f"world {world} rank {rank}: {result}")
                self.assertIn(str(V + 3), result["message"])


@S.requires_kernels
class VocabParallelArgumentsTest(unittest.TestCase):
    """The tensor-parallel arguments' checks that need no process group."""

    def test_bad_arguments(self):
        hidden, weight = torch.randn(4, 8), torch.randn(6, 8)
        labels = torch.randint(0, 6, (4,))
        calls = [
            (dict(vocab_start=0, vocab_size=6), "no tp_group was given"),
            (dict(vocab_start=0), "give both vocab_start and vocab_size"),
            (dict(tp_group=object()), "torch.distributed is not initialized"),
            (dict(reduce_grad_hidden="no"), "reduce_grad_hidden must be True or False"),
        ]
        for kwargs, message in calls:
            with self.subTest(kwargs=kwargs):
                with self.assertRaisesRegex(cegen.InvalidInputError, re.escape(message)):
                    cegen.linear_cross_entropy(hidden, weight, labels, **kwargs)


class DefaultChunkTest(unittest.TestCase):
    def test_default_chunk(self):
        # 256 MiB hold 1046 tokens at V = 128256 in bf16: equal chunks of 1024 (a multiple
        # of 128) at every N that 1024 divides, the long context included
        for n in (8192, 16384, 131072, 1 << 30):
            self.assertEqual(linear.default_chunk_tokens(n, 128256, 2), 1024, n)
        self.assertEqual(linear.default_chunk_tokens(10, 128256, 2), 10)
        self.assertEqual(linear.default_chunk_tokens(1000, 128256, 2), 1000)  # one chunk
        self.assertEqual(linear.default_chunk_tokens(8192, 1 << 40, 4), 1)
        per_token = 37 * 4
        # 1000 tokens, at most 300 a chunk: 4 chunks of 250, rounded up to 256 (<= 300)
        self.assertEqual(linear.default_chunk_tokens(1000, 37, 4, 300 * per_token), 256)
        # at most 250: 256 does not fit and 128 (8 chunks) is far below: 4 chunks of 250
        self.assertEqual(linear.default_chunk_tokens(1000, 37, 4, 250 * per_token), 250)
        # at most 30 (below the alignment): 4 equal chunks of 25, not 30 + 30 + 30 + 10
        self.assertEqual(linear.default_chunk_tokens(100, 37, 4, 30 * per_token), 25)
        for n in range(1, 700, 7):
            for cap in (1, 5, 100, 128, 200, 300, 1000):
                chunk = linear.default_chunk_tokens(n, 37, 4, cap * per_token)
                self.assertTrue(1 <= chunk <= max(1, min(n, cap)), (n, cap, chunk))

    def test_free_memory(self):
        # A quarter of the free memory caps the chunk: plenty changes nothing, 1 GB free
        # leaves 256 MiB (the default), 400 MiB free 100 MiB (at most 408 tokens: aligned
        # chunks of 384, not 21 of 391), none at all one token a chunk.
        per_token = 128256 * 2
        self.assertEqual(linear.default_chunk_tokens(8192, 128256, 2, free_bytes=80 << 30), 1024)
        self.assertEqual(linear.default_chunk_tokens(8192, 128256, 2, free_bytes=1 << 30), 1024)
        small = linear.default_chunk_tokens(8192, 128256, 2, free_bytes=400 << 20)
        self.assertLessEqual(small * per_token, (400 << 20) // linear.FREE_SHARE)
        self.assertEqual(small, 384)
        self.assertEqual(linear.default_chunk_tokens(8192, 128256, 2, free_bytes=0), 1)
        self.assertIsNone(linear.available_bytes(torch.device("cpu")))

    @S.requires_kernels
    def test_free_memory_reaches_the_chunks(self):
        # What available_bytes reports is what the default chunk is made from (mocked: this
        # machine has no GPU), asked once per shape, and the loss does not depend on the
        # chunking.
        torch.manual_seed(5)
        h = torch.randn(40, 16, dtype=torch.float32)
        w = torch.randn(37, 16, dtype=torch.float32)
        labels = torch.randint(0, 37, (40,))
        per_token = 37 * 4
        asked = []

        def available(device):
            asked.append(device)
            return 40 * per_token

        with mock.patch.dict(linear._DEFAULT_CHUNKS, clear=True), \
                mock.patch.object(linear, "available_bytes", available):
            small = cegen.linear_cross_entropy(h, w, labels)
            self.assertEqual(linear._DEFAULT_CHUNKS, {("cpu", 40, 37, 4): 10})  # a quarter
            again = cegen.linear_cross_entropy(h, w, labels)
            self.assertEqual(len(asked), 1)  # the second call reuses the first's chunk
            cegen.linear_cross_entropy(h[:20], w, labels[:20])
            self.assertEqual(len(asked), 2)  # a new shape asks again
        whole = cegen.linear_cross_entropy(h, w, labels, chunk_tokens=40)
        torch.testing.assert_close(small, whole, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(again, small, rtol=0, atol=0)

    def test_available_bytes(self):
        # (torch.cuda mocked: this machine has no GPU.) The driver's free memory plus the
        # allocator's unused reserve; None on the host and while capturing a graph.
        cuda = torch.device("cuda", 0)
        with mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: False), \
                mock.patch.object(torch.cuda, "memory_reserved", lambda device: 3 << 30), \
                mock.patch.object(torch.cuda, "memory_allocated", lambda device: 1 << 30), \
                mock.patch.object(torch.cuda, "mem_get_info",
                                  lambda device: (5 << 30, 80 << 30)):
            self.assertEqual(linear.available_bytes(cuda), 7 << 30)
        with mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: True):
            self.assertIsNone(linear.available_bytes(cuda))
        self.assertIsNone(linear.available_bytes(torch.device("cpu")))


@S.requires_kernels
class UninitializedGradientsTest(unittest.TestCase):
    """d hidden and d weight are allocated without a zero fill (the first chunk's GEMM
    writes d weight): poisoned with NaN, every schedule still gives the float64 answer."""

    def test_poisoned_buffers(self):
        case = LinearCrossEntropyTest()
        case.setUp()
        hidden, weight, bias, labels = case.problem()
        n = labels.shape[0]
        upstream = torch.rand((n,), generator=case.gen, dtype=torch.float64) + 0.5
        with mock.patch.object(linear, "_uninitialized",
                               lambda like: torch.full_like(like, float("nan"))):
            for chunk in (1, 4, n):
                for schedule in ("recompute", "grad_weights", "exact", "multiple"):
                    with self.subTest(chunk=chunk, schedule=schedule):
                        weights = None if schedule == "recompute" else upstream.float()
                        if schedule == "multiple":  # g = 0.5 grad_weights: d weight scaled
                            weights = (upstream * 2).float()
                        ours, refs = case.run_both(
                            hidden, weight, bias, labels, upstream, chunk=chunk,
                            grad_weights=weights, grad_weights_exact=schedule == "exact",
                            backward_with=weights if schedule == "grad_weights" else None)
                        case.assert_close(ours, refs, f"poisoned, chunk {chunk}, {schedule}")
            for reduction in ("mean", "sum"):
                with self.subTest(reduction=reduction):
                    refs = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
                    ref = reference(*refs, labels)
                    (ref.mean() if reduction == "mean" else ref.sum()).backward()
                    ours_in = [t.float().clone().requires_grad_(True)
                               for t in (hidden, weight, bias)]
                    loss = cegen.linear_cross_entropy(ours_in[0], ours_in[1], labels,
                                                      bias=ours_in[2], chunk_tokens=3,
                                                      reduction=reduction)
                    loss.backward()
                    case.assert_close([None] + [t.grad for t in ours_in],
                                      [None] + [t.grad for t in refs], f"poisoned, {reduction}")


class ScaleRowsTest(unittest.TestCase):
    """linear._scale_rows, the backward's scaling of the forward's gradients, by cegen's
    rescale kernel and by PyTorch's operations (no kernel), against float64: rows whose
    factor is 1 untouched (bitwise), zero upstreams zero rows, a NaN factor NaN rows."""

    def paths(self):
        yield "torch", mock.patch.object(linear, "_rescale_kernel", lambda grad, bundle: None)
        if S._MISSING is None and linear._rescale_kernel(torch.zeros((1, 1)), None) is not None:
            calls = []
            real = linear._rescale_kernel

            def found(grad, bundle):
                kernel = real(grad, bundle)
                calls.append(kernel is not None)
                return kernel

            self.kernel_calls = calls
            yield "kernel", mock.patch.object(linear, "_rescale_kernel", found)

    def check(self, path, before, after, factors):
        """``after`` is ``before`` times ``factors`` (broadcast), bitwise where the factor
        is 1, zero where it is 0, NaN where it is NaN."""
        want = before.double() * factors.double()
        ones = (factors == 1).expand(before.shape)
        self.assertTrue(torch.equal(after[ones], before[ones]), f"{path}: factor-1 rows changed")
        nan = torch.isnan(factors).expand(before.shape)
        self.assertTrue(bool(torch.isnan(after[nan]).all()), f"{path}: NaN factor not NaN")
        zero = (factors == 0).expand(before.shape)
        self.assertTrue(bool((after[zero] == 0).all()), f"{path}: zero factor not 0")
        finite = ~nan
        if bool(finite.any()):
            want = want.expand(before.shape)
            error = float((after.double()[finite] - want[finite]).abs().max())
            self.assertLessEqual(error, 1e-6 * float(want[finite].abs().max()), path)

    def test_rows_and_factors(self):
        gen = torch.Generator().manual_seed(SEED)
        n, h = 9, 13
        for path, patch in self.paths():
            with patch, self.subTest(path=path):
                grad = torch.randn((n, h), generator=gen)
                weights = torch.rand((n,), generator=gen) + 0.5
                upstream = torch.rand((n,), generator=gen) + 0.5
                upstream[[0, 4]] = weights[[0, 4]]  # equal: untouched
                upstream[[2, 7]] = 0.0  # masked: zero rows
                upstream[5] = 2 * weights[5]
                before = grad.clone()
                linear._scale_rows(grad, weights, upstream, None)
                self.check(path, before, grad, (upstream.double() / weights.double())[:, None])
                # a strided upstream (every other element of a longer tensor)
                strided = torch.stack([upstream, torch.full_like(upstream, 7.0)], 1)[:, 0]
                grad = before.clone()
                linear._scale_rows(grad, weights, strided, None)
                self.check(path, before, grad, (upstream.double() / weights.double())[:, None])
                # one weight and a stride-0 upstream (a sum's): one factor for every row
                for value in (0.25, 0.5, 0.0):
                    grad = before.clone()
                    linear._scale_rows(grad, torch.tensor(0.25),
                                       torch.tensor(value).expand(n), None)
                    self.check(path, before, grad, torch.tensor(value / 0.25))

    def test_one_factor_for_every_element(self):
        """d weight and d bias: a 0-d factor over a contiguous gradient (viewed as rows of
        at most SCALE_ROW_ELEMENTS), a transposed one and a vector."""
        gen = torch.Generator().manual_seed(SEED + 1)
        for path, patch in self.paths():
            for factor in (1.0, 0.3, 0.0, float("nan"), 4.0):
                with patch, mock.patch.object(linear, "SCALE_ROW_ELEMENTS", 64), \
                        self.subTest(path=path, factor=factor):
                    for grad in (torch.randn((37, 16), generator=gen),
                                 torch.randn((16, 37), generator=gen).t(),
                                 torch.randn((37,), generator=gen)):
                        before = grad.clone()
                        linear._scale_rows(grad, torch.ones(()), torch.tensor(factor), None)
                        self.check(path, before, grad, torch.tensor(factor))
        if hasattr(self, "kernel_calls"):
            self.assertIn(True, self.kernel_calls, "the rescale kernel was never used")


if __name__ == "__main__":
    unittest.main()
