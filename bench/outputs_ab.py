"""Kernel-level cost of the forward's lse/entropy/argmax outputs (issue 17): for each bundle given,
the forward kernel with and without the outputs on the same inputs, side by side per shape, against
the one-read floor; optionally the fused (overwrite) kernel of each --fused bundle.

Each time is per call: 20 back-to-back calls of cegen's kernel entry (``cegen._kernels.forward`` /
``fused``) between two CUDA events, the median of 7 such loops (the host enqueues faster than the
kernels run, so this is the kernels' time, not the API's; bench/api_bench.py times the public API),
after 1.5 s of warm-up, the loops with and without the outputs interleaved (an idle GPU's first
second of load runs at lower clocks).
Prints a markdown table; with --plot PATH also draws it (matplotlib, where available).

Usage (GPU machine; bundles with the flat bf16 forward kernel, e.g. ce-gen --target=sm_90 --op=forward
--logits=bf16 --labels=i64 --layout=flat --label-smoothing=off --z-loss=off --overwrite=0
--weights=token -o DIR):
    python3 bench/outputs_ab.py --runtime .dev/lib/libce_runtime.so --bundles A B [--fused F G]
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", default=None)
    parser.add_argument("--bundles", nargs="+", required=True, help="forward bundles to compare")
    parser.add_argument("--fused", nargs="*", default=[], help="fused (overwrite) bundles")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--plot", default=None, help="PNG of the forward's ratios per shape")
    parser.add_argument("--minus-inf", type=int, default=0, metavar="K",
                        help="K logits of every row set to -inf at random columns (a vocabulary "
                             "mask; the plain forward reads the same tensor)")
    args = parser.parse_args()

    import torch

    import cegen
    from cegen import _kernels

    if args.runtime:
        cegen.set_runtime_library(args.runtime)
    cegen.configure(bundle_dirs=[], run_ce_gen=False)
    cuda = args.device == "cuda"
    dev = torch.device(args.device)

    def timed(*fns) -> list:
        return kernel_loops.timed(torch, fns, cuda)

    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; device {name}; torch "
          f"{torch.__version__}; ms per call (20 back-to-back calls, median of 7, after 1.5 s "
          f"of warm-up, with and without the outputs interleaved)"
          + (f"; {args.minus_inf} logits of every row -inf" if args.minus_inf else ""))
    header = ["shape", "floor ms"]
    for bundle in args.bundles:
        header += [f"{bundle} fwd", f"{bundle} +outputs", "ratio"]
    header += [f"{bundle} fused_ow" for bundle in args.fused]
    print("| " + " | ".join(header) + " |")
    print("|---|" + "---:|" * (len(header) - 1))
    ratios = {bundle: [] for bundle in args.bundles}
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    for tokens, vocab in shapes:
        torch.manual_seed(tokens + vocab)
        x = torch.randn(tokens, vocab, device=dev, dtype=torch.bfloat16) * 2
        y = torch.randint(0, vocab, (tokens,), device=dev)
        if args.minus_inf:
            masked = torch.randint(0, vocab, (tokens, args.minus_inf), device=dev)
            masked = torch.where(masked == y[:, None], (masked + 1) % vocab, masked)
            x.scatter_(1, masked, float("-inf"))
        w = torch.full((tokens,), 1.0 / tokens, device=dev)
        cells = [f"{tokens}x{vocab}", f"{tokens * vocab * 2 / HBM_BYTES_PER_S * 1e3:.3f}"]
        for bundle in args.bundles:
            options = _kernels.KernelOptions(bundle=bundle)
            plain, outputs = timed(
                lambda: _kernels.forward(x, y, options, low=True),
                lambda: _kernels.forward(x, y, options, low=True, entropy=True, argmax=True))
            ratios[bundle].append(outputs / plain)
            cells += [f"{plain:.3f}", f"{outputs:.3f}", f"**{outputs / plain:.3f}**"]
        for bundle in args.fused:
            options = _kernels.KernelOptions(bundle=bundle)
            fused_ms, = timed(lambda: _kernels.fused(x, y, w, options, overwrite=True))
            cells.append(f"{fused_ms:.3f}")
        print("| " + " | ".join(cells) + " |", flush=True)
        del x
        if cuda:
            torch.cuda.empty_cache()
    if args.plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except Exception as error:  # noqa: BLE001  (the table is the result; the plot optional)
            print(f"no plot: matplotlib unavailable ({error})")
            return 0
        figure, axes = plt.subplots(figsize=(8, 4))
        width = 0.8 / len(args.bundles)
        for k, bundle in enumerate(args.bundles):
            axes.bar([i + k * width for i in range(len(shapes))], ratios[bundle], width,
                     label=bundle)
        axes.axhline(1.05, color="red", linestyle="--", label="target 1.05")
        axes.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))])
        axes.set_xticklabels([f"{t}x{v}" for t, v in shapes], fontsize=8)
        axes.set_ylabel("forward + outputs / forward")
        axes.set_title(f"forward with lse, entropy, argmax ({name})")
        axes.legend(fontsize=8)
        figure.tight_layout()
        figure.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
