"""The logit scale (issue 17): ``logit_scale=s`` takes every logit x as ``z = s x`` before the
softmax, on every Python path, against the float64 references of ``_reference_outputs``
(loss, lse and gradient of z, the gradient of x being ``s`` times that of z).

* :class:`TestCrossEntropy`: :func:`cegen.cross_entropy`, eager and traced (the custom ops),
  with and without ``grad_weights`` (the fused kernel), with smoothing, z-loss and an
  ignore_index, and ``[S, B, V]`` logits; lse and lse_low of the forward kernel.
* :class:`TestVocabParallel`: the shard statistics of a scaled slice (rest of z; max,
  target and sum of x), :func:`cegen.combine_shard_stats` with ``logit_scale`` over
  simulated ranks and the sharded backward given the combined ``lse_low``, at ordinary
  logits and at offsets of 1e4 (where forming ``s x - s max`` as two products would show);
  and :func:`cegen.vocab_parallel_cross_entropy` as a group of one.
* :class:`TestLinear`: :func:`cegen.linear_cross_entropy` (chunked GEMMs) against float64
  GEMMs and the reference.
* :class:`TestValidation`: a scale that is not finite and > 0 is refused on every entry
  point, and the default is 1.
"""

from __future__ import annotations

import math
import unittest

import torch

import _support as S
import cegen
from cegen import _kernels
from cegen.ops import _traced_cross_entropy
from _reference_outputs import reference_outputs

def _f32(value: float) -> float:
    """``value`` rounded to float32: the scale the kernels get, and so the references'."""
    return torch.tensor(value, dtype=torch.float32).item()


#: Scales drawn for the cases: 1 (no transform), below and above 1, the ends of the
#: numerics test's log-uniform range.
SCALES = tuple(_f32(s) for s in (1.0, 0.05, 0.37, 2.5, 20.0))


def _grad_tolerance(dtype: torch.dtype, scale: float):
    """S.GRAD_TOLERANCE with its absolute part in units of the scaled gradient."""
    rtol, atol = S.GRAD_TOLERANCE[dtype]
    return rtol, atol * max(1.0, scale)


@S.requires_kernels
class TestCrossEntropy(unittest.TestCase):
    def check(self, shape, dtype, scale, *, fused=False, traced=False, offset=0, **options):
        layout = options.pop("label_layout", "bs")
        logits = S.random_logits(shape, dtype, offset=offset).requires_grad_(True)
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
                                         None, "error", logit_scale=scale)
        else:
            loss = cegen.cross_entropy(logits, labels, label_layout=layout, grad_weights=weights,
                                       logit_scale=scale, **options)
        loss.backward(upstream)
        ref = reference_outputs(logits, labels, logit_scale=scale, label_layout=layout,
                                grad_loss=upstream, **options)
        what = f"shape={shape} {dtype} s={scale} fused={fused} traced={traced} {options}"
        S.assert_close(self, loss, ref.loss, *S.LOSS_TOLERANCE[dtype], "loss " + what)
        S.assert_close(self, logits.grad, ref.grad, *_grad_tolerance(dtype, scale),
                       "gradient " + what)

    def test_every_path_and_scale(self) -> None:
        for index, scale in enumerate(SCALES):
            for fused in (False, True):
                for traced in (False, True):
                    with self.subTest(scale=scale, fused=fused, traced=traced):
                        self.check((13, 301), torch.float32, scale, fused=fused, traced=traced,
                                   offset=10 * index)

    def test_options_dtypes_and_layouts(self) -> None:
        cases = [
            ((13, 301), torch.bfloat16, {"ignore_index": -100}),
            ((5, 3, 257), torch.float16, {"label_smoothing": 0.1, "label_layout": "sb"}),
            ((5, 3, 257), torch.float32, {"z_loss": 1e-3, "label_smoothing": 0.2,
                                          "ignore_index": -100}),
        ]
        for index, (shape, dtype, options) in enumerate(cases):
            for scale in SCALES:
                for fused in (False, True):
                    with self.subTest(shape=shape, dtype=dtype, scale=scale, fused=fused,
                                      **options):
                        self.check(shape, dtype, scale, fused=fused, offset=100 + 10 * index,
                                   **dict(options))

    def test_forward_lse_and_low_part(self) -> None:
        # lse of z; lse + lse_low is s max + log(sum) to twice f32's precision, also at
        # logits near 1e4 where s max's own rounding is ~1e-3 (it joins lse_low).
        for scale in SCALES:
            for offset in (0.0, 1.0e4):
                with self.subTest(scale=scale, offset=offset):
                    logits = S.random_logits((9, 400), torch.float32, offset=7) + offset
                    labels = S.random_labels((9,), 400, offset=8)
                    loss, lse, low = _kernels.forward(logits, labels,
                                                      _kernels.KernelOptions(logit_scale=scale),
                                                      low=True)
                    ref = reference_outputs(logits, labels, logit_scale=scale)
                    S.assert_close(self, loss, ref.loss, 1e-5, 1e-5, "loss")
                    S.assert_close(self, lse, ref.lse, 1e-6, 0.0, "lse")
                    exact = lse.double() + low.double()
                    error = (exact - ref.lse).abs().max().item()
                    self.assertLess(error, 1e-5, f"lse + lse_low (seed={S.SEED})")

    def test_scale_one_is_the_unscaled_loss(self) -> None:
        logits = S.random_logits((7, 99), torch.float32, offset=40)
        labels = S.random_labels((7,), 99, offset=41)
        plain = cegen.cross_entropy(logits, labels)
        self.assertTrue(torch.equal(cegen.cross_entropy(logits, labels, logit_scale=1.0), plain))
        # s = 2 is the loss of 2 x (both exact in f32).
        doubled = cegen.cross_entropy(logits * 2, labels)
        S.assert_close(self, cegen.cross_entropy(logits, labels, logit_scale=2.0), doubled,
                       1e-6, 1e-6, "s = 2")


