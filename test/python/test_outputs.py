"""The per-token outputs of issue 17: ``return_lse``, ``return_entropy`` and ``return_argmax``
of :func:`cegen.cross_entropy`, returning a :class:`cegen.CrossEntropyResult`, against the
float64 references of ``_reference_outputs`` on fresh random inputs with poisoned outputs.

* :class:`TestPaths`: every path (no gradient, forward + backward kernels, fused, overwrite,
  traced through the custom ops) and layout, with the options and logit scales; the loss
  and gradient are those of the plain call.
* :class:`TestRows`: rows the outputs must get right: ties of the maximum (the lowest
  index), a NaN (argmax -1, entropy NaN), all -inf (argmax 0, entropy NaN), -inf entries
  (masked vocabulary: p = 0 adds nothing), a one-hot-like row (entropy near 0), a uniform
  row (entropy log V), large offsets, ignored tokens and bad labels under Megatron's
  contract (their rows' outputs all the same).
* :class:`TestSoftcap`: with ``logit_softcap`` the outputs are of z = cap tanh(s x / cap),
  as the loss is: the entropy of softmax(z), the argmax the lowest index of the largest z
  (a saturated cap ties different logits; equal logits in any lanes tie to the first), on
  every path and in bf16 and f32.
* :class:`TestApi`: the result type and its Nones, only the loss differentiable, the sweep
  run only for entropy or argmax, flags checked.
"""

from __future__ import annotations

import contextlib
import math
import unittest
from unittest import mock

import torch

import _support as S
import cegen
from cegen import _library
from cegen.ops import _traced_cross_entropy
from _reference_outputs import argmax_acceptable, reference_outputs

#: Entropy tolerance, relative to max(1, H): the sweep sums p log2 p in f32 with
#: log2 p = (x - m) fl(s log2 e) - log(S) log2 e (a few ulps of |log2 p| per term).
ENTROPY_RTOL = 2e-5


def _check_outputs(test: unittest.TestCase, result, ref, what: str,
                   returns=(True, True, True)) -> None:
    want_lse, want_entropy, want_argmax = returns
    if want_lse:
        # Rows without a finite lse (a NaN, +inf or no logit above -inf) as the reference's.
        finite = torch.isfinite(ref.lse)
        test.assertTrue(torch.equal(torch.isfinite(result.lse), finite), "lse rows " + what)
        # A +inf logit: the kernels' lse is NaN (their max-shifted sum meets inf - inf),
        # the reference's +inf; both flag the row.
        expected = torch.where(ref.lse == math.inf, math.nan, ref.lse)
        test.assertTrue(torch.equal(result.lse[~finite].double().nan_to_num(0.5),
                                    expected[~finite].nan_to_num(0.5)), "lse non-finite " + what)
        S.assert_close(test, result.lse[finite], ref.lse[finite], 1e-6, 1e-6, "lse " + what)
    else:
        test.assertIsNone(result.lse, what)
    if want_entropy:
        expected = ref.entropy
        test.assertEqual(result.entropy.dtype, torch.float32, what)
        test.assertEqual(result.entropy.shape, expected.shape, what)
        nan = torch.isnan(expected)
        test.assertTrue(torch.equal(torch.isnan(result.entropy), nan),
                        f"entropy NaN rows {what} (seed={S.SEED})")
        error = ((result.entropy.double() - expected).abs()
                 / expected.abs().clamp(min=1.0))[~nan]
        if error.numel():
            test.assertLess(error.max().item(), ENTROPY_RTOL,
                            f"entropy {what} (seed={S.SEED})")
    else:
        test.assertIsNone(result.entropy, what)
    if want_argmax:
        test.assertEqual(result.argmax.dtype, torch.int64, what)
        test.assertTrue(torch.equal(result.argmax, ref.argmax),
                        f"argmax {what} (seed={S.SEED}): {result.argmax.tolist()} "
                        f"vs {ref.argmax.tolist()}")
    else:
        test.assertIsNone(result.argmax, what)


