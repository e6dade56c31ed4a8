"""Wheel tag of the cegen package; the metadata is in pyproject.toml (PEP 621).

A package that carries ``cegen/libce_runtime.so`` (staged by scripts/build_wheel.sh) holds
machine code, so its wheel is a platform wheel: ``py3-none-<platform>`` (any Python 3, no
extension module, this platform, e.g. ``linux_x86_64``). Without the runtime the wheel is
pure Python (``py3-none-any``), as before.
"""

from pathlib import Path

from setuptools import Distribution, setup

try:  # setuptools >= 70.1 has its own; Debian 12's setuptools 66 uses the wheel package's
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:
    from wheel.bdist_wheel import bdist_wheel

CARRIES_RUNTIME = (Path(__file__).resolve().parent / "cegen" / "libce_runtime.so").is_file()


class PlatformDistribution(Distribution):
    """A distribution with machine code: installed into platlib, the wheel's root."""

    def has_ext_modules(self) -> bool:
        return True


class PlatformWheel(bdist_wheel):
    """``bdist_wheel`` that tags the wheel for this platform but any Python 3."""

    def get_tag(self):  # type: ignore[no-untyped-def]
        _, _, platform = super().get_tag()
        return "py3", "none", platform


if CARRIES_RUNTIME:
    setup(distclass=PlatformDistribution, cmdclass={"bdist_wheel": PlatformWheel})
else:
    setup()
