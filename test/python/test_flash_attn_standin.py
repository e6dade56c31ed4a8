"""cegen's stand-in of flash-attention's CrossEntropyLoss (test/compat/flash_attn_standin),
tested on its own, without flash-attention's fetched test file (issue 17).

Checked against float64 computed with PyTorch's own smoothing (flash-attention's semantics,
not cegen's Megatron formula): the loss with each reduction and the gradient, fp32 and bf16,
smoothing, z-loss, ignored tokens, a non-default ignore_index, inplace_backward (refused by
cegen for a leaf: same numbers, a warning); a process group of one (the vocab-parallel
entry); logit_scale through cegen's own (issue 17); NotExpressibleError with its reasons,
in order, for what cegen cannot do yet (and needs logit_scale for an entry without it), and a
precomputed lse ignored where flash-attention ignores it; and the path the stand-in takes
once cegen.cross_entropy takes ``logit_scale`` and ``return_lse`` (issue 17), through a
float64 stand-in of that signature.
"""

from __future__ import annotations

import collections
import sys
import tempfile
import unittest
import warnings
from typing import Any, Optional

import _support as S

sys.path.insert(0, str(S.REPO / "test" / "compat" / "flash_attn_standin"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import cegen  # noqa: E402
from flash_attn.losses import cross_entropy as standin  # noqa: E402
from flash_attn.losses.cross_entropy import CrossEntropyLoss, NotExpressibleError  # noqa: E402

VOCAB = 1000


def _flash_attn_reference(x: torch.Tensor, y: torch.Tensor, *, smoothing: float = 0.0,
                          scale: float = 1.0, lse_square_scale: float = 0.0,
                          ignore_index: int = -100, reduction: str = "mean"):
    """(loss, z_loss, x64 leaf) in float64 as flash-attention defines them: PyTorch's
    smoothing of the scaled logits, plus lse_square_scale * lse^2, 0 for ignored tokens."""
    leaf = x.detach().to(torch.float64).requires_grad_(True)
    z = leaf * scale
    loss = F.cross_entropy(z, y, reduction="none", label_smoothing=smoothing,
                           ignore_index=ignore_index)
    keep = (y != ignore_index).to(torch.float64)
    z_loss = lse_square_scale * torch.logsumexp(z, -1) ** 2 * keep
    loss = loss + z_loss
    count = keep.sum()
    if reduction == "mean":
        return loss.sum() / count, z_loss.detach().sum() / count, leaf
    if reduction == "sum":
        return loss.sum(), z_loss.detach().sum(), leaf
    return loss, z_loss.detach(), leaf


def _inputs(rows: int, dtype: torch.dtype, offset: int, ignore_index: int = -100):
    x = S.random_logits((rows, VOCAB), dtype, offset=offset)
    y = S.random_labels((rows,), VOCAB, offset=offset + 1)
    y[::7] = ignore_index
    return x, y


@S.requires_kernels
class StandinAgainstFloat64Test(unittest.TestCase):
    def check(self, module: CrossEntropyLoss, dtype: torch.dtype, offset: int) -> None:
        x, y = _inputs(37, dtype, offset, module.ignore_index)
        grad_out_shape = (37,) if module.reduction == "none" else ()
        g = S.random_logits(grad_out_shape, torch.float32, scale=1.0, offset=offset + 2)
        leaf = x.clone().requires_grad_(True)
        out = module(leaf, y)
        out.backward(g)
        expected, _, x64 = _flash_attn_reference(
            x, y, smoothing=module.label_smoothing, scale=module.logit_scale,
            lse_square_scale=module.lse_square_scale, ignore_index=module.ignore_index,
            reduction=module.reduction)
        expected.backward(g.to(torch.float64))
        self.assertEqual(out.dtype, torch.float32)
        self.assertEqual(out.shape, expected.shape)
        S.assert_close(self, out, expected, 1e-5, 1e-5, "loss")
        S.assert_close(self, leaf.grad, x64.grad, *S.GRAD_TOLERANCE[dtype], "gradient")

    def test_reductions_smoothing_z_loss_and_ignored_tokens(self) -> None:
        cases = [
            (torch.float32, dict()),
            (torch.float32, dict(label_smoothing=0.9, reduction="sum")),
            (torch.bfloat16, dict(label_smoothing=0.1, lse_square_scale=1e-2)),
            (torch.float32, dict(lse_square_scale=1e-2, reduction="none", ignore_index=3)),
            (torch.bfloat16, dict(label_smoothing=0.9, lse_square_scale=1e-2, reduction="none")),
            # cegen's logit_scale (issue 17), passed through by the stand-in.
            (torch.float32, dict(logit_scale=0.7, label_smoothing=0.2)),
            (torch.bfloat16, dict(logit_scale=2.0, lse_square_scale=1e-2, reduction="none")),
        ]
        for index, (dtype, options) in enumerate(cases):
            with self.subTest(dtype=dtype, **options):
                self.check(CrossEntropyLoss(**options), dtype, offset=10 * index)

    def test_inplace_backward_on_a_leaf_gives_the_same_numbers_and_a_warning(self) -> None:
        from cegen._ownership import reset_overwrite_warnings

        reset_overwrite_warnings()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.check(CrossEntropyLoss(inplace_backward=True, label_smoothing=0.1),
                       torch.float32, offset=90)
        self.assertTrue(any(issubclass(w.category, cegen.OverwriteRefusedWarning) for w in caught))

    def test_precomputed_lse_is_ignored_where_flash_attention_ignores_it(self) -> None:
        # flash-attention reads it only with logit_scale 1 and no smoothing.
        x, y = _inputs(16, torch.float32, offset=120)
        wrong_lse = torch.zeros(16)
        out = CrossEntropyLoss(label_smoothing=0.2)(x, y, precomputed_lse=wrong_lse)
        expected, _, _ = _flash_attn_reference(x, y, smoothing=0.2)
        S.assert_close(self, out, expected, 1e-5, 1e-5, "loss with an ignored precomputed lse")

    def test_a_process_group_of_one(self) -> None:
        import torch.distributed as dist

        if not dist.is_available():
            self.skipTest("torch.distributed is not available")
        with tempfile.NamedTemporaryFile() as rendezvous:
            dist.init_process_group("gloo", init_method=f"file://{rendezvous.name}", rank=0,
                                    world_size=1)
            try:
                x, y = _inputs(21, torch.float32, offset=130)
                leaf = x.clone().requires_grad_(True)
                module = CrossEntropyLoss(label_smoothing=0.3, lse_square_scale=1e-3,
                                          process_group=dist.group.WORLD)
                out = module(leaf, y)
                out.backward()
            finally:
                dist.destroy_process_group()
        expected, _, x64 = _flash_attn_reference(x, y, smoothing=0.3, lse_square_scale=1e-3)
        expected.backward()
        S.assert_close(self, out, expected, 1e-5, 1e-5, "loss")
        S.assert_close(self, leaf.grad, x64.grad, *S.GRAD_TOLERANCE[torch.float32], "gradient")


class NotExpressibleTest(unittest.TestCase):
    def test_reasons_in_order_and_never_a_number(self) -> None:
        x, y = _inputs(8, torch.float32, offset=200)
        lse = torch.logsumexp(x, -1)
        # cegen takes logit_scale and return_lse (issue 17): only the precomputed lse, where
        # flash-attention reads it, is left.
        cases = [
            (dict(), lse, [standin.NEEDS_PRECOMPUTED_LSE]),
            (dict(return_z_loss=True, lse_square_scale=1e-2), lse,
             [standin.NEEDS_PRECOMPUTED_LSE]),
        ]
        for options, precomputed, reasons in cases:
            with self.subTest(options=options, precomputed=precomputed is not None):
                module = CrossEntropyLoss(**options)
                self.assertEqual(module.missing(precomputed), reasons)
                with self.assertRaises(NotExpressibleError) as raised:
                    module(x.clone().requires_grad_(True), y, precomputed_lse=precomputed)
                self.assertEqual(list(raised.exception.reasons), reasons)

    def test_an_entry_without_logit_scale(self) -> None:
        # The reason is still given, first, for an entry point that lacks the keyword.
        def without_scale(logits: torch.Tensor, labels: torch.Tensor, *,
                          ignore_index: Optional[int] = None, label_smoothing: float = 0.0,
                          z_loss: float = 0.0, overwrite_input: bool = False) -> torch.Tensor:
            raise AssertionError("never called")

        original = cegen.cross_entropy
        cegen.cross_entropy = without_scale
        try:
            module = CrossEntropyLoss(logit_scale=0.7, return_z_loss=True)
            self.assertEqual(module.missing(),
                             [standin.NEEDS_LOGIT_SCALE, standin.NEEDS_Z_LOSS_RETURNED])
        finally:
            cegen.cross_entropy = original

    def test_what_flash_attention_rejects(self) -> None:
        with self.assertRaises(NotImplementedError):
            CrossEntropyLoss(reduction="max")
        with self.assertRaises(ValueError):
            CrossEntropyLoss()(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long))
        with self.assertRaises(ValueError):
            CrossEntropyLoss(logit_scale=0.0)(torch.zeros(2, 5), torch.zeros(2, dtype=torch.long))


_Result = collections.namedtuple("_Result", "loss lse entropy argmax")


def _issue17_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *,
                           ignore_index: Optional[int] = None, label_smoothing: float = 0.0,
                           z_loss: float = 0.0, overwrite_input: bool = False,
                           logit_scale: float = 1.0, return_lse: bool = False) -> Any:
    """cegen.cross_entropy as issue 17 specifies it (Megatron's smoothing of z = scale x,
    z-loss of z, the lse as an output), in float64 by autograd: what the stand-in will call."""
    z = logits.to(torch.float64) * logit_scale
    vocab = z.shape[-1]
    s = label_smoothing * vocab / (vocab - 1)
    lse = torch.logsumexp(z, -1)
    target = z.gather(1, labels.clamp(0, vocab - 1).unsqueeze(1)).squeeze(1)
    loss = (1 - s) * (lse - target) + s * (lse - z.mean(-1)) + z_loss * lse * lse
    loss = torch.where(labels == ignore_index, torch.zeros_like(loss), loss).float()
    if not return_lse:
        return loss
    return _Result(loss, lse.detach().float(), None, None)


