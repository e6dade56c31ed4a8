"""overwrite_input: the gradient goes into the logits' storage only when exclusively owned."""

from __future__ import annotations

import sys
import unittest
import warnings
from typing import List

import _support as S
import torch

import cegen
from cegen import _ownership
from _fresh_logits import MakeLogits, fresh_logits


def refusals(caught) -> List[str]:  # type: ignore[no-untyped-def]
    return [str(w.message) for w in caught if issubclass(w.category, cegen.OverwriteRefusedWarning)]


class TestOwnershipRules(unittest.TestCase):
    """The checks of cegen._ownership, without launching kernels."""

    def setUp(self) -> None:
        self.x = torch.randn(4, 6, requires_grad=True)

    def refusal(self, logits: torch.Tensor, extra_refs: int = 0, vouched: int = 0):  # type: ignore[no-untyped-def]
        return _ownership.overwrite_refusal(logits, _ownership.TEMPORARY_REFCOUNT + extra_refs, vouched)

    def test_exclusively_owned(self) -> None:
        self.assertIsNone(self.refusal(self.x * 2.0))

    def test_leaf(self) -> None:
        self.assertRegex(self.refusal(self.x), "leaf")

    def test_no_gradient_needed(self) -> None:
        self.assertIsNone(self.refusal(torch.randn(4, 6)))

    def test_view(self) -> None:
        self.assertRegex(self.refusal((self.x * 2.0).view(4, 6)), "view")
        self.assertRegex(self.refusal((self.x * 2.0)[1:]), "view")

    def test_not_contiguous(self) -> None:
        logits = self.x.t() * 2.0  # elementwise output keeps the transposed layout, not a view
        self.assertIsNone(logits._base)
        self.assertRegex(self.refusal(logits), "not contiguous")

    def test_storage_larger_than_the_tensor(self) -> None:
        owned = self.x * 2.0
        with torch.no_grad():  # re-point it at a storage that holds more than its elements
            owned.set_(torch.empty(100).storage(), 0, (4, 6), (6, 1))
        self.assertRegex(self.refusal(owned), "whole storage")

    def test_second_reference(self) -> None:
        self.assertRegex(self.refusal(self.x * 2.0, extra_refs=1), "another Python reference")
        self.assertIsNone(self.refusal(self.x * 2.0, extra_refs=1, vouched=1))

    def test_producer_saved_its_output(self) -> None:
        # Where PyTorch exposes storage use counts the saved copy is seen as a sharer first.
        self.assertRegex(self.refusal(self.x.exp()), "ExpBackward|share the logits' storage")

    def test_refcount_calibration_matches_this_interpreter(self) -> None:
        def entry(obj: object) -> int:
            return sys.getrefcount(obj)

        self.assertEqual(entry(object()), _ownership.TEMPORARY_REFCOUNT)
        named = object()
        self.assertEqual(entry(named), _ownership.TEMPORARY_REFCOUNT + 1)

    def test_bump_version(self) -> None:
        logits = self.x * 2.0
        before = logits._version
        _ownership.bump_version(logits)
        self.assertGreater(logits._version, before)


