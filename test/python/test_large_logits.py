"""Gradients of rows far from 0 (issue 23 item 3): every backward path against float64.

A backward kernel takes the forward's f32 lse; without its low part every exponent
``x - lse`` carries ``|lse| * 2^-24`` of error, 6e-4 relative at logits near 1e6. The
forward writes ``lse_low`` (``lse + lse_low`` is the log-sum-exp to twice f32's
precision) and every backward reads it, so the gradient's error stays at f32's few ulps
at any offset: the two-kernel path, its overwrite variant, the fused kernel, the
vocab-parallel backward (its combine computes ``lse_low``) and the linear cross
entropy's recomputing backward. The references are float64 softmaxes of the very f32
values the kernels read.
"""

from __future__ import annotations

import unittest

import _support as S
import torch

import cegen
from cegen import _kernels

OFFSETS = (1.0e4, 1.0e6, 1.0e7)
#: Gradient tolerance (absolute, the gradient being in [-1, 1] times the upstream): a few
#: f32 ulps of the largest probability. Without lse_low the error at 1e6 is ~1e-3.
TOLERANCE = 2.0e-6


def shifted_logits(shape, offset: float, index: int) -> torch.Tensor:
    """f32 logits ``randn * 3 + offset`` (the f32 values are the inputs)."""
    return (S.random_logits(shape, offset=index).double() + offset).float()


def reference_grad(logits: torch.Tensor, labels: torch.Tensor,
                   upstream: torch.Tensor) -> torch.Tensor:
    """``upstream * (softmax - onehot)`` in float64 from the f32 values."""
    x = logits.double()
    grad = torch.softmax(x, dim=-1)
    grad.scatter_add_(-1, labels.unsqueeze(-1), -torch.ones_like(x[..., :1]))
    return grad * upstream.double().unsqueeze(-1)


def assert_grad(test: unittest.TestCase, grad: torch.Tensor, expected: torch.Tensor,
                what: str) -> None:
    error = (grad.double() - expected).abs().max().item()
    test.assertLessEqual(error, TOLERANCE, f"{what}: max |error| {error:.3g} (seed={S.SEED})")


@S.requires_kernels
class TestLargeLogits(unittest.TestCase):
    """Rows of ``randn * 3 + c`` for c up to 1e7, f32 logits, per-token upstream."""

    def cases(self):  # type: ignore[no-untyped-def]
        for index, offset in enumerate(OFFSETS):
            logits = shifted_logits((24, 1001), offset, 10 + index)
            labels = S.random_labels((24,), 1001, offset=20 + index)
            upstream = torch.rand(24, generator=S.generator(30 + index)) + 0.5
            yield offset, logits, labels, upstream

    def test_two_kernel_backward(self) -> None:
        for offset, logits, labels, upstream in self.cases():
            with self.subTest(offset=offset):
                leaf = logits.clone().requires_grad_(True)
                with _kernels.poison_outputs():
                    cegen.cross_entropy(leaf, labels).backward(upstream)
                assert_grad(self, leaf.grad, reference_grad(logits, labels, upstream),
                            f"backward at offset {offset:g}")

    def test_overwrite_backward(self) -> None:
        for offset, logits, labels, upstream in self.cases():
            with self.subTest(offset=offset):
                leaf = logits.clone().requires_grad_(True)
                with _kernels.poison_outputs():
                    loss = cegen.cross_entropy(leaf * 1.0, labels, overwrite_input=True)
                    loss.backward(upstream)
                assert_grad(self, leaf.grad, reference_grad(logits, labels, upstream),
                            f"overwriting backward at offset {offset:g}")

    def test_fused(self) -> None:
        for offset, logits, labels, upstream in self.cases():
            with self.subTest(offset=offset):
                leaf = logits.clone().requires_grad_(True)
                with _kernels.poison_outputs():
                    loss = cegen.cross_entropy(leaf, labels, grad_weights=upstream)
                    loss.backward(upstream)
                assert_grad(self, leaf.grad, reference_grad(logits, labels, upstream),
                            f"fused at offset {offset:g}")

    def test_vocab_parallel_backward(self) -> None:
        # One process: the shard statistics, the combine (which computes lse_low) and
        # the sharded backward kernel, as on every rank of a group.
        for offset, logits, labels, upstream in self.cases():
            with self.subTest(offset=offset):
                leaf = logits.clone().requires_grad_(True)
                with _kernels.poison_outputs():
                    loss = cegen.vocab_parallel_cross_entropy(leaf, labels)
                    loss.backward(upstream)
                assert_grad(self, leaf.grad, reference_grad(logits, labels, upstream),
                            f"vocab-parallel backward at offset {offset:g}")

    def test_combine_low_part_is_exact(self) -> None:
        # lse + lse_low is top + log1p(rest) without the f32 sum's rounding.
        top = torch.tensor([1.0e6, -3.0e7, 2.5, 0.0, float("-inf")], dtype=torch.float32)
        log1p_rest = torch.tensor([0.3, 7.1, 1.0e-9, 11.2, 0.0], dtype=torch.float32)
        stats = torch.zeros(1, 5, 4)
        stats[0, :, 0] = top
        stats[0, :, 1] = torch.expm1(log1p_rest.double()).float()
        labels = torch.zeros(5, dtype=torch.int64)
        _, lse, low = cegen.combine_shard_stats(
            stats, labels, ignore_index=None, label_smoothing=0.0, z_loss=0.0,
            vocab_local=10, vocab=10, global_smoothing=False, rank=0, with_low=True)
        log1p_used = torch.log1p(stats[0, :, 1])  # what the combine takes the log of
        exact = top.double() + log1p_used.double()
        finite = torch.isfinite(exact)
        self.assertTrue(bool(((lse.double() + low.double()) == exact)[finite].all()),
                        f"{lse} + {low} != {exact}")
        self.assertEqual(low[~finite].tolist(), [0.0])

    def test_linear_cross_entropy_recompute(self) -> None:
        # Logits h W^T + b exact in f32 whatever the GEMM's order: multiples of 1/4 near
        # the bias 1e6 (< 2^20, so a quarter is representable).
        tokens, hidden_size, vocab = 12, 8, 301
        hidden = (torch.randint(-2, 3, (tokens, hidden_size), generator=S.generator(40))
                  .float() / 2)
        weight = (torch.randint(-2, 3, (vocab, hidden_size), generator=S.generator(41))
                  .float() / 2)
        bias = torch.full((vocab,), 1.0e6)
        labels = S.random_labels((tokens,), vocab, offset=42)
        upstream = torch.rand(tokens, generator=S.generator(43)) + 0.5
        h = hidden.clone().requires_grad_(True)
        with _kernels.poison_outputs():
            loss = cegen.linear_cross_entropy(h, weight, labels, bias=bias, chunk_tokens=5)
            loss.backward(upstream)  # per token, known only now: the recompute
        logits = hidden @ weight.t() + bias
        grad_logits = reference_grad(logits, labels, upstream)
        expected = grad_logits @ weight.double()
        error = (h.grad.double() - expected).abs().max().item()
        self.assertLessEqual(error, TOLERANCE * hidden_size,
                             f"d hidden: max |error| {error:.3g} (seed={S.SEED})")


if __name__ == "__main__":
    unittest.main()