class FutureCegenTest(unittest.TestCase):
    """The stand-in's logit_scale and return_z_loss paths, through a float64 function with the
    signature issue 17 gives cegen.cross_entropy (they run for real once cegen has it)."""

    def test_logit_scale_and_z_loss_returned(self) -> None:
        original = cegen.cross_entropy
        cegen.cross_entropy = _issue17_cross_entropy
        try:
            for reduction in ("mean", "sum", "none"):
                with self.subTest(reduction=reduction):
                    x, y = _inputs(23, torch.float32, offset=300)
                    module = CrossEntropyLoss(label_smoothing=0.9, logit_scale=0.7,
                                              lse_square_scale=1e-2, return_z_loss=True,
                                              reduction=reduction)
                    self.assertEqual(module.missing(), [])
                    leaf = x.clone().requires_grad_(True)
                    loss, z_loss = module(leaf, y)
                    expected, expected_z, x64 = _flash_attn_reference(
                        x, y, smoothing=0.9, scale=0.7, lse_square_scale=1e-2,
                        reduction=reduction)
                    S.assert_close(self, loss, expected, 1e-5, 1e-5, "loss")
                    S.assert_close(self, z_loss, expected_z, 1e-5, 1e-6, "z_loss")
                    self.assertFalse(z_loss.requires_grad)
                    loss.sum().backward()
                    expected.sum().backward()
                    S.assert_close(self, leaf.grad, x64.grad, 1e-5, 1e-6, "gradient")
        finally:
            cegen.cross_entropy = original


