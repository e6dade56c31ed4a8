"""The device-facing parts of the Python API that run without a GPU.

Bundles are looked up per target (``host`` for CPU tensors, ``sm_90`` for a CUDA device of
compute capability 9.0, ...); label checks are no-ops on the CPU and lazy on a GPU; a CUDA
device on a machine without a driver is a clear error. The GPU paths themselves run on a GPU
machine: test/gpu/test_h200.py.
"""

from __future__ import annotations

import unittest

import _support as S
import torch

import cegen
from cegen import _bundle_cache, _kernels, _runtime
from cegen._variant import VariantKey


class TestTargets(unittest.TestCase):
    def test_cpu_tensors_use_host_kernels(self) -> None:
        self.assertEqual(_kernels.device_target(torch.device("cpu")), "host")

    def test_label_checks_on_the_cpu_are_no_ops(self) -> None:
        cegen.check_labels(torch.device("cpu"))
        cegen.check_labels("cpu", wait=False)

    @S.requires_kernels
    def test_bundles_are_searched_per_target(self) -> None:
        key = VariantKey("forward", "f32", "i64", "flat")
        bundle = _bundle_cache.bundle_for(key)
        self.assertIn((str(key), "host"), bundle.kernels())
        self.assertEqual(bundle.targets(), ["host"])
        self.assertEqual(bundle.keys("host"), [str(key)])
        self.assertEqual(bundle.keys("sm_90"), [])
        self.assertTrue(bundle.has(key, "host"))
        self.assertFalse(bundle.has(key, "sm_90"))
        # A host-only bundle named for a GPU target says what it has and how to build the rest.
        with self.assertRaises(cegen.VariantNotFoundError) as caught:
            _bundle_cache.bundle_for(key, bundle, target="sm_90")
        message = str(caught.exception)
        self.assertIn("holds no sm_90 kernel for variant", message)
        self.assertIn("it holds this variant for host", message)
        # The hint is one canonical key, which ce-gen takes as it is.
        self.assertIn(f"ce-gen --target=sm_90 -o DIR --variant={key}", message)
        with self.assertRaises(cegen.VariantNotFoundError):
            _bundle_cache.bundle_for(key, str(bundle.path), target="gfx942")

    @S.requires_kernels
    def test_the_cache_builds_per_target(self) -> None:
        key = VariantKey("forward", "f32", "i64", "flat")
        ce_gen = _bundle_cache.find_ce_gen()
        assert ce_gen is not None
        cache = cegen.get_config().resolved_cache_dir()
        host = _bundle_cache.cache_entry(key, ce_gen, "host", cache)
        gpu = _bundle_cache.cache_entry(key, ce_gen, "sm_90", cache)
        self.assertNotEqual(host, gpu)
        self.assertEqual(_bundle_cache.ce_gen_command(ce_gen, key, gpu, "sm_90")[1],
                         "--target=sm_90")


@unittest.skipIf(not _runtime.runtime_available(), "libce_runtime.so is not built")
class TestNoGpuHere(unittest.TestCase):
    """CI has no GPU: the runtime answers CE_ERROR_NO_DEVICE, never crashes."""

    def test_label_check_on_a_missing_cuda_device(self) -> None:
        runtime = cegen.get_runtime()
        try:
            runtime.check_label_status(_runtime.Device.CUDA, 0, None, True)
        except cegen.CegenError as error:
            self.assertEqual(error.status, _runtime.Status.NO_DEVICE)
            self.assertIn("no CUDA device", str(error))
            return
        self.skipTest("a CUDA device is present")

    def test_launch_on_a_missing_hip_device(self) -> None:
        runtime = cegen.get_runtime()
        logits = torch.zeros((2, 3))
        labels = torch.zeros((2,), dtype=torch.int64)
        loss, lse = torch.empty(2), torch.empty(2)

        def desc(tensor: torch.Tensor, dtype: int) -> _runtime.TensorDesc:
            return _runtime.TensorDesc.make(tensor.data_ptr(), dtype, tensor.shape, tensor.stride(),
                                            _runtime.Device.HIP, 0)

        if not _bundle_cache.find_ce_gen():
            self.skipTest("ce-gen is not built")
        bundle = _bundle_cache.bundle_for(VariantKey("forward", "f32", "i64", "flat"))
        try:
            runtime.forward(bundle, runtime.default_options(), desc(logits, _runtime.DType.F32),
                            desc(labels, _runtime.DType.I64), desc(loss, _runtime.DType.F32),
                            desc(lse, _runtime.DType.F32))
        except cegen.CegenError as error:
            if error.status != _runtime.Status.NO_DEVICE:
                self.skipTest(f"a HIP device is present: {error}")
            self.assertIn("no HIP device", str(error))
            return
        self.skipTest("a HIP device is present")


if __name__ == "__main__":
    unittest.main()
