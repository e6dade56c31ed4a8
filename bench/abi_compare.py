#!/usr/bin/env python3
"""Kernels of bundle format version 3 (option values as arguments) against version 2 (values
compiled in), side by side in one process on the H200: issue 15's 1 % bound.

A program, not a test. Both runtimes are loaded at once (each ``libce_runtime.so`` through
its own ctypes handle: the version 2 library reads only version 2 bundles, the version 3
library only version 3 ones), on the same inputs, and every row is timed alternately: old,
new, old, new, ... ``--rounds`` times, each a median of ``gpu_bench.time_step`` (L2 flush,
GPU sleep, CUDA events), so that clock drift between the two halves cancels. The variants
are gpu_bench's ``fwd``, ``fwd+bwd_ow`` and ``fused_ow`` on bf16 logits, int64 labels,
``ignore_index=-100``, no smoothing, no z-loss (the version 2 bench bundle of
docs/PERFORMANCE.md, made before version 3 by ``ce-gen --target=sm_90
--op=forward,backward,fused --logits=bf16 --labels=i64 --layout=flat --ignore-index=-100
--label-smoothing=0 --z-loss=0 --overwrite=0,1 --weights=token``), and again with label
smoothing 0.1 and z-loss 1e-4 on the version 3 "on" kernels against the version 2 kernels
compiled for those values, when ``--old-options-bundle`` is given. Run from the repository
root::

    python3 bench/abi_compare.py --old-runtime OLD/libce_runtime.so --old-bundle OLD/bundle \\
        --new-runtime .dev/lib/libce_runtime.so --new-bundle NEW/bundle --out $OUT

Prints a table (ms old, ms new, new/old) and writes OUT/abi_compare.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "bench"))

import gpu_bench  # noqa: E402  (Dev, time_step, Problem, KernelSet, Ours)

VARIANTS = ("fwd", "fwd+bwd_ow", "fused_ow")
#: The kernel roles those variants use (gpu_bench.KernelSet.ROLES).
NEEDED_ROLES = ("forward", "backward1", "fused1")


def old_keys(smoothing: str, z_loss: str) -> Dict[str, str]:
    """The version 2 keys of gpu_bench's roles (values compiled in)."""
    def key(op: str, overwrite: int = 0, weights: str = "none") -> str:
        return (f"op={op},logits=bf16,labels=i64,layout=flat,ignore_index=-100,"
                f"label_smoothing={smoothing},z_loss={z_loss},overwrite={overwrite},"
                f"weights={weights}")
    return {"forward": key("forward"), "backward0": key("backward"),
            "backward1": key("backward", 1), "fused0": key("fused", 0, "token"),
            "fused1": key("fused", 1, "token")}


def new_keys(smoothing: bool, z_loss: bool) -> Dict[str, str]:
    """The version 3 keys of the same roles (values are arguments)."""
    from cegen import VariantKey

    def key(op: str, overwrite: bool = False, weights: str = "none") -> str:
        return str(VariantKey(op=op, logits="bf16", labels="i64", layout="flat",
                              label_smoothing=smoothing, z_loss=z_loss, overwrite=overwrite,
                              weights=weights))
    return {"forward": key("forward"), "backward0": key("backward"),
            "backward1": key("backward", True), "fused0": key("fused", False, "token"),
            "fused1": key("fused", True, "token")}


def make_ours(torch: Any, rt: Any, bundle_dir: str, keys: Dict[str, str], prob: Any,
              dev: Any, smoothing: float, z_loss: float) -> Any:
    bundle = rt.open_bundle(Path(bundle_dir).resolve())
    missing = [keys[role] for role in NEEDED_ROLES if not bundle.has(keys[role], "sm_90")]
    if missing:
        raise RuntimeError(f"bundle {bundle_dir} lacks sm_90 kernels: {missing}")
    name = Path(bundle_dir).name
    kset = gpu_bench.KernelSet(name, {role: (bundle, name) for role in gpu_bench.KernelSet.ROLES},
                               keys)
    ours = gpu_bench.Ours(None, rt, kset, prob, dev, -100)
    for options in ours.opts.values():
        options.label_smoothing = smoothing
        options.z_loss = z_loss
    return ours


