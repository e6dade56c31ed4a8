"""The fused path's backward (grad_weights=): per-row rescaling on the device and the lazy
report of tokens whose weight was 0 but whose upstream gradient was not.

The gradients are compared with the float64 reference for the upstream gradient autograd
delivered, on fresh random inputs; cegen._gradient_status's GPU behaviour (a report that
arrives after the backward, once) is driven with a stand-in event on the CPU.
"""

from __future__ import annotations

import subprocess
import tempfile
import unittest
from pathlib import Path
from unittest import mock

import _support as S
import torch
from _fresh_logits import MakeLogits, fresh_logits

import cegen
from cegen import _bundle_cache, _gradient_status, _kernels, _library, _rescale


def fused(logits, labels, weights, upstream, **options):
    """Loss and gradient of the fused path for ``upstream`` (a fresh leaf copy)."""
    leaf = logits.detach().clone().requires_grad_(True)
    with _kernels.poison_outputs():
        loss = cegen.cross_entropy(leaf, labels, grad_weights=weights, **options)
        loss.backward(upstream)
    return loss, leaf.grad


@S.requires_kernels
class TestRescaleOnDevice(unittest.TestCase):
    """Rows whose upstream gradient equals the weight are the kernel's; the others are
    rescaled; a masked token (upstream 0) gets a zero row whatever its weight."""

    def mixed_upstream(self, weights: torch.Tensor, offset: int) -> torch.Tensor:
        g = torch.rand(weights.shape, generator=S.generator(offset)) * 2 + 0.25
        pick = torch.rand(weights.shape, generator=S.generator(offset + 1))
        upstream = torch.where(pick < 0.4, weights, g)       # equal to the weight
        upstream = torch.where(pick > 0.8, torch.zeros_like(g), upstream)  # masked
        return upstream

    def test_layouts_and_dtypes(self) -> None:
        cases = [((40, 131), "bs", torch.float32), ((7, 3, 97), "bs", torch.bfloat16),
                 ((6, 4, 257), "sb", torch.float16)]
        for index, (shape, layout, dtype) in enumerate(cases):
            with self.subTest(shape=shape, layout=layout, dtype=dtype):
                logits = S.random_logits(shape, dtype, offset=20 + index)
                tokens = _kernels.token_shape(shape, layout)
                labels = S.random_labels(tokens, shape[-1], offset=30 + index)
                weights = torch.rand(tokens, generator=S.generator(40 + index)) + 0.5
                weights.view(-1)[::5] = 0.0  # weight 0 ...
                upstream = self.mixed_upstream(weights, 50 + index)
                upstream.view(-1)[::5] = 0.0  # ... with upstream 0: fine
                loss, grad = fused(logits, labels, weights, upstream, label_layout=layout,
                                   label_smoothing=0.1)
                ref_loss, ref_grad = S.reference(logits, labels, grad_loss=upstream,
                                                 label_layout=layout, label_smoothing=0.1)
                S.assert_close(self, loss, ref_loss, *S.LOSS_TOLERANCE[dtype], "loss")
                S.assert_close(self, grad, ref_grad, *S.GRAD_TOLERANCE[dtype], "gradient")

    def test_scalar_weight_and_stride_zero_upstream(self) -> None:
        logits = S.random_logits((24, 300), offset=60)
        labels = S.random_labels((24,), 300, offset=61)
        for weight, scale in ((1.0, 1.0), (0.5, 1.0), (2.0, 0.0)):
            with self.subTest(weight=weight, scale=scale):
                leaf = logits.clone().requires_grad_(True)
                loss = cegen.cross_entropy(leaf, labels, grad_weights=weight)
                (loss.sum() * scale).backward()  # upstream: a stride-0 expand of `scale`
                _, ref_grad = S.reference(logits, labels, grad_loss=torch.full((24,), scale))
                S.assert_close(self, leaf.grad, ref_grad, *S.GRAD_TOLERANCE[torch.float32],
                               "gradient")

    def test_overwrite_rescales_the_logits_storage(self) -> None:
        logits = S.random_logits((32, 211), offset=70)
        labels = S.random_labels((32,), 211, offset=71)
        weights = torch.rand((32,), generator=S.generator(72)) + 0.5
        upstream = self.mixed_upstream(weights, 73)
        source = logits.clone().requires_grad_(True)
        MakeLogits.output_pointers.clear()
        MakeLogits.grad_pointers.clear()
        loss = cegen.cross_entropy(fresh_logits(source), labels, grad_weights=weights,
                                   overwrite_input=True)
        loss.backward(upstream)
        self.assertEqual(MakeLogits.grad_pointers, MakeLogits.output_pointers,
                         "the gradient was not written over the logits")
        _, ref_grad = S.reference(logits, labels, grad_loss=upstream)
        S.assert_close(self, source.grad, ref_grad, *S.GRAD_TOLERANCE[torch.float32], "gradient")

    def test_upstream_that_is_the_weights_skips_the_rescale(self) -> None:
        logits = S.random_logits((16, 129), offset=80)
        labels = S.random_labels((16,), 129, offset=81)
        weights = torch.rand((16,), generator=S.generator(82)) + 0.5
        calls = []
        original = _rescale.rescale_fused_gradient

        def counting(*args):  # type: ignore[no-untyped-def]
            calls.append(args)
            return original(*args)

        with mock.patch.object(_rescale, "rescale_fused_gradient", counting):
            _, grad = fused(logits, labels, weights, weights)
            self.assertEqual(calls, [], "the upstream gradient was the weights tensor")
            _, grad2 = fused(logits, labels, weights, weights.clone())
            self.assertEqual(len(calls), 1, "an equal copy is not known equal on the host")
        _, ref_grad = S.reference(logits, labels, grad_loss=weights)
        S.assert_close(self, grad, ref_grad, *S.GRAD_TOLERANCE[torch.float32], "gradient")
        S.assert_close(self, grad2, ref_grad, *S.GRAD_TOLERANCE[torch.float32], "gradient")


