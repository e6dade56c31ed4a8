"""Numerics of cegen.cross_entropy on the host kernels against float64 references.

Every run uses fresh random inputs (the seed is printed) and poisons output buffers
before each launch, so a kernel that skips a write shows up as NaN.
"""

from __future__ import annotations

import unittest

import _support as S
import torch
import torch.nn.functional as F

import cegen
from cegen import _kernels


def run(logits: torch.Tensor, labels: torch.Tensor, grad_loss=None, **options):
    """cegen loss and gradient for ``logits`` (a fresh leaf copy) and ``grad_loss``."""
    leaf = logits.detach().clone().requires_grad_(True)
    with _kernels.poison_outputs():
        loss = cegen.cross_entropy(leaf, labels, **options)
        if grad_loss is None:
            loss.sum().backward()
        else:
            loss.backward(grad_loss)
    return loss, leaf.grad


@S.requires_kernels
class TestAgainstTorch(unittest.TestCase):
    """Loss and gradient against F.cross_entropy computed in float64."""

    def test_plain_fp32_odd_and_large_vocab(self) -> None:
        for index, (tokens, vocab) in enumerate([(7, 2), (33, 17), (64, 1000), (16, 4099), (8, 32000)]):
            with self.subTest(tokens=tokens, vocab=vocab):
                logits = S.random_logits((tokens, vocab), offset=index)
                labels = S.random_labels((tokens,), vocab, offset=100 + index)
                loss, grad = run(logits, labels)
                x = logits.double().requires_grad_(True)
                expected = F.cross_entropy(x, labels, reduction="none")
                expected.sum().backward()
                self.assertEqual(loss.dtype, torch.float32)
                self.assertEqual(tuple(loss.shape), (tokens,))
                S.assert_close(self, loss, expected, 1e-5, 1e-5, "loss")
                S.assert_close(self, grad, x.grad, *S.GRAD_TOLERANCE[torch.float32], "gradient")

    def test_ignore_index(self) -> None:
        logits = S.random_logits((48, 257))
        labels = S.random_labels((48,), 257)
        labels[::3] = -100
        loss, grad = run(logits, labels, ignore_index=-100)
        x = logits.double().requires_grad_(True)
        expected = F.cross_entropy(x, labels, reduction="none", ignore_index=-100)
        expected.sum().backward()
        S.assert_close(self, loss, expected, 1e-5, 1e-5, "loss")
        S.assert_close(self, grad, x.grad, *S.GRAD_TOLERANCE[torch.float32], "gradient")
        self.assertTrue(bool((loss[::3] == 0).all()))
        self.assertTrue(bool((grad[::3] == 0).all()))

    def test_label_smoothing_is_megatrons_formula(self) -> None:
        # PyTorch's smoothing eps equals Megatron's s = alpha * V / (V - 1).
        vocab, alpha = 311, 0.1
        logits = S.random_logits((40, vocab))
        labels = S.random_labels((40,), vocab)
        loss, grad = run(logits, labels, label_smoothing=alpha)
        x = logits.double().requires_grad_(True)
        s = alpha * vocab / (vocab - 1)
        expected = F.cross_entropy(x, labels, reduction="none", label_smoothing=s)
        expected.sum().backward()
        S.assert_close(self, loss, expected, 1e-5, 1e-5, "loss vs torch")
        S.assert_close(self, grad, x.grad, *S.GRAD_TOLERANCE[torch.float32], "gradient vs torch")
        ref_loss, ref_grad = S.reference(logits, labels, label_smoothing=alpha)
        S.assert_close(self, loss, ref_loss, 1e-5, 1e-5, "loss vs Megatron formula")
        S.assert_close(self, grad, ref_grad, *S.GRAD_TOLERANCE[torch.float32], "gradient vs formula")


