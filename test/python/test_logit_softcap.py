"""The logit softcap (issue 17): ``logit_softcap=cap`` takes every logit x as
``z = cap * tanh(s * x / cap)`` (s the logit scale) before the softmax, against the float64
references of ``_reference_outputs`` (loss, lse and gradient of z, the gradient of x carrying
``dz/dx = s (1 - tanh^2)``).

* :class:`TestCrossEntropy`: :func:`cegen.cross_entropy`, eager and traced (the custom ops),
  with and without ``grad_weights`` (the fused kernel), overwrite, with smoothing, z-loss and
  an ignore_index, ``[S, B, V]`` logits, caps with and without a scale; the forward's lse;
  infinite logits (``+-cap``).
* :class:`TestValidation`: a cap that is not None or finite and > 0 is refused; the default
  (None) is the kernel without a softcap, bit for bit.

* :class:`TestVocabParallelAndLinear`: ``logit_softcap`` on
  :func:`cegen.vocab_parallel_cross_entropy` (a group of one here, with the lse, entropy and
  argmax; groups of 2 and 4 in test_tensor_parallel's outputs case) and on
  :func:`cegen.linear_cross_entropy` (chunks of 16 tokens, with and without
  ``grad_weights``) against float64 of the same z.
"""

from __future__ import annotations

import math
import unittest

import torch

import _support as S
import cegen
from cegen import _kernels
from cegen.ops import _traced_cross_entropy
from _reference_outputs import argmax_acceptable, reference_outputs


def _f32(value: float) -> float:
    """``value`` rounded to float32: what the kernels get, and so the references'."""
    return torch.tensor(value, dtype=torch.float32).item()


#: (scale, cap) pairs: Gemma 2's final cap 30, a cap the logits saturate (2), a scale with it.
CASES = tuple((_f32(s), _f32(c)) for s, c in ((1.0, 30.0), (1.0, 2.0), (2.5, 15.0),
                                               (0.37, 50.0)))


def _tolerances(dtype: torch.dtype, scale: float, cap: float):
    """S's tolerances plus what an f32 z within a few ulps of the cap costs: ``cap 2^-21``
    absolute in the loss, and ``s cap 2^-19`` in the gradient's units (docs/lowering.md,
    "The logit softcap")."""
    rtol, atol = S.LOSS_TOLERANCE[dtype]
    grad_rtol, grad_atol = S.GRAD_TOLERANCE[dtype]
    return ((rtol, atol + cap * 2.0 ** -21),
            (grad_rtol, grad_atol * max(1.0, scale) + scale * 2.0 ** -19))


