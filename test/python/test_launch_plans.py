"""Launch plans (cegen._plans): a call whose key matches an earlier call's reuses its
descriptors, so every input metadata the descriptors hold must be in the key.

Each case first makes a plan with one call, then calls again with tensors that differ
from the first in one thing only (a stride, a dtype, 0-d against per-token weights, the
thread), and checks loss and gradient against the float64 reference on fresh random
inputs; a key that left that thing out would reuse the first call's descriptors and
read the second call's memory wrongly.
"""

from __future__ import annotations

import threading
import unittest
from types import SimpleNamespace
from unittest import mock

import _support as S
import torch

import cegen
from cegen import _bundle_cache, _kernels, _plans
from cegen._runtime import Device

V = 24


def _leaf(logits: torch.Tensor) -> torch.Tensor:
    return logits.detach().clone().requires_grad_(True)


@S.requires_kernels
class TestPlanKeys(unittest.TestCase):

    def check(self, logits: torch.Tensor, labels: torch.Tensor, grad_loss: torch.Tensor,
              what: str, **options) -> None:
        """Loss and gradient of one call (poisoned outputs) against float64."""
        leaf = logits.detach().requires_grad_(True)
        with _kernels.poison_outputs():
            loss = cegen.cross_entropy(leaf, labels, **options)
            (grad,) = torch.autograd.grad(loss, leaf, grad_loss)
        ref_options = {k: v for k, v in options.items() if k != "grad_weights"}
        ref_loss, ref_grad = S.reference(logits, labels, grad_loss=grad_loss, **ref_options)
        S.assert_close(self, loss, ref_loss, *S.LOSS_TOLERANCE[logits.dtype], f"{what}: loss")
        S.assert_close(self, grad, ref_grad, *S.GRAD_TOLERANCE[logits.dtype], f"{what}: grad")

    def test_strides_of_each_tensor(self) -> None:
        n = 6
        wide = S.random_logits((n, 2 * V), offset=1)
        logits = wide[:, :V].contiguous()
        labels2 = S.random_labels((2 * n,), V, offset=2)
        labels = labels2[::2].contiguous()
        g2 = torch.rand((2 * n,), generator=S.generator(3)) + 0.5
        g = g2[::2].contiguous()
        self.check(logits, labels, g, "contiguous (makes the plans)")
        # The same values and shapes, read through other strides.
        self.check(wide[:, :V], labels, g, "logits rows of stride 2V")
        self.check(logits, labels2[::2], g, "labels of stride 2")
        self.check(logits, labels, g2[::2], "upstream gradient of stride 2")
        self.check(logits, labels, torch.ones(()).expand(n), "upstream gradient of stride 0")
        self.check(logits, labels, g.double(), "upstream gradient in float64")
        self.check(logits, labels, g2.double()[::2],
                   "upstream gradient of stride 2 in float64 (made contiguous)")
        for name, (x, y) in {"contiguous": (logits, labels),
                             "strided": (wide[:, :V], labels2[::2])}.items():
            with torch.no_grad():
                loss = cegen.cross_entropy(x, y)
            expected, _ = S.reference(x, y)
            S.assert_close(self, loss, expected, *S.LOSS_TOLERANCE[x.dtype],
                           f"no_grad forward, {name}")

    def test_kernel_backward_with_a_float64_upstream_gradient(self) -> None:
        # cegen._kernels.backward called directly (linear.py, tensor_parallel.py): the
        # upstream gradient is converted to float32 there, which makes a strided float64
        # one contiguous, so its dtype is part of the key.
        n = 6
        logits = S.random_logits((n, V), offset=40)
        labels = S.random_labels((n,), V, offset=41)
        g2 = torch.rand((2 * n,), generator=S.generator(42), dtype=torch.float64) + 0.5
        options = _kernels.KernelOptions()
        _, lse = _kernels.forward(logits, labels, options)
        for name, g in (("float32", g2.float()[::2]), ("float64", g2[::2])):
            with _kernels.poison_outputs():
                grad = _kernels.backward(logits, labels, lse, g, options, overwrite=False)
            _, expected = S.reference(logits, labels, grad_loss=g)
            S.assert_close(self, grad, expected, *S.GRAD_TOLERANCE[torch.float32],
                           f"upstream gradient of stride 2 in {name}")

    def test_sbv_layouts_share_shapes(self) -> None:
        s, b = 4, 4  # square: the token shape is the same for either label layout
        logits = S.random_logits((s, b, V), offset=4)
        g = torch.rand((b, s), generator=S.generator(5)) + 0.5
        for layout in ("bs", "sb"):
            labels = S.random_labels((b, s), V, offset=6)
            self.check(logits, labels, g, f"[S,B,V], labels {layout}", label_layout=layout)
            self.check(logits.transpose(0, 1).contiguous().transpose(0, 1), labels, g,
                       f"[B,S,V] memory read as [S,B,V], labels {layout}",
                       label_layout=layout)

    def test_fused_weights(self) -> None:
        n = 5
        logits = S.random_logits((n, V), offset=7)
        labels = S.random_labels((n,), V, offset=8)
        w2 = torch.rand((2 * n,), generator=S.generator(9)) + 0.5
        w = w2[::2].contiguous()
        # Through the API with the weights as the upstream gradient (nothing to rescale).
        self.check(logits, labels, w, "token weights", grad_weights=w)
        self.check(logits, labels, w2[::2], "token weights of stride 2", grad_weights=w2[::2])
        # The fused kernel itself (the rescale is cegen._rescale's, tested on its own).
        options = _kernels.KernelOptions()
        cases = (("token weights", w, w), ("token weights of stride 2", w2[::2], w),
                 ("token weights in float64", w.double(), w),
                 ("float64 weights of stride 2 (made contiguous)", w2.double()[::2], w),
                 ("0-d weights", torch.full((), 0.75), torch.full((n,), 0.75)))
        for name, weights, upstream in cases:
            with _kernels.poison_outputs():
                loss, _, grad = _kernels.fused(logits, labels, weights, options, overwrite=False)
            expected_loss, expected_grad = S.reference(logits, labels, grad_loss=upstream)
            S.assert_close(self, loss, expected_loss, *S.LOSS_TOLERANCE[torch.float32],
                           f"fused kernel, {name}: loss")
            S.assert_close(self, grad, expected_grad, *S.GRAD_TOLERANCE[torch.float32],
                           f"fused kernel, {name}: grad")

    def test_a_call_of_another_shape_is_checked(self) -> None:
        n = 4
        logits = S.random_logits((n, V), offset=16)
        labels = S.random_labels((n + 1,), V, offset=17)
        weights = torch.rand((n + 1,), generator=S.generator(18)) + 0.5
        cegen.cross_entropy(logits, labels[:n])
        cegen.cross_entropy(_leaf(logits), labels[:n], grad_weights=weights[:n])
        with self.assertRaisesRegex(cegen.InvalidInputError, "labels of shape"):
            cegen.cross_entropy(logits, labels)
        with self.assertRaisesRegex(cegen.InvalidInputError, "grad_weights has shape"):
            cegen.cross_entropy(_leaf(logits), labels[:n], grad_weights=weights)
        with self.assertRaisesRegex(cegen.InvalidInputError, "dtype"):
            cegen.cross_entropy(logits.double(), labels[:n])

    def test_a_repeated_call_reuses_its_plan(self) -> None:
        logits = _leaf(S.random_logits((3, V), offset=10))
        labels = S.random_labels((3,), V, offset=11)
        cegen.cross_entropy(logits, labels).sum().backward()
        plans = dict(_plans.thread_plans())
        for _ in range(3):
            cegen.cross_entropy(logits, labels).sum().backward()
        self.assertEqual(plans, _plans.thread_plans(), "a repeated call made new plans")

    def test_plans_are_made_again_for_a_new_bundle_generation(self) -> None:
        logits = S.random_logits((3, V), offset=12)
        labels = S.random_labels((3,), V, offset=13)
        cegen.cross_entropy(logits, labels)
        before = set(map(id, _plans.thread_plans().values()))
        _bundle_cache.clear_open_bundles()
        loss = cegen.cross_entropy(logits, labels)
        after = {id(p) for p in _plans.thread_plans().values()
                 if p.generation == _bundle_cache.generation}
        self.assertTrue(after - before, "no plan was made for the new bundle generation")
        S.assert_close(self, loss, S.reference(logits, labels)[0],
                       *S.LOSS_TOLERANCE[torch.float32], "loss after clear_open_bundles")

    def test_threads_have_their_own_descriptors(self) -> None:
        # Same key in every thread, different memory: the runtime reads a plan's
        # descriptors with the GIL released, so a shared plan would mix the threads' data.
        n, rounds = 64, 40
        inputs = [(S.random_logits((n, V), offset=20 + i), S.random_labels((n,), V, offset=30 + i))
                  for i in range(3)]
        expected = [S.reference(x, y) for x, y in inputs]
        errors = []

        def work(index: int) -> None:
            x, y = inputs[index]
            try:
                for _ in range(rounds):
                    leaf = _leaf(x)
                    loss = cegen.cross_entropy(leaf, y)
                    loss.sum().backward()
                    torch.testing.assert_close(loss.double(), expected[index][0],
                                               rtol=1e-5, atol=1e-5)
                    torch.testing.assert_close(leaf.grad.double(), expected[index][1],
                                               rtol=2e-5, atol=4e-6)
            except Exception as error:  # noqa: BLE001 - reported by the main thread
                errors.append(f"thread {index}: {error}")

        cegen.cross_entropy(*inputs[0])  # kernels ready before the threads start
        threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.assertEqual(errors, [])

    def test_describe_hook_sees_every_launch(self) -> None:
        logits = S.random_logits((3, V), offset=14)
        labels = S.random_labels((3,), V, offset=15)
        cegen.cross_entropy(logits, labels)
        with S.recorded_descriptors() as records:
            cegen.cross_entropy(logits, labels)
            cegen.cross_entropy(logits, labels)
        self.assertEqual([name for name, *_ in records], ["logits", "labels", "loss", "lse"] * 2)