@S.requires_kernels
class TestVariants(unittest.TestCase):
    """dtypes, label types, z-loss and combinations against the float64 reference."""

    def check(self, logits: torch.Tensor, labels: torch.Tensor, grad_loss=None, **options) -> None:
        loss, grad = run(logits, labels, grad_loss, **options)
        ref_loss, ref_grad = S.reference(logits, labels, grad_loss=grad_loss, **options)
        self.assertEqual(loss.dtype, torch.float32)
        self.assertEqual(tuple(loss.shape), tuple(labels.shape))
        self.assertEqual(grad.dtype, logits.dtype)
        S.assert_close(self, loss, ref_loss, *S.LOSS_TOLERANCE[logits.dtype], f"loss {options}")
        S.assert_close(self, grad, ref_grad, *S.GRAD_TOLERANCE[logits.dtype], f"gradient {options}")

    def test_logits_dtypes_and_label_types(self) -> None:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for label_dtype in (torch.int64, torch.int32):
                with self.subTest(dtype=dtype, labels=label_dtype):
                    logits = S.random_logits((37, 1029), dtype)
                    labels = S.random_labels((37,), 1029, label_dtype)
                    self.check(logits, labels)

    def test_z_loss(self) -> None:
        logits = S.random_logits((29, 515))
        labels = S.random_labels((29,), 515)
        self.check(logits, labels, z_loss=1e-4)

    def test_all_options_together(self) -> None:
        for dtype in (torch.float32, torch.bfloat16):
            with self.subTest(dtype=dtype):
                logits = S.random_logits((6, 5, 333), dtype)
                labels = S.random_labels((5, 6), 333)
                labels[0, :2] = -100
                grad_loss = torch.rand((5, 6), generator=S.generator(7)) + 0.5
                self.check(logits, labels, grad_loss, ignore_index=-100, label_smoothing=0.1,
                           z_loss=1e-4)


@S.requires_kernels
class TestLayouts(unittest.TestCase):
    """[S,B,V] logits with [B,S] or [S,B] labels, strided labels, transposed logits views."""

    def check(self, logits: torch.Tensor, labels: torch.Tensor, label_layout: str, grad_loss=None) -> None:
        loss, grad = run(logits, labels, grad_loss, label_layout=label_layout)
        ref_loss, ref_grad = S.reference(logits, labels, label_layout=label_layout, grad_loss=grad_loss)
        self.assertEqual(tuple(loss.shape), tuple(labels.shape))
        S.assert_close(self, loss, ref_loss, 1e-5, 1e-5, f"loss ({label_layout})")
        S.assert_close(self, grad, ref_grad, *S.GRAD_TOLERANCE[logits.dtype], f"gradient ({label_layout})")

    def test_bs_labels_give_bs_loss(self) -> None:
        logits = S.random_logits((9, 4, 130))  # [S, B, V]
        labels = S.random_labels((4, 9), 130)  # [B, S], Megatron's
        self.check(logits, labels, "bs")
        loss, _ = run(logits, labels, label_layout="bs")
        self.assertEqual(tuple(loss.shape), (4, 9))
        self.assertTrue(loss.is_contiguous())

    def test_sb_labels(self) -> None:
        logits = S.random_logits((9, 4, 130))
        labels = S.random_labels((9, 4), 130)
        self.check(logits, labels, "sb")

    def test_strided_labels_are_read_in_place(self) -> None:
        logits = S.random_logits((8, 3, 97))
        wide = S.random_labels((3, 16), 97)
        labels = wide[:, ::2]  # [B, S] with strides (16, 2)
        transposed = S.random_labels((8, 3), 97).t()  # [B, S] view of [S, B] storage
        for name, view in (("every other column", labels), ("transposed", transposed)):
            with self.subTest(labels=name):
                with S.recorded_descriptors() as records:
                    self.check(logits, view, "bs")
                label_records = [r for r in records if r[0] == "labels"]
                self.assertTrue(label_records)
                for _, _, strides, pointer in label_records:
                    self.assertEqual(strides, tuple(view.stride()), "labels were copied")
                    self.assertEqual(pointer, view.data_ptr(), "labels were copied")

    def test_transposed_logits_view(self) -> None:
        stored = S.random_logits((3, 8, 101))  # [B, S, V] storage
        logits = stored.transpose(0, 1)  # [S, B, V] view
        labels = S.random_labels((3, 8), 101)
        self.check(logits, labels, "bs")

    def test_logits_rows_with_gaps(self) -> None:
        padded = S.random_logits((12, 140))
        logits = padded[:, :129]  # row stride 140, vocabulary stride 1
        labels = S.random_labels((12,), 129)
        self.check(logits, labels, "bs")


