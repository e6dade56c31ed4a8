"""The kernel cache (cegen._bundle_cache): logging of ce-gen runs, per-entry locks across
threads and processes, repair of damaged entries, and the size limit (issue 23, item 12).

ce-gen is wrapped by a shell script (FakeCeGen) that records each run and can hold it at a
gate until the test opens it, so a test can tell exactly what ran while a build was in
progress. Every test uses a cache directory of its own.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import unittest
from pathlib import Path
from typing import Any, Callable, List, Optional

import _support as S
import torch

import cegen
from cegen import VariantKey, _bundle_cache

FORWARD_F32 = VariantKey("forward", "f32", "i64", "flat")
FORWARD_F16 = VariantKey("forward", "f16", "i64", "flat")
FORWARD_BF16 = VariantKey("forward", "bf16", "i64", "flat")
BACKWARD_F32 = VariantKey("backward", "f32", "i64", "flat")
FORWARD_F32_I32 = VariantKey("forward", "f32", "i32", "flat")


class FakeCeGen:
    """A ``ce-gen`` wrapper script in ``directory``: logs each run to ``calls``, touches
    ``started``, waits for ``release`` when gated, then runs the real ce-gen; with
    ``damage`` it then cuts every code object of its output to one byte."""

    def __init__(self, directory: Path, real: Path, *, gated: bool = False, damage: bool = False):
        self.calls = directory / "calls"
        self.started = directory / "started"
        self.release = directory / "release"
        self.path = directory / "ce-gen"
        if not gated:
            self.release.touch()
        damage_step = 'for f in "$out"/*.so; do printf x > "$f"; done' if damage else ":"
        self.path.write_text(
            "#!/bin/sh\n"
            f"echo \"$*\" >> '{self.calls}'\n"
            f"touch '{self.started}'\n"
            f"while [ ! -e '{self.release}' ]; do sleep 0.02; done\n"
            'out=""; previous=""\n'
            'for argument in "$@"; do [ "$previous" = "-o" ] && out="$argument"; '
            'previous="$argument"; done\n'
            f"'{real}' \"$@\" || exit $?\n"
            f"{damage_step}\n"
        )
        self.path.chmod(0o755)

    def runs(self) -> int:
        return len(self.calls.read_text().splitlines()) if self.calls.exists() else 0

    def wait_started(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.started.exists():
            if time.monotonic() > deadline:
                raise AssertionError("the gated ce-gen never started")
            time.sleep(0.02)

    def open_gate(self) -> None:
        self.release.touch()


def in_thread(function: Callable[[], Any]) -> "tuple[threading.Thread, List[Any]]":
    """Runs ``function`` in a daemon thread; the list receives its result or exception."""
    outcome: List[Any] = []

    def run() -> None:
        try:
            outcome.append(function())
        except BaseException as error:  # noqa: BLE001 - handed to the test
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


@S.requires_kernels
class CacheTestCase(unittest.TestCase):
    """A fresh cache directory and configuration per test, restored afterwards."""

    def setUp(self) -> None:
        self.previous = cegen.get_config()
        self.real_ce_gen = _bundle_cache.find_ce_gen()
        self.work = Path(tempfile.mkdtemp(prefix="cegen-cache-test-"))
        self.cache = self.work / "cache"
        cegen.configure(cache_dir=self.cache, cache_max_bytes=None)

    def tearDown(self) -> None:
        cegen.configure(cache_dir=self.previous.cache_dir, ce_gen=self.previous.ce_gen,
                        cache_max_bytes=self.previous.cache_max_bytes,
                        run_ce_gen=self.previous.run_ce_gen)
        gc.collect()
        shutil.rmtree(self.work, ignore_errors=True)

    def fake(self, name: str = "gen", **kwargs: Any) -> FakeCeGen:
        directory = self.work / name
        directory.mkdir()
        gen = FakeCeGen(directory, self.real_ce_gen, **kwargs)
        cegen.configure(ce_gen=gen.path)
        return gen

    def forward_matches_reference(self) -> None:
        """A forward call through the cache (f32, flat) against float64."""
        logits, labels = S.random_logits((5, 37)), S.random_labels((5,), 37)
        loss = cegen.cross_entropy(logits, labels)
        S.assert_close(self, loss, S.reference(logits, labels)[0], 1e-5, 1e-5, "loss")

    def entries(self) -> List[Path]:
        return sorted(p for p in self.cache.iterdir() if re.fullmatch(r"[0-9a-f]{24}", p.name))


class TestLogging(CacheTestCase):
    def test_a_miss_logs_what_where_and_how_long(self) -> None:
        with self.assertLogs("cegen.cache", logging.INFO) as logs:
            bundle = _bundle_cache.bundle_for(FORWARD_F32)
        entry = self.entries()[0]
        self.assertEqual(Path(bundle.path), entry)
        text = "\n".join(logs.output)
        self.assertIn(f"cache miss: running ce-gen for the host kernel {FORWARD_F32} into {entry}",
                      text)
        self.assertRegex(text, rf"ce-gen built {re.escape(str(entry))} in \d+\.\d\d s")
        # A hit, in this process or from the disk, runs nothing and says nothing at INFO.
        with self.assertNoLogs("cegen.cache", logging.INFO):
            _bundle_cache.bundle_for(FORWARD_F32)
            _bundle_cache.clear_open_bundles()
            _bundle_cache.bundle_for(FORWARD_F32)


class TestLocks(CacheTestCase):
    def test_a_cached_call_does_not_wait_for_another_entrys_compile(self) -> None:
        gen = self.fake(gated=True)
        gen.open_gate()
        _bundle_cache.bundle_for(FORWARD_F32)  # cached before the slow compile starts
        gen.release.unlink()
        compiling, compiled = in_thread(lambda: _bundle_cache.bundle_for(BACKWARD_F32))
        try:
            gen.wait_started()
            # An in-process hit, a hit from the disk, and a whole cross_entropy call, each
            # while the other thread's ce-gen is held at its gate.
            for what, call in (("memo hit", lambda: _bundle_cache.bundle_for(FORWARD_F32)),
                               ("disk hit", lambda: (_bundle_cache.clear_open_bundles(),
                                                     _bundle_cache.bundle_for(FORWARD_F32))),
                               ("cross_entropy", self.forward_matches_reference)):
                with self.subTest(what=what):
                    thread, outcome = in_thread(call)
                    thread.join(timeout=30)
                    self.assertFalse(thread.is_alive(), f"the {what} waited for the compile")
                    self.assertNotIsInstance(outcome[0], BaseException, outcome)
            self.assertTrue(compiling.is_alive(), "the compile finished before its gate opened")
        finally:
            gen.open_gate()
            compiling.join(timeout=120)
        self.assertTrue(Path(compiled[0].path).is_dir(), compiled)
        self.assertTrue(compiled[0].has(BACKWARD_F32, "host"))
        self.assertEqual(gen.runs(), 2)

    def test_threads_build_an_entry_once(self) -> None:
        gen = self.fake(gated=True)
        threads = [in_thread(lambda: _bundle_cache.bundle_for(FORWARD_F32)) for _ in range(3)]
        gen.wait_started()
        time.sleep(0.5)  # the other threads are at the entry's lock by now
        gen.open_gate()
        results = []
        for thread, outcome in threads:
            thread.join(timeout=120)
            results.append(outcome[0])
        self.assertEqual(gen.runs(), 1)
        self.assertEqual({id(bundle) for bundle in results}, {id(results[0])})

    def test_processes_build_an_entry_once(self) -> None:
        gen = self.fake(gated=True)
        script = (
            "import sys\n"
            f"sys.path.insert(0, {str(S.REPO / 'python')!r})\n"
            "import cegen\n"
            "from cegen import VariantKey, _bundle_cache\n"
            f"cegen.configure(cache_dir={str(self.cache)!r}, ce_gen={str(gen.path)!r})\n"
            "print('calling', flush=True)\n"
            "bundle = _bundle_cache.bundle_for(VariantKey('forward', 'f32', 'i64', 'flat'))\n"
            "print('built', bundle.path, flush=True)\n"
        )

        def start() -> subprocess.Popen:
            return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)

        first = start()
        second = None
        try:
            gen.wait_started()  # the first process holds the entry's build lock
            second = start()
            self.assertEqual(second.stdout.readline().strip(), "calling")
            time.sleep(1.0)  # the second process is waiting for the lock (or running ce-gen)
            gen.open_gate()
            outputs = [process.communicate(timeout=120)[0] for process in (first, second)]
        finally:
            gen.open_gate()
            for process in (first, second):
                if process is not None and process.poll() is None:
                    process.kill()
        for process, output in zip((first, second), outputs):
            self.assertEqual(process.returncode, 0, output)
        self.assertEqual(gen.runs(), 1, "both processes ran ce-gen for one entry")
        entry = str(self.entries()[0])
        self.assertTrue(all(f"built {entry}" in output for output in outputs), outputs)


class TestRepair(CacheTestCase):
    def build_and_forget(self, key: VariantKey = FORWARD_F32) -> Path:
        bundle = _bundle_cache.bundle_for(key)
        entry = Path(bundle.path)
        del bundle
        _bundle_cache.clear_open_bundles()
        gc.collect()
        return entry

    def test_damaged_entries_are_rebuilt(self) -> None:
        # Damaged files are written as new files: this process may still have the old
        # object mapped (a launch plan of cegen._kernels keeps its Bundle), and a file
        # changed in place under a mapping faults whoever maps it, cache or not.
        def replace(path: Path, data: bytes) -> None:
            path.unlink()
            path.write_bytes(data)

        def flip_object(entry: Path) -> None:
            data = bytearray((entry / "host-x86_64.so").read_bytes())
            data[len(data) // 2] ^= 0xFF
            replace(entry / "host-x86_64.so", bytes(data))

        def cut_object(entry: Path) -> None:
            path = entry / "host-x86_64.so"
            replace(path, path.read_bytes()[:1000])

        def cut_manifest(entry: Path) -> None:
            path = entry / "manifest.json"
            replace(path, path.read_bytes()[:200])

        def remove_manifest(entry: Path) -> None:
            (entry / "manifest.json").unlink()

        gen = self.fake()
        for damage in (flip_object, cut_object, cut_manifest, remove_manifest):
            with self.subTest(damage=damage.__name__):
                entry = self.build_and_forget()
                runs = gen.runs()
                damage(entry)
                with self.assertLogs("cegen.cache", logging.WARNING) as logs:
                    bundle = _bundle_cache.bundle_for(FORWARD_F32)
                self.assertIn(f"the cached bundle {entry} is damaged", "\n".join(logs.output))
                self.assertEqual(gen.runs(), runs + 1)
                self.assertEqual(Path(bundle.path), entry)
                self.forward_matches_reference()
                del bundle
                _bundle_cache.clear_open_bundles()

    def test_an_entry_is_rebuilt_once(self) -> None:
        gen = self.fake(damage=True)  # every bundle it writes is damaged
        with self.assertRaisesRegex(cegen.CeGenToolError, "ce-gen built .* but it cannot be used"):
            _bundle_cache.bundle_for(FORWARD_F32)
        self.assertEqual(gen.runs(), 1)
        with self.assertLogs("cegen.cache", logging.WARNING):  # the damaged entry found
            with self.assertRaisesRegex(cegen.CeGenToolError, "ce-gen rebuilt .* but it cannot be used"):
                _bundle_cache.bundle_for(FORWARD_F32)
        self.assertEqual(gen.runs(), 2, "a damaged entry is rebuilt once per call, not in a loop")

    def test_damaged_entry_without_ce_gen_runs(self) -> None:
        self.fake()
        entry = self.build_and_forget()
        (entry / "host-x86_64.so").unlink()  # a new file, not the one that may be mapped
        (entry / "host-x86_64.so").write_bytes(b"x")
        cegen.configure(run_ce_gen=False)
        with self.assertRaisesRegex(cegen.BundleError, "running ce-gen to rebuild it is disabled"):
            _bundle_cache.bundle_for(FORWARD_F32)


class TestSizeLimit(CacheTestCase):
    def test_least_recently_used_unused_entries_go(self) -> None:
        self.fake()
        in_use = _bundle_cache.bundle_for(FORWARD_F32)  # held open below
        oldest = Path(in_use.path)
        unused = Path(_bundle_cache.bundle_for(FORWARD_F16).path)
        now = time.time()
        os.utime(oldest, (now - 300, now - 300))
        os.utime(unused, (now - 200, now - 200))
        entry_bytes = max(_bundle_cache._tree_bytes(p) for p in (oldest, unused))
        # Room for one entry and a half. configure() forgets the open bundles (the
        # process's tables), but `in_use` holds the entry's shared lock as any process does.
        cegen.configure(cache_max_bytes=entry_bytes * 3 // 2)
        with self.assertLogs("cegen.cache", logging.INFO) as logs:
            newest = Path(_bundle_cache.bundle_for(FORWARD_BF16).path)
        self.assertTrue(oldest.is_dir(), "an entry in use was evicted")
        self.assertFalse(unused.exists(), "the least recently used unused entry stayed")
        self.assertTrue(newest.is_dir())
        self.assertFalse((self.cache / "locks" / f"{unused.name}.use").exists())
        text = "\n".join(logs.output)
        self.assertIn(f"evicted {unused}", text)
        self.assertIn("over its limit", text)  # the entry in use keeps it over
        # Once nobody holds it, the oldest goes too.
        del in_use
        _bundle_cache.clear_open_bundles()
        gc.collect()
        total = _bundle_cache.prune_cache()
        self.assertFalse(oldest.exists())
        self.assertEqual(self.entries(), [newest])
        self.assertLessEqual(total, entry_bytes * 3 // 2)
        self.forward_matches_reference()  # rebuilt after its eviction

    def test_opening_an_entry_makes_it_recent(self) -> None:
        self.fake()
        # Forward kernels only: entries of about one size (a backward entry is about half
        # a forward's, which holds the statistics sweep twice, and would fit the half).
        keys = (FORWARD_F32, FORWARD_F16, FORWARD_F32_I32)
        entries = [Path(_bundle_cache.bundle_for(key).path) for key in keys]
        _bundle_cache.clear_open_bundles()
        gc.collect()
        now = time.time()
        for age, entry in zip((300, 200, 100), entries):
            os.utime(entry, (now - age, now - age))
        _bundle_cache.bundle_for(FORWARD_F32)  # the oldest, opened from the disk: now the newest
        _bundle_cache.clear_open_bundles()
        gc.collect()
        entry_bytes = max(_bundle_cache._tree_bytes(p) for p in entries)
        cegen.configure(cache_max_bytes=entry_bytes * 5 // 2)
        newest = Path(_bundle_cache.bundle_for(FORWARD_BF16).path)
        # Four entries, room for two and a half: the two least recently used go, in order.
        self.assertEqual(self.entries(), sorted([entries[0], newest]))

    def test_no_limit_keeps_everything(self) -> None:
        cegen.configure(cache_max_bytes=None)
        for key in (FORWARD_F32, FORWARD_F16):
            _bundle_cache.bundle_for(key)
        _bundle_cache.clear_open_bundles()
        gc.collect()
        _bundle_cache.prune_cache()
        self.assertEqual(len(self.entries()), 2)

    def test_stale_scratch_directories_go(self) -> None:
        _bundle_cache.bundle_for(FORWARD_F32)
        stale = self.cache / (".%s.abcd" % ("0" * 24))
        fresh = self.cache / (".%s.efgh" % ("1" * 24))
        for directory in (stale, fresh):
            (directory / "bundle").mkdir(parents=True)
        cegen.configure(ce_gen_timeout_s=60.0)
        os.utime(stale, (time.time() - 3600, time.time() - 3600))
        try:
            _bundle_cache.prune_cache()
        finally:
            cegen.configure(ce_gen_timeout_s=self.previous.ce_gen_timeout_s)
        self.assertFalse(stale.exists(), "a dead build's scratch directory stayed")
        self.assertTrue(fresh.exists(), "a build that may still run lost its directory")


if __name__ == "__main__":
    unittest.main()
