#!/usr/bin/env python3
"""Runs flash-attention's own cross-entropy test file against cegen (issue 17).

flash-attention's tests/losses/test_cross_entropy.py (fetched, never committed) imports
``flash_attn.losses.cross_entropy.CrossEntropyLoss``; this runner puts cegen's stand-in of it
(test/compat/flash_attn_standin) first on ``sys.path``, imports the file, expands every
``pytest.mark.parametrize`` grid itself (pytest's markers when pytest is installed, a small
shim of them when not: Debian's /usr/bin/python3 has no pytest) and calls each case, then
prints the count of cases passed, failed, skipped by the file itself and not expressible,
the last by reason (the stand-in's ``NotExpressibleError``).

The file creates its tensors on ``device="cuda"``. With ``--device=cpu`` (the default where
CUDA is not available) the module's ``torch`` is replaced by a proxy that maps every
``device=`` argument to the CPU (cegen's host kernels) and caps the row count of the
row-making factories (``randn``, ``randint``, ``randperm``: their first dimension, which in
this file is ``batch_size * seqlen``) at ``--max-rows``; ``torch.cuda.get_device_capability``
answers (9, 0) while the file is imported (its bfloat16 cases are then in the grid, as on
an H200). On CUDA nothing is mapped or capped unless asked.

    PYTHONPATH=python /usr/bin/python3 test/compat/run_flash_attn_tests.py \\
        .dev/fa-compat/test_cross_entropy.py

On a GPU machine without ce-gen, give the runtime and an sm_90 bundle with the kernels the
cases ask for (``--runtime .dev/lib/libce_runtime.so --bundle DIR``). The counts, the
command and what each reason means are in docs/compat-flash-attention.md.

Exit status: 0 when no case failed or raised anything else, 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import gc
import importlib.util
import inspect
import itertools
import shutil
import sys
import tempfile
import time
import traceback
import types
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
STANDIN = HERE / "flash_attn_standin"


class _Skipped(Exception):
    """What the shim's ``pytest.skip`` raises."""


class _Mark:
    """A marker as pytest stores it in ``function.pytestmark`` (name, args, kwargs)."""

    def __init__(self, name: str, args: tuple, kwargs: dict) -> None:
        self.name, self.args, self.kwargs = name, args, kwargs


class _MarkFactory:
    """``pytest.mark``: ``pytest.mark.NAME(*args)`` appends a marker to the function."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def make(*args: Any, **kwargs: Any) -> Callable[[Any], Any]:
            def decorate(function: Any) -> Any:
                function.pytestmark = getattr(function, "pytestmark", []) + [
                    _Mark(name, args, kwargs)]
                return function
            return decorate
        return make


def _pytest_shim() -> types.ModuleType:
    """The part of pytest's API that flash-attention's test file uses."""
    shim = types.ModuleType("pytest")
    shim.mark = _MarkFactory()  # type: ignore[attr-defined]

    def skip(reason: str = "", **_: Any) -> None:
        raise _Skipped(reason)

    skip.Exception = _Skipped  # type: ignore[attr-defined]
    shim.skip = skip  # type: ignore[attr-defined]
    return shim


def _skip_exception() -> type:
    """The exception ``pytest.skip`` raises (pytest's own derives from BaseException)."""
    return sys.modules["pytest"].skip.Exception  # type: ignore[attr-defined, no-any-return]


class _MappedTorch(types.ModuleType):
    """``torch`` for a test module written for CUDA: ``device=`` arguments mapped to
    ``device``, and the first dimension of what ``randn``/``randint``/``randperm`` make
    capped at ``max_rows`` (0: no cap). Everything else is torch's own."""

    _ROW_FACTORIES = ("randn", "randint", "randperm")

    def __init__(self, torch_module: types.ModuleType, device: str, max_rows: int) -> None:
        super().__init__("torch")
        self._torch, self._device, self._max_rows = torch_module, device, max_rows

    def _cap(self, rows: int) -> int:
        return min(rows, self._max_rows) if self._max_rows else rows

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._torch, name)
        if not callable(value) or isinstance(value, type) or isinstance(value, types.ModuleType):
            return value

        def mapped(*args: Any, **kwargs: Any) -> Any:
            if "device" in kwargs and kwargs["device"] is not None:
                kwargs["device"] = self._device
            if name in self._ROW_FACTORIES:
                args = self._capped(name, args, kwargs)
            return value(*args, **kwargs)

        return mapped

    def _capped(self, name: str, args: tuple, kwargs: dict) -> tuple:
        if name == "randperm":
            return (self._cap(args[0]),) + args[1:]
        if name == "randint":
            # randint(high, size) or randint(low, high, size); size may be a keyword.
            if "size" in kwargs:
                kwargs["size"] = (self._cap(kwargs["size"][0]),) + tuple(kwargs["size"][1:])
                return args
            size = args[-1]
            return args[:-1] + ((self._cap(size[0]),) + tuple(size[1:]),)
        if args and isinstance(args[0], (tuple, list, self._torch.Size)):
            return ((self._cap(args[0][0]),) + tuple(args[0][1:]),) + args[1:]
        return (self._cap(args[0]),) + args[1:]


