"""Finds the bundle that holds a kernel variant, building it with ``ce-gen`` on a miss.

Lookup order for a :class:`VariantKey` and a target (``host`` for CPU tensors, ``sm_90``
for a CUDA device of compute capability 9.0, ``gfx942`` for an MI300X, ...):

1. the bundle the caller named (``bundle=``): only that one, a missing variant is an error;
2. bundles opened earlier in this process;
3. ``Config.bundle_dirs``: bundles made ahead of time by ``ce-gen``;
4. the package's prebuilt bundle for the target, ``cegen/prebuilt-kernels/<target>/`` (an
   installed wheel carries one per target; the source tree none). One that cannot be
   opened here (a host bundle for CPU features this machine lacks) is skipped with a
   warning, logged once;
5. the on-disk cache ``<cache_dir>/<hash>``, one bundle per variant, where ``hash`` covers
   the variant key, the target and the identity of the ``ce-gen`` binary (a rebuilt
   ``ce-gen`` never reuses kernels of an older one);
6. a cache miss runs ``ce-gen`` as a subprocess into a fresh directory that is renamed
   into place atomically, so concurrent processes never see half a bundle; unless
   ``Config.run_ce_gen`` is False (the default when the package carries prebuilt
   kernels), when the miss is a :class:`VariantNotFoundError` saying how to get the kernel.

``ce-gen`` links MLIR and LLVM; running it as a subprocess keeps them out of the trainer.

Concurrency: a lock guards only the in-process tables and is never held across I/O. Each
cache entry has its own locks, so a call whose kernel is cached never waits for another
entry's ``ce-gen``:

* a thread lock per entry (threads of this process build an entry once);
* ``<cache_dir>/locks/<hash>.build``, an exclusive ``flock`` held while an entry is built,
  repaired or evicted (processes build an entry once; the others wait and open it);
* ``<cache_dir>/locks/<hash>.use``, a shared ``flock`` held for as long as a process has
  the entry open (its ``Bundle`` object lives); eviction needs it exclusively, so no
  entry in use by any process is removed.

An entry that fails to open (a damaged object, a missing manifest) is removed and rebuilt
once; a rebuilt entry that still fails is an error. After each ``ce-gen`` run the cache is
trimmed to ``Config.cache_max_bytes``, least recently used entries first (an entry's
directory mtime is touched when a process opens it). Logger ``cegen.cache``: INFO for
each ``ce-gen`` run (what, where, and how long it took), evictions and repairs.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from . import _config
from ._errors import BundleError, CeGenToolError, VariantNotFoundError
from ._runtime import Bundle, get_runtime
from ._variant import VariantKey

__all__ = ["bundle_for", "find_ce_gen", "ce_gen_command", "clear_open_bundles", "prune_cache",
           "BundleLike"]

BundleLike = Union[str, "os.PathLike[str]", Bundle]

logger = logging.getLogger("cegen.cache")

#: Bumped when the cache layout or what the hash covers changes.
_CACHE_SCHEMA = 1
#: Cache entries are named by 24 hex digits; scratch and evicted directories start with
#: ``.<hash>.``; lock files live in ``locks/``.
_ENTRY_NAME = re.compile(r"^[0-9a-f]{24}$")
_SCRATCH_NAME = re.compile(r"^\.([0-9a-f]{24})\.")
_LOCKS = "locks"

#: Guards the tables below; held only for dictionary operations, never across I/O.
_lock = threading.Lock()
_by_key: Dict[Tuple[str, str], Bundle] = {}
_by_dir: Dict[str, Bundle] = {}
#: One lock per bundle directory (an explicit bundle, a bundle_dirs entry, a cache entry):
#: opening or building one never blocks calls that need another.
_dir_locks: Dict[str, threading.Lock] = {}
#: The package's prebuilt bundles that failed to open: directory -> the error (not retried
#: until :func:`clear_open_bundles`).
_prebuilt_errors: Dict[str, BundleError] = {}


#: Bumped by :func:`clear_open_bundles`: lookups cached elsewhere (``cegen._kernels``) made
#: under an older generation are made again.
generation = 0


def clear_open_bundles() -> None:
    """Forgets the bundles opened by this process (they close once unreferenced)."""
    global generation
    with _lock:
        _by_key.clear()
        _by_dir.clear()
        _prebuilt_errors.clear()
        generation += 1


_config.add_config_listener(lambda old, new: clear_open_bundles())


def find_ce_gen(config: Optional[_config.Config] = None) -> Optional[Path]:
    """The ``ce-gen`` executable that a cache miss would run, or None."""
    return _config.find_first(_config.ce_gen_candidates(config), executable=True)


def ce_gen_command(ce_gen: Path, key: VariantKey, output: Path, target: str = "host") -> List[str]:
    """The command line that builds the bundle holding ``key`` into ``output``."""
    return [str(ce_gen), f"--target={target}", "-o", str(output), *key.ce_gen_options()]


def _dir_lock(real: str) -> threading.Lock:
    with _lock:
        lock = _dir_locks.get(real)
        if lock is None:
            lock = _dir_locks[real] = threading.Lock()
        return lock


def _open_dir(directory: Path) -> Bundle:
    """The bundle in ``directory``, opened once per process."""
    real = str(Path(directory).expanduser().resolve())
    with _lock:
        bundle = _by_dir.get(real)
    if bundle is not None:
        return bundle
    with _dir_lock(real):
        with _lock:
            bundle = _by_dir.get(real)
        if bundle is None:
            bundle = get_runtime().open_bundle(Path(real))
            with _lock:
                _by_dir[real] = bundle
    return bundle


def _generator_identity(ce_gen: Path) -> str:
    stat = ce_gen.resolve().stat()
    return f"{ce_gen.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"


def cache_entry(key: VariantKey, ce_gen: Path, target: str, cache_dir: Path) -> Path:
    """The cache directory of ``key`` as built by ``ce_gen`` for ``target``."""
    identity = json.dumps(
        {
            "schema": _CACHE_SCHEMA,
            "key": str(key),
            "target": target,
            "generator": _generator_identity(ce_gen),
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(identity.encode()).hexdigest()[:24]
    return cache_dir / digest


# -- file locks ------------------------------------------------------------------------------

_lock_warnings: set = set()


def _warn_once(message: str) -> None:
    with _lock:
        if message in _lock_warnings:
            return
        _lock_warnings.add(message)
    logger.warning(message)


def _lock_file(entry: Path, kind: str) -> Path:
    return entry.parent / _LOCKS / f"{entry.name}.{kind}"


class _FileLock:
    """An ``flock`` on ``path``, released by :meth:`release` or when garbage-collected.

    The file may be unlinked by an eviction while another process waits for it, so after
    taking the lock the holder checks that ``path`` still names the locked file, and
    starts again if not (the usual pattern for lock files that are deleted).
    """

    def __init__(self, fd: Optional[int]):
        self._fd = fd

    @classmethod
    def take(cls, path: Path, exclusive: bool, blocking: bool = True) -> Optional["_FileLock"]:
        """The lock, or None when ``blocking`` is False and another holder has it. Where
        the file system refuses file locks, a warning is logged once and an empty lock
        is returned: the atomic rename still keeps every entry whole."""
        mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if blocking else fcntl.LOCK_NB)
        while True:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            except OSError as error:
                _warn_once(f"cannot create lock files in {path.parent} ({error.strerror}); "
                           "the kernel cache runs without cross-process locks there")
                return cls(None)
            try:
                fcntl.flock(fd, mode)
            except OSError as error:
                os.close(fd)
                if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) and not blocking:
                    return None
                _warn_once(f"cannot lock files in {path.parent} ({error.strerror}); the "
                           "kernel cache runs without cross-process locks there")
                return cls(None)
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                return cls(fd)
            os.close(fd)  # unlinked while we waited: lock the file that is there now

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor releases the flock

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # interpreter shutdown may have torn os down already
            pass


# -- building, opening and repairing cache entries --------------------------------------------


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _build(key: VariantKey, ce_gen: Path, target: str, entry: Path, timeout_s: float) -> None:
    """Runs ce-gen into a private directory and renames it to ``entry``."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    output = scratch / "bundle"
    command = ce_gen_command(ce_gen, key, output, target)
    logger.info("cache miss: running ce-gen for the %s kernel %s into %s", target, key, entry)
    logger.debug("command: %s", " ".join(command))
    started = time.monotonic()
    try:
        try:
            result = subprocess.run(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired as error:
            raise CeGenToolError(
                f"ce-gen did not finish within {timeout_s:g} s: {' '.join(command)}"
            ) from error
        except OSError as error:
            raise CeGenToolError(f"cannot run ce-gen ({' '.join(command)}): {error}") from error
        if result.returncode != 0:
            raise CeGenToolError(
                f"ce-gen failed with exit status {result.returncode} building variant {key}\n"
                f"command: {' '.join(command)}\n{_tail(result.stderr or result.stdout)}"
            )
        if not (output / "manifest.json").is_file():
            raise CeGenToolError(
                f"ce-gen exited 0 but wrote no manifest.json into {output}\n"
                f"command: {' '.join(command)}"
            )
        try:
            os.rename(output, entry)
        except OSError:
            # Another process won the race (one without working file locks); its bundle
            # is as good as ours.
            if not (entry / "manifest.json").is_file():
                raise
        logger.info("ce-gen built %s in %.2f s (%s kernel %s)", entry,
                    time.monotonic() - started, target, key)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _remove_entry(entry: Path) -> None:
    """Moves ``entry`` aside (atomically: a reader sees it whole or not at all) and
    deletes it."""
    try:
        aside = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
        os.rename(entry, aside / "removed")
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def _open_entry(entry: Path, real: str, key: VariantKey, target: str) -> Bundle:
    """Opens a cache entry, marks it in use and recently used; BundleError when it is
    missing, damaged, or lacks the variant."""
    in_use = _FileLock.take(_lock_file(entry, "use"), exclusive=False)
    try:
        bundle = get_runtime().open_bundle(entry)
    except BundleError:
        if in_use is not None:
            in_use.release()
        raise
    if not bundle.has(key, target):
        held = bundle.kernels()
        bundle.close()
        if in_use is not None:
            in_use.release()
        raise BundleError(f"the cached bundle {entry} holds no {target} kernel for variant "
                          f"{key}; it holds: {held}")
    bundle._cache_in_use = in_use  # type: ignore[attr-defined]  # released with the Bundle
    with contextlib.suppress(OSError):
        os.utime(entry)  # least recently used goes first
    with _lock:
        _by_dir[real] = bundle
    return bundle


def _cached_bundle(key: VariantKey, ce_gen: Path, target: str, config: _config.Config) -> Bundle:
    """The cache entry of ``key``: opened, built on a miss, rebuilt once when damaged."""
    cache_dir = config.resolved_cache_dir().resolve()
    entry = cache_entry(key, ce_gen, target, cache_dir)
    real = str(entry)
    with _lock:
        bundle = _by_dir.get(real)
    if bundle is not None:
        return bundle
    with _dir_lock(real):
        with _lock:
            bundle = _by_dir.get(real)
        if bundle is not None:
            return bundle
        damage: Optional[BundleError] = None
        if (entry / "manifest.json").is_file():
            try:
                return _open_entry(entry, real, key, target)
            except BundleError as error:
                damage = error
        if not config.run_ce_gen:
            if damage is not None:
                raise BundleError(f"{damage}\n(the cache entry is damaged and running ce-gen to "
                                  "rebuild it is disabled: cegen.configure(run_ce_gen=False))",
                                  damage.status, damage.status_name) from damage
            raise VariantNotFoundError(
                f"variant {key} for {target} is not in the cache {entry} and running ce-gen "
                f"is disabled (run_ce_gen=False){_prebuilt_note(target)}\n"
                f"let cegen build it with {ce_gen}: cegen.configure(run_ce_gen=True); "
                f"or build it ahead of time:\n  {_ahead_of_time_hint(key, target)}"
            )
        build_lock_path = _lock_file(entry, "build")
        build_lock = _FileLock.take(build_lock_path, exclusive=True, blocking=False)
        if build_lock is None:
            logger.info("waiting for another process building %s", entry)
            build_lock = _FileLock.take(build_lock_path, exclusive=True)
        try:
            # Under the build lock the entry is what the last builder left: built or
            # repaired by the process we waited for, still damaged, or gone (evicted).
            damage = None
            if (entry / "manifest.json").is_file():
                try:
                    return _open_entry(entry, real, key, target)
                except BundleError as error:
                    damage = error
            if damage is not None or entry.exists():
                reason = damage if damage is not None else "it has no manifest.json"
                logger.warning("the cached bundle %s is damaged (%s); rebuilding it", entry,
                               str(reason).splitlines()[0])
                _remove_entry(entry)
            _build(key, ce_gen, target, entry, config.ce_gen_timeout_s)
            try:
                bundle = _open_entry(entry, real, key, target)
            except BundleError as error:  # once: a ce-gen that writes bad bundles stays bad
                raise CeGenToolError(
                    f"ce-gen {'rebuilt' if damage is not None else 'built'} {entry} but it "
                    f"cannot be used: {error}", error.status, error.status_name) from error
        finally:
            build_lock.release()
    prune_cache(config)
    return bundle


# -- size limit ---------------------------------------------------------------------------------


def _tree_bytes(directory: Path) -> int:
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def prune_cache(config: Optional[_config.Config] = None) -> int:
    """Trims the cache to ``config.cache_max_bytes`` and returns its size in bytes.

    Entries go least recently used first (oldest directory mtime); entries that any
    process has open, or that one is building, stay. Leftover scratch directories of
    builds that died (older than ``ce_gen_timeout_s`` and not being built) are removed.
    Runs after every ``ce-gen`` run; callers may run it at any time.
    """
    config = config or _config.get_config()
    cache_dir = config.resolved_cache_dir().resolve()
    try:
        names = os.listdir(cache_dir)
    except OSError:
        return 0
    now = time.time()
    entries = []
    for name in names:
        path = cache_dir / name
        scratch = _SCRATCH_NAME.match(name)
        if scratch:
            try:
                stale = now - path.stat().st_mtime > config.ce_gen_timeout_s
            except OSError:
                continue
            if stale:
                lock = _FileLock.take(_lock_file(cache_dir / scratch.group(1), "build"),
                                      exclusive=True, blocking=False)
                if lock is not None:
                    shutil.rmtree(path, ignore_errors=True)
                    lock.release()
            continue
        if _ENTRY_NAME.match(name) and path.is_dir():
            with contextlib.suppress(OSError):
                entries.append((path.stat().st_mtime_ns, _tree_bytes(path), path))
    total = sum(size for _, size, _ in entries)
    limit = config.cache_max_bytes
    if limit is None or total <= limit:
        return total
    with _lock:
        open_here = set(_by_dir)
    for _, size, path in sorted(entries, key=lambda item: item[0]):
        if total <= limit:
            break
        if str(path) in open_here:
            continue
        if _evict(path):
            total -= size
            logger.info("evicted %s (%d bytes, least recently used) to keep the cache under "
                        "%d bytes", path, size, limit)
    if total > limit:
        logger.info("the cache %s holds %d bytes, over its limit of %d: the rest is in use",
                    cache_dir, total, limit)
    return total


def _evict(entry: Path) -> bool:
    """Removes ``entry`` and its lock files unless some process builds or uses it."""
    build = _FileLock.take(_lock_file(entry, "build"), exclusive=True, blocking=False)
    if build is None:
        return False
    try:
        use = _FileLock.take(_lock_file(entry, "use"), exclusive=True, blocking=False)
        if use is None:
            return False
        try:
            if not entry.is_dir():
                return False
            _remove_entry(entry)
            # Unlinked while held: a process waiting on one sees it gone and starts again.
            for kind in ("use", "build"):
                with contextlib.suppress(OSError):
                    os.unlink(_lock_file(entry, kind))
            return True
        finally:
            use.release()
    finally:
        build.release()


# -- lookup ------------------------------------------------------------------------------------


def _variant_missing(key: VariantKey, target: str, bundle: Bundle) -> VariantNotFoundError:
    keys = bundle.keys(target)
    shown = "\n  ".join(keys[:20]) or "(none)"
    more = f"\n  ... and {len(keys) - 20} more" if len(keys) > 20 else ""
    elsewhere = [t for t in bundle.targets() if t != target and bundle.has(key, t)]
    also = f"\n(it holds this variant for {', '.join(elsewhere)})" if elsewhere else ""
    return VariantNotFoundError(
        f"the bundle {bundle.path} holds no {target} kernel for variant\n  {key}\n"
        f"its {target} kernels:\n  {shown}{more}{also}\n"
        f"build one with: ce-gen --target={target} -o DIR {' '.join(key.ce_gen_options())}"
    )


def _ahead_of_time_hint(key: VariantKey, target: str) -> str:
    """How to build ``key`` into a bundle and have it searched."""
    return (f"ce-gen --target={target} -o DIR {' '.join(key.ce_gen_options())}\n"
            "and pass bundle=DIR or cegen.configure(bundle_dirs=[DIR])")


def _prebuilt_note(target: str) -> str:
    """A line for a miss: what the package's prebuilt kernels hold for ``target``."""
    directory = _config.prebuilt_bundle_dir(target)
    if directory is not None:
        error = _prebuilt_errors.get(str(directory))
        if error is not None:
            return (f"\n(the package's prebuilt {target} kernels in {directory} cannot be "
                    f"used here: {str(error).splitlines()[0]})")
        return f"\n(the package's prebuilt {target} kernels in {directory} do not include it)"
    targets = _config.prebuilt_targets()
    if targets:
        return (f"\n(the package carries prebuilt kernels for {', '.join(targets)}, "
                f"none for {target})")
    return ""


def _prebuilt_bundle(target: str) -> Optional[Bundle]:
    """The package's prebuilt bundle for ``target``, opened once; None when there is none
    or it cannot be opened here (logged once as a warning, with why)."""
    directory = _config.prebuilt_bundle_dir(target)
    if directory is None:
        return None
    with _lock:
        failed = str(directory) in _prebuilt_errors
    if failed:
        return None
    try:
        return _open_dir(directory)
    except BundleError as error:
        with _lock:
            _prebuilt_errors[str(directory)] = error
        logger.warning("the package's prebuilt %s kernels in %s cannot be used here, looking "
                       "elsewhere: %s", target, directory, error)
        return None


def _remember(memo: Tuple[str, str], bundle: Bundle) -> Bundle:
    with _lock:
        return _by_key.setdefault(memo, bundle)


def bundle_for(key: VariantKey, bundle: Optional[BundleLike] = None, target: str = "host") -> Bundle:
    """The open bundle that holds ``key`` for ``target`` (the module docstring says where
    it is looked for)."""
    if isinstance(bundle, Bundle):
        if not bundle.has(key, target):
            raise _variant_missing(key, target, bundle)
        return bundle
    if bundle is not None:
        opened = _open_dir(Path(bundle))
        if not opened.has(key, target):
            raise _variant_missing(key, target, opened)
        return opened

    memo = (str(key), target)
    with _lock:
        found = _by_key.get(memo)
    if found is not None:
        return found

    config = _config.get_config()
    for directory in config.bundle_dirs:
        if not (Path(directory).expanduser() / "manifest.json").is_file():
            raise BundleError(f"configured bundle directory {directory} has no manifest.json")
        opened = _open_dir(Path(directory))
        if opened.has(key, target):
            return _remember(memo, opened)

    prebuilt = _prebuilt_bundle(target)
    if prebuilt is not None and prebuilt.has(key, target):
        return _remember(memo, prebuilt)

    ce_gen = find_ce_gen(config)
    if ce_gen is None:
        looked = "\n  ".join(str(c) for c in _config.ce_gen_candidates(config))
        raise VariantNotFoundError(
            f"no bundle holds variant {key} for {target} and ce-gen was not found to build "
            f"it{_prebuilt_note(target)}\nce-gen was looked for at:\n  {looked}\n"
            f"build it where ce-gen is installed (LLVM/MLIR 22):\n  "
            f"{_ahead_of_time_hint(key, target)}"
        )
    return _remember(memo, _cached_bundle(key, ce_gen, target, config))