class TestGpuLaunchWiring(unittest.TestCase):
    """The GPU branch of a planned launch, which the host tests cannot run: the label
    poll and the entry point get the device, its current stream and the plan's
    addresses, and a non-OK status raises through Runtime.check."""

    def launch(self, poll: bool, label_status: int = 0, launch_status: int = 0):
        calls = []
        checked = []

        def check(status: int, what: str) -> None:
            checked.append((status, what))
            raise cegen.CegenError(f"{what}: status {status}")

        plan = _plans.Plan(_bundle_cache.generation, (3,), torch.device("cpu"),
                           (Device.CUDA, 1))
        plan.bundle = SimpleNamespace(handle="handle")
        plan.runtime = SimpleNamespace(check=check)
        plan.entry = lambda *args: calls.append(("entry",) + args) or launch_status
        plan.check_labels = lambda *args: calls.append(("labels",) + args) or label_status
        plan.options_address = 77
        plan.addresses = (11, 12, None)
        with mock.patch.object(_kernels, "_raw_stream", lambda index: 1000 + index):
            try:
                _kernels._launch_plan(plan, "cegen forward", poll=poll)
            except cegen.CegenError:
                pass
        return calls, checked

    def test_poll_then_launch_on_the_current_stream(self) -> None:
        self.assertTrue(_plans.Plan(0, (), None, (Device.CUDA, 0)).gpu)
        calls, checked = self.launch(poll=True)
        self.assertEqual(calls, [("labels", Device.CUDA, 1, 1001, 0),
                                 ("entry", "handle", 77, 11, 12, None, 1001)])
        self.assertEqual(checked, [])
        calls, _ = self.launch(poll=False)
        self.assertEqual(calls, [("entry", "handle", 77, 11, 12, None, 1001)])

    def test_a_status_raises(self) -> None:
        calls, checked = self.launch(poll=True, label_status=4)
        self.assertEqual(checked, [(4, "cegen label check")])
        self.assertEqual([c[0] for c in calls], ["labels"], "launched after a bad label report")
        _, checked = self.launch(poll=True, launch_status=6)
        self.assertEqual(checked, [(6, "cegen forward")])


if __name__ == "__main__":
    unittest.main()
