"""The no-host-synchronization contract, checked on the CPU for every path of the API.

On a GPU, reading a device value on the host (``Tensor.item()``, ``bool(tensor)``,
``float(tensor)``, ``.tolist()``, ``torch.nonzero``, boolean-mask indexing, printing a
tensor, ``.cpu()``) waits for the stream, and so does a blocking host-to-device copy
(``torch.tensor(value, device=cuda)``); none of them may happen in cegen's forward or
backward. On CPU tensors the same calls are visible without a GPU:

* PyTorch's profiler records every ATen operator, from every thread (the autograd
  engine's too); the operators that read a value back (``aten::_local_scalar_dense``,
  behind item/bool/int/float; ``aten::nonzero``, ``aten::masked_select``, ``aten::unique``,
  ``aten::equal``, ...) must not appear;
* the Python-level readers (``tolist``, ``numpy``, ``cpu``, printing) and the tensor
  factories that copy host data (``torch.tensor``, ``torch.as_tensor``) are wrapped and
  must not be called.

Each path runs once untimed first (kernels built and loaded, status slots made), then once
under the watch. cegen's lazy status words are read through NumPy views of host memory
made when a slot is created (cegen._gradient_status), which is not a device read.
"""

from __future__ import annotations

import contextlib
import unittest
from typing import Callable, Iterator, List
from unittest import mock

import _support as S
import torch
from _fresh_logits import fresh_logits

import cegen
from cegen import _gradient_status

#: ATen operators that read a device value back to the host (a stream synchronization).
SYNCING_OPS = {
    "aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::nonzero",
    "aten::nonzero_numpy", "aten::nonzero_static", "aten::masked_select", "aten::unique",
    "aten::_unique", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
    "aten::equal", "aten::allclose", "aten::bincount", "aten::histc",
}

#: Python-level tensor methods that read values on the host.
READING_METHODS = ("tolist", "numpy", "cpu", "__repr__", "__str__", "__format__", "__bool__",
                   "__int__", "__float__", "__index__", "item")
#: Factories that copy host data into a (possibly device) tensor: a blocking H2D copy.
COPYING_FACTORIES = ("tensor", "as_tensor")


@contextlib.contextmanager
def watched() -> Iterator[List[str]]:
    """Collects every synchronizing call made inside the block."""
    found: List[str] = []
    patches = []
    for name in READING_METHODS:
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, __name=name, __original=original, **kwargs):  # type: ignore[no-untyped-def]
            found.append(f"Tensor.{__name}")
            return __original(self, *args, **kwargs)

        patches.append(mock.patch.object(torch.Tensor, name, wrapper))
    for name in COPYING_FACTORIES:
        original = getattr(torch, name)

        def factory(*args, __name=name, __original=original, **kwargs):  # type: ignore[no-untyped-def]
            found.append(f"torch.{__name}")
            return __original(*args, **kwargs)

        patches.append(mock.patch.object(torch, name, factory))
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with contextlib.ExitStack() as stack:
        stack.enter_context(profiler)
        for patch in patches:
            stack.enter_context(patch)
        yield found
    found.extend(sorted({event.name for event in profiler.events()} & SYNCING_OPS))


def check_no_sync(test: unittest.TestCase, name: str, step: Callable[[], None]) -> None:
    """Runs ``step`` once, then again under :func:`watched`: nothing may be found."""
    with test.subTest(path=name):
        step()  # kernels built and loaded, status slots made
        with watched() as found:
            step()
        test.assertEqual(found, [], f"{name}: synchronizing calls in cegen's forward/backward")