def _parametrized_cases(function: Any) -> Iterator[Dict[str, Any]]:
    """Every combination of the function's parametrize markers (the last marker's values
    varying fastest), each as {argument: value} in the function's argument order."""
    order = list(inspect.signature(function).parameters)  # ids name them in this order
    axes: List[Tuple[List[str], List[Tuple[Any, ...]]]] = []
    for mark in getattr(function, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names, values = mark.args[0], mark.args[1]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        rows = []
        for value in values:
            value = getattr(value, "values", value)  # pytest.param(...)
            rows.append(tuple(value) if len(names) > 1 else (value,))
        axes.append((names, rows))
    for combination in itertools.product(*(rows for _, rows in reversed(axes))):
        case: Dict[str, Any] = {}
        for (names, _), row in zip(reversed(axes), combination):
            case.update(zip(names, row))
        yield {name: case[name] for name in order if name in case}


def _case_id(function: Any, case: Dict[str, Any]) -> str:
    def text(value: Any) -> str:
        return str(value).replace("torch.", "")
    return f"{function.__name__}[{', '.join(f'{k}={text(v)}' for k, v in case.items())}]"


def _import_test_file(path: Path, device: str, max_rows: int) -> types.ModuleType:
    import torch

    spec = importlib.util.spec_from_file_location("flash_attn_test_file", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    original = torch.cuda.get_device_capability
    if device == "cpu":
        torch.cuda.get_device_capability = lambda *_args, **_kwargs: (9, 0)
    try:
        spec.loader.exec_module(module)
    finally:
        torch.cuda.get_device_capability = original
    if device == "cpu" or max_rows:
        module.torch = _MappedTorch(torch, device, max_rows)  # type: ignore[attr-defined]
    return module


class Outcome:
    PASSED, FAILED, ERROR, SKIPPED, NOT_EXPRESSIBLE = (
        "passed", "failed", "error", "skipped by the test file", "not expressible")


def run_case(function: Callable[..., Any], case: Dict[str, Any]
             ) -> Tuple[str, Any, List[warnings.WarningMessage]]:
    """(outcome, detail, warnings) of one call: detail is the NotExpressibleError's reasons,
    the skip reason or the failure's text."""
    from flash_attn.losses.cross_entropy import NotExpressibleError

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            function(**case)
        except NotExpressibleError as error:
            return Outcome.NOT_EXPRESSIBLE, error.reasons, caught
        except AssertionError as error:
            return Outcome.FAILED, traceback.format_exc(limit=-2) or repr(error), caught
        except _skip_exception() as skip:  # type: ignore[misc]
            return Outcome.SKIPPED, str(skip), caught
        except Exception:  # noqa: BLE001 - counted and printed, the run goes on
            return Outcome.ERROR, traceback.format_exc(limit=-3), caught
    return Outcome.PASSED, None, caught


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("test_file", type=Path, help="flash-attention's tests/losses/test_cross_entropy.py")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where the file's tensors go (auto: cuda when available)")
    parser.add_argument("--max-rows", type=int, default=None,
                        help="cap on the rows the file makes (default 256 on the CPU, none on CUDA)")
    parser.add_argument("-k", dest="keyword", default=None,
                        help="run only the cases whose id contains this text")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="cegen kernel cache (default: a private one removed at exit)")
    parser.add_argument("--runtime", type=Path, default=None,
                        help="libce_runtime.so to load (cegen.configure(runtime_library=...))")
    parser.add_argument("--bundle", type=Path, action="append", default=[],
                        help="a bundle directory to take kernels from, without running ce-gen "
                             "(repeatable; for a machine with no ce-gen, e.g. the H200)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every case's outcome")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(STANDIN))
    try:
        import cegen
    except ImportError:
        sys.path.insert(1, str(REPO / "python"))
        import cegen
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    max_rows = args.max_rows if args.max_rows is not None else (256 if device == "cpu" else 0)
    settings: Dict[str, Any] = {}
    if args.runtime is not None:
        settings["runtime_library"] = str(args.runtime.resolve())
    if args.bundle:
        settings.update(bundle_dirs=[str(b.resolve()) for b in args.bundle], run_ce_gen=False)
    cache = None
    if args.cache_dir is None:
        cache = tempfile.mkdtemp(prefix="cegen-fa-compat-")
    cegen.configure(cache_dir=cache or args.cache_dir, **settings)
    try:
        import pytest  # noqa: F401
        pytest_kind = f"pytest {pytest.__version__}'s markers"
    except ImportError:
        sys.modules["pytest"] = _pytest_shim()
        pytest_kind = "no pytest: the runner's shim of pytest.mark.parametrize and pytest.skip"

    module = _import_test_file(args.test_file.resolve(), device, max_rows)
    tests = [getattr(module, name) for name in dir(module)
             if name.startswith("test") and callable(getattr(module, name))]
    counts: collections.Counter = collections.Counter()
    first_reason: collections.Counter = collections.Counter()
    any_reason: collections.Counter = collections.Counter()
    skip_reasons: collections.Counter = collections.Counter()
    warning_kinds: collections.Counter = collections.Counter()
    problems: List[Tuple[str, str, str]] = []
    started = time.time()
    for function in tests:
        for case in _parametrized_cases(function):
            case_id = _case_id(function, case)
            if args.keyword and args.keyword not in case_id:
                continue
            outcome, detail, caught = run_case(function, case)
            counts[outcome] += 1
            if outcome == Outcome.NOT_EXPRESSIBLE:
                first_reason[detail[0]] += 1
                any_reason.update(detail)
            elif outcome == Outcome.SKIPPED:
                skip_reasons[detail] += 1
            elif outcome in (Outcome.FAILED, Outcome.ERROR):
                problems.append((case_id, outcome, detail))
            for message in caught:
                warning_kinds[f"{message.category.__name__}: {str(message.message)[:110]}"] += 1
            if args.verbose:
                shown = "; ".join(detail) if outcome == Outcome.NOT_EXPRESSIBLE else ""
                print(f"{outcome:>24}  {case_id} {shown}", flush=True)
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
    if cache is not None:
        shutil.rmtree(cache, ignore_errors=True)

    for case_id, outcome, detail in problems:
        print(f"--- {outcome}: {case_id}\n{detail}")
    total = sum(counts.values())
    run = total - counts[Outcome.SKIPPED]
    print(f"flash-attention {args.test_file.name} through cegen's CrossEntropyLoss stand-in")
    print(f"device: {device}" + (f", rows capped at {max_rows}" if max_rows else "")
          + f"; torch {torch.__version__}; {pytest_kind}; {time.time() - started:.0f} s")
    print("| outcome | cases |\n|---|---:|")
    print(f"| cases in the grid | {total} |")
    print(f"| skipped by the test file itself | {counts[Outcome.SKIPPED]} |")
    print(f"| run | {run} |")
    for outcome in (Outcome.PASSED, Outcome.FAILED, Outcome.ERROR, Outcome.NOT_EXPRESSIBLE):
        print(f"| {outcome} | {counts[outcome]} |")
    for reason, count in first_reason.most_common():
        print(f"| not expressible, first reason: {reason} | {count} |")
    for reason, count in any_reason.most_common():
        print(f"| (cases that need: {reason}) | {count} |")
    for reason, count in skip_reasons.most_common():
        print(f"skipped by the file: {count} x {reason!r}")
    for kind, count in warning_kinds.most_common():
        print(f"warning: {count} x {kind}")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