@S.requires_kernels
class TestRescaleKernel(unittest.TestCase):
    """The correction is cegen's rescale kernel (ce_rescale), not PyTorch's operations,
    wherever a bundle has it; without one the PyTorch path gives the same gradient."""

    def run_case(self, offset: int, layout: str, shape, dtype,  # type: ignore[no-untyped-def]
                 **options):
        logits = S.random_logits(shape, dtype, offset=offset)
        tokens = _kernels.token_shape(shape, layout)
        labels = S.random_labels(tokens, shape[-1], offset=offset + 1)
        weights = torch.rand(tokens, generator=S.generator(offset + 2)) + 0.5
        g = torch.rand(tokens, generator=S.generator(offset + 3)) + 0.25
        pick = torch.rand(tokens, generator=S.generator(offset + 4))
        upstream = torch.where(pick < 0.5, weights, g).transpose(0, -1).contiguous() \
            .transpose(0, -1)  # strided when 2-D: any strides are the kernel's
        _, grad = fused(logits, labels, weights, upstream, label_layout=layout, **options)
        _, ref_grad = S.reference(logits, labels, grad_loss=upstream, label_layout=layout)
        S.assert_close(self, grad, ref_grad, *S.GRAD_TOLERANCE[dtype], "gradient")

    def test_kernel_does_the_rows(self) -> None:
        def no_torch(*args):  # type: ignore[no-untyped-def]
            raise AssertionError("the PyTorch fallback ran; the rescale kernel should have")

        with mock.patch.object(_rescale, "_rescale_with_torch", no_torch):
            for index, (shape, layout, dtype) in enumerate(
                    [((33, 517), "bs", torch.bfloat16), ((5, 6, 130), "bs", torch.float32),
                     ((4, 7, 64), "sb", torch.float16)]):
                with self.subTest(shape=shape, layout=layout, dtype=dtype):
                    self.run_case(300 + 10 * index, layout, shape, dtype)

    def test_the_callers_bundle_is_searched_first(self) -> None:
        # bundle= of the call reaches the rescale kernel's lookup too (it took the cache's
        # alone, so a machine without ce-gen ran the PyTorch fallback).
        ce_gen = _bundle_cache.find_ce_gen()
        if ce_gen is None:
            self.skipTest("no ce-gen to build a bundle of the test's own")
        with tempfile.TemporaryDirectory() as directory:
            subprocess.run([str(ce_gen), "--target=host", "--op=fused,rescale", "--logits=f32",
                            "--labels=i64", "--layout=flat", "--label-smoothing=off",
                            "--z-loss=off", "--overwrite=0", "--weights=token", "-o",
                            directory], check=True, capture_output=True)
            looked = []
            original = _bundle_cache.bundle_for

            def spy(key, bundle=None, target="host"):  # type: ignore[no-untyped-def]
                looked.append((str(key), bundle))
                return original(key, bundle, target)

            with mock.patch.object(_bundle_cache, "bundle_for", spy):
                self.run_case(410, "bs", (12, 301), torch.float32, bundle=directory)
            rescale_lookups = [b for k, b in looked if k.startswith("op=rescale")]
            self.assertTrue(rescale_lookups, looked)
            self.assertEqual(str(Path(rescale_lookups[0]).resolve()),
                             str(Path(directory).resolve()))

    def test_fallback_without_a_kernel(self) -> None:
        with mock.patch.object(_rescale, "_rescale_kernel", lambda grad, layout, bundle: None), \
                mock.patch.object(_rescale, "_rescale_with_torch",
                                  wraps=_rescale._rescale_with_torch) as torch_path:
            self.run_case(400, "bs", (6, 3, 211), torch.bfloat16)
            self.assertEqual(torch_path.call_count, 1)


