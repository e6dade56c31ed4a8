"""How the package finds the kernels it carries (issue 15, item 3).

An installed wheel holds one bundle per target in ``cegen/prebuilt-kernels/<target>/``: it is
searched after ``Config.bundle_dirs`` and before the cache, only the asked target's;
``run_ce_gen`` defaults to False when the package carries one; a prebuilt bundle that cannot
be opened is skipped with one warning; a miss says what to do; the runtime next to the
package comes first unless one is configured. The package's prebuilt directory is simulated
by pointing ``cegen._config.PREBUILT_DIR`` at a temporary directory holding a bundle that
ce-gen makes once for the module.
"""

from __future__ import annotations

import gc
import logging
import shutil
import subprocess
import tempfile
import unittest
from pathlib import Path
from typing import List
from unittest import mock

import _support as S

import cegen
from cegen import VariantKey, _bundle_cache, _config

FORWARD = VariantKey("forward", "f32", "i64", "flat")
BACKWARD = VariantKey("backward", "f32", "i64", "flat")

_WORK = Path(tempfile.mkdtemp(prefix="cegen-prebuilt-test-"))
#: A host bundle holding FORWARD only, made by setUpModule.
_BUNDLE = _WORK / "bundle"


def setUpModule() -> None:
    if S.kernels_missing() is not None or _bundle_cache.find_ce_gen() is None:
        return  # the test classes skip
    subprocess.run(_bundle_cache.ce_gen_command(_bundle_cache.find_ce_gen(), FORWARD, _BUNDLE),
                   check=True, stdout=subprocess.DEVNULL)


def tearDownModule() -> None:
    shutil.rmtree(_WORK, ignore_errors=True)


@S.requires_kernels
@unittest.skipIf(S.INSTALLED, "simulates the package's prebuilt directory in the source tree")
class PrebuiltTestCase(unittest.TestCase):
    """A private prebuilt directory, cache and configuration per test; a ``ce-gen`` that
    records its runs (and runs the real one) so a test can tell whether it ran."""

    def setUp(self) -> None:
        self.previous = cegen.get_config()
        self.work = Path(tempfile.mkdtemp(prefix="case-", dir=_WORK))
        self.root = self.work / "prebuilt-kernels"
        self.cache = self.work / "cache"
        patcher = mock.patch.object(_config, "PREBUILT_DIR", self.root)
        patcher.start()
        self.addCleanup(patcher.stop)
        self.calls = self.work / "ce-gen-calls"
        self.ce_gen = self.work / "ce-gen"
        self.ce_gen.write_text(f'#!/bin/sh\necho "$@" >> "{self.calls}"\n'
                               f'exec "{_bundle_cache.find_ce_gen()}" "$@"\n')
        self.ce_gen.chmod(0o755)
        cegen.configure(cache_dir=self.cache, ce_gen=self.ce_gen, run_ce_gen=False,
                        bundle_dirs=())

    def tearDown(self) -> None:
        cegen.configure(cache_dir=self.previous.cache_dir, ce_gen=self.previous.ce_gen,
                        run_ce_gen=self.previous.run_ce_gen,
                        bundle_dirs=self.previous.bundle_dirs)
        gc.collect()

    def ship(self, target: str) -> Path:
        """Puts the module's bundle where the package keeps ``target``'s prebuilt kernels."""
        return Path(shutil.copytree(_BUNDLE, self.root / target))

    def ce_gen_runs(self) -> List[str]:
        return self.calls.read_text().splitlines() if self.calls.exists() else []

    def cache_entries(self) -> List[Path]:
        return sorted(p for p in self.cache.iterdir() if p.name != "locks") \
            if self.cache.exists() else []


class TestRunCeGenDefault(PrebuiltTestCase):
    def test_default_follows_what_the_package_carries(self) -> None:
        self.assertEqual(_config.prebuilt_targets(), [])
        self.assertIs(cegen.Config().run_ce_gen, True, "no prebuilt directory")
        (self.root / "host").mkdir(parents=True)
        self.assertEqual(_config.prebuilt_targets(), [])
        self.assertIs(cegen.Config().run_ce_gen, True, "a target directory without a manifest")
        self.ship("sm_90")
        self.assertEqual(_config.prebuilt_targets(), ["sm_90"])
        self.assertIs(cegen.Config().run_ce_gen, False)
        shutil.rmtree(self.root / "host")
        self.ship("host")
        self.assertEqual(_config.prebuilt_targets(), ["host", "sm_90"])
        self.assertIs(cegen.Config().run_ce_gen, False)
        self.assertIs(cegen.Config(run_ce_gen=True).run_ce_gen, True, "a setting wins")

    def test_target_names_stay_inside_the_directory(self) -> None:
        self.ship("host")
        self.assertEqual(_config.prebuilt_bundle_dir("host"), self.root / "host")
        for name in ("../_prebuilt/host", "", ".", "host/"):
            self.assertIsNone(_config.prebuilt_bundle_dir(name), name)

    def test_the_source_tree_carries_none(self) -> None:
        # The real package directory of the source tree: no prebuilt kernels, ce-gen runs.
        self.assertFalse((_config.PACKAGE_DIR / "prebuilt-kernels").exists())
        self.assertIs(self.previous.run_ce_gen, True)


