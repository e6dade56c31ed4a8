"""Finds the bundle that holds a kernel variant, building it with ``ce-gen`` on a miss.

Lookup order for a :class:`VariantKey` and a target (``host`` for CPU tensors, ``sm_90``
for a CUDA device of compute capability 9.0, ``gfx942`` for an MI300X, ...):

1. the bundle the caller named (``bundle=``): only that one, a missing variant is an error;
2. bundles opened earlier in this process;
3. ``Config.bundle_dirs``: bundles made ahead of time by ``ce-gen``;
4. the on-disk cache ``<cache_dir>/<hash>``, one bundle per variant, where ``hash`` covers
   the variant key, the target and the identity of the ``ce-gen`` binary (a rebuilt
   ``ce-gen`` never reuses kernels of an older one);
5. a cache miss runs ``ce-gen`` as a subprocess into a fresh directory that is renamed
   into place atomically, so concurrent processes never see half a bundle.

``ce-gen`` links MLIR and LLVM; running it as a subprocess keeps them out of the trainer.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from . import _config
from ._errors import BundleError, CeGenToolError, VariantNotFoundError
from ._runtime import Bundle, get_runtime
from ._variant import VariantKey

__all__ = ["bundle_for", "find_ce_gen", "ce_gen_command", "clear_open_bundles", "BundleLike"]

BundleLike = Union[str, "os.PathLike[str]", Bundle]

#: Bumped when the cache layout or what the hash covers changes.
_CACHE_SCHEMA = 1

_lock = threading.RLock()
_by_key: Dict[Tuple[str, str], Bundle] = {}
_by_dir: Dict[str, Bundle] = {}


def clear_open_bundles() -> None:
    """Forgets the bundles opened by this process (they close once unreferenced)."""
    with _lock:
        _by_key.clear()
        _by_dir.clear()


_config.add_config_listener(lambda old, new: clear_open_bundles())


def find_ce_gen(config: Optional[_config.Config] = None) -> Optional[Path]:
    """The ``ce-gen`` executable that a cache miss would run, or None."""
    return _config.find_first(_config.ce_gen_candidates(config), executable=True)


def ce_gen_command(ce_gen: Path, key: VariantKey, output: Path, target: str = "host") -> List[str]:
    """The command line that builds the bundle holding ``key`` into ``output``."""
    return [str(ce_gen), f"--target={target}", "-o", str(output), *key.ce_gen_options()]


def _open_dir(directory: Path) -> Bundle:
    real = str(Path(directory).expanduser().resolve())
    bundle = _by_dir.get(real)
    if bundle is None:
        bundle = get_runtime().open_bundle(Path(real))
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


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _build(key: VariantKey, ce_gen: Path, target: str, entry: Path, timeout_s: float) -> None:
    """Runs ce-gen into a private directory and renames it to ``entry``."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    output = scratch / "bundle"
    command = ce_gen_command(ce_gen, key, output, target)
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
            # Another process won the race; its bundle is as good as ours.
            if not (entry / "manifest.json").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


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


def bundle_for(key: VariantKey, bundle: Optional[BundleLike] = None, target: str = "host") -> Bundle:
    """The open bundle that holds ``key`` for ``target`` (the module docstring says where
    it is looked for)."""
    if isinstance(bundle, Bundle):
        if not bundle.has(key, target):
            raise _variant_missing(key, target, bundle)
        return bundle
    with _lock:
        if bundle is not None:
            opened = _open_dir(Path(bundle))
            if not opened.has(key, target):
                raise _variant_missing(key, target, opened)
            return opened

        memo = (str(key), target)
        if memo in _by_key:
            return _by_key[memo]

        config = _config.get_config()
        for directory in config.bundle_dirs:
            if not (Path(directory).expanduser() / "manifest.json").is_file():
                raise BundleError(f"configured bundle directory {directory} has no manifest.json")
            opened = _open_dir(Path(directory))
            if opened.has(key, target):
                _by_key[memo] = opened
                return opened

        ce_gen = find_ce_gen(config)
        if ce_gen is None:
            looked = "\n  ".join(str(c) for c in _config.ce_gen_candidates(config))
            raise VariantNotFoundError(
                f"no bundle holds variant {key} for {target} and ce-gen was not found to build "
                f"it; looked at:"
                f"\n  {looked}\nbuild ce-gen, pass bundle=, or cegen.configure(bundle_dirs=...)"
            )
        entry = cache_entry(key, ce_gen, target, config.resolved_cache_dir())
        if not (entry / "manifest.json").is_file():
            if not config.run_ce_gen:
                raise VariantNotFoundError(
                    f"variant {key} for {target} is not in the cache {entry} and running ce-gen "
                    "is disabled "
                    "(cegen.configure(run_ce_gen=False))"
                )
            _build(key, ce_gen, target, entry, config.ce_gen_timeout_s)
        opened = _open_dir(entry)
        if not opened.has(key, target):
            raise CeGenToolError(
                f"ce-gen built {entry} but it holds no {target} kernel for variant {key}; "
                f"it holds: {opened.kernels()}"
            )
        _by_key[memo] = opened
        return opened