@S.requires_kernels
class TestLargeLogits(unittest.TestCase):
    """The fused gradient keeps the row maximum and the log of the sum apart (issue 23 item
    3): its error does not grow with the logits' magnitude, up to rows of equal 3e38s."""

    def test_offsets(self) -> None:
        n, v = 16, 1000
        labels = S.random_labels((n,), v, offset=501)
        for index, offset in enumerate((1e4, 1e6, 1e7, 1e30)):
            with self.subTest(offset=offset):
                x = (torch.randn((n, v), generator=S.generator(500 + index),
                                 dtype=torch.float64) + offset).float()
                _, grad = fused(x, labels, torch.ones(n), torch.ones(n))
                p = torch.softmax(x.double(), dim=1)
                p[torch.arange(n), labels] -= 1.0
                error = ((grad.double() - p).abs().amax(1) / p.abs().amax(1)).max().item()
                # exp(x - lse) with an f32 lse: 1.6e-5 at 1e4, 1e-3 at 1e6 (the issue).
                self.assertLess(error, 1e-6, f"relative row error {error:.3g}")

    def test_equal_huge_row(self) -> None:
        v = 40
        x = torch.full((3, v), 3e38)
        labels = torch.tensor([0, 7, 39])
        _, grad = fused(x, labels, torch.ones(3), torch.ones(3))
        expected = torch.full((3, v), 1.0 / v)
        expected[torch.arange(3), labels] -= 1.0
        torch.testing.assert_close(grad, expected, rtol=1e-6, atol=0)