@S.requires_kernels
class TestUpstreamGradients(unittest.TestCase):
    """Per-token upstream gradients of any strides reach the kernel as strided views."""

    def setUp(self) -> None:
        self.logits = S.random_logits((6, 4, 211))
        self.labels = S.random_labels((4, 6), 211)

    def backward_with(self, make_objective):
        leaf = self.logits.clone().requires_grad_(True)
        with S.recorded_descriptors() as records, _kernels.poison_outputs():
            loss = cegen.cross_entropy(leaf, self.labels)
            make_objective(loss).backward()
        grad_records = [r for r in records if r[0] == "grad_loss"]
        self.assertEqual(len(grad_records), 1)
        return leaf.grad, grad_records[0]

    def test_sum_gives_stride_zero_gradient(self) -> None:
        grad, (_, sizes, strides, _) = self.backward_with(lambda loss: loss.sum())
        self.assertEqual(sizes, (4, 6))
        self.assertEqual(strides, (0, 0), "the stride-0 gradient of loss.sum() was copied")
        _, ref_grad = S.reference(self.logits, self.labels)
        S.assert_close(self, grad, ref_grad, *S.GRAD_TOLERANCE[torch.float32], "gradient")

    def test_mean(self) -> None:
        # mean's backward divides an expanded gradient, which materializes it: any strides.
        grad, _ = self.backward_with(lambda loss: loss.mean())
        _, ref_grad = S.reference(self.logits, self.labels, grad_loss=torch.full((4, 6), 1 / 24))
        S.assert_close(self, grad, ref_grad, *S.GRAD_TOLERANCE[torch.float32], "gradient")

    def test_non_uniform_masked_mean(self) -> None:
        mask = (torch.rand((4, 6), generator=S.generator(3)) > 0.3).float()
        grad, _ = self.backward_with(lambda loss: (loss * mask).sum() / mask.sum())
        _, ref_grad = S.reference(self.logits, self.labels, grad_loss=mask / mask.sum())
        S.assert_close(self, grad, ref_grad, *S.GRAD_TOLERANCE[torch.float32], "gradient")

    def test_scaled_sum_keeps_stride_zero(self) -> None:
        grad, (_, _, strides, _) = self.backward_with(lambda loss: loss.sum() * 0.25)
        self.assertEqual(strides, (0, 0))
        _, ref_grad = S.reference(self.logits, self.labels, grad_loss=torch.full((4, 6), 0.25))
        S.assert_close(self, grad, ref_grad, *S.GRAD_TOLERANCE[torch.float32], "gradient")

    def test_broadcast_over_one_dimension(self) -> None:
        per_sequence = torch.rand((4, 1), generator=S.generator(4)) + 0.5
        upstream = per_sequence.expand(4, 6)  # strides (1, 0)
        leaf = self.logits.clone().requires_grad_(True)
        with S.recorded_descriptors() as records:
            cegen.cross_entropy(leaf, self.labels).backward(upstream)
        (_, _, strides, pointer) = [r for r in records if r[0] == "grad_loss"][0]
        self.assertEqual(strides, tuple(upstream.stride()))
        self.assertEqual(pointer, upstream.data_ptr())
        _, ref_grad = S.reference(self.logits, self.labels, grad_loss=upstream)
        S.assert_close(self, leaf.grad, ref_grad, *S.GRAD_TOLERANCE[torch.float32], "gradient")

    def test_transposed_upstream_gradient(self) -> None:
        upstream = (torch.randn((6, 4), generator=S.generator(5))).t()  # [B, S] view
        leaf = self.logits.clone().requires_grad_(True)
        with S.recorded_descriptors() as records:
            cegen.cross_entropy(leaf, self.labels).backward(upstream)
        (_, _, strides, _) = [r for r in records if r[0] == "grad_loss"][0]
        self.assertEqual(strides, tuple(upstream.stride()))
        _, ref_grad = S.reference(self.logits, self.labels, grad_loss=upstream)
        S.assert_close(self, leaf.grad, ref_grad, *S.GRAD_TOLERANCE[torch.float32], "gradient")