@S.requires_kernels
class TestOverwrite(unittest.TestCase):
    """End to end through cegen.cross_entropy."""

    def setUp(self) -> None:
        cegen.reset_overwrite_warnings()
        MakeLogits.output_pointers.clear()
        MakeLogits.grad_pointers.clear()
        self.base = S.random_logits((8, 3, 157))
        self.labels = S.random_labels((3, 8), 157)
        _, self.ref_grad = S.reference(self.base, self.labels)

    def test_exclusively_owned_logits_receive_the_gradient(self) -> None:
        x = self.base.clone().requires_grad_(True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = cegen.cross_entropy(fresh_logits(x), self.labels, overwrite_input=True)
            loss.sum().backward()
        self.assertEqual(refusals(caught), [])
        self.assertEqual(MakeLogits.grad_pointers, MakeLogits.output_pointers,
                         "the gradient did not reuse the logits' storage")
        S.assert_close(self, x.grad, self.ref_grad, *S.GRAD_TOLERANCE[torch.float32], "gradient")

    def test_fused_overwrite(self) -> None:
        x = self.base.clone().requires_grad_(True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = cegen.cross_entropy(fresh_logits(x), self.labels, overwrite_input=True,
                                       grad_weights=1.0)
            loss.sum().backward()
        self.assertEqual(refusals(caught), [])
        self.assertEqual(MakeLogits.grad_pointers, MakeLogits.output_pointers)
        S.assert_close(self, x.grad, self.ref_grad, *S.GRAD_TOLERANCE[torch.float32], "gradient")

    def test_second_reference_falls_back_with_a_warning(self) -> None:
        x = self.base.clone().requires_grad_(True)
        logits = fresh_logits(x)
        kept = logits.detach().clone()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cegen.cross_entropy(logits, self.labels, overwrite_input=True).sum().backward()
        messages = refusals(caught)
        self.assertEqual(len(messages), 1)
        self.assertIn("another Python reference", messages[0])
        self.assertNotEqual(MakeLogits.grad_pointers, MakeLogits.output_pointers)
        self.assertTrue(torch.equal(logits.detach(), kept), "the logits were overwritten")
        S.assert_close(self, x.grad, self.ref_grad, *S.GRAD_TOLERANCE[torch.float32], "gradient")

    def test_view_falls_back_with_a_warning(self) -> None:
        x = self.base.clone().requires_grad_(True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = cegen.cross_entropy(fresh_logits(x).view(8, 3, 157), self.labels, overwrite_input=True)
            loss.sum().backward()
        messages = refusals(caught)
        self.assertEqual(len(messages), 1)
        self.assertIn("view", messages[0])
        S.assert_close(self, x.grad, self.ref_grad, *S.GRAD_TOLERANCE[torch.float32], "gradient")

    def test_leaf_falls_back_and_is_left_intact(self) -> None:
        x = self.base.clone().requires_grad_(True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cegen.cross_entropy(x, self.labels, overwrite_input=True).sum().backward()
        self.assertIn("leaf", " ".join(refusals(caught)))
        self.assertTrue(torch.equal(x.detach(), self.base))

    def test_warns_once_per_reason(self) -> None:
        x = self.base.clone().requires_grad_(True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                cegen.cross_entropy(x, self.labels, overwrite_input=True)
        self.assertEqual(len(refusals(caught)), 1)

    def test_another_saved_reader_fails_loudly(self) -> None:
        # A second consumer that saved the logits for its backward cannot be seen from the
        # logits; the version bump makes autograd refuse to use its stale copy.
        x = self.base.clone().requires_grad_(True)
        side: List[torch.Tensor] = []

        def logits_with_side_reader() -> torch.Tensor:
            logits = fresh_logits(x)
            side.append((logits * logits).sum())
            return logits

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = cegen.cross_entropy(logits_with_side_reader(), self.labels, overwrite_input=True)
        if refusals(caught):
            # Newer PyTorch makes the saved copy visible (storage use count, or a reference
            # to the Python object held for the C++ side), and the request is refused up front.
            self.assertRegex(refusals(caught)[0], "share the logits' storage|another Python reference")
            (loss.sum() + side[0]).backward()
            return
        with self.assertRaisesRegex(RuntimeError, "modified by an inplace operation"):
            (loss.sum() + side[0]).backward()

    def test_logits_hold_the_gradient_afterwards(self) -> None:
        # What docs/megatron.md warns about: a reader that keeps a view sees the gradient.
        x = self.base.clone().requires_grad_(True)
        holder: List[torch.Tensor] = []

        class Keep(torch.autograd.Function):
            @staticmethod
            def forward(ctx, value):  # type: ignore[no-untyped-def]
                out = value.detach().clone()
                holder.append(out.detach())  # an alias the ownership check cannot see on 1.13
                return out

            @staticmethod
            def backward(ctx, grad):  # type: ignore[no-untyped-def]
                return grad

        loss = cegen.cross_entropy(Keep.apply(x), self.labels, overwrite_input=True)
        if _ownership._storage_users(holder[0]) is not None:
            self.skipTest("this PyTorch exposes storage use counts; the alias is refused instead")
        loss.sum().backward()
        S.assert_close(self, holder[0], self.ref_grad, *S.GRAD_TOLERANCE[torch.float32],
                       "logits after backward")


if __name__ == "__main__":
    unittest.main()
