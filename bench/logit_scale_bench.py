"""The logit scale's cost through cegen.cross_entropy beside flash-attention's ``logit_scale``
path (issue 17): forward and forward + backward, with and without a scale, both libraries in one
process, per shape; the bandwidth floor (one read forward, read + write + read for forward and
backward), and each scaled path's loss on a few rows against float64 of ``z = s x``.

Timing: CUDA events around one call, the median of ``--reps`` after three warm-up calls (each
call's inputs made outside the timed region). flash-attention's Triton ``cross_entropy_loss``
comes from ``--peers DIR`` (bench/peers.py: fetched for the run, never committed).

Usage (GPU machine, with the device runtime and sm_90 bundles holding the flat bf16 forward,
backward and fused kernels):
    python3 bench/logit_scale_bench.py --runtime .dev/lib/libce_runtime.so --bundle DIR \\
        --peers .dev/peers --plot PNG
On the host (a dry run of cegen's side only): --device cpu --shapes 64x1000 --reps 3.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

DEFAULT_SHAPES = "8192x128256,16384x32000,4096x151936,8192x50304,32768x128256"
SCALE = 0.5  # flash-attention's tests use 0.9 and 1.2; any value other than 1 takes the path
HBM_BYTES_PER_S = 4.8e12  # the H200's peak, as docs/PERFORMANCE.md's floors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", default=None)
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--peers", default=None, help="directory with flash-attention's source")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--plot", default=None, help="PNG: achieved bandwidth per shape")
    args = parser.parse_args()

    import torch

    import cegen
    import kernel_loops
    import peers

    if args.runtime:
        cegen.set_runtime_library(args.runtime)
    cegen.configure(bundle_dirs=[args.bundle], run_ce_gen=False)
    cuda = args.device == "cuda"
    dev = torch.device(args.device)
    flash = None
    if args.peers:
        modules, status = peers.load(torch, args.peers, cuda)
        print(peers.status_line(peers.FLASH, status[peers.FLASH]))
        flash = modules.get(peers.FLASH)
    print(f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; device "
          f"{torch.cuda.get_device_name() if cuda else 'cpu'}; torch {torch.__version__}; "
          f"logit scale {SCALE}; median of {args.reps}")

    def timed(step, setup) -> float:
        return kernel_loops.single_calls(torch, step, setup, args.reps, cuda)

    def cegen_loss(x: Any, labels: Any, scale: float) -> Any:
        return cegen.cross_entropy(x, labels, logit_scale=scale)

    def flash_loss(x: Any, labels: Any, scale: float) -> Any:
        return flash.cross_entropy_loss(x, labels, logit_scale=scale)[0]

    libraries: Dict[str, Callable[[Any, Any, float], Any]] = {"cegen": cegen_loss}
    if flash is not None:
        libraries["flash_ce"] = flash_loss
    failures = 0
    results: List[Dict[str, Any]] = []
    print("| shape | path | library | plain ms | scaled ms | scaled / plain | scaled % of floor |")
    print("|---|---|---|---:|---:|---:|---:|")
    for text in args.shapes.split(","):
        n, v = (int(part) for part in text.split("x"))
        gen = torch.Generator(device="cpu").manual_seed(n + v)
        base = (torch.randn((n, v), generator=gen) * 4).to(torch.bfloat16).to(dev)
        labels = torch.randint(0, v, (n,), generator=gen).to(dev)
        upstream = torch.rand((n,), generator=gen).to(dev)
        floors = {"forward": n * v * 2 / HBM_BYTES_PER_S * 1e3,
                  "fwd+bwd": 3 * n * v * 2 / HBM_BYTES_PER_S * 1e3}
        for library, loss_of in libraries.items():
            for path in ("forward", "fwd+bwd"):
                times = {}
                for scale in (1.0, SCALE):
                    if path == "forward":
                        def step(_: Any, scale: float = scale) -> None:
                            with torch.no_grad():
                                loss_of(base, labels, scale)
                        times[scale] = timed(step, lambda: None)
                    else:
                        def step(x: Any, scale: float = scale) -> None:
                            torch.autograd.grad(loss_of(x, labels, scale), x, upstream)
                        times[scale] = timed(step, lambda: base.detach().requires_grad_(True))
                plain, scaled = times[1.0], times[SCALE]
                percent = 100 * floors[path] / scaled
                results.append({"shape": text, "path": path, "library": library,
                                "plain": plain, "scaled": scaled, "percent": percent})
                print(f"| {text} | {path} | {library} | {plain:.3f} | {scaled:.3f} | "
                      f"{scaled / plain:.3f} | {percent:.0f} % |", flush=True)
            # The scaled loss on the first rows against float64.
            rows = min(n, 64)
            with torch.no_grad():
                loss = loss_of(base[:rows].contiguous(), labels[:rows], SCALE).double().cpu()
            z = base[:rows].double().cpu() * SCALE
            ref = torch.logsumexp(z, 1) - z.gather(1, labels[:rows].cpu()[:, None])[:, 0]
            error = (loss - ref).abs().max().item()
            ok = error <= 1e-5 * max(1.0, ref.abs().max().item())
            failures += library == "cegen" and not ok
            print(f"|  | loss vs float64 | {library} | max abs error {error:.3g} | "
                  f"{'ok' if ok else 'over 1e-5'} | | |")
        base = None  # released before the next shape's
        if cuda:
            torch.cuda.empty_cache()
    print(f"{failures} cegen numerics failures")
    if args.plot:
        draw(results, args.plot, torch.cuda.get_device_name() if cuda else "cpu")
    return 1 if failures else 0


def draw(results: List[Dict[str, Any]], path: str, device: str) -> Optional[str]:
    """Achieved bandwidth (% of the floor) of the scaled paths per shape, cegen beside flash_ce."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as error:  # noqa: BLE001  (the table is the result; the plot optional)
        print(f"no plot: matplotlib unavailable ({error})")
        return None
    shapes = list(dict.fromkeys(r["shape"] for r in results))
    series = list(dict.fromkeys((r["library"], r["path"]) for r in results))
    figure, axes = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(series)
    for k, (library, kind) in enumerate(series):
        values = [next((r["percent"] for r in results if r["shape"] == s and
                        r["library"] == library and r["path"] == kind), 0) for s in shapes]
        axes.bar([i + k * width for i in range(len(shapes))], values, width,
                 label=f"{library} {kind}, logit_scale={SCALE}")
    axes.axhline(100, color="black", linestyle="--", label="floor (HBM peak)")
    axes.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))])
    axes.set_xticklabels(shapes, fontsize=8)
    axes.set_ylabel("% of the bandwidth floor")
    axes.set_title(f"cross entropy with a logit scale, bf16 ({device})")
    axes.legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    sys.exit(main())
