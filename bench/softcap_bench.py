"""The logit softcap's cost and numerics through cegen.cross_entropy (issue 17): forward,
backward and fused (overwrite) with and without ``logit_softcap``, side by side per shape,
timed with CUDA events (median of ``--reps`` after warm-up), and each softcap path's loss
and gradient on a few rows against float64 of ``z = cap tanh(s x / cap)``.

Usage (GPU machine, with the device runtime and sm_90 bundles that hold the plain and
softcap bf16 flat kernels):
    python3 bench/softcap_bench.py --runtime .dev/lib/libce_runtime.so --bundle DIR
On the host (a dry run): --device cpu --shapes 64x1000 --reps 3.
With --plot PATH it also draws the ratios (softcap time over plain time per shape and path,
against issue 17's 1.05) as a PNG (matplotlib, where available).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import kernel_loops  # noqa: E402  (bench/, the script's own folder)

DEFAULT_SHAPES = "8192x128256,16384x32000,4096x151936,8192x50304,32768x128256"
CAP, SCALE = 30.0, 1.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", default=None)
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--plot", default=None, help="PNG of the ratios per shape and path")
    args = parser.parse_args()

    import torch

    import cegen

    if args.runtime:
        cegen.set_runtime_library(args.runtime)
    cegen.configure(bundle_dirs=[args.bundle], run_ce_gen=False)
    cuda = args.device == "cuda"
    dev = torch.device(args.device)
    print(f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; device "
          f"{torch.cuda.get_device_name() if cuda else 'cpu'}; torch {torch.__version__}; "
          f"cap {CAP}, scale {SCALE}; median of {args.reps}")

    def timed(step, setup) -> float:
        return kernel_loops.single_calls(torch, step, setup, args.reps, cuda)

    failures = 0
    ratios = {"forward": [], "backward": [], "fused": []}
    print(f"{'shape':>14} {'path':>9} {'plain ms':>9} {'softcap ms':>10} {'ratio':>6}")
    for text in args.shapes.split(","):
        n, v = (int(part) for part in text.split("x"))
        gen = torch.Generator(device="cpu").manual_seed(n + v)
        base = (torch.randn((n, v), generator=gen) * 4).to(torch.bfloat16).to(dev)
        labels = torch.randint(0, v, (n,), generator=gen).to(dev)
        ones = torch.ones((n,), device=dev)
        caps = {"plain": None, "softcap": CAP}

        def forward(cap):
            return lambda _: cegen.cross_entropy(base, labels, logit_scale=SCALE,
                                                 logit_softcap=cap)

        def fused(cap):
            def setup():
                return base.clone().requires_grad_(True)

            def step(x):
                loss = cegen.cross_entropy(x * 1, labels, logit_scale=SCALE, logit_softcap=cap,
                                           grad_weights=1.0)
                loss.backward(ones)
            return step, setup

        def backward(cap):
            # forward + backward minus the forward: the backward kernel's share.
            def setup():
                x = base.clone().requires_grad_(True)
                return x, cegen.cross_entropy(x, labels, logit_scale=SCALE, logit_softcap=cap)

            return lambda state: state[1].backward(ones), setup

        times = {}
        for name, cap in caps.items():
            times[("forward", name)] = timed(forward(cap), lambda: None)
            times[("backward", name)] = timed(*backward(cap))
            times[("fused", name)] = timed(*fused(cap))
        for path in ("forward", "backward", "fused"):
            plain, capped = times[(path, "plain")], times[(path, "softcap")]
            ratios[path].append(capped / plain)
            print(f"{text:>14} {path:>9} {plain:9.3f} {capped:10.3f} {capped / plain:6.3f}")

        # Numerics of the softcap paths on the first rows, against float64.
        rows = min(n, 64)
        x = base[:rows].clone().requires_grad_(True)
        loss = cegen.cross_entropy(x, labels[:rows], logit_scale=SCALE, logit_softcap=CAP)
        g = torch.rand((rows,), generator=gen).to(dev)
        loss.backward(g)
        xd = base[:rows].double().cpu().requires_grad_(True)
        z = CAP * torch.tanh(SCALE * xd / CAP)
        ref = torch.logsumexp(z, 1) - z.gather(1, labels[:rows].cpu()[:, None])[:, 0]
        ref.backward(g.double().cpu())
        loss_err = (loss.double().cpu() - ref).abs().max().item()
        grad_err = (x.grad.double().cpu() - xd.grad).abs().max().item()
        grad_ulp = (xd.grad.abs().max().item() * 2.0 ** -8)
        ok = loss_err <= 1e-5 * max(1.0, ref.abs().max().item()) + CAP * 2.0 ** -21 \
            and grad_err <= grad_ulp
        failures += not ok
        print(f"{text:>14} numerics: max |loss err| {loss_err:.3g}, max |grad err| "
              f"{grad_err:.3g} (bf16 ulp of the row max {grad_ulp:.3g}) {'ok' if ok else 'FAIL'}")
    print(f"{failures} numerics failures")
    if args.plot:
        draw(ratios, args.shapes.split(","), args.plot,
             torch.cuda.get_device_name() if cuda else "cpu")
    return 1 if failures else 0


def draw(ratios, shapes, path: str, device: str) -> None:
    """Bars of softcap / plain time per shape, one per path, with the 1.05 target."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as error:  # noqa: BLE001  (the table is the result; the plot optional)
        print(f"no plot: matplotlib unavailable ({error})")
        return
    figure, axes = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(ratios)
    for k, (name, values) in enumerate(ratios.items()):
        axes.bar([i + k * width for i in range(len(shapes))], values, width, label=name)
    axes.axhline(1.05, color="red", linestyle="--", label="target 1.05")
    axes.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))])
    axes.set_xticklabels(shapes, fontsize=8)
    axes.set_ylabel(f"softcap {CAP:g} / plain time")
    axes.set_title(f"cegen.cross_entropy with logit_softcap ({device})")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
