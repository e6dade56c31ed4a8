"""cegen.linear_cross_entropy on the host kernels against a float64 reference.

The reference is the unchunked computation in float64: logits = h W^T + b, Megatron's
smoothing and the z-loss as in DESIGN.md, autograd for the gradients. Chunks are forced
small, so that a chunk of one token, a last partial chunk and ignored tokens across a
chunk boundary all occur; both schedules are covered (grad_weights known in the forward,
and the backward that recomputes each chunk's logits), with upstream gradients that match
the weights, differ from them, are stride-0 and are zero.
"""

from __future__ import annotations

import re
import unittest

import torch

from _support import SEED, kernels_missing

import cegen
from cegen import linear

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
                 **options):
        """(ours, reference) of loss and the gradients of hidden, weight, bias."""
        ref_inputs = [t.clone().requires_grad_(True) if t is not None else None
                      for t in (hidden, weight, bias)]
        ref_loss = reference(ref_inputs[0], ref_inputs[1], ref_inputs[2], labels, **options)
        ref_loss.backward(upstream)
        ours_inputs = [t.float().clone().requires_grad_(True) if t is not None else None
                       for t in (hidden, weight, bias)]
        loss = cegen.linear_cross_entropy(ours_inputs[0], ours_inputs[1], labels,
                                          bias=ours_inputs[2], chunk_tokens=chunk,
                                          grad_weights=grad_weights, **options)
        loss.backward(upstream.float() if upstream.dim() else upstream.float())
        ours = [loss] + [t.grad if t is not None else None for t in ours_inputs]
        refs = [ref_loss] + [t.grad if t is not None else None for t in ref_inputs]
        return ours, refs

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
            for schedule in ("recompute", "fused-match", "fused-differ", "fused-scalar"):
                with self.subTest(chunk=chunk, schedule=schedule):
                    grad_weights, g = None, upstream
                    if schedule == "fused-match":
                        grad_weights = upstream.float()
                    elif schedule == "fused-differ":
                        grad_weights = (upstream * 2).float()  # the backward must recompute
                    elif schedule == "fused-scalar":
                        grad_weights, g = 1.0 / n, torch.full((n,), 1.0 / n, dtype=torch.float64)
                    ours, refs = self.run_both(hidden, weight, bias, labels, g, chunk=chunk,
                                               grad_weights=grad_weights, ignore_index=-100,
                                               label_smoothing=0.1, z_loss=1e-3)
                    self.assert_close(ours, refs, f"chunk {chunk}, {schedule}")
                    self.assertTrue(bool((ours[0][2:4] == 0).all()), "ignored tokens' loss")

    def test_stride0_and_zero_upstream(self):
        hidden, weight, bias, labels = self.problem(with_bias=False)
        n = labels.shape[0]
        for name, g in (("stride-0 ones", torch.ones((), dtype=torch.float64).expand(n)),
                        ("zeros", torch.zeros((n,), dtype=torch.float64))):
            with self.subTest(upstream=name):
                ours, refs = self.run_both(hidden, weight, None, labels, g, chunk=4)
                self.assert_close(ours, refs, name)

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
        ]
        for call, message in cases:
            with self.subTest(message=message):
                with self.assertRaisesRegex(cegen.InvalidInputError, re.escape(message)):
                    call()
        bad = labels.clone()
        bad[0] = 10 ** 6
        with self.assertRaises(cegen.LabelOutOfRangeError):
            cegen.linear_cross_entropy(h32, w32, bad)




class DefaultChunkTest(unittest.TestCase):
    def test_default_chunk(self):
        self.assertEqual(linear.default_chunk_tokens(8192, 128256, 2), 1046)  # 256 MiB
        self.assertEqual(linear.default_chunk_tokens(10, 128256, 2), 10)
        self.assertEqual(linear.default_chunk_tokens(8192, 1 << 40, 4), 1)


if __name__ == "__main__":
    unittest.main()