_SYNTHETIC_TEST_FILE = """
import pytest
import torch
from flash_attn.losses.cross_entropy import CrossEntropyLoss

is_sm8x = torch.cuda.get_device_capability("cuda")[0] >= 8


@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if is_sm8x else []))
@pytest.mark.parametrize("logit_scale", [1.0, 0.5])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_synthetic(smoothing, logit_scale, dtype):
    if smoothing == 0.2 and dtype == torch.bfloat16:
        pytest.skip("skipped by the file")
    x = torch.randn(4096, 300, device="cuda", dtype=dtype, requires_grad=True)
    y = torch.randint(0, 300, (4096,), device="cuda")
    y[torch.randperm(4096)[:10]] = -100
    assert x.shape[0] == ROWS and x.device.type == "cpu" and y.device.type == "cpu"
    out = CrossEntropyLoss(label_smoothing=smoothing, logit_scale=logit_scale)(x, y)
    ref = torch.nn.CrossEntropyLoss(label_smoothing=smoothing)(x.double() * logit_scale, y)
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-6)
    assert smoothing == 0.0, "a failure the runner counts"
"""


@S.requires_kernels
class RunnerTest(unittest.TestCase):
    """test/compat/run_flash_attn_tests.py on a small file written like flash-attention's:
    the grid expanded, the file's skip, device "cuda" mapped to the CPU and the rows capped,
    the outcomes counted by reason, the exit status."""

    def test_counts_of_a_synthetic_test_file(self) -> None:
        import contextlib
        import importlib.util
        import io
        import os

        spec = importlib.util.spec_from_file_location(
            "run_flash_attn_tests", S.REPO / "test" / "compat" / "run_flash_attn_tests.py")
        runner = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(runner)
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "test_synthetic.py")
            with open(path, "w") as handle:
                handle.write(_SYNTHETIC_TEST_FILE.replace("ROWS", "64"))
            printed = io.StringIO()
            saved_pytest = sys.modules.get("pytest")
            try:
                with contextlib.redirect_stdout(printed):
                    status = runner.main([path, "--device=cpu", "--max-rows=64",
                                          f"--cache-dir={S._CACHE}"])
            finally:
                if saved_pytest is None:
                    sys.modules.pop("pytest", None)
        text = printed.getvalue()
        # 8 cases: 2 skipped (smoothing 0.2, bf16); cegen takes logit_scale (issue 17), so
        # every other case runs: smoothing 0.0 passes at both scales (4), smoothing 0.2
        # fails at both (2).
        for row in ("| cases in the grid | 8 |", "| skipped by the test file itself | 2 |",
                    "| passed | 4 |", "| failed | 2 |", "| error | 0 |",
                    "| not expressible | 0 |"):
            self.assertIn(row, text)
        self.assertNotIn("first reason: needs logit_scale", text)
        self.assertIn("a failure the runner counts", text)
        self.assertEqual(status, 1)


if __name__ == "__main__":
    unittest.main()