@S.requires_kernels
class TestCrossEntropy(unittest.TestCase):
    def check(self, shape, dtype, scale, cap, *, fused=False, traced=False, overwrite=False,
              offset=0, **options):
        layout = options.pop("label_layout", "bs")
        leaf = S.random_logits(shape, dtype, offset=offset)
        logits = leaf.clone().requires_grad_(True)
        tokens = _kernels.token_shape(shape, layout)
        labels = S.random_labels(tokens, shape[-1], offset=offset + 1)
        if options.get("ignore_index") is not None:
            drop = torch.rand(tokens, generator=S.generator(offset + 2)) < 0.25
            labels = torch.where(drop, torch.full_like(labels, options["ignore_index"]), labels)
        upstream = torch.rand(tokens, generator=S.generator(offset + 3)) * 2 - 1
        weights = upstream if fused else None
        if traced:
            loss = _traced_cross_entropy(logits, labels, options.get("ignore_index"),
                                         options.get("label_smoothing", 0.0),
                                         options.get("z_loss", 0.0), False, layout, weights,
                                         None, "error", logit_scale=scale, logit_softcap=cap)
            loss.backward(upstream)
            grad = logits.grad
        elif overwrite:
            # Exclusively owned logits (a fresh autograd output): the gradient is written
            # over their storage, which must be what reaches the leaf.
            from _fresh_logits import MakeLogits, fresh_logits
            cegen.reset_overwrite_warnings()
            MakeLogits.output_pointers.clear()
            MakeLogits.grad_pointers.clear()
            # No **options: a call with ** packs the positional arguments into a tuple,
            # one more reference to the logits (the overwrite would be refused).
            self.assertEqual(options, {})
            loss = cegen.cross_entropy(fresh_logits(logits), labels, label_layout=layout,
                                       grad_weights=weights, logit_scale=scale,
                                       logit_softcap=cap, overwrite_input=True)
            loss.backward(upstream)
            self.assertEqual(MakeLogits.grad_pointers, MakeLogits.output_pointers,
                             "the gradient did not reuse the logits' storage")
            grad = logits.grad
        else:
            loss = cegen.cross_entropy(logits, labels, label_layout=layout, grad_weights=weights,
                                       logit_scale=scale, logit_softcap=cap, **options)
            loss.backward(upstream)
            grad = logits.grad
        ref = reference_outputs(leaf, labels, logit_scale=scale, logit_softcap=cap,
                                label_layout=layout, grad_loss=upstream, **options)
        what = (f"shape={shape} {dtype} s={scale} cap={cap} fused={fused} traced={traced} "
                f"overwrite={overwrite} {options}")
        loss_tol, grad_tol = _tolerances(dtype, scale, cap)
        S.assert_close(self, loss, ref.loss, *loss_tol, "loss " + what)
        S.assert_close(self, grad, ref.grad.to(grad.dtype).double(), *grad_tol,
                       "gradient " + what)

    def test_every_path_and_cap(self) -> None:
        for index, (scale, cap) in enumerate(CASES):
            for fused in (False, True):
                for traced in (False, True):
                    with self.subTest(scale=scale, cap=cap, fused=fused, traced=traced):
                        self.check((13, 301), torch.float32, scale, cap, fused=fused,
                                   traced=traced, offset=10 * index)

    def test_overwrite(self) -> None:
        for index, (scale, cap) in enumerate(CASES[:2]):
            for fused in (False, True):
                with self.subTest(scale=scale, cap=cap, fused=fused):
                    self.check((11, 257), torch.float32, scale, cap, fused=fused,
                               overwrite=True, offset=50 + 10 * index)

    def test_options_dtypes_and_layouts(self) -> None:
        cases = [
            ((13, 301), torch.bfloat16, {"ignore_index": -100}),
            ((5, 3, 257), torch.float32, {"label_smoothing": 0.1, "label_layout": "sb"}),
            ((5, 3, 257), torch.float32, {"z_loss": 1e-3, "label_smoothing": 0.2,
                                          "ignore_index": -100}),
        ]
        for index, (shape, dtype, options) in enumerate(cases):
            for scale, cap in CASES[:3]:
                for fused in (False, True):
                    with self.subTest(shape=shape, dtype=dtype, scale=scale, cap=cap,
                                      fused=fused, **options):
                        self.check(shape, dtype, scale, cap, fused=fused,
                                   offset=100 + 10 * index, **dict(options))

    def test_forward_lse_and_infinite_logits(self) -> None:
        # lse of z; +-inf logits are +-cap (finite loss), NaN stays NaN.
        for scale, cap in CASES:
            with self.subTest(scale=scale, cap=cap):
                logits = S.random_logits((9, 400), torch.float32, offset=7) * 10
                logits[1, ::3] = -math.inf
                logits[2, 5] = math.inf
                labels = S.random_labels((9,), 400, offset=8)
                options = _kernels.KernelOptions(logit_scale=scale, logit_softcap=cap)
                loss, lse, _ = _kernels.forward(logits, labels, options, low=True)
                finite = logits.clamp(-1e30, 1e30)  # tanh(+-1e30 s / cap) = +-1 too
                ref = reference_outputs(finite, labels, logit_scale=scale, logit_softcap=cap)
                loss_tol, _ = _tolerances(torch.float32, scale, cap)
                S.assert_close(self, loss, ref.loss, *loss_tol, "loss")
                S.assert_close(self, lse, ref.lse, *loss_tol, "lse")
                logits[3, 7] = math.nan
                loss, _, _ = _kernels.forward(logits, labels, options, low=True)
                self.assertTrue(math.isnan(loss[3].item()))
                self.assertTrue(torch.isfinite(loss[:3]).all())


