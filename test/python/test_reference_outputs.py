"""The float64 references of issue 17 (test/python/_reference_outputs.py) against PyTorch.

The references' loss and closed-form gradient through the logit scale and softcap are
compared with torch autograd of an independent formulation (``F.cross_entropy`` with its
own label smoothing, on z built by torch ops) on fresh random inputs, every combination of
smoothing, z-loss, scale, cap, ignore_index and the three logit/label layouts, with a
random upstream gradient; lse with ``torch.logsumexp``, entropy with
``torch.distributions.Categorical``, argmax with ``torch.argmax``; and the rows the
definitions decide: -inf entries, all-equal, ties, softcap saturation, NaN and +inf rows,
ignored NaN rows, out-of-range labels; and ``argmax_acceptable``.
"""

from __future__ import annotations

import itertools
import math
import unittest
from typing import Optional

import _support as S

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _reference_outputs import (argmax_acceptable, reference_outputs,  # noqa: E402
                                transform_derivative, transformed_logits)

TIGHT = dict(rtol=1e-12, atol=1e-13)


def _rows(tensor: torch.Tensor, layout: str) -> torch.Tensor:
    """[T, V] rows in the labels' order, written apart from the module's own helper."""
    if tensor.dim() == 2:
        return tensor
    if layout == "bs":
        return tensor.permute(1, 0, 2).reshape(-1, tensor.shape[-1])
    return tensor.reshape(-1, tensor.shape[-1])


def _autograd_reference(logits: torch.Tensor, labels: torch.Tensor, layout: str,
                        ignore_index: Optional[int], alpha: float, z_loss: float,
                        scale: float, cap: Optional[float], grad_loss: torch.Tensor):
    """(loss, gradient) from torch: F.cross_entropy of z with PyTorch's smoothing epsilon set
    to Megatron's s, plus z_loss * lse^2, differentiated by autograd."""
    x = logits.detach().to(torch.float64).clone().requires_grad_(True)
    z = x * scale if cap is None else torch.tanh(x * scale / cap) * cap
    rows = _rows(z, layout)
    y = labels.reshape(-1)
    vocab = rows.shape[-1]
    s = alpha * vocab / (vocab - 1)
    ignore = -100 if ignore_index is None else ignore_index
    loss = F.cross_entropy(rows, y, reduction="none", label_smoothing=s, ignore_index=ignore)
    lse = torch.logsumexp(rows, dim=-1)
    keep = (y != ignore).to(torch.float64)
    loss = loss + z_loss * lse * lse * keep
    (grad,) = torch.autograd.grad(loss, x, grad_loss.to(torch.float64).reshape(-1))
    return loss.detach().reshape(labels.shape), grad


class TransformTest(unittest.TestCase):
    def test_derivative_is_autograd_of_the_transform(self) -> None:
        x = S.random_logits((64, 97), torch.float64, scale=40.0, offset=10)
        x[0, :4] = torch.tensor([0.0, 1e4, -1e4, 1e-30], dtype=torch.float64)
        for scale, cap in itertools.product((1.0, 0.7, 2.5, -1.3), (None, 30.0, 5.0, 0.5)):
            with self.subTest(scale=scale, cap=cap):
                leaf = x.clone().requires_grad_(True)
                z = leaf * scale if cap is None else cap * torch.tanh(leaf * scale / cap)
                (expected,) = torch.autograd.grad(z.sum(), leaf)
                S.assert_close(self, transformed_logits(x, scale, cap), z, what="z", **TIGHT)
                S.assert_close(self, transform_derivative(x, scale, cap), expected,
                               what="dz/dx", **TIGHT)
                if cap is not None:
                    self.assertTrue(bool((transformed_logits(x, scale, cap).abs() <= abs(cap)).all()))

    def test_scale_then_cap(self) -> None:
        # scale * x / cap, not scale * (x / cap) * ... with the scale outside the tanh.
        z = transformed_logits(torch.tensor([10.0]), 2.0, 5.0)
        self.assertAlmostEqual(float(z), 5.0 * math.tanh(4.0), places=14)
        self.assertNotAlmostEqual(float(z), 2.0 * 5.0 * math.tanh(2.0), places=3)

    def test_rejects_a_zero_or_non_finite_cap(self) -> None:
        for cap in (0.0, math.inf, math.nan):
            with self.assertRaises(ValueError):
                transformed_logits(torch.zeros(1), 1.0, cap)
        with self.assertRaises(ValueError):
            transformed_logits(torch.zeros(1), math.inf, None)