@S.requires_kernels
class TestZeroWeight(unittest.TestCase):
    """A token with weight 0 and upstream gradient != 0: NaN row, one report."""

    def test_reported_once_by_the_api(self) -> None:
        logits = S.random_logits((4, 3, 97), offset=90)
        labels = S.random_labels((3, 4), 97, offset=91)
        weights = torch.ones((3, 4))
        weights[1, 2] = 0.0
        weights[2, 0] = 0.0
        upstream = torch.ones((3, 4))
        upstream[2, 0] = 0.0  # weight 0, upstream 0: a masked token, not an error
        leaf = logits.clone().requires_grad_(True)
        loss = cegen.cross_entropy(leaf, labels, grad_weights=weights)
        # On the CPU the count is final in the backward, which raises.
        with self.assertRaisesRegex(cegen.CegenError, r"for 1 token\(s\) whose grad_weights "
                                                      r"entry was 0 \(fused backward \d+ on cpu\)"):
            loss.backward(upstream)
        # Reported once: the next call and an explicit check raise nothing.
        cegen.cross_entropy(logits, labels)
        _gradient_status.check_fused_gradients(torch.device("cpu"))

    def test_rows_become_nan(self) -> None:
        for layout, tokens, shape in (("bs", (3, 4), (4, 3, 5)), ("sb", (4, 3), (4, 3, 5)),
                                      ("bs", (12,), (12, 5))):
            with self.subTest(layout=layout, shape=shape):
                weights = torch.rand(tokens, generator=S.generator(92)) + 0.5
                upstream = torch.rand(tokens, generator=S.generator(93)) + 0.5
                flat_w, flat_g = weights.view(-1), upstream.view(-1)
                flat_w[[1, 6]] = 0.0
                flat_g[6] = 0.0  # token 1: an error; token 6: masked
                row_of = _token_rows(shape, layout)  # token index -> gradient row index
                grad = torch.randn(shape, generator=S.generator(94))
                rows = grad.view(-1, shape[-1])
                for token in (1, 6):
                    rows[row_of[token]] = 0.0  # the fused kernel's 0 * dloss/dx
                expected = rows * _column(upstream / weights, row_of)
                expected[row_of[1]] = float("nan")
                expected[row_of[6]] = 0.0
                with self.assertRaises(_gradient_status.ZeroWeightGradientError):
                    _library.rescale_fused_gradient(grad, weights, upstream, layout, None)
                torch.testing.assert_close(rows, expected, equal_nan=True)


def _token_rows(shape, layout):  # type: ignore[no-untyped-def]
    """Row index in the [.., V] gradient of each token, in the labels' (flat) order."""
    if len(shape) == 2:
        return list(range(shape[0]))
    s_len, b_len = shape[0], shape[1]
    if layout == "bs":  # token (b, s) lives in row s * B + b
        return [s * b_len + b for b in range(b_len) for s in range(s_len)]
    return list(range(s_len * b_len))


def _column(ratio: torch.Tensor, row_of) -> torch.Tensor:  # type: ignore[no-untyped-def]
    flat = ratio.reshape(-1)
    column = torch.empty((len(row_of), 1))
    for token, row in enumerate(row_of):
        column[row, 0] = flat[token]
    return torch.nan_to_num(column, nan=0.0, posinf=0.0, neginf=0.0)


class TestCustomOp(unittest.TestCase):
    """The rescale is a custom op (where PyTorch has them) that declares its mutation, so
    torch.compile keeps it as one opaque call and orders it after the fused kernel."""

    def test_mutation_is_declared(self) -> None:
        specs = {name: mutates for name, _, _, mutates in _library._TENSOR_SPECS}
        self.assertEqual(specs["rescale_fused_gradient"], ("grad",))
        if cegen.HAS_CUSTOM_OP:
            schema = str(torch.ops.cegen.rescale_fused_gradient.default._schema)
            self.assertIn("Tensor(a0!) grad", schema)


class _Event:
    """A stand-in for torch.cuda.Event whose copy completes when the test says so."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class TestLazyReport(unittest.TestCase):
    """cegen._gradient_status as on a GPU: a count that has not arrived is not read; once
    it has, the next poll raises, once."""

    def test_report_waits_for_the_copy_and_is_made_once(self) -> None:
        device = torch.device("cpu")
        with mock.patch.dict(_gradient_status._states, clear=True):
            state = _gradient_status._state(device, create=True)
            slot = _gradient_status._new_slots(device, 1)[0]
            slot.event = _Event()
            slot.where = "fused backward 7 on cuda:0"
            slot.word.fill_(3)
            state.pending.append(slot)
            _gradient_status.poll(device)  # the copy has not completed: nothing yet
            slot.event.done = True
            with self.assertRaisesRegex(_gradient_status.ZeroWeightGradientError,
                                        r"for 3 token\(s\).*\(fused backward 7 on cuda:0\)"):
                _gradient_status.poll(device)
            _gradient_status.poll(device)  # made once
            self.assertEqual(state.pending, [])


if __name__ == "__main__":
    unittest.main()