@S.requires_kernels
class TestVocabParallel(unittest.TestCase):
    VOCAB = 512

    def options(self, start: int, scale: float, **options) -> _kernels.KernelOptions:
        return _kernels.KernelOptions(shard=_kernels.Shard(start, self.VOCAB, True),
                                      logit_scale=scale, **options)

    def simulate(self, scale: float, world: int, offset: float, **options) -> None:
        vocab, local = self.VOCAB, self.VOCAB // world
        logits = S.random_logits((11, vocab), torch.float32, offset=60) + offset
        labels = S.random_labels((11,), vocab, offset=61)
        grad_loss = torch.rand((11,), generator=S.generator(62))
        stats_options = {k: v for k, v in options.items() if k != "z_loss"}
        gathered = torch.zeros((world, 11, 4))
        pieces = [logits[:, r * local:(r + 1) * local].contiguous() for r in range(world)]
        for rank, piece in enumerate(pieces):
            _kernels.shard_stats(piece, labels, self.options(rank * local, scale, **stats_options),
                                 out=gathered[rank])
            # What the statistics hold: max, target and sum of x; rest of z.
            top = piece.double().max(dim=-1).values
            S.assert_close(self, gathered[rank, :, 0], top, 0.0, 0.0, "stats max")
            rest = torch.exp(scale * (piece.double() - top[:, None])).sum(dim=-1) - 1
            S.assert_close(self, gathered[rank, :, 1], rest, 1e-5, 1e-6, "stats rest")
        ref = reference_outputs(logits, labels, logit_scale=scale, grad_loss=grad_loss, **options)
        grads = []
        for rank, piece in enumerate(pieces):
            loss, lse, low = cegen.combine_shard_stats(
                gathered, labels, ignore_index=options.get("ignore_index"),
                label_smoothing=options.get("label_smoothing", 0.0),
                z_loss=options.get("z_loss", 0.0), vocab_local=local, vocab=vocab,
                global_smoothing=True, rank=rank, with_low=True, logit_scale=scale)
            what = f"s={scale} world={world} offset={offset} rank={rank} {options}"
            S.assert_close(self, loss, ref.loss, 1e-5, 1e-5, "loss " + what)
            S.assert_close(self, lse, ref.lse, 1e-6, 0.0, "lse " + what)
            grads.append(_kernels.backward(piece, labels, lse, grad_loss,
                                           self.options(rank * local, scale, **options),
                                           overwrite=False, lse_low=low))
        S.assert_close(self, torch.cat(grads, dim=-1), ref.grad,
                       *_grad_tolerance(torch.float32, scale), f"gradient s={scale} {offset}")

    def test_simulated_ranks(self) -> None:
        for scale in SCALES:
            for world in (2, 4):
                with self.subTest(scale=scale, world=world):
                    self.simulate(scale, world, 0.0, label_smoothing=0.1, z_loss=1e-4,
                                  ignore_index=-100)

    def test_large_logits(self) -> None:
        # At 1e4 the loss of s x_y - s max as two float32 products would be off by
        # ~s 1e4 2^-24 (4e-3 at s = 7.3); the combine subtracts first. The backward given the
        # combined lse_low stays within the usual tolerance.
        for scale in (1.0, _f32(0.37), _f32(7.3)):
            with self.subTest(scale=scale):
                self.simulate(scale, 2, 1.0e4)

    def test_group_of_one(self) -> None:
        logits = S.random_logits((6, 4, 130), torch.bfloat16, offset=70).requires_grad_(True)
        labels = S.random_labels((4, 6), 130, offset=71)
        for scale in (0.5, 3.0):
            with self.subTest(scale=scale):
                logits.grad = None
                loss = cegen.vocab_parallel_cross_entropy(logits, labels, logit_scale=scale,
                                                          label_smoothing=0.1)
                loss.sum().backward()
                ref = reference_outputs(logits, labels, logit_scale=scale, label_smoothing=0.1)
                S.assert_close(self, loss, ref.loss, 1e-5, 1e-5, "loss")
                S.assert_close(self, logits.grad, ref.grad,
                               *_grad_tolerance(torch.bfloat16, scale), "gradient")