@S.requires_kernels
class TestNoHostSync(unittest.TestCase):
    """Forward, and forward + backward, of every path: no synchronizing call."""

    @classmethod
    def setUpClass(cls) -> None:
        cls.logits = S.random_logits((6, 4, 97), offset=400)  # [S, B, V]
        cls.labels = S.random_labels((4, 6), 97, offset=401)  # [B, S]
        cls.upstream = torch.rand((4, 6), generator=S.generator(402)) + 0.5
        cls.weights = torch.rand((4, 6), generator=S.generator(403)) + 0.5

    def leaf(self) -> torch.Tensor:
        return self.logits.clone().requires_grad_(True)

    def check(self, name: str, step: Callable[[], None]) -> None:
        check_no_sync(self, name, step)

    def test_plain_paths(self) -> None:
        def forward() -> None:
            with torch.no_grad():
                cegen.cross_entropy(self.logits, self.labels, ignore_index=-100)

        def forward_backward() -> None:
            cegen.cross_entropy(self.leaf(), self.labels, label_smoothing=0.1).backward(self.upstream)

        def stride_zero_upstream() -> None:
            cegen.cross_entropy(self.leaf(), self.labels).sum().backward()

        def overwrite() -> None:
            cegen.cross_entropy(fresh_logits(self.leaf()), self.labels,
                                overwrite_input=True).backward(self.upstream)

        self.check("forward", forward)
        self.check("forward+backward", forward_backward)
        self.check("forward+backward, loss.sum()", stride_zero_upstream)
        self.check("overwrite", overwrite)

    def test_fused_paths(self) -> None:
        def scalar_weight() -> None:
            cegen.cross_entropy(self.leaf(), self.labels, grad_weights=1.0).sum().backward()

        def token_weights_rescaled() -> None:
            cegen.cross_entropy(self.leaf(), self.labels,
                                grad_weights=self.weights).backward(self.upstream)

        def upstream_is_weights() -> None:
            cegen.cross_entropy(self.leaf(), self.labels,
                                grad_weights=self.weights).backward(self.weights)

        def fused_overwrite() -> None:
            cegen.cross_entropy(fresh_logits(self.leaf()), self.labels, grad_weights=self.weights,
                                overwrite_input=True).backward(self.upstream)

        def zero_weight_reported() -> None:
            weights = self.weights.clone()
            weights[1, 2] = 0.0
            loss = cegen.cross_entropy(self.leaf(), self.labels, grad_weights=weights)
            with self.assertRaises(_gradient_status.ZeroWeightGradientError):
                loss.backward(self.upstream)

        self.check("fused, scalar weight", scalar_weight)
        self.check("fused, token weights rescaled", token_weights_rescaled)
        self.check("fused, upstream is the weights", upstream_is_weights)
        self.check("fused overwrite", fused_overwrite)
        self.check("fused, zero weight reported", zero_weight_reported)

    def test_vocab_parallel_paths(self) -> None:
        # Without torch.distributed: a group of one, through the sharded kernels and the
        # combine all the same.
        def forward_backward() -> None:
            cegen.vocab_parallel_cross_entropy(self.leaf(), self.labels,
                                               label_smoothing=0.1).backward(self.upstream)

        def overwrite() -> None:
            cegen.vocab_parallel_cross_entropy(
                fresh_logits(self.leaf()), self.labels, overwrite_input=True,
                label_out_of_range="megatron").backward(self.upstream)

        self.check("vocab-parallel forward+backward", forward_backward)
        self.check("vocab-parallel overwrite", overwrite)


@S.requires_kernels
class TestMegatronPatch(unittest.TestCase):
    """The patched compute_language_model_loss of the Megatron-Core stand-in."""

    def test_patched_loss(self) -> None:
        from cegen import megatron as turbo_ce
        from megatron.core.models.gpt.gpt_model import TinyGPTModel
        from megatron.core.process_groups_config import FakeProcessGroup, ProcessGroupCollection
        from megatron.core.transformer.transformer_config import TransformerConfig

        for overwrite, fused in ((False, False), (True, False), (False, True), (True, True)):
            turbo_ce.install(turbo_ce.TurboCESettings(use_turbo_cross_entropy=True,
                                                      turbo_ce_overwrite_input=overwrite,
                                                      turbo_ce_fused_gradient=fused))
            self.addCleanup(turbo_ce.uninstall)
            config = TransformerConfig(tensor_model_parallel_size=1,
                                       cross_entropy_loss_fusion=True)
            groups = ProcessGroupCollection(tp=FakeProcessGroup(1), cp=FakeProcessGroup(1),
                                            pp=FakeProcessGroup(1), embd=None)
            model = TinyGPTModel(config, hidden_size=16, vocab_size=97, pg_collection=groups)
            hidden = S.random_logits((6, 4, 16), scale=1.0, offset=404)
            labels = S.random_labels((4, 6), 97, offset=405)
            mask = (torch.rand((4, 6), generator=S.generator(406)) > 0.3).float()

            def step() -> None:
                # pretrain_gpt's loss_func and the schedule's scaling, upstream of the loss
                # (the fused path predicts that gradient from the loss mask on the device).
                loss = model(hidden, labels, loss_mask=mask)
                total = torch.sum(loss.view(-1) * mask.view(-1))
                (total / torch.clamp(mask.sum().to(torch.int), min=1) / 2).backward()

            check_no_sync(self, f"megatron patch, overwrite={overwrite}, fused={fused}", step)