@S.requires_kernels
class TestFused(unittest.TestCase):
    """grad_weights: the gradient is computed by the forward kernel (ce_fused)."""

    def setUp(self) -> None:
        self.logits = S.random_logits((5, 3, 173))
        self.labels = S.random_labels((3, 5), 173)

    def fused(self, grad_weights, objective, **options):
        leaf = self.logits.clone().requires_grad_(True)
        with S.recorded_descriptors() as records, _kernels.poison_outputs():
            loss = cegen.cross_entropy(leaf, self.labels, grad_weights=grad_weights, **options)
            objective(loss).backward()
        ops = {name for name, *_ in records}
        self.assertIn("grad_weights", ops, "the fused kernel did not run")
        self.assertNotIn("grad_loss", ops, "a backward kernel ran in fused mode")
        self.rescaled = "rescale grad" in ops  # the correction kernel (ce_rescale) ran
        return loss, leaf.grad

    def test_scalar_weight_matching_the_mean(self) -> None:
        loss, grad = self.fused(1 / 15, lambda loss: loss.mean())
        ref_loss, ref_grad = S.reference(self.logits, self.labels, grad_loss=torch.full((3, 5), 1 / 15))
        S.assert_close(self, loss, ref_loss, 1e-5, 1e-5, "loss")
        S.assert_close(self, grad, ref_grad, *S.GRAD_TOLERANCE[torch.float32], "gradient")

    def test_scalar_weight_rescaled_in_backward(self) -> None:
        _, grad = self.fused(1.0, lambda loss: 3.0 * loss.sum())
        _, ref_grad = S.reference(self.logits, self.labels, grad_loss=torch.full((3, 5), 3.0))
        S.assert_close(self, grad, ref_grad, *S.GRAD_TOLERANCE[torch.float32], "gradient")

    def test_token_weights_loss_mask(self) -> None:
        mask = (torch.rand((3, 5), generator=S.generator(9)) > 0.4).float()
        mask[0, 0] = 1.0
        weights = mask / mask.sum()
        _, grad = self.fused(weights, lambda loss: (loss * mask).sum() / mask.sum())
        _, ref_grad = S.reference(self.logits, self.labels, grad_loss=weights)
        S.assert_close(self, grad, ref_grad, *S.GRAD_TOLERANCE[torch.float32], "gradient")

    def test_token_weights_rescaled_per_token(self) -> None:
        weights = torch.rand((3, 5), generator=S.generator(10)) + 0.5
        upstream = torch.rand((3, 5), generator=S.generator(11)) + 0.5
        _, grad = self.fused(weights, lambda loss: (loss * upstream).sum(), label_smoothing=0.1)
        self.assertTrue(self.rescaled, "an upstream gradient unlike the weights: no rescale")
        _, ref_grad = S.reference(self.logits, self.labels, grad_loss=upstream, label_smoothing=0.1)
        S.assert_close(self, grad, ref_grad, *S.GRAD_TOLERANCE[torch.float32], "gradient")

    def test_zero_weight_with_upstream_gradient_is_an_error(self) -> None:
        weights = torch.ones((3, 5))
        weights[1, 2] = 0.0
        leaf = self.logits.clone().requires_grad_(True)
        loss = cegen.cross_entropy(leaf, self.labels, grad_weights=weights)
        # On the CPU the backward that met the token reports it (on a GPU: a later call).
        with self.assertRaisesRegex(cegen.CegenError, "1 token.*grad_weights entry was 0"):
            loss.sum().backward()

    def test_no_grad_runs_forward_only(self) -> None:
        with torch.no_grad(), S.recorded_descriptors() as records:
            loss = cegen.cross_entropy(self.logits, self.labels, grad_weights=1.0)
        self.assertNotIn("grad_weights", {name for name, *_ in records})
        ref_loss, _ = S.reference(self.logits, self.labels)
        S.assert_close(self, loss, ref_loss, 1e-5, 1e-5, "loss")