def compare(torch: Any, dev: Any, pair: List[Any], prob: Any, rounds: int) -> Dict[str, Any]:
    """Alternating medians of each variant for the (old, new) pair."""
    rows = {}
    steps = [ours.steps() for ours in pair]
    for variant in VARIANTS:
        times: List[List[float]] = [[], []]
        for _ in range(rounds):
            for side in (0, 1):
                step, setup = steps[side][variant]
                times[side].append(gpu_bench.time_step(dev, step, setup, None)["ms"])
        old_ms, new_ms = statistics.median(times[0]), statistics.median(times[1])
        rows[variant] = {"old_ms": old_ms, "new_ms": new_ms, "ratio": new_ms / old_ms,
                         "old_all": times[0], "new_all": times[1]}
    return rows


def check_same(torch: Any, pair: List[Any], prob: Any) -> Dict[str, float]:
    """The two kernels' losses and fused gradients (written over the logits) on the same
    inputs: the largest absolute difference."""
    losses, grads = [], []
    for ours in pair:
        prob.restore()
        loss, _ = ours.forward()
        _, _, grad = ours.fused(True)
        torch.cuda.synchronize()
        losses.append(loss.clone())
        grads.append(grad.float().clone())
    prob.restore()
    return {"loss_max_abs": float((losses[0] - losses[1]).abs().max()),
            "grad_max_abs": float((grads[0] - grads[1]).abs().max())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old-runtime", required=True)
    parser.add_argument("--old-bundle", required=True)
    parser.add_argument("--old-options-bundle", default=None,
                        help="version 2 bundle with label_smoothing=0.1, z_loss=0.0001 kernels")
    parser.add_argument("--new-runtime", required=True)
    parser.add_argument("--new-bundle", required=True)
    parser.add_argument("--shapes", default=gpu_bench.DEFAULT_SHAPES)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch
    from cegen import _runtime

    dev = gpu_bench.Dev(torch, "cuda")
    old_rt = _runtime.Runtime(Path(args.old_runtime))
    new_rt = _runtime.Runtime(Path(args.new_runtime))
    configs = [("plain", args.old_bundle, old_keys("0", "0"), new_keys(False, False), 0.0, 0.0)]
    if args.old_options_bundle:
        configs.append(("smoothing 0.1, z 1e-4", args.old_options_bundle,
                        old_keys("0.100000001", "9.99999975e-05"), new_keys(True, True),
                        0.1, 1e-4))
    results: Dict[str, Any] = {"device": torch.cuda.get_device_name(),
                               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "rounds": args.rounds, "rows": []}
    print(f"{'options':<22} {'shape':<14} {'variant':<11} {'old ms':>8} {'new ms':>8} "
          f"{'new/old':>8}", flush=True)
    for name, old_bundle, okeys, nkeys, smoothing, z_loss in configs:
        for n, v in gpu_bench.parse_shapes(args.shapes):
            prob = gpu_bench.Problem(torch, dev, n, v, seed=n * 7 + v)
            pair = [make_ours(torch, old_rt, old_bundle, okeys, prob, dev, smoothing, z_loss),
                    make_ours(torch, new_rt, args.new_bundle, nkeys, prob, dev, smoothing,
                              z_loss)]
            same = check_same(torch, pair, prob)
            rows = compare(torch, dev, pair, prob, args.rounds)
            for variant, row in rows.items():
                print(f"{name:<22} {n}x{v:<9} {variant:<11} {row['old_ms']:8.3f} "
                      f"{row['new_ms']:8.3f} {row['ratio']:8.4f}", flush=True)
                results["rows"].append({"options": name, "n": n, "v": v, "variant": variant,
                                        **row, **same})
            del pair, prob
            torch.cuda.empty_cache()
    worst = max(row["ratio"] for row in results["rows"])
    results["worst_ratio"] = worst
    print(f"worst new/old: {worst:.4f} (bound 1.01)")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "abi_compare.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