@S.requires_kernels
class TestVocabParallelAndLinear(unittest.TestCase):
    def test_vocab_parallel_group_of_one(self) -> None:
        logits = S.random_logits((6, 4, 130), torch.bfloat16, scale=12.0,
                                 offset=120).requires_grad_(True)
        labels = S.random_labels((4, 6), 130, offset=121)
        for scale, cap in CASES:
            with self.subTest(scale=scale, cap=cap):
                logits.grad = None
                with _kernels.poison_outputs():
                    result = cegen.vocab_parallel_cross_entropy(
                        logits, labels, logit_scale=scale, logit_softcap=cap,
                        return_lse=True, return_entropy=True, return_argmax=True)
                result.loss.sum().backward()
                ref = reference_outputs(logits, labels, logit_scale=scale, logit_softcap=cap)
                loss_tolerance, grad_tolerance = _tolerances(torch.bfloat16, scale, cap)
                S.assert_close(self, result.loss, ref.loss, *loss_tolerance, "loss")
                S.assert_close(self, result.lse, ref.lse, 1e-6, 1e-6 + cap * 2.0 ** -21, "lse")
                S.assert_close(self, result.entropy, ref.entropy, 2e-5, 2e-5 + cap * 2.0 ** -19,
                               "entropy")
                self.assertTrue(bool(argmax_acceptable(
                    logits, result.argmax, atol=cap * 2.0 ** -20, logit_scale=scale,
                    logit_softcap=cap).all()), f"argmax {result.argmax.tolist()}")
                S.assert_close(self, logits.grad, ref.grad, *grad_tolerance, "gradient")

    def test_linear_against_float64_gemms(self) -> None:
        hidden64 = torch.randn((40, 24), generator=S.generator(130), dtype=torch.float64)
        weight64 = torch.randn((301, 24), generator=S.generator(131), dtype=torch.float64)
        labels = S.random_labels((40,), 301, offset=132)
        for scale, cap in CASES:
            for grad_weights in (None, 1.0):
                with self.subTest(scale=scale, cap=cap, grad_weights=grad_weights):
                    hidden = hidden64.float().requires_grad_(True)
                    weight = weight64.float().requires_grad_(True)
                    loss = cegen.linear_cross_entropy(
                        hidden, weight, labels, logit_scale=scale, logit_softcap=cap,
                        chunk_tokens=16, grad_weights=grad_weights)
                    loss.backward(torch.ones_like(loss))
                    logits = hidden.detach().double() @ weight.detach().double().t()
                    ref = reference_outputs(logits, labels, logit_scale=scale,
                                            logit_softcap=cap)
                    S.assert_close(self, loss, ref.loss, 1e-5, 1e-5 + cap * 2.0 ** -21, "loss")
                    # A logit's gradient to s 2^-19 (the f32 1 - t^2), summed over the
                    # 40 tokens or 301 ids of the GEMMs with |h|, |w| of about 1.
                    atol = 1e-5 * max(1.0, scale) + 40 * scale * 2.0 ** -19
                    grad_hidden = ref.grad @ weight.detach().double()
                    grad_weight = ref.grad.t() @ hidden.detach().double()
                    S.assert_close(self, hidden.grad, grad_hidden, 1e-4, atol, "d hidden")
                    S.assert_close(self, weight.grad, grad_weight, 1e-4, atol, "d weight")

    def test_refused_caps(self) -> None:
        logits = S.random_logits((3, 17), torch.float32, offset=133)
        labels = S.random_labels((3,), 17, offset=134)
        hidden, weight = torch.randn((3, 5)), torch.randn((17, 5))
        for bad in (0.0, -1.0, math.inf, math.nan):
            with self.subTest(value=bad):
                with self.assertRaisesRegex(cegen.InvalidInputError, "logit_softcap"):
                    cegen.vocab_parallel_cross_entropy(logits, labels, logit_softcap=bad)
                with self.assertRaisesRegex(cegen.InvalidInputError, "logit_softcap"):
                    cegen.linear_cross_entropy(hidden, weight, labels, logit_softcap=bad)


class TestValidation(unittest.TestCase):
    BAD = (0.0, -1.0, math.inf, -math.inf, math.nan, 1e39, "2")

    def test_kernel_options(self) -> None:
        self.assertEqual(_kernels.KernelOptions().logit_softcap, 0.0)
        self.assertEqual(_kernels.KernelOptions(logit_softcap=0.1).logit_softcap,
                         float(torch.tensor(0.1, dtype=torch.float32)))
        for bad in self.BAD[1:]:
            with self.subTest(value=bad):
                with self.assertRaisesRegex(cegen.InvalidInputError, "logit_softcap"):
                    _kernels.KernelOptions(logit_softcap=bad)
        with self.assertRaisesRegex(cegen.InvalidInputError, "must be finite in float32"):
            _kernels.KernelOptions(logit_scale=1e30, logit_softcap=1e-30)

    def test_variant_key(self) -> None:
        logits = torch.zeros((2, 5))
        labels = torch.zeros((2,), dtype=torch.int64)
        plain = _kernels._key("forward", logits, labels, _kernels.KernelOptions())
        capped = _kernels._key("forward", logits, labels,
                               _kernels.KernelOptions(logit_softcap=30.0))
        self.assertEqual(str(capped), str(plain) + ",softcap=on")

    @S.requires_kernels
    def test_entry_point(self) -> None:
        logits = S.random_logits((3, 17), torch.float32, offset=90)
        labels = S.random_labels((3,), 17, offset=91)
        for bad in self.BAD:
            with self.subTest(value=bad):
                with self.assertRaisesRegex(cegen.InvalidInputError, "logit_softcap"):
                    cegen.cross_entropy(logits, labels, logit_softcap=bad)
        # None is no softcap: the plain kernel, bit for bit.
        self.assertTrue(torch.equal(cegen.cross_entropy(logits, labels, logit_softcap=None),
                                    cegen.cross_entropy(logits, labels)))


if __name__ == "__main__":
    unittest.main()