class LossAndGradientTest(unittest.TestCase):
    def test_every_combination_against_autograd(self) -> None:
        shapes = [((37, 211), None), ((5, 3, 130), "bs"), ((4, 6, 77), "sb")]
        combos = itertools.product(shapes, (0.0, 0.1), (0.0, 1e-3), (1.0, 0.7),
                                   (None, 30.0, 2.0), (None, -100))
        for index, ((shape, layout), alpha, z_loss, scale, cap, ignore) in enumerate(combos):
            layout = layout or "bs"
            label_shape = ((shape[1], shape[0]) if layout == "bs" else shape[:2]) \
                if len(shape) == 3 else shape[:1]
            x = S.random_logits(shape, torch.float64, scale=4.0, offset=100 + index)
            y = S.random_labels(label_shape, shape[-1], offset=400 + index)
            if ignore is not None:
                y.view(-1)[::5] = ignore
            g = S.random_logits(label_shape, torch.float64, scale=1.0, offset=700 + index)
            with self.subTest(shape=shape, layout=layout, alpha=alpha, z_loss=z_loss,
                              scale=scale, cap=cap, ignore=ignore):
                got = reference_outputs(x, y, ignore_index=ignore, label_smoothing=alpha,
                                        z_loss=z_loss, logit_scale=scale, logit_softcap=cap,
                                        label_layout=layout, grad_loss=g)
                loss, grad = _autograd_reference(x, y, layout, ignore, alpha, z_loss, scale,
                                                 cap, g)
                self.assertEqual(got.loss.shape, y.shape)
                self.assertEqual(got.grad.shape, x.shape)
                S.assert_close(self, got.loss, loss, what="loss", **TIGHT)
                S.assert_close(self, got.grad, grad, what="gradient", **TIGHT)
                z = transformed_logits(x, scale, cap)
                zr = _rows(z, layout)
                S.assert_close(self, got.lse.reshape(-1), torch.logsumexp(zr, -1), what="lse",
                               **TIGHT)
                entropy = torch.distributions.Categorical(logits=zr).entropy()
                S.assert_close(self, got.entropy.reshape(-1), entropy, what="entropy", **TIGHT)
                self.assertTrue(torch.equal(got.argmax.reshape(-1), zr.argmax(dim=-1)))

    def test_default_upstream_gradient_is_one(self) -> None:
        x = S.random_logits((9, 50), torch.float64, offset=31)
        y = S.random_labels((9,), 50, offset=32)
        ones = reference_outputs(x, y, logit_softcap=3.0, grad_loss=torch.ones(9))
        default = reference_outputs(x, y, logit_softcap=3.0)
        self.assertTrue(torch.equal(ones.grad, default.grad))