@S.requires_kernels
class TestPaths(unittest.TestCase):
    def run_case(self, shape, dtype, *, fused=False, overwrite=False, traced=False,
                 grad=True, scale=1.0, offset=0, returns=(True, True, True), **options):
        layout = options.pop("label_layout", "bs")
        source = S.random_logits(shape, dtype, offset=offset)
        tokens = cegen._kernels.token_shape(shape, layout)
        labels = S.random_labels(tokens, shape[-1], offset=offset + 1)
        if options.get("ignore_index") is not None:
            drop = torch.rand(tokens, generator=S.generator(offset + 2)) < 0.25
            labels = torch.where(drop, torch.full_like(labels, options["ignore_index"]), labels)
        upstream = torch.rand(tokens, generator=S.generator(offset + 3)) * 2 - 1
        weights = upstream if fused else None
        leaf = source.clone().requires_grad_(grad)
        what = (f"shape={shape} {dtype} fused={fused} overwrite={overwrite} traced={traced} "
                f"grad={grad} s={scale} {options} returns={returns}")
        ref = reference_outputs(source, labels, logit_scale=scale, label_layout=layout,
                                grad_loss=upstream, **options)
        with cegen._kernels.poison_outputs():
            if traced:
                result = _traced_cross_entropy(
                    leaf, labels, options.get("ignore_index"),
                    options.get("label_smoothing", 0.0), options.get("z_loss", 0.0), False,
                    layout, weights, None, "error", logit_scale=scale, returns=returns)
            else:
                logits = leaf * 1 if overwrite else leaf  # a non-leaf the call may own
                result = cegen.cross_entropy(
                    logits if not overwrite else leaf * 1, labels, label_layout=layout,
                    grad_weights=weights, overwrite_input=overwrite, logit_scale=scale,
                    return_lse=returns[0], return_entropy=returns[1],
                    return_argmax=returns[2], **options)
        self.assertIsInstance(result, cegen.CrossEntropyResult)
        S.assert_close(self, result.loss, ref.loss, *S.LOSS_TOLERANCE[dtype], "loss " + what)
        _check_outputs(self, result, ref, what, returns)
        if grad:
            result.loss.backward(upstream)
            rtol, atol = S.GRAD_TOLERANCE[dtype]
            S.assert_close(self, leaf.grad, ref.grad, rtol, atol * max(1.0, scale),
                           "gradient " + what)

    def test_every_path(self) -> None:
        index = 0
        for fused in (False, True):
            for overwrite in (False, True):
                for traced in (False, True):
                    if traced and overwrite:
                        continue  # a traced call never overwrites
                    index += 1
                    with self.subTest(fused=fused, overwrite=overwrite, traced=traced):
                        self.run_case((13, 301), torch.float32, fused=fused,
                                      overwrite=overwrite, traced=traced, offset=10 * index)
        for traced in (False, True):
            with self.subTest(grad=False, traced=traced):
                self.run_case((13, 301), torch.float32, grad=False, traced=traced, offset=90)

    def test_options_dtypes_layouts_and_scales(self) -> None:
        cases = [
            ((13, 301), torch.bfloat16, 1.0, {"ignore_index": -100}),
            ((5, 3, 257), torch.float16, 0.37, {"label_smoothing": 0.1, "label_layout": "sb"}),
            ((5, 3, 257), torch.float32, 2.5, {"z_loss": 1e-3, "label_smoothing": 0.2,
                                               "ignore_index": -100}),
            ((4, 2, 1000), torch.bfloat16, 20.0, {}),
        ]
        for index, (shape, dtype, scale, options) in enumerate(cases):
            for fused in (False, True):
                with self.subTest(shape=shape, dtype=dtype, scale=scale, fused=fused, **options):
                    self.run_case(shape, dtype, fused=fused, scale=scale,
                                  offset=100 + 10 * index, **dict(options))

    def test_each_output_alone(self) -> None:
        for index, returns in enumerate(((True, False, False), (False, True, False),
                                         (False, False, True), (False, True, True))):
            for fused in (False, True):
                with self.subTest(returns=returns, fused=fused):
                    self.run_case((7, 3, 129), torch.bfloat16, fused=fused, returns=returns,
                                  offset=200 + 10 * index)


