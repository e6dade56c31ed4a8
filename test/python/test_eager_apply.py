"""cegen.ops._c_apply: the eager autograd Functions applied through PyTorch's C++ apply,
without the Python classmethod PyTorch >= 2.0 wraps around it (host time).

PyTorch 1.13 (the host tests' PyTorch) has no such wrapper, so these tests make one: a
Function whose ``apply`` is a Python classmethod over the C++ one, as in PyTorch 2.x,
and stand-ins for functorch's probe and unwrapping function. They check that the C++
apply is called while no transform is active, with every tensor argument unwrapped,
that the Python apply runs while one is, and that the result and its gradient are
cegen's.
"""

from __future__ import annotations

import unittest
from typing import Any, List

import _support as S
import torch

import cegen
from cegen import ops


def _wrapped(function: Any, calls: List[str]) -> Any:
    """A subclass of ``function`` whose apply is a Python classmethod, as in PyTorch 2.x."""

    class Wrapped(function):  # type: ignore[misc, valid-type]
        @classmethod
        def apply(cls, *args: Any) -> Any:  # type: ignore[override]
            calls.append("python apply")
            return super().apply(*args)

    return Wrapped


@S.requires_kernels
class TestCApply(unittest.TestCase):

    def run_case(self, function: Any, fused: bool) -> None:
        calls: List[str] = []
        unwrapped: List[int] = []
        transforms = [False]

        def unwrap(tensor: torch.Tensor) -> torch.Tensor:
            unwrapped.append(id(tensor))
            return tensor

        wrapped = _wrapped(function, calls)
        apply = ops._c_apply(wrapped, active=lambda: transforms[0], unwrap=unwrap)
        self.assertIsNot(apply, wrapped.apply, "the Python apply was kept")
        n, vocab = 5, 19
        logits = S.random_logits((n, vocab), offset=1)
        labels = S.random_labels((n,), vocab, offset=2)
        g = torch.rand((n,), generator=S.generator(3)) + 0.5
        options = cegen._kernels.kernel_options(None, 0.0, 0.0, "bs", None, "error")
        expected_loss, expected_grad = S.reference(logits, labels, grad_loss=g)
        for active in (False, True):
            transforms[0] = active
            calls.clear()
            unwrapped.clear()
            leaf = logits.clone().requires_grad_(True)
            args = (leaf, labels, g, options, False) if fused else (leaf, labels, options, False)
            loss = apply(*args)
            (grad,) = torch.autograd.grad(loss, leaf, g)
            what = f"{function.__name__}, transforms active: {active}"
            S.assert_close(self, loss, expected_loss, *S.LOSS_TOLERANCE[torch.float32],
                           f"{what}: loss")
            S.assert_close(self, grad, expected_grad, *S.GRAD_TOLERANCE[torch.float32],
                           f"{what}: grad")
            self.assertEqual(calls, ["python apply"] if active else [], what)
            tensors = [id(leaf), id(labels)] + ([id(g)] if fused else [])
            self.assertEqual(sorted(unwrapped), [] if active else sorted(tensors), what)

    def test_plain(self) -> None:
        self.run_case(ops._EagerCrossEntropy, fused=False)

    def test_fused(self) -> None:
        self.run_case(ops._EagerFusedCrossEntropy, fused=True)

    def test_without_a_python_apply_it_is_the_functions_own(self) -> None:
        # PyTorch 1.13: apply is the C++ one already, nothing to go around.
        if ops._EagerCrossEntropy.apply == vars(torch._C._FunctionBase)["apply"].__get__(
                None, ops._EagerCrossEntropy):
            self.assertEqual(ops._c_apply(ops._EagerCrossEntropy, active=lambda: False,
                                          unwrap=lambda t: t),
                             ops._EagerCrossEntropy.apply)


if __name__ == "__main__":
    unittest.main()
