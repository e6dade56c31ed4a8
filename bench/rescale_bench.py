#!/usr/bin/env python3
"""The fused gradient's correction (``ce_rescale``) on a GPU: float64 checks, then its time
against the floor and against the PyTorch operations it replaced, in one process.

A program, not a test. On a CUDA machine, from the repository root, with a runtime library
and sm_90 bundles made where ce-gen is (test/gpu/prepare_api_run.sh puts the rescale
kernels in .dev/api/bundles/api)::

    python3 bench/rescale_bench.py --runtime .dev/lib/libce_runtime.so \\
        --bundle .dev/api/bundles/api .dev/api/bundles/rescale --out $OUT/rescale

(``.dev/api/bundles/rescale`` holds every dtype and layout; a kernel no bundle has is
reported as not checked).

Checks (every logits dtype the bundle has, flat ``[N, V]`` and Megatron's ``[S, B, V]`` with
``[B, S]`` per-token values, strided and stride-0 upstream gradients, 0-d weights): each
token's pair ``(g, w)`` is drawn from the contract's cases (equal, different, ``g = 0``,
``w = 0`` with ``g != 0`` on a zero row, NaN ``g``, ``-0`` against ``+0``); rows with
``g == w`` must be bitwise unchanged, others within one ulp of the dtype (plus the f32
ratio's rounding) of the float64 product, NaN where the contract says so.

Timings (bf16, the benchmark shapes, gpu_bench's method: L2 flushed, GPU sleep, CUDA
events, median and p10-p90) per shape, flat and ``[S, B, V]``:

* ``kernel, g == w``: every row skipped (what a right prediction costs: a read of 2N floats
  and the launch); floor: one launch (reported in microseconds);
* ``kernel, 10 % differ`` and ``kernel, all differ``: rows read and written once; floor:
  the differing rows' bytes read and written at the copy bandwidth;
* ``torch ops`` (cegen._rescale's fallback, what ran before the kernel): any ``g``.

Writes OUT/results.json, OUT/table.md and OUT/rescale.png (achieved bandwidth of the
all-differ row against the copy floor, kernel beside the PyTorch operations, per shape).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "bench"))

import gpu_bench as gb  # noqa: E402

SHAPES = "8192x128256,16384x32000,4096x151936,8192x50304,32768x128256"


def ulp(torch: Any, dtype: Any, values: Any) -> Any:
    """One unit in the last place of ``dtype`` at ``values`` (float64)."""
    mantissa = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[dtype]
    tiny = {torch.bfloat16: 2.0 ** -133, torch.float16: 2.0 ** -24, torch.float32: 2.0 ** -149}
    exponent = torch.floor(torch.log2(values.abs().clamp_min(1e-300)))
    return torch.maximum(torch.pow(2.0, exponent - mantissa), torch.tensor(tiny[dtype],
                                                                            dtype=torch.float64))


def check(torch: Any, rescale: Any, dtype: Any, shape: List[int], layout: str,
          scalar_weight: bool, broadcast_g: bool, seed: int, device: str = "cuda") -> Dict[str, Any]:
    """One float64 check of ``rescale(grad, w, g, layout)`` on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    dev = torch.device(device)
    rows_shape = shape[:-1]
    tokens = rows_shape if len(shape) == 2 or layout == "sb" else [shape[1], shape[0]]
    n = math.prod(tokens)
    kind = torch.randint(0, 6, (n,), generator=gen)
    kind[0] = 1
    w = torch.rand(n, generator=gen, dtype=torch.float64) * 1.75 + 0.25
    g = torch.rand(n, generator=gen, dtype=torch.float64) * 1.75 + 0.25
    if scalar_weight:
        w[:] = w[0]
    if scalar_weight or broadcast_g:
        kind = torch.where(kind < 2, 0, 1)
        kind[0] = 1
    g = torch.where(kind == 0, w, g)
    g = torch.where(kind == 2, 0.0, g)
    w = torch.where(kind == 3, 0.0, w)
    g = torch.where(kind == 4, float("nan"), g)
    g = torch.where(kind == 5, 0.0, g)
    w = torch.where(kind == 5, -0.0, w)
    if broadcast_g:
        g[:] = g[0]
        kind = torch.where(g.float() == w.float(), 0, 1)
    g32, w32 = g.float(), w.float()
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 1.5
    token_of_row = torch.arange(n).view(tokens)
    if len(shape) == 3 and layout == "bs":
        token_of_row = token_of_row.t()  # [B, S] -> [S, B]
    token_of_row = token_of_row.reshape(-1)
    zero_rows = (kind == 3)[token_of_row].view(rows_shape + [1])
    x = torch.where(zero_rows, 0.0, x)
    grad = x.to(dtype).to(dev)
    before = grad.clone()
    g_dev = g32.view(tokens).to(dev)
    if broadcast_g:
        g_dev = g32[:1].to(dev).expand(tokens)
    else:  # a strided view
        g_dev = torch.empty(tokens + [2], device=dev)[..., 0]
        g_dev.copy_(g32.view(tokens))
    w_dev = w32[:1].view([]).to(dev) if scalar_weight else w32.view(tokens).to(dev)
    rescale(grad, w_dev, g_dev, layout)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    got = grad.double().cpu().view(n if len(shape) == 2 else -1, shape[-1])
    x_rows = before.double().cpu().view(got.shape)
    pair = kind[token_of_row]
    gt, wt = g32.double()[token_of_row], w32.double()[token_of_row]
    ratio32 = torch.where(gt == 0, 0.0, (gt.float() / wt.float()).double())
    ref = x_rows * (gt / wt).unsqueeze(1)
    ref = torch.where((gt == 0).unsqueeze(1), x_rows * 0.0, ref)
    tol = ulp(torch, dtype, ref) + ulp(torch, torch.float32, ref) * 4 + \
        (x_rows * (ratio32 - torch.where(gt == 0, 0.0, gt / wt)).unsqueeze(1)).abs()
    same = (pair == 0) | (pair == 5)
    nan_rows = (pair == 3) | (pair == 4)
    bitwise = (grad.view(-1).view(torch.int16 if dtype != torch.float32 else torch.int32)
               .cpu().view(got.shape) ==
               before.view(-1).view(torch.int16 if dtype != torch.float32 else torch.int32)
               .cpu().view(got.shape))
    failures = 0
    failures += int((~bitwise[same]).sum())
    failures += int((~torch.isnan(got[nan_rows])).sum())
    scaled = ~(same | nan_rows)
    failures += int((~((got - ref).abs() <= tol))[scaled].sum())
    worst = float(((got - ref).abs() / tol.clamp_min(1e-300))[scaled].max()) if scaled.any() else 0.0
    return {"checks": got.numel(), "failures": failures, "worst_error_over_tolerance": worst}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime", required=True)
    parser.add_argument("--bundle", required=True, nargs="+",
                        help="bundle directories (searched in order)")
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 0
    import cegen
    from cegen import _rescale
    cegen.set_runtime_library(args.runtime)
    cegen.configure(bundle_dirs=list(args.bundle), run_ce_gen=False)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    results: Dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "checks": [], "timings": []}

    def kernel_only(grad, w, g, layout):  # type: ignore[no-untyped-def]
        if not _rescale._rescale_with_kernel(grad, w, g, layout):
            raise RuntimeError("no rescale kernel in the bundle")

    gb.log("checks against float64:")
    seed = 1000
    total_failures = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for shape, layout in (([37, 1031], "bs"), ([9, 4, 4099], "bs"), ([5, 6, 130], "sb"),
                              ([64, 7], "bs")):
            for scalar_weight, broadcast_g in ((False, False), (True, False), (False, True)):
                seed += 1
                if _rescale._rescale_kernel(torch.empty([1] * len(shape), dtype=dtype,
                                                        device="cuda"), layout) is None:
                    gb.log(f"  {str(dtype):15s} {str(shape):15s} {layout}: no kernel in the "
                           "bundles, not checked")
                    results["checks"].append({"dtype": str(dtype), "shape": shape,
                                              "layout": layout, "skipped": True})
                    break
                result = check(torch, kernel_only, dtype, shape, layout, scalar_weight,
                               broadcast_g, seed)
                result.update({"dtype": str(dtype), "shape": shape, "layout": layout,
                               "scalar_weight": scalar_weight, "broadcast_g": broadcast_g})
                total_failures += result["failures"]
                results["checks"].append(result)
                gb.log(f"  {str(dtype):15s} {str(shape):15s} {layout} scalar_w={scalar_weight:d} "
                       f"broadcast_g={broadcast_g:d}: {result['checks']} checks, "
                       f"{result['failures']} failures")

    dev = gb.Dev(torch, "cuda")
    ceil = gb.ceilings(torch, dev, 4 << 30)
    results["copy_Bps"] = ceil["copy_Bps"]
    gb.log(f"copy bandwidth {ceil['copy_Bps'] / 1e12:.2f} TB/s")
    rows = []
    for n, v in gb.parse_shapes(args.shapes):
        for layout_name, shape in (("flat", [n, v]), ("sbv_bs", [n // 2, 2, v])):
            grad = torch.randn(shape, device=dev.device, dtype=torch.bfloat16)
            tokens = [n] if layout_name == "flat" else [2, n // 2]
            w = torch.rand(tokens, device=dev.device) + 0.5
            equal = w.clone()
            all_differ = w * 1.25
            some = w.clone()
            some.view(-1)[::10] *= 1.25
            cases = [
                ("kernel, g == w", lambda g=equal: kernel_only(grad, w, g, "bs"), 0.0),
                ("kernel, 10% differ", lambda g=some: kernel_only(grad, w, g, "bs"), 0.1),
                ("kernel, all differ", lambda g=all_differ: kernel_only(grad, w, g, "bs"), 1.0),
                ("torch ops", lambda g=all_differ: _rescale._rescale_with_torch(grad, w, g, "bs"),
                 1.0),
            ]
            for name, step, fraction in cases:
                timing = gb.time_step(dev, step, None, args.reps)
                floor_ms = fraction * 2 * grad.numel() * 2 / ceil["copy_Bps"] * 1e3
                row = {"shape": f"{n}x{v}", "layout": layout_name, "variant": name,
                       "floor_ms": floor_ms, **timing}
                rows.append(row)
                pct = f"{100 * floor_ms / timing['ms']:5.1f}% of floor" if floor_ms else \
                    f"{1e3 * timing['ms']:7.1f} us"
                gb.log(f"{n}x{v} {layout_name:6s} {name:20s} {timing['ms']:8.3f} ms "
                       f"({timing['p10_ms']:.3f}-{timing['p90_ms']:.3f})  {pct}")
            del grad
    results["timings"] = rows
    results["failures"] = total_failures
    checked = [c for c in results["checks"] if not c.get("skipped")]
    if not checked:
        gb.log("FAIL: no rescale kernel was checked")
        total_failures += 1
    if out:
        (out / "results.json").write_text(json.dumps(results, indent=1))
        lines = [f"# ce_rescale, {results['date']}, {results['device']}", "",
                 f"command: `{results['command']}`", "",
                 f"float64 checks: {sum(c['checks'] for c in checked)} values, "
                 f"{total_failures} failures", "",
                 f"copy bandwidth {ceil['copy_Bps'] / 1e12:.2f} TB/s", "",
                 "| shape N×V | layout | variant | ms | p10-p90 ms | % of floor |",
                 "|---|---|---|---:|---:|---:|"]
        for r in rows:
            pct = f"{100 * r['floor_ms'] / r['ms']:.0f}" if r["floor_ms"] else "-"
            lines.append(f"| {r['shape']} | {r['layout']} | {r['variant']} | {r['ms']:.3f} | "
                         f"{r['p10_ms']:.3f}-{r['p90_ms']:.3f} | {pct} |")
        (out / "table.md").write_text("\n".join(lines) + "\n")
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            fig, ax = plt.subplots(figsize=(9, 4))
            labels = sorted({(r["shape"], r["layout"]) for r in rows}, key=lambda s: (s[0], s[1]))
            xs = range(len(labels))
            for offset, variant in ((-0.2, "kernel, all differ"), (0.2, "torch ops")):
                values = [next(r for r in rows if (r["shape"], r["layout"]) == lab
                               and r["variant"] == variant) for lab in labels]
                ax.bar([x + offset for x in xs],
                       [2 * 2 * int(r["shape"].split("x")[0]) * int(r["shape"].split("x")[1])
                        / (r["ms"] * 1e-3) / 1e12 for r in values], width=0.4, label=variant)
            ax.axhline(ceil["copy_Bps"] / 1e12, color="k", linestyle="--", label="copy floor")
            ax.set_xticks(list(xs))
            ax.set_xticklabels([f"{s}\n{lay}" for s, lay in labels], fontsize=7)
            ax.set_ylabel("TB/s (gradient read + written)")
            ax.set_title(f"ce_rescale vs PyTorch ops, every row rescaled ({results['device']})")
            ax.legend()
            fig.tight_layout()
            fig.savefig(out / "rescale.png", dpi=120)
        except ImportError:
            gb.log("matplotlib missing: no plot")
    gb.log(f"float64 checks: {total_failures} failures")
    return 1 if total_failures else 0


if __name__ == "__main__":
    sys.exit(main())