@S.requires_kernels
class TestRows(unittest.TestCase):
    def special_rows(self, vocab: int, dtype: torch.dtype) -> torch.Tensor:
        x = S.random_logits((12, vocab), torch.float32, offset=300)
        x[0, 7] = x[0].max() + 2.0
        x[0, vocab - 3] = x[0, 7]          # a tie: 7 wins
        x[1] = 0.5                         # all equal: 0, entropy log V
        x[2, vocab // 2] = float("nan")    # argmax -1, entropy NaN
        x[3] = float("-inf")               # argmax 0, entropy NaN
        x[4, : vocab // 2] = float("-inf")  # masked half: finite entropy
        x[5] = -30.0
        x[5, vocab - 1] = 30.0             # one-hot-like: entropy ~ 0, argmax V - 1
        x[6] += 1.0e4                      # large offsets
        x[7] -= 1.0e5
        x[8, 0] = float("inf")             # lse inf: entropy NaN, argmax 0
        x[9, 3] = x[9, 11] = x[9].max() + 1  # tie at two low indices
        return x.to(dtype)

    def test_special_rows(self) -> None:
        vocab = 261
        for dtype in (torch.float32, torch.bfloat16):
            for scale in (1.0, 0.37):
                for fused in (False, True):
                    with self.subTest(dtype=dtype, scale=scale, fused=fused):
                        x = self.special_rows(vocab, dtype)
                        labels = S.random_labels((12,), vocab, offset=301)
                        weights = torch.ones(12) if fused else None
                        with cegen._kernels.poison_outputs():
                            result = cegen.cross_entropy(
                                x.clone().requires_grad_(fused), labels, logit_scale=scale,
                                grad_weights=weights, return_lse=True, return_entropy=True,
                                return_argmax=True, label_out_of_range="megatron")
                        ref = reference_outputs(x, labels, logit_scale=scale,
                                                label_out_of_range="megatron")
                        _check_outputs(self, result, ref, f"{dtype} s={scale} fused={fused}")
                        self.assertEqual(result.argmax[:4].tolist(), [7, 0, -1, 0])
                        self.assertAlmostEqual(result.entropy[1].item(), math.log(vocab),
                                               places=5)
                        # 60 s apart: H ~ (V - 1) 60 s exp(-60 s).
                        self.assertLess(result.entropy[5].item(), 1e-20 if scale == 1 else 1e-5)

    def test_ignored_and_bad_labels_get_their_rows_outputs(self) -> None:
        x = S.random_logits((6, 50), torch.float32, offset=310)
        good = torch.tensor([1, 2, 3, 4, 5, 6])
        odd = torch.tensor([-100, 2, 70, 4, -100, 6])  # ignored and out of range (megatron)
        a = cegen.cross_entropy(x, good, return_lse=True, return_entropy=True,
                                return_argmax=True)
        b = cegen.cross_entropy(x, odd, ignore_index=-100, label_out_of_range="megatron",
                                return_lse=True, return_entropy=True, return_argmax=True)
        self.assertTrue(torch.equal(a.lse, b.lse))
        self.assertTrue(torch.equal(a.entropy, b.entropy))
        self.assertTrue(torch.equal(a.argmax, b.argmax))
        self.assertEqual(b.loss[0].item(), 0.0)


@S.requires_kernels
class TestSoftcap(unittest.TestCase):
    """The outputs' sweep must see the z the statistics sweep saw: fed the raw x instead,
    the argmax compares x with the maximum of z and the entropy's log p is off by x - z."""

    def check(self, dtype, scale, cap, *, fused=False, traced=False, offset=0):
        shape = (12, 301)  # 301: the vector loop and its scalar tail
        source = S.random_logits(shape, dtype, scale=2.0 * cap / scale, offset=offset)
        # Rows the cap saturates: different logits with the same z in f32 (tanh(y) = 1
        # for |y| >= 9 in the kernels' tanh), so the lowest index of the tie must win,
        # not the largest x; and a row whose largest x is past the saturation twice.
        high = 12.0 * cap / scale
        # No random element of those rows may saturate too (a 4.5-sigma draw would: z = cap
        # in f32, a rightful lower-index tie): |y| <= 4 keeps its z below cap by cap/1500.
        source[:3] = source[:3].clamp(-4.0 * cap / scale, 4.0 * cap / scale)
        source[0, 40], source[0, 7], source[0, 200] = high, 2 * high, 3 * high
        source[1, 5], source[1, 300] = 3 * high, 2 * high
        source[2] = -high
        source[2, 100], source[2, 250] = high, 2 * high
        source = source.to(dtype)
        labels = S.random_labels((shape[0],), shape[1], offset=offset + 1)
        upstream = torch.rand(shape[0], generator=S.generator(offset + 3)) * 2 - 1
        leaf = source.clone().requires_grad_(True)
        ref = reference_outputs(source, labels, logit_scale=scale, logit_softcap=cap,
                                grad_loss=upstream)
        weights = upstream if fused else None
        with cegen._kernels.poison_outputs():
            if traced:
                result = _traced_cross_entropy(
                    leaf, labels, None, 0.0, 0.0, False, "bs", weights, None, "error",
                    logit_scale=scale, logit_softcap=cap, returns=(True, True, True))
            else:
                result = cegen.cross_entropy(
                    leaf, labels, grad_weights=weights, logit_scale=scale,
                    logit_softcap=cap, return_lse=True, return_entropy=True,
                    return_argmax=True)
        what = f"{dtype} s={scale} cap={cap} fused={fused} traced={traced} (seed={S.SEED})"
        # z in f32 is within a few ulps of the cap (docs/lowering.md, "The logit softcap").
        z_atol = 8 * cap * 2.0 ** -23
        S.assert_close(self, result.lse, ref.lse, 1e-6, 1e-6 + z_atol, "lse " + what)
        # |dH| <= max_j |dz_j| sum_j p_j |z_j - mean z| <= z_atol 2 cap.
        error = (result.entropy.double() - ref.entropy).abs()
        bound = ENTROPY_RTOL * ref.entropy.abs().clamp(min=1.0) + 2 * cap * z_atol
        self.assertTrue(bool((error <= bound).all()),
                        f"entropy {what}: {result.entropy.tolist()} vs {ref.entropy.tolist()}")
        ok = argmax_acceptable(source, result.argmax, atol=z_atol, logit_scale=scale,
                               logit_softcap=cap)
        self.assertTrue(bool(ok.all()),
                        f"argmax {what}: {result.argmax.tolist()} vs {ref.argmax.tolist()}")
        # The saturated ties: the lowest index of the largest z, not of the largest x.
        self.assertEqual(result.argmax[:3].tolist(), [7, 5, 100], what)
        result.loss.backward(upstream)
        rtol, atol = S.GRAD_TOLERANCE[dtype]
        S.assert_close(self, leaf.grad, ref.grad, rtol,
                       atol * max(1.0, scale) + scale * 2.0 ** -19, "gradient " + what)

    def test_entropy_and_argmax_are_of_z(self) -> None:
        index = 0
        for dtype in (torch.float32, torch.bfloat16):
            for scale, cap in ((1.0, 5.0), (2.5, 15.0)):
                for fused, traced in ((False, False), (True, False), (False, True),
                                      (True, True)):
                    index += 1
                    with self.subTest(dtype=dtype, scale=scale, cap=cap, fused=fused,
                                      traced=traced):
                        self.check(dtype, scale, cap, fused=fused, traced=traced,
                                   offset=400 + 10 * index)

    def test_equal_logits_tie_to_the_lowest_index(self) -> None:
        # The row's largest logit planted at eight positions of different vector lanes
        # (and the scalar tail): equal x must give equal z wherever they sit, so the argmax
        # is the first of them exactly (no near-tie allowance). The kernels may build z's
        # reciprocal two ways in different lanes (docs/lowering.md, "The logit softcap"),
        # which rounds the same x apart by an ulp in about a third of such rows; the sweeps
        # an argmax is taken in build every z one way.
        # The other logits are kept 0.1 below the maximum and |x| / cap below 2 (scale 1,
        # caps >= 2), so that z keeps them 0.007 (thousands of f32 ulps) below z's maximum:
        # a logit near the maximum, or a cap that saturates tanh (scale 6 with a cap of 2.2
        # made several logits' z equal to the cap in f32, seed 1059099453), would make an
        # earlier index a rightful answer.
        rows, vocab = 128, 301
        positions = torch.tensor([3, 12, 21, 30, 101, 250, 297, 300])
        for index, dtype in enumerate((torch.bfloat16, torch.float32)):
            for fused in (False, True):
                offset = 900 + 10 * index + fused
                source = S.random_logits((rows, vocab), dtype, scale=1.0, offset=offset)
                gen = S.generator(offset + 5)
                for row in range(rows):
                    planted = positions[torch.randperm(len(positions), generator=gen)[:4]]
                    top = source[row].max()
                    source[row] = torch.minimum(source[row], top - 0.1)
                    source[row, planted] = top
                labels = S.random_labels((rows,), vocab, offset=offset + 1)
                caps = torch.rand(rows, generator=gen) * 40 + 2
                first = torch.tensor([int((r == r.max()).nonzero()[0]) for r in source])
                for cap in caps[:4].tolist():
                    with self.subTest(dtype=dtype, fused=fused, cap=cap):
                        with cegen._kernels.poison_outputs():
                            if fused:  # the fused kernel's separate outputs sweep
                                options = cegen._kernels.KernelOptions(logit_softcap=cap)
                                argmax = cegen._kernels.fused(
                                    source, labels, torch.full((rows,), 0.5), options,
                                    overwrite=False, argmax=True)[-1]
                            else:
                                argmax = cegen.cross_entropy(source, labels, logit_softcap=cap,
                                                             return_argmax=True).argmax
                        wrong = (argmax != first).nonzero().flatten().tolist()
                        self.assertEqual(wrong, [], f"rows whose tie went to a later index "
                                         f"(seed={S.SEED})")


@S.requires_kernels
class TestApi(unittest.TestCase):
    def test_plain_call_returns_a_tensor_and_same_loss(self) -> None:
        x = S.random_logits((9, 77), torch.float32, offset=320)
        y = S.random_labels((9,), 77, offset=321)
        plain = cegen.cross_entropy(x, y)
        self.assertIsInstance(plain, torch.Tensor)
        result = cegen.cross_entropy(x, y, return_argmax=True)
        self.assertTrue(torch.equal(result.loss, plain))
        self.assertIsNone(result.lse)
        self.assertIsNone(result.entropy)
        loss, lse, entropy, argmax = result  # a named tuple
        self.assertIs(argmax, result.argmax)

    def test_only_the_loss_is_differentiable(self) -> None:
        x = S.random_logits((9, 77), torch.float32, offset=330).requires_grad_(True)
        y = S.random_labels((9,), 77, offset=331)
        for fused in (None, 1.0):
            result = cegen.cross_entropy(x, y, grad_weights=fused, return_lse=True,
                                         return_entropy=True, return_argmax=True)
            self.assertTrue(result.loss.requires_grad)
            for name in ("lse", "entropy", "argmax"):
                self.assertFalse(getattr(result, name).requires_grad, name)

    def test_the_sweep_runs_only_for_entropy_or_argmax(self) -> None:
        x = S.random_logits((9, 77), torch.float32, offset=340).requires_grad_(True)
        y = S.random_labels((9,), 77, offset=341)
        calls = []
        original = _library.forward_outputs

        def spy(*args):
            calls.append(1)
            return original(*args)

        with mock.patch.object(_library, "forward_outputs", spy):
            cegen.cross_entropy(x, y, return_lse=True).loss.sum().backward()
            self.assertEqual(calls, [])
            cegen.cross_entropy(x, y, return_entropy=True).loss.sum().backward()
            self.assertEqual(calls, [1])

    def test_grad_weights_take_the_forward_kernels_sweep_for_entropy_or_argmax(self) -> None:
        # The fused kernel would take the entropy and argmax in a sweep of their own (1.9x
        # against 1.5x on the H200): with either asked, grad_weights (with and without
        # overwrite_input) run the forward kernel's accumulating sweep and the backward
        # kernel; with the lse alone the fused kernel still runs.
        y = S.random_labels((9,), 77, offset=343)
        weights = torch.full((9,), 0.5)
        leaf = S.random_logits((9, 77), torch.float32, offset=342).requires_grad_(True)
        calls = []
        spies = {name: getattr(_library, name)
                 for name in ("fused", "fused_overwrite", "backward", "backward_overwrite")}

        def spy(name):
            def call(*args):
                calls.append(name)
                return spies[name](*args)
            return call

        with contextlib.ExitStack() as stack:
            for name in spies:
                stack.enter_context(mock.patch.object(_library, name, spy(name)))
            for overwrite in (False, True):
                # A non-leaf held by no other reference: the overwrite is granted.
                result = cegen.cross_entropy(leaf * 1.0, y, grad_weights=weights,
                                             overwrite_input=overwrite, return_argmax=True)
                result.loss.backward(weights)
                self.assertIsNotNone(result.argmax)
            self.assertEqual(calls, ["backward", "backward_overwrite"])
            calls.clear()
            cegen.cross_entropy(leaf * 1.0, y, grad_weights=weights, return_lse=True)
            self.assertEqual(calls, ["fused"])

    def test_flags_must_be_bools(self) -> None:
        x = S.random_logits((3, 10), torch.float32, offset=350)
        y = S.random_labels((3,), 10, offset=351)
        for name in ("return_lse", "return_entropy", "return_argmax"):
            for bad in (1, "yes", None, torch.tensor(True)):
                with self.subTest(name=name, bad=bad):
                    with self.assertRaises(cegen.InvalidInputError):
                        cegen.cross_entropy(x, y, **{name: bad})


if __name__ == "__main__":
    unittest.main()
