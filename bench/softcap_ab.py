"""Kernel-level cost of the logit softcap (issue 17) across ce-gen builds: for each bundle given,
the softcap forward, backward and fused kernels against the plain ones of the first bundle, on
the same inputs, side by side per shape, with the one-read floor.

Meant for comparing ce-gens that differ only in how the softcap is built (for instance the share
of reciprocals built from FMAs, TargetInfo::getSoftcapFmaReciprocalEighths): every bundle's
softcap kernels and the plain kernels are timed in one process, their loops interleaved (A B C
A B C ...) after 1.5 s of warm-up so that each sees the same clocks (the H200's power cap moves
them; docs/PERFORMANCE.md, "Clocks"). Each time is per call: 20 back-to-back calls of cegen's
kernel entry (``cegen._kernels``) between two CUDA events, the median of 7 such loops. The
backward and fused kernels write a separate gradient (overwrite=0), so the inputs stay the same
logits; bench/softcap_bench.py times the public API with overwrite.

After the timings each bundle's softcap forward and backward on the first 64 rows of each shape
are checked against float64 of ``z = cap tanh(s x / cap)``: loss within 1e-5 relative plus
``cap 2^-21``, gradient within a bf16 ulp of the row's largest.

Prints a markdown table; with --plot PATH also draws the ratios (matplotlib, where available).

Usage (GPU machine; bundles of ce-gen --target=sm_90 --op=forward,backward,fused --logits=bf16
--layout=flat --overwrite=0 --softcap=off,on -o DIR):
    python3 bench/softcap_ab.py --runtime .dev/lib/libce_runtime.so --bundles A B C
On the host (a dry run of the harness): --device cpu --shapes 64x1000 with host bundles.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import kernel_loops  # noqa: E402  (bench/, the script's own folder)

DEFAULT_SHAPES = "8192x128256,16384x32000,4096x151936,8192x50304,32768x128256"
HBM_BYTES_PER_S = 4.8e12  # the H200's peak, as docs/PERFORMANCE.md's floors
CAP, SCALE = 30.0, 1.0
PATHS = ("forward", "backward", "fused")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", default=None)
    parser.add_argument("--bundles", nargs="+", required=True, help="bundles to compare")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--plot", default=None, help="PNG of the ratios per shape and path")
    args = parser.parse_args()

    import torch

    import cegen
    from cegen import _kernels

    if args.runtime:
        cegen.set_runtime_library(args.runtime)
    cegen.configure(bundle_dirs=[], run_ce_gen=False)
    cuda = args.device == "cuda"
    dev = torch.device(args.device)

    def timed(fns) -> list:
        return kernel_loops.timed(torch, fns, cuda)

    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; device {name}; torch "
          f"{torch.__version__}; cap {CAP:g}, scale {SCALE:g}; ms per call (20 back-to-back "
          f"calls, median of 7, after 1.5 s of warm-up, all kernels' loops interleaved)")
    header = ["shape", "path", "floor ms", "plain ms"]
    for bundle in args.bundles:
        header += [f"{bundle} ms", "ratio"]
    print("| " + " | ".join(header) + " |")
    print("|---|---|" + "---:|" * (len(header) - 2))
    plain_options = _kernels.KernelOptions(bundle=args.bundles[0], logit_scale=SCALE)
    capped = [_kernels.KernelOptions(bundle=b, logit_scale=SCALE, logit_softcap=CAP)
              for b in args.bundles]
    ratios = {(b, p): [] for b in args.bundles for p in PATHS}
    failures = 0
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    for tokens, vocab in shapes:
        torch.manual_seed(tokens + vocab)
        x = (torch.randn(tokens, vocab, device=dev) * 4).to(torch.bfloat16)
        y = torch.randint(0, vocab, (tokens,), device=dev)
        g = torch.rand((tokens,), device=dev)
        w = torch.full((tokens,), 1.0 / tokens, device=dev)
        lse = {}
        for options in [plain_options] + capped:
            _, lse[id(options)], low = _kernels.forward(x, y, options, low=True)
            lse[id(options)] = (lse[id(options)], low)

        def step(path, options):
            if path == "forward":
                return lambda: _kernels.forward(x, y, options, low=True)
            if path == "backward":
                stats, low = lse[id(options)]
                return lambda: _kernels.backward(x, y, stats, g, options, overwrite=False,
                                                 lse_low=low)
            return lambda: _kernels.fused(x, y, w, options, overwrite=False, low=True)

        floors = {"forward": 1, "backward": 2, "fused": 2}  # reads/writes of the logits
        for path in PATHS:
            times = timed([step(path, o) for o in [plain_options] + capped])
            floor = tokens * vocab * 2 * floors[path] / HBM_BYTES_PER_S * 1e3
            cells = [f"{tokens}x{vocab}", path, f"{floor:.3f}", f"{times[0]:.3f}"]
            for bundle, ms in zip(args.bundles, times[1:]):
                ratios[(bundle, path)].append(ms / times[0])
                cells += [f"{ms:.3f}", f"**{ms / times[0]:.3f}**"]
            print("| " + " | ".join(cells) + " |", flush=True)
        failures += check(torch, _kernels, x, y, capped, args.bundles)
        del x
        if cuda:
            torch.cuda.empty_cache()
    print(f"{failures} numerics failures")
    if args.plot:
        draw(ratios, args.bundles, [f"{t}x{v}" for t, v in shapes], args.plot, name)
    return 1 if failures else 0


def check(torch, kernels, x, y, capped, bundles) -> int:
    """Each bundle's softcap forward and backward on the first rows against float64."""
    rows = min(x.shape[0], 64)
    xs, ys = x[:rows].contiguous(), y[:rows].contiguous()
    gen = torch.Generator(device="cpu").manual_seed(rows)
    g = torch.rand((rows,), generator=gen).to(x.device)
    xd = xs.double().cpu().requires_grad_(True)
    z = CAP * torch.tanh(SCALE * xd / CAP)
    ref = torch.logsumexp(z, 1) - z.gather(1, ys.cpu()[:, None])[:, 0]
    ref.backward(g.double().cpu())
    failures = 0
    for bundle, options in zip(bundles, capped):
        loss, lse, low = kernels.forward(xs, ys, options, low=True)
        grad = kernels.backward(xs, ys, lse, g, options, overwrite=False, lse_low=low)
        loss_err = (loss.double().cpu() - ref.detach()).abs().max().item()
        grad_err = (grad.double().cpu() - xd.grad).abs().max().item()
        grad_ulp = xd.grad.abs().max().item() * 2.0 ** -8
        ok = (loss_err <= 1e-5 * max(1.0, ref.abs().max().item()) + CAP * 2.0 ** -21
              and grad_err <= grad_ulp)
        failures += not ok
        print(f"  {bundle} {x.shape[0]}x{x.shape[1]}: max |loss err| {loss_err:.3g}, max |grad "
              f"err| {grad_err:.3g} (bf16 ulp of the largest {grad_ulp:.3g}) "
              f"{'ok' if ok else 'FAIL'}", flush=True)
    return failures


def draw(ratios, bundles, shapes, path: str, device: str) -> None:
    """Bars of softcap / plain time per shape, one group per path, one bar per bundle."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as error:  # noqa: BLE001  (the table is the result; the plot optional)
        print(f"no plot: matplotlib unavailable ({error})")
        return
    figure, panels = plt.subplots(1, len(PATHS), figsize=(13, 4), sharey=True)
    width = 0.8 / len(bundles)
    for axes, name in zip(panels, PATHS):
        for k, bundle in enumerate(bundles):
            axes.bar([i + k * width for i in range(len(shapes))], ratios[(bundle, name)], width,
                     label=Path(bundle).name)
        axes.axhline(1.05, color="red", linestyle="--", label="target 1.05")
        axes.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))])
        axes.set_xticklabels(shapes, fontsize=7, rotation=20)
        axes.set_title(name)
    panels[0].set_ylabel(f"softcap {CAP:g} / plain kernel time")
    handles, labels = panels[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="center right", fontsize=7)
    figure.suptitle(f"softcap kernels per ce-gen build ({device})")
    figure.tight_layout(rect=(0, 0, 0.9, 1))
    figure.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
