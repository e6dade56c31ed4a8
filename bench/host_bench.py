#!/usr/bin/env python3
"""Host benchmark: cegen's host kernels against PyTorch's CPU F.cross_entropy.

A program, not a test. From the repository root, after building the runtime and ce-gen::

    PYTHONPATH=python /usr/bin/python3 bench/host_bench.py            # N=2048, V=32000, fp32

It measures, in one run and on the same inputs, the forward and the forward+backward of
PyTorch's ``F.cross_entropy(reduction="none")`` and of ``cegen.cross_entropy`` (plain,
overwrite-input and fused), and prints per variant the median and best time, the achieved
bandwidth over the bytes the variant must move at least, the ratio to that floor
(bytes / the host copy bandwidth measured in the same run) and the speedup over PyTorch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import cegen  # noqa: E402

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


class _Source(torch.autograd.Function):
    """Makes fresh non-leaf logits whose gradient goes nowhere (for overwrite-input)."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.detach().clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        return None


def time_it(step: Callable[[], None], setup: Callable[[], None], warmup: int, iters: int) -> List[float]:
    """Seconds of each timed ``step``; ``setup`` runs before each, outside the timing."""
    times = []
    for index in range(warmup + iters):
        setup()
        start = time.perf_counter()
        step()
        elapsed = time.perf_counter() - start
        if index >= warmup:
            times.append(elapsed)
    return times


def copy_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Host copy bandwidth in bytes/s, counting bytes read and written (torch copy_)."""
    source = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
    target = torch.empty_like(source)
    target.copy_(source)
    best = min(time_it(lambda: target.copy_(source), lambda: None, 1, repeats))
    return 2 * nbytes / best


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="N (default 2048)")
    parser.add_argument("--vocab", type=int, default=32000, help="V (default 32000)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="f32")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads for PyTorch's baseline (default: PyTorch's)")
    parser.add_argument("--bundle", default=None, help="a prebuilt bundle directory to use")
    parser.add_argument("--cache-dir", default=None, help="cegen kernel cache (default ~/.cache/cegen)")
    parser.add_argument("--runtime", default=None, help="libce_runtime.so (default: build/lib)")
    args = parser.parse_args(argv)

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.cache_dir is not None:
        cegen.configure(cache_dir=args.cache_dir)
    if args.runtime is not None:
        cegen.set_runtime_library(args.runtime)
    dtype = DTYPES[args.dtype]
    n, v = args.tokens, args.vocab
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn((n, v), generator=generator) * 3).to(dtype)
    labels = torch.randint(0, v, (n,), generator=generator)
    element = logits.element_size()
    row_bytes = n * v * element

    # Build (or find) every kernel before timing.
    leaf = logits.clone().requires_grad_(True)
    cegen.cross_entropy(leaf, labels, bundle=args.bundle).sum().backward()
    cegen.cross_entropy(_Source.apply(leaf), labels, bundle=args.bundle, overwrite_input=True).sum().backward()
    cegen.cross_entropy(leaf, labels, bundle=args.bundle, grad_weights=1.0).sum().backward()

    results: Dict[str, Tuple[List[float], int]] = {}
    state: Dict[str, object] = {}

    def fresh_leaf() -> None:
        state["leaf"] = logits.clone().requires_grad_(True)

    def fresh_source() -> None:
        state["pending"] = [_Source.apply(state["leaf_for_source"])]

    # --- forward ---------------------------------------------------------------------------
    with torch.no_grad():
        results["torch F.cross_entropy  forward"] = (time_it(
            lambda: F.cross_entropy(logits, labels, reduction="none"), lambda: None,
            args.warmup, args.iters), row_bytes)
        results["cegen                  forward"] = (time_it(
            lambda: cegen.cross_entropy(logits, labels, bundle=args.bundle), lambda: None,
            args.warmup, args.iters), row_bytes)

    # --- forward + backward ----------------------------------------------------------------
    def torch_step() -> None:
        F.cross_entropy(state["leaf"], labels, reduction="none").sum().backward()

    def cegen_step() -> None:
        cegen.cross_entropy(state["leaf"], labels, bundle=args.bundle).sum().backward()

    def cegen_fused_step() -> None:
        cegen.cross_entropy(state["leaf"], labels, bundle=args.bundle, grad_weights=1.0).sum().backward()

    def cegen_overwrite_step() -> None:
        pending = state["pending"]
        cegen.cross_entropy(pending.pop(), labels, bundle=args.bundle,  # type: ignore[attr-defined]
                            overwrite_input=True).sum().backward()

    state["leaf_for_source"] = logits.clone().requires_grad_(True)
    results["torch F.cross_entropy  fwd+bwd"] = (time_it(torch_step, fresh_leaf, args.warmup, args.iters),
                                                 3 * row_bytes)
    results["cegen                  fwd+bwd"] = (time_it(cegen_step, fresh_leaf, args.warmup, args.iters),
                                                 3 * row_bytes)
    results["cegen overwrite-input  fwd+bwd"] = (time_it(cegen_overwrite_step, fresh_source,
                                                         args.warmup, args.iters), 3 * row_bytes)
    results["cegen fused            fwd+bwd"] = (time_it(cegen_fused_step, fresh_leaf, args.warmup,
                                                         args.iters), 2 * row_bytes)

    bandwidth = copy_bandwidth(max(row_bytes, 64 << 20))
    baseline = {"forward": statistics.median(results["torch F.cross_entropy  forward"][0]),
                "fwd+bwd": statistics.median(results["torch F.cross_entropy  fwd+bwd"][0])}

    print(f"cegen host benchmark: N={n} V={v} {args.dtype}; torch {torch.__version__} with "
          f"{torch.get_num_threads()} thread(s); runtime {cegen.get_runtime().path}")
    print(f"host copy bandwidth (torch copy_, read+write): {bandwidth / 1e9:.1f} GB/s; "
          f"floor = minimum bytes / that bandwidth; {args.iters} timed iterations after "
          f"{args.warmup} warm-up")
    header = (f"{'variant':32} {'median ms':>10} {'best ms':>9} {'min bytes':>10} {'GB/s':>7} "
              f"{'floor ms':>9} {'x floor':>8} {'vs torch':>9}")
    print(header)
    print("-" * len(header))
    for name, (times, nbytes) in results.items():
        median, best = statistics.median(times), min(times)
        floor = nbytes / bandwidth
        kind = "forward" if name.endswith("forward") else "fwd+bwd"
        print(f"{name:32} {median * 1e3:10.2f} {best * 1e3:9.2f} {nbytes / 1e6:8.0f}MB "
              f"{nbytes / median / 1e9:7.2f} {floor * 1e3:9.2f} {median / floor:8.2f} "
              f"{baseline[kind] / median:8.2f}x")
    print("min bytes: forward N*V*b read; fwd+bwd 3*N*V*b (forward read, backward read+write); "
          "fused 2*N*V*b. 'vs torch' = PyTorch's median time / this median (>1: cegen faster).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
