"""Process-wide settings of the Python API, and where things are found by default.

Nothing here reads an environment variable: every setting is a function argument
(:func:`configure`, :func:`set_runtime_library`) with a default that is discovered from
where the package lives (next to an installed package, or the repository's ``build/``).

An installed wheel (``scripts/build_wheel.sh``, docs/packaging.md) carries the runtime as
``cegen/libce_runtime.so`` and kernels made ahead of time, one bundle per target, in
``cegen/prebuilt-kernels/<target>/``: both are found without any configuration, and a package
that carries prebuilt kernels does not run ``ce-gen`` by default (``Config.run_ce_gen``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import sys
import threading
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Tuple

from . import _validate
from ._errors import InvalidInputError

__all__ = [
    "Config",
    "configure",
    "get_config",
    "set_runtime_library",
    "runtime_library_candidates",
    "ce_gen_candidates",
    "add_config_listener",
    "prebuilt_bundle_dir",
    "prebuilt_targets",
]

RUNTIME_LIBRARY_NAME = "libce_runtime.so"
CE_GEN_NAME = "ce-gen"

#: The directory of this package (``python/cegen`` in the source tree).
PACKAGE_DIR = Path(__file__).resolve().parent

#: Kernels made ahead of time that ship inside the package (a wheel built by
#: ``scripts/build_wheel.sh``): ``<PREBUILT_DIR>/<target>/manifest.json`` and its code
#: objects, one bundle per target. Absent in the source tree.
PREBUILT_DIR = PACKAGE_DIR / "prebuilt-kernels"

#: What a target's name may be (``host``, ``sm_90``, ``gfx942``): it names a directory.
_TARGET_NAME = re.compile(r"^[A-Za-z0-9_]+$")


def prebuilt_bundle_dir(target: str) -> Optional[Path]:
    """The package's prebuilt bundle for ``target``, or None when it carries none."""
    if not _TARGET_NAME.match(target):
        return None
    directory = PREBUILT_DIR / target
    return directory if (directory / "manifest.json").is_file() else None


def prebuilt_targets() -> List[str]:
    """The targets the package carries prebuilt kernels for, sorted (none: ``[]``)."""
    try:
        names = sorted(os.listdir(PREBUILT_DIR))
    except OSError:
        return []
    return [name for name in names if prebuilt_bundle_dir(name) is not None]


def _run_ce_gen_default() -> bool:
    """``Config.run_ce_gen``'s default: False when the package carries prebuilt kernels."""
    return not prebuilt_targets()


def _source_tree_root() -> Optional[Path]:
    """The repository root when the package is used from the source tree, else None."""
    candidate = PACKAGE_DIR.parent.parent
    if PACKAGE_DIR.parent.name == "python" and (candidate / "runtime").is_dir():
        return candidate
    return None


