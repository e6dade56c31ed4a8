"""The installed wheel (issue 15, item 4): cegen from a virtual environment, with no ce-gen
anywhere and no build tree, runs forward, backward and fused on the host from the package's
prebuilt kernels alone, with option values never compiled anywhere (label smoothing 0.037,
z-loss 3e-5, ignore_index -7), fp32 and bf16, against float64.

scripts/test_wheel.sh installs the wheel of scripts/build_wheel.sh into a fresh venv and
runs this file with ``CEGEN_TEST_INSTALLED=1`` from a directory outside the repository,
without PYTHONPATH and with a PATH that reaches no ce-gen; without that variable (the
source tree's test run) the tests skip.
"""

from __future__ import annotations

import shutil
import sys
import unittest
from pathlib import Path

import _support as S
import torch

import cegen
from cegen import VariantKey, _bundle_cache, _config, _kernels

TARGETS = ["gfx90a", "gfx942", "gfx950", "host", "sm_90"]
#: Values no bundle was compiled for: they reach the kernels as arguments.
OPTIONS = {"ignore_index": -7, "label_smoothing": 0.037, "z_loss": 3e-5}


def inside(path: Path, directory: Path) -> bool:
    """Whether ``path`` is ``directory`` or below it (both resolved)."""
    path, directory = Path(path).resolve(), Path(directory).resolve()
    return path == directory or directory in path.parents


def labels_with_ignored(shape, vocab: int, offset: int) -> torch.Tensor:
    """Random labels in [0, vocab) with about a quarter (and the first) set to -7."""
    labels = S.random_labels(shape, vocab, offset=offset)
    ignored = torch.rand(shape, generator=S.generator(offset + 1)) < 0.25
    labels[ignored] = -7
    labels.view(-1)[0] = -7
    return labels


@unittest.skipUnless(S.INSTALLED, "runs against the installed wheel (scripts/test_wheel.sh)")
class TestInstalledPackage(unittest.TestCase):
    """Where everything comes from: the venv's package, its runtime, its bundles."""

    def test_package_is_the_installed_one(self) -> None:
        self.assertNotEqual(sys.prefix, sys.base_prefix, "not running in a virtual environment")
        self.assertTrue(inside(Path(cegen.__file__), Path(sys.prefix)),
                        f"cegen is {cegen.__file__}, outside the venv {sys.prefix}")
        self.assertTrue(inside(_config.PACKAGE_DIR, Path(sys.prefix)))
        self.assertIsNone(_config._source_tree_root())
        self.assertIsNone(cegen.get_config().default_build_dir())

    def test_no_compiler_reachable(self) -> None:
        self.assertIsNone(shutil.which("ce-gen"), "a ce-gen is on PATH")
        self.assertIsNone(cegen.find_ce_gen(), "the package finds a ce-gen")

    def test_runtime_and_bundles_from_the_package(self) -> None:
        self.assertEqual(Path(cegen.get_runtime().path),
                         _config.PACKAGE_DIR / _config.RUNTIME_LIBRARY_NAME)
        self.assertEqual(_config.prebuilt_targets(), TARGETS)
        for target in TARGETS:
            with self.subTest(target=target):
                bundle = cegen.open_bundle(str(_config.prebuilt_bundle_dir(target)))
                self.assertEqual(bundle.targets(), [target])
                self.assertGreater(len(bundle.kernels()), 0)

    def test_run_ce_gen_is_off_by_default(self) -> None:
        self.assertIs(cegen.get_config().run_ce_gen, False)
        self.assertIs(cegen.Config().run_ce_gen, False)

    def test_a_target_not_shipped_says_what_to_do(self) -> None:
        key = VariantKey("forward", "f32", "i64", "flat")
        with self.assertRaises(cegen.VariantNotFoundError) as caught:
            _bundle_cache.bundle_for(key, target="sm_80")
        message = str(caught.exception)
        for expected in ("prebuilt kernels for gfx90a, gfx942, gfx950, host, sm_90, none for sm_80",
                         "ce-gen was not found", "ce-gen --target=sm_80 -o DIR --variant=",
                         "bundle_dirs=[DIR]"):
            self.assertIn(expected, message)