class TestLookup(PrebuiltTestCase):
    def test_prebuilt_kernels_are_used_without_ce_gen(self) -> None:
        shipped = self.ship("host")
        cegen.configure(run_ce_gen=True)  # a miss would run ce-gen: none may happen
        bundle = _bundle_cache.bundle_for(FORWARD, target="host")
        self.assertEqual(Path(bundle.path).resolve(), shipped.resolve())
        logits, labels = S.random_logits((9, 301)), S.random_labels((9,), 301)
        loss = cegen.cross_entropy(logits, labels)
        S.assert_close(self, loss, S.reference(logits, labels)[0], 1e-5, 1e-5, "loss")
        self.assertEqual(self.ce_gen_runs(), [])
        self.assertEqual(self.cache_entries(), [])

    def test_bundle_dirs_come_before_the_package(self) -> None:
        self.ship("host")
        mine = Path(shutil.copytree(_BUNDLE, self.work / "mine"))
        cegen.configure(bundle_dirs=[mine])
        bundle = _bundle_cache.bundle_for(FORWARD, target="host")
        self.assertEqual(Path(bundle.path).resolve(), mine.resolve())

    def test_only_the_asked_targets_bundle(self) -> None:
        self.ship("sm_90")  # holds host kernels, under another target's name
        cegen.configure(ce_gen=self.work / "no-ce-gen")
        with self.assertRaises(cegen.VariantNotFoundError) as caught:
            _bundle_cache.bundle_for(FORWARD, target="host")
        self.assertIn("the package carries prebuilt kernels for sm_90, none for host",
                      str(caught.exception))

    def test_a_miss_with_run_ce_gen_off_says_what_to_do(self) -> None:
        shipped = self.ship("host")
        with self.assertRaises(cegen.VariantNotFoundError) as caught:
            _bundle_cache.bundle_for(BACKWARD, target="host")
        message = str(caught.exception)
        for expected in ("running ce-gen is disabled (run_ce_gen=False)",
                         f"the package's prebuilt host kernels in {shipped} do not include it",
                         f"let cegen build it with {self.ce_gen}: cegen.configure(run_ce_gen=True)",
                         f"ce-gen --target=host -o DIR --variant={BACKWARD}",
                         "bundle=DIR or cegen.configure(bundle_dirs=[DIR])"):
            self.assertIn(expected, message)
        self.assertEqual(self.ce_gen_runs(), [])
        # Without any ce-gen: the same hint, and where ce-gen was looked for.
        cegen.configure(ce_gen=self.work / "no-ce-gen")
        with self.assertRaises(cegen.VariantNotFoundError) as caught:
            _bundle_cache.bundle_for(BACKWARD, target="host")
        message = str(caught.exception)
        for expected in ("ce-gen was not found to build it",
                         f"the package's prebuilt host kernels in {shipped} do not include it",
                         str(self.work / "no-ce-gen"),
                         f"ce-gen --target=host -o DIR --variant={BACKWARD}"):
            self.assertIn(expected, message)

    def test_a_miss_with_run_ce_gen_on_builds_into_the_cache(self) -> None:
        self.ship("host")
        cegen.configure(run_ce_gen=True)
        bundle = _bundle_cache.bundle_for(BACKWARD, target="host")
        self.assertTrue(bundle.has(BACKWARD, "host"))
        self.assertEqual(len(self.ce_gen_runs()), 1)
        self.assertEqual([p.resolve() for p in self.cache_entries()],
                         [Path(bundle.path).resolve()])

    def test_a_damaged_prebuilt_bundle_is_skipped_with_one_warning(self) -> None:
        shipped = self.ship("host")
        (shipped / "manifest.json").write_text("{")
        with self.assertLogs("cegen.cache", logging.WARNING) as logs:
            for _ in range(2):
                with self.assertRaises(cegen.VariantNotFoundError) as caught:
                    _bundle_cache.bundle_for(FORWARD, target="host")
                self.assertIn(f"the package's prebuilt host kernels in {shipped} cannot be "
                              "used here", str(caught.exception))
        warnings = [r for r in logs.output if "cannot be used here" in r]
        self.assertEqual(len(warnings), 1, logs.output)
        cegen.configure(run_ce_gen=True)  # the cache and ce-gen stand in
        with self.assertLogs("cegen.cache", logging.INFO):
            bundle = _bundle_cache.bundle_for(FORWARD, target="host")
        self.assertEqual(len(self.ce_gen_runs()), 1)
        self.assertNotEqual(Path(bundle.path).resolve(), shipped.resolve())


class TestRuntimeLibrary(PrebuiltTestCase):
    def test_the_packages_runtime_comes_first_unless_one_is_configured(self) -> None:
        candidates = _config.runtime_library_candidates(cegen.Config())
        self.assertEqual(candidates[0], _config.PACKAGE_DIR / _config.RUNTIME_LIBRARY_NAME)
        mine = self.work / "libce_runtime.so"
        self.assertEqual(_config.runtime_library_candidates(cegen.Config(runtime_library=mine)),
                         [mine])


if __name__ == "__main__":
    unittest.main()