def _install_prefix() -> Optional[Path]:
    """``<prefix>`` when installed as ``<prefix>/lib/pythonX.Y/{site,dist}-packages/cegen``."""
    packages = PACKAGE_DIR.parent
    if packages.name in ("site-packages", "dist-packages") and packages.parent.parent.name == "lib":
        return packages.parent.parent.parent
    return None


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings of the kernel cache and of library discovery.

    Attributes:
        cache_dir: where bundles that ``ce-gen`` builds on a cache miss are kept, one
            directory per variant (``<cache_dir>/<hash>``). Default ``~/.cache/cegen``.
        bundle_dirs: bundles made ahead of time by ``ce-gen``, searched (in order) before
            the package's prebuilt kernels (``cegen/prebuilt-kernels/<target>/`` of an installed
            wheel) and the cache.
        build_dir: a cegen build directory (``build/`` of the repository by default) in
            which the runtime library and ``ce-gen`` are looked for.
        runtime_library: an explicit ``libce_runtime.so`` (see :func:`set_runtime_library`).
        ce_gen: an explicit ``ce-gen`` executable.
        run_ce_gen: whether a cache miss may run ``ce-gen``; when False a variant that no
            bundle holds is an error. Default: False when the package carries prebuilt
            kernels (an installed wheel, docs/packaging.md: a training node needs no
            compiler, and a variant it lacks is a clear error rather than a search for
            ``ce-gen``), True otherwise (the source tree, ``PYTHONPATH=python``).
        ce_gen_timeout_s: how long one ``ce-gen`` run may take, in seconds (> 0).
        cache_max_bytes: the size limit of ``cache_dir`` in bytes, or None for no limit.
            After each ``ce-gen`` run the cache removes entries that no process has open,
            least recently used first, until it fits (docs/megatron.md, "The kernel
            cache"). Default 4 GiB.
    """

    cache_dir: Path = dataclasses.field(default_factory=lambda: Path("~/.cache/cegen"))
    bundle_dirs: Tuple[Path, ...] = ()
    build_dir: Optional[Path] = None
    runtime_library: Optional[Path] = None
    ce_gen: Optional[Path] = None
    run_ce_gen: bool = dataclasses.field(default_factory=_run_ce_gen_default)
    ce_gen_timeout_s: float = 900.0
    cache_max_bytes: Optional[int] = 4 * 2 ** 30

    def resolved_cache_dir(self) -> Path:
        """``cache_dir`` with ``~`` expanded."""
        return Path(self.cache_dir).expanduser()

    def default_build_dir(self) -> Optional[Path]:
        """``build_dir``, or the source tree's ``build/`` when used from the source tree."""
        if self.build_dir is not None:
            return Path(self.build_dir).expanduser()
        root = _source_tree_root()
        return None if root is None else root / "build"


_lock = threading.Lock()
_config = Config()
_listeners: List[Callable[[Config, Config], None]] = []


def get_config() -> Config:
    """The settings in force."""
    return _config


def add_config_listener(listener: Callable[[Config, Config], None]) -> None:
    """Calls ``listener(old, new)`` after every change (used to drop in-process caches)."""
    _listeners.append(listener)


def configure(**changes: Any) -> Config:
    """Changes some settings (the fields of :class:`Config`) and returns the new settings.

    Example::

        cegen.configure(cache_dir="/scratch/cegen-cache", bundle_dirs=["/opt/kernels"])
    """
    global _config
    fields = {field.name for field in dataclasses.fields(Config)}
    unknown = sorted(set(changes) - fields)
    if unknown:
        raise TypeError(f"configure(): unknown setting(s) {unknown}; known: {sorted(fields)}")
    normalized = {name: _checked_setting(name, value) for name, value in changes.items()}
    with _lock:
        old = _config
        _config = dataclasses.replace(old, **normalized)
        new = _config
    for listener in list(_listeners):
        listener(old, new)
    return new


def _checked_setting(name: str, value: Any) -> Any:
    """A setting's value checked by cegen._validate and normalized (paths as Path)."""
    if name == "bundle_dirs":
        if isinstance(value, (str, os.PathLike)):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise InvalidInputError(
                f"bundle_dirs must be a path or a list of paths, got {value!r}")
        return tuple(_validate.path(f"bundle_dirs[{index}]", item)
                     for index, item in enumerate(value))
    if name == "cache_dir":
        return _validate.path(name, value)
    if name in ("build_dir", "runtime_library", "ce_gen"):
        return _validate.path(name, value, allow_none=True)
    if name == "run_ce_gen":
        return _validate.flag(name, value)
    if name == "ce_gen_timeout_s":
        return _validate.real(name, value, 0.0, sys.float_info.max, low_open=True,
                              what="a finite number of seconds > 0")
    if name == "cache_max_bytes":
        return _validate.integer(name, value, 0, allow_none=True)
    return value


def set_runtime_library(path: "os.PathLike[str] | str") -> None:
    """Uses the ``libce_runtime.so`` at ``path`` instead of discovering one."""
    library = Path(path).expanduser()
    if not library.is_file():
        from ._errors import RuntimeLibraryError

        raise RuntimeLibraryError(f"set_runtime_library: no file at {library}")
    configure(runtime_library=library)


def _build_dirs(config: Config) -> Sequence[Path]:
    build = config.default_build_dir()
    return [] if build is None else [build]


def runtime_library_candidates(config: Optional[Config] = None) -> List[Path]:
    """Where ``libce_runtime.so`` is looked for, first match wins."""
    config = config or get_config()
    if config.runtime_library is not None:
        return [Path(config.runtime_library).expanduser()]
    candidates = [
        PACKAGE_DIR / RUNTIME_LIBRARY_NAME,  # installed next to the package
        PACKAGE_DIR / "lib" / RUNTIME_LIBRARY_NAME,
    ]
    prefix = _install_prefix()
    if prefix is not None:  # <prefix>/lib/pythonX.Y/site-packages/cegen -> <prefix>/lib
        candidates.append(prefix / "lib" / RUNTIME_LIBRARY_NAME)
    for build in _build_dirs(config):
        candidates += [
            build / "lib" / RUNTIME_LIBRARY_NAME,
            build / "runtime" / RUNTIME_LIBRARY_NAME,
            build / "runtime" / "lib" / RUNTIME_LIBRARY_NAME,
        ]
    return candidates


def ce_gen_candidates(config: Optional[Config] = None) -> List[Path]:
    """Where ``ce-gen`` is looked for, first match wins (``PATH`` comes last)."""
    config = config or get_config()
    if config.ce_gen is not None:
        return [Path(config.ce_gen).expanduser()]
    candidates = [PACKAGE_DIR / "bin" / CE_GEN_NAME]
    prefix = _install_prefix()
    if prefix is not None:
        candidates.append(prefix / "bin" / CE_GEN_NAME)
    for build in _build_dirs(config):
        candidates += [build / "bin" / CE_GEN_NAME, build / "tools" / CE_GEN_NAME / CE_GEN_NAME]
    on_path = shutil.which(CE_GEN_NAME)
    if on_path:
        candidates.append(Path(on_path))
    return candidates


def find_first(candidates: Sequence[Path], executable: bool = False) -> Optional[Path]:
    """The first candidate that is a file (and executable, when asked)."""
    for candidate in candidates:
        if candidate.is_file() and (not executable or os.access(candidate, os.X_OK)):
            return candidate
    return None