@unittest.skipUnless(S.INSTALLED, "runs against the installed wheel (scripts/test_wheel.sh)")
class TestInstalledKernels(unittest.TestCase):
    """forward, backward and fused with run-time option values, against float64."""

    def setUp(self) -> None:
        _bundle_cache.clear_open_bundles()

    def tearDown(self) -> None:
        # Every kernel came from the package's host bundle; the cache stayed empty.
        opened = list(_bundle_cache._by_dir)
        self.assertTrue(opened, "no bundle was opened")
        for directory in opened:
            self.assertTrue(inside(Path(directory), _config.PREBUILT_DIR / "host"),
                            f"a kernel came from {directory}")
        cache = cegen.get_config().resolved_cache_dir()
        self.assertEqual(sorted(cache.iterdir()) if cache.exists() else [], [],
                         "the kernel cache was used")

    def check(self, loss, grad, logits, labels, grad_loss, what: str) -> None:
        ref_loss, ref_grad = S.reference(logits, labels, grad_loss=grad_loss, **OPTIONS)
        self.assertEqual(loss.dtype, torch.float32)
        self.assertEqual(grad.dtype, logits.dtype)
        S.assert_close(self, loss, ref_loss, *S.LOSS_TOLERANCE[logits.dtype], f"loss, {what}")
        S.assert_close(self, grad, ref_grad, *S.GRAD_TOLERANCE[logits.dtype], f"gradient, {what}")
        ignored = labels == -7
        self.assertTrue(bool((loss[ignored] == 0).all()), f"ignored tokens' loss, {what}")

    def test_forward_and_backward(self) -> None:
        for index, dtype in enumerate((torch.float32, torch.bfloat16)):
            for shape, label_shape in (((53, 1031), (53,)), ((7, 3, 517), (3, 7))):
                with self.subTest(dtype=dtype, shape=shape):
                    offset = 10 * index + len(shape)
                    logits = S.random_logits(shape, dtype, offset=offset)
                    labels = labels_with_ignored(label_shape, shape[-1], offset + 100)
                    grad_loss = torch.rand(label_shape, generator=S.generator(offset + 200)) + 0.5
                    leaf = logits.clone().requires_grad_(True)
                    with _kernels.poison_outputs():
                        loss = cegen.cross_entropy(leaf, labels, **OPTIONS)
                        loss.backward(grad_loss)
                    self.check(loss, leaf.grad, logits, labels, grad_loss,
                               f"forward+backward {dtype} {shape}")

    def test_fused(self) -> None:
        for index, dtype in enumerate((torch.float32, torch.bfloat16)):
            with self.subTest(dtype=dtype):
                tokens, vocab = 61, 2053
                logits = S.random_logits((tokens, vocab), dtype, offset=300 + index)
                labels = labels_with_ignored((tokens,), vocab, 400 + index)
                leaf = logits.clone().requires_grad_(True)
                with _kernels.poison_outputs():
                    loss = cegen.cross_entropy(leaf, labels, grad_weights=1 / tokens, **OPTIONS)
                    loss.mean().backward()
                grad_loss = torch.full((tokens,), 1 / tokens, dtype=torch.float64)
                self.check(loss, leaf.grad, logits, labels, grad_loss, f"fused {dtype}")

    def test_forward_only(self) -> None:
        logits = S.random_logits((45, 769), torch.bfloat16, offset=500)
        labels = labels_with_ignored((45,), 769, 600)
        with torch.no_grad(), _kernels.poison_outputs():
            loss = cegen.cross_entropy(logits, labels, **OPTIONS)
        ref_loss, _ = S.reference(logits, labels, **OPTIONS)
        S.assert_close(self, loss, ref_loss, *S.LOSS_TOLERANCE[torch.bfloat16], "forward loss")


if __name__ == "__main__":
    unittest.main()