def core_reference(logits: torch.Tensor, labels: torch.Tensor, grad_loss: torch.Tensor,
                   label_smoothing: float = 0.0) -> tuple:
    """Megatron-Core's loss and gradient for [S, B, V] logits and [B, S] labels: the
    stand-in of megatron/core/tensor_parallel/cross_entropy.py on float64 logits."""
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy_impl

    x = logits.detach().to(torch.float64).requires_grad_(True)
    loss = vocab_parallel_cross_entropy_impl(x, labels.t().contiguous(), label_smoothing)
    (loss.t() * grad_loss.to(torch.float64)).sum().backward()
    return loss.detach().t(), x.grad


@S.requires_kernels
class TestLabelOutOfRange(unittest.TestCase):
    """label_out_of_range: "error" (the default) raises, "megatron" gives Core's values."""

    def test_error_is_the_default(self) -> None:
        logits = S.random_logits((5, 3, 61))
        labels = S.sft_labels((3, 5), 61)
        for options in ({}, {"label_out_of_range": "error"}, {"ignore_index": -100}):
            with self.subTest(**options):
                with self.assertRaises(cegen.LabelOutOfRangeError):
                    cegen.cross_entropy(logits, labels, **options)
                with self.assertRaises(cegen.LabelOutOfRangeError):
                    cegen.cross_entropy(logits.clone().requires_grad_(True), labels,
                                        grad_weights=1.0, **options)

    def test_megatron_matches_core_and_the_formula(self) -> None:
        # Every logits dtype and label type, forward + backward and fused, [S, B, V] with
        # [B, S] labels and [N, V]; smoothing and z-loss through the formula.
        cases = [
            ((7, 3, 97), "backward", {}),
            ((7, 3, 97), "fused", {}),
            ((7, 3, 97), "backward", {"label_smoothing": 0.1}),
            ((40, 131), "backward", {"ignore_index": -100, "label_smoothing": 0.1, "z_loss": 1e-4}),
            ((40, 131), "fused", {"ignore_index": -100, "z_loss": 1e-4}),
        ]
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for label_dtype in (torch.int64, torch.int32):
                for index, (shape, mode, options) in enumerate(cases):
                    with self.subTest(dtype=dtype, labels=label_dtype, shape=shape, mode=mode,
                                      **options):
                        self.check(shape, dtype, label_dtype, mode, options, offset=10 * index)

    def check(self, shape, dtype, label_dtype, mode, options, offset) -> None:  # type: ignore[no-untyped-def]
        logits = S.random_logits(shape, dtype, offset=offset)
        tokens = (shape[1], shape[0]) if len(shape) == 3 else (shape[0],)
        labels = S.sft_labels(tokens, shape[-1], label_dtype, offset=offset + 1)
        upstream = torch.rand(tokens, generator=S.generator(offset + 2)) + 0.25
        leaf = logits.clone().requires_grad_(True)
        with _kernels.poison_outputs():
            if mode == "fused":
                loss = cegen.cross_entropy(leaf, labels, grad_weights=upstream,
                                           label_out_of_range="megatron", **options)
            else:
                loss = cegen.cross_entropy(leaf, labels, label_out_of_range="megatron", **options)
            loss.backward(upstream)
        ref_loss, ref_grad = S.reference(logits, labels, grad_loss=upstream,
                                         label_out_of_range="megatron", **options)
        S.assert_close(self, loss, ref_loss, *S.LOSS_TOLERANCE[dtype], "loss vs formula")
        S.assert_close(self, leaf.grad, ref_grad, *S.GRAD_TOLERANCE[dtype], "gradient vs formula")
        if len(shape) == 3 and "ignore_index" not in options and "z_loss" not in options:
            core_loss, core_grad = core_reference(logits, labels, upstream,
                                                  options.get("label_smoothing", 0.0))
            S.assert_close(self, loss, core_loss, *S.LOSS_TOLERANCE[dtype], "loss vs Core")
            S.assert_close(self, leaf.grad, core_grad, *S.GRAD_TOLERANCE[dtype], "gradient vs Core")
        outside = ((labels < 0) | (labels >= shape[-1])).to(torch.int64)
        if "ignore_index" in options:
            outside = outside * (labels != options["ignore_index"]).to(torch.int64)
        self.assertGreaterEqual(int(outside.sum()), 4, "no label outside the vocabulary")

    def test_megatron_without_gradient_and_with_overwrite(self) -> None:
        from _fresh_logits import MakeLogits, fresh_logits

        logits = S.random_logits((6, 4, 89), torch.bfloat16, offset=70)
        labels = S.sft_labels((4, 6), 89, offset=71)
        upstream = torch.rand((4, 6), generator=S.generator(72)) + 0.25
        ref_loss, ref_grad = S.reference(logits, labels, grad_loss=upstream,
                                         label_out_of_range="megatron")
        with torch.no_grad(), _kernels.poison_outputs():
            loss = cegen.cross_entropy(logits, labels, label_out_of_range="megatron")
        S.assert_close(self, loss, ref_loss, *S.LOSS_TOLERANCE[torch.bfloat16], "no-grad loss")
        for fused in (False, True):
            with self.subTest(fused=fused):
                cegen.reset_overwrite_warnings()
                MakeLogits.output_pointers.clear()
                MakeLogits.grad_pointers.clear()
                x = logits.clone().requires_grad_(True)
                with _kernels.poison_outputs():
                    loss = cegen.cross_entropy(
                        fresh_logits(x), labels, overwrite_input=True,
                        grad_weights=upstream if fused else None, label_out_of_range="megatron")
                    loss.backward(upstream)
                self.assertEqual(MakeLogits.grad_pointers, MakeLogits.output_pointers,
                                 "the gradient did not reuse the logits' storage")
                S.assert_close(self, loss, ref_loss, *S.LOSS_TOLERANCE[torch.bfloat16], "loss")
                S.assert_close(self, x.grad, ref_grad, *S.GRAD_TOLERANCE[torch.bfloat16], "gradient")


