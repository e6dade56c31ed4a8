"""The code torch.compile traces (cegen.ops._traced_cross_entropy), run eagerly on the CPU.

PyTorch here (Debian's 1.13) has no torch.compile; test/gpu/test_graphs_compile.py compiles
on the H200. These tests force ``is_compiling()`` to True so that the traced branch runs on
host kernels: the same loss and gradient as the eager path for the plain and fused calls,
the fused backward without its eager-only checks (the rescale always runs), and overwrite
refused with its warning.
"""

from __future__ import annotations

import unittest
import warnings
from unittest import mock

import _support as S
import torch

import cegen
from cegen import _library, ops


def traced():  # type: ignore[no-untyped-def]
    """Patches the module-level is_compiling that cegen.ops uses."""
    return mock.patch.object(ops, "is_compiling", lambda: True)


@S.requires_kernels
class TestTracedPath(unittest.TestCase):
    def setUp(self) -> None:
        self.logits = S.random_logits((5, 3, 131), offset=500)
        self.labels = S.random_labels((3, 5), 131, offset=501)
        self.upstream = torch.rand((3, 5), generator=S.generator(502)) + 0.5

    def run_both(self, **options):  # type: ignore[no-untyped-def]
        results = []
        for force in (False, True):
            leaf = self.logits.clone().requires_grad_(True)
            with (traced() if force else mock.patch.object(ops, "is_compiling", lambda: False)):
                loss = cegen.cross_entropy(leaf, self.labels, **options)
                loss.backward(self.upstream)
            results.append((loss.detach(), leaf.grad))
        return results

    def test_plain_and_fused_match_eager(self) -> None:
        for options in ({"label_smoothing": 0.1}, {"grad_weights": 1.0},
                        {"grad_weights": self.upstream}, {"ignore_index": 7, "z_loss": 1e-4}):
            with self.subTest(options=sorted(options)):
                (loss, grad), (traced_loss, traced_grad) = self.run_both(**options)
                ref = {k: v for k, v in options.items() if k != "grad_weights"}
                ref_loss, ref_grad = S.reference(self.logits, self.labels, grad_loss=self.upstream,
                                                 **ref)
                S.assert_close(self, traced_loss, ref_loss, 1e-5, 1e-5, "traced loss")
                S.assert_close(self, traced_grad, ref_grad, *S.GRAD_TOLERANCE[torch.float32],
                               "traced gradient")
                self.assertTrue(torch.equal(traced_grad, grad), "traced and eager differ")

    def test_traced_fused_backward_always_rescales(self) -> None:
        calls = []
        original = _library.rescale_fused_gradient

        def counting(*args):  # type: ignore[no-untyped-def]
            calls.append(1)
            return original(*args)

        with traced(), mock.patch.object(_library, "rescale_fused_gradient", counting):
            leaf = self.logits.clone().requires_grad_(True)
            weights = self.upstream
            cegen.cross_entropy(leaf, self.labels, grad_weights=weights).backward(weights)
        self.assertEqual(calls, [1], "the traced backward must not test tensor identity")

    def test_no_grad_forward(self) -> None:
        with traced(), torch.no_grad():
            loss = cegen.cross_entropy(self.logits, self.labels)
        ref_loss, _ = S.reference(self.logits, self.labels)
        S.assert_close(self, loss, ref_loss, 1e-5, 1e-5, "loss")

    def test_overwrite_refused_while_tracing(self) -> None:
        cegen.reset_overwrite_warnings()
        source = self.logits.clone().requires_grad_(True)
        with traced(), warnings.catch_warnings(record=True) as caught, \
                mock.patch("cegen._ownership.is_compiling", lambda: True):
            warnings.simplefilter("always")
            loss = cegen.cross_entropy(source * 1.0, self.labels, overwrite_input=True)
            loss.backward(self.upstream)
        messages = [str(w.message) for w in caught]
        self.assertTrue(any("torch.compile" in m for m in messages), messages)
        _, ref_grad = S.reference(self.logits, self.labels, grad_loss=self.upstream)
        S.assert_close(self, source.grad, ref_grad, *S.GRAD_TOLERANCE[torch.float32], "gradient")


if __name__ == "__main__":
    unittest.main()