@S.requires_kernels
class TestLinear(unittest.TestCase):
    def test_against_float64_gemms(self) -> None:
        hidden64 = torch.randn((40, 24), generator=S.generator(80), dtype=torch.float64)
        weight64 = torch.randn((301, 24), generator=S.generator(81), dtype=torch.float64) * 0.3
        labels = S.random_labels((40,), 301, offset=82)
        for scale in (1.0, 0.25, 6.0):  # exact in float32
            for grad_weights in (None, 1.0):
                with self.subTest(scale=scale, grad_weights=grad_weights):
                    hidden = hidden64.float().requires_grad_(True)
                    weight = weight64.float().requires_grad_(True)
                    loss = cegen.linear_cross_entropy(hidden, weight, labels, logit_scale=scale,
                                                      z_loss=1e-4, chunk_tokens=16,
                                                      grad_weights=grad_weights)
                    loss.backward(torch.ones_like(loss))
                    logits = hidden.detach().double() @ weight.detach().double().t()
                    ref = reference_outputs(logits, labels, logit_scale=scale, z_loss=1e-4)
                    S.assert_close(self, loss, ref.loss, 1e-5, 1e-5, "loss")
                    grad_hidden = ref.grad @ weight.detach().double()
                    grad_weight = ref.grad.t() @ hidden.detach().double()
                    tolerance = (1e-4, 1e-5 * max(1.0, scale))
                    S.assert_close(self, hidden.grad, grad_hidden, *tolerance, "d hidden")
                    S.assert_close(self, weight.grad, grad_weight, *tolerance, "d weight")


class TestValidation(unittest.TestCase):
    BAD = (0.0, -1.0, math.inf, -math.inf, math.nan, 1e-50, 1e39, "2", None)

    def test_kernel_options(self) -> None:
        self.assertEqual(_kernels.KernelOptions().logit_scale, 1.0)
        self.assertEqual(_kernels.KernelOptions(logit_scale=0.1).logit_scale,
                         float(torch.tensor(0.1, dtype=torch.float32)))
        for bad in self.BAD:
            with self.subTest(value=bad):
                with self.assertRaisesRegex(cegen.InvalidInputError, "logit_scale"):
                    _kernels.KernelOptions(logit_scale=bad)

    @S.requires_kernels
    def test_entry_points(self) -> None:
        logits = S.random_logits((3, 17), torch.float32, offset=90)
        labels = S.random_labels((3,), 17, offset=91)
        weight = torch.randn((17, 5))
        hidden = torch.randn((3, 5))
        calls = {
            "cross_entropy": lambda s: cegen.cross_entropy(logits, labels, logit_scale=s),
            "vocab_parallel": lambda s: cegen.vocab_parallel_cross_entropy(
                logits, labels, logit_scale=s),
            "linear": lambda s: cegen.linear_cross_entropy(hidden, weight, labels,
                                                           logit_scale=s),
            "combine": lambda s: cegen.combine_shard_stats(
                torch.zeros((1, 3, 4)), labels, ignore_index=None, label_smoothing=0.0,
                z_loss=0.0, vocab_local=17, vocab=17, global_smoothing=False, rank=0,
                logit_scale=s),
        }
        for name, call in calls.items():
            for bad in (0.0, -2.0, math.inf, math.nan):
                with self.subTest(entry=name, value=bad):
                    with self.assertRaisesRegex(cegen.InvalidInputError, "logit_scale"):
                        call(bad)


if __name__ == "__main__":
    unittest.main()