@S.requires_kernels
class TestBundles(unittest.TestCase):
    """Kernels from a bundle made ahead of time, and from the cache."""

    def test_explicit_bundle_and_cache_reuse(self) -> None:
        logits = S.random_logits((4, 50))
        labels = S.random_labels((4,), 50)
        cegen.cross_entropy(logits, labels)  # builds the forward variant into the cache
        key = cegen.VariantKey("forward", "f32", "i64", "flat")
        bundle = cegen._bundle_cache.bundle_for(key)
        self.assertIn(str(key), bundle.keys())
        loss = cegen.cross_entropy(logits, labels, bundle=str(bundle.path))
        ref_loss, _ = S.reference(logits, labels)
        S.assert_close(self, loss, ref_loss, 1e-5, 1e-5, "loss")
        loss = cegen.cross_entropy(logits, labels, bundle=bundle)
        S.assert_close(self, loss, ref_loss, 1e-5, 1e-5, "loss")

    @unittest.skipIf(S.INSTALLED, "the installed package's prebuilt bundle holds every variant")
    def test_bundle_without_the_variant(self) -> None:
        logits = S.random_logits((4, 50))
        labels = S.random_labels((4,), 50)
        cegen.cross_entropy(logits, labels)
        bundle = cegen._bundle_cache.bundle_for(cegen.VariantKey("forward", "f32", "i64", "flat"))
        with self.assertRaisesRegex(cegen.VariantNotFoundError, "label_smoothing=on"):
            cegen.cross_entropy(logits, labels, label_smoothing=0.1, bundle=bundle.path)

    def test_missing_bundle_directory(self) -> None:
        with self.assertRaises(cegen.BundleError):
            cegen.cross_entropy(S.random_logits((2, 8)), S.random_labels((2,), 8),
                                bundle="/nonexistent/cegen-bundle")


if __name__ == "__main__":
    unittest.main()