@S.requires_kernels
class TestLinearNoHostSync(unittest.TestCase):
    """cegen.linear_cross_entropy: every schedule's forward and backward, the fused one's
    backward deciding from metadata and device values only: the common factor of a multiple
    of grad_weights, the NaN and the report of an upstream that is not one (issue 18)."""

    def test_linear_paths(self) -> None:
        hidden = S.random_logits((12, 16), scale=1.0, offset=407)
        weight = S.random_logits((97, 16), scale=0.3, offset=408)
        labels = S.random_labels((12,), 97, offset=409)
        labels[3] = -100
        weights = torch.rand((12,), generator=S.generator(410)) + 0.5
        weights[5] = 0.0
        upstream = torch.rand((12,), generator=S.generator(411)) + 0.5

        masked = weights.clone()
        masked[[0, 7]] = 0.0

        def not_a_multiple() -> None:
            loss = call(grad_weights=weights)
            with self.assertRaises(_gradient_status.UnpredictedUpstreamError):
                loss.backward(upstream)  # on the CPU the backward reports at once

        def leaves():
            return hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)

        def call(**kwargs):
            h, w = leaves()
            return cegen.linear_cross_entropy(h, w, labels, chunk_tokens=5, ignore_index=-100,
                                              **kwargs)

        paths = {
            "forward": lambda: call().detach(),
            "recompute schedule": lambda: call().backward(upstream),
            "fused, number weight, loss.sum()": lambda: call(grad_weights=1.0).sum().backward(),
            "fused, upstream is grad_weights": lambda: call(grad_weights=weights).backward(weights),
            "fused, a multiple of grad_weights (one factor, checked on the device)":
                lambda: call(grad_weights=weights).backward(weights * 3),
            "fused, masked multiple, first token masked":
                lambda: call(grad_weights=masked).backward(masked * 0.25),
            "fused, another upstream (d weight NaN, reported)": not_a_multiple,
            "fused, another upstream, grad_weights_exact (d weight recomputed)":
                lambda: call(grad_weights=weights, grad_weights_exact=True).backward(upstream),
            "fused, number weight, loss.mean()": lambda: call(grad_weights=1 / 12).mean().backward(),
            "reduction mean": lambda: call(reduction="mean").backward(),
            "reduction sum, no grad": lambda: torch.no_grad()(call)(reduction="sum"),
        }
        for name, step in paths.items():
            check_no_sync(self, f"linear_cross_entropy: {name}", step)


class TestTheWatchSeesSyncs(unittest.TestCase):
    """The watch itself: each kind of synchronizing call is reported."""

    def test_each_kind_is_seen(self) -> None:
        x = torch.rand(4)
        cases = {
            "bool": lambda: bool(torch.any(x > 0.5)),
            "item": lambda: x.sum().item(),
            "float": lambda: float(x[0]),
            "tolist": lambda: x.tolist(),
            "nonzero": lambda: torch.nonzero(x > 0.5),
            "mask index": lambda: x[x > 0.5],
            "equal": lambda: torch.equal(x, x),
            "tensor": lambda: torch.tensor(1.0),
            "print": lambda: f"{x}",
        }
        for name, call in cases.items():
            with self.subTest(call=name):
                with watched() as found:
                    call()
                self.assertNotEqual(found, [], f"{name} was not seen")


if __name__ == "__main__":
    unittest.main()