class DecidedRowsTest(unittest.TestCase):
    def test_masked_entries_ties_nan_and_infinite_rows(self) -> None:
        inf, nan = math.inf, math.nan
        x = torch.tensor([
            [1.0, -inf, 2.0, -inf, 0.5],   # masked entries: finite entropy of the rest
            [3.0, 3.0, 3.0, 3.0, 3.0],     # all equal: log V, argmax 0
            [0.0, 7.0, 1.0, 7.0, 7.0],     # ties: lowest index
            [0.0, 1.0, nan, 2.0, 1.0],     # NaN: argmax -1, NaN outputs
            [-inf, -inf, -inf, -inf, -inf],  # all -inf: argmax 0, lse -inf, entropy NaN
            [0.0, inf, 1.0, inf, 2.0],     # +inf (no cap): argmax 1, entropy NaN
        ], dtype=torch.float64)
        y = torch.tensor([0, 2, 1, 0, 1, 2])
        out = reference_outputs(x, y)
        finite = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
        p = torch.softmax(finite, 0)
        self.assertAlmostEqual(float(out.entropy[0]), float(-(p * p.log()).sum()), places=13)
        self.assertAlmostEqual(float(out.entropy[1]), math.log(5), places=13)
        self.assertEqual(out.argmax.tolist(), [2, 0, 1, -1, 0, 1])
        self.assertTrue(math.isnan(float(out.entropy[3])) and math.isnan(float(out.loss[3])))
        self.assertTrue(math.isnan(float(out.lse[3])))
        self.assertEqual(float(out.lse[4]), -inf)
        self.assertTrue(math.isnan(float(out.entropy[4])))
        self.assertEqual(float(out.lse[5]), inf)
        self.assertTrue(math.isnan(float(out.entropy[5])))
        self.assertEqual(out.argmax.dtype, torch.int64)

    def test_softcap_saturation_ties_and_finite_infinities(self) -> None:
        x = torch.tensor([[0.0, 1000.0, 2000.0, -math.inf], [math.inf, 1.0, math.inf, 0.0]],
                         dtype=torch.float64)
        y = torch.tensor([2, 0])
        capped = reference_outputs(x, y, logit_softcap=1.0)
        # tanh(1000) == tanh(2000) == 1 in float64: a tie of z, the lowest index wins.
        self.assertEqual(capped.argmax.tolist(), [1, 0])
        self.assertEqual(reference_outputs(x[:1], y[:1]).argmax.tolist(), [2])
        # A capped +inf is the cap: everything finite, its derivative 0.
        self.assertTrue(bool(torch.isfinite(capped.lse).all() & torch.isfinite(capped.entropy).all()))
        self.assertTrue(bool(torch.isfinite(capped.grad).all()))
        self.assertEqual(capped.grad[1, 0].item(), 0.0)

    def test_ignored_rows_have_zero_loss_and_gradient_but_their_statistics(self) -> None:
        x = S.random_logits((4, 30), torch.float64, offset=41)
        x[1, 3] = math.nan
        y = torch.tensor([5, -100, -100, 7])
        out = reference_outputs(x, y, ignore_index=-100, z_loss=1e-2, label_smoothing=0.2,
                                logit_scale=0.5, logit_softcap=4.0)
        self.assertEqual(out.loss[1:3].tolist(), [0.0, 0.0])
        self.assertTrue(bool((out.grad[1:3] == 0).all()))
        self.assertEqual(out.argmax[1].item(), -1)
        z = transformed_logits(x[2], 0.5, 4.0)
        self.assertAlmostEqual(float(out.lse[2]), float(torch.logsumexp(z, 0)), places=13)
        self.assertEqual(out.argmax[2].item(), int(z.argmax()))

    def test_out_of_range_labels(self) -> None:
        x = S.random_logits((3, 20), torch.float64, offset=51)
        y = torch.tensor([4, 20, -1])
        with self.assertRaises(ValueError):
            reference_outputs(x, y)
        out = reference_outputs(x, y, label_out_of_range="megatron", logit_scale=2.0,
                                logit_softcap=3.0, label_smoothing=0.1, z_loss=1e-3)
        z = transformed_logits(x, 2.0, 3.0)
        lse = torch.logsumexp(z, -1)
        s = 0.1 * 20 / 19
        for row in (1, 2):
            expected = ((1 - s) * (lse[row] - z[row].max()) + s * (lse[row] - z[row].mean())
                        + 1e-3 * lse[row] ** 2)
            self.assertAlmostEqual(float(out.loss[row]), float(expected), places=12)
            # No one-hot term: g (p (1 + 2 z lse) - s/V) dz/dx.
            p = torch.softmax(z[row], 0)
            grad = (p * (1 + 2e-3 * lse[row]) - s / 20) * transform_derivative(x[row], 2.0, 3.0)
            S.assert_close(self, out.grad[row], grad, what="out-of-range gradient", **TIGHT)


class ArgmaxAcceptableTest(unittest.TestCase):
    def test_which_answers_are_right(self) -> None:
        x = torch.tensor([[0.0, 5.0, 5.0 + 1e-9, 1.0],
                          [0.0, 5.0, 6.0, 1.0],
                          [0.0, math.nan, 6.0, 1.0]], dtype=torch.float64)
        ok = lambda answers: argmax_acceptable(x, torch.tensor(answers), atol=1e-6).tolist()  # noqa: E731
        self.assertEqual(ok([2, 2, -1]), [True, True, True])
        self.assertEqual(ok([1, 1, 2]), [True, False, False])  # a near-tie; far; NaN row
        self.assertEqual(ok([3, 4, -1]), [False, False, True])  # not the max; out of range
        # An exact tie goes to the lowest index; a near-tie either way.
        y = torch.tensor([[9.0, 1.0, 9.0], [9.0, 1.0, 9.0 - 1e-9]], dtype=torch.float64)
        tie = lambda answers: argmax_acceptable(y, torch.tensor(answers), atol=1e-6).tolist()  # noqa: E731
        self.assertEqual(tie([2, 2]), [False, True])
        self.assertEqual(tie([0, 0]), [True, True])
        # Saturated softcap: 1000 and 2000 are both z = 1, the lower index must win.
        w = torch.tensor([[0.0, 1000.0, 2000.0]], dtype=torch.float64)
        capped = lambda answer: argmax_acceptable(w, torch.tensor([answer]), atol=1e-6,  # noqa: E731
                                                  logit_softcap=1.0).tolist()
        self.assertEqual((capped(1), capped(2)), ([True], [False]))


if __name__ == "__main__":
    unittest.main()
