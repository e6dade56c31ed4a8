#!/usr/bin/env python3
"""API-level benchmark: ``cegen.cross_entropy`` with autograd, as a trainer calls it, beside
flash-attention's and Liger-Kernel's public functions, against the bandwidth floors.

A program, not a test. On a CUDA machine, from the repository root, with a runtime library
and an sm_90 bundle made on a machine that has ce-gen (test/gpu/prepare_api_run.sh)::

    python3 bench/api_bench.py --runtime .dev/lib/libce_runtime.so \\
        --bundle .dev/api/bundles/api --peers .dev/peers --out $OUT/api

What is timed, per shape (bf16 logits [N, V] ~ randn, int64 labels ~ U[0, V),
ignore_index -100, a per-token upstream gradient g ~ U[0.5, 1.5)), with bench/gpu_bench.py's
method (``time_step``: an untimed setup, a 256 MB write that flushes the L2, a GPU sleep so
that host work queued before the first kernel is hidden, CUDA events around the call, the
median over repetitions, p10-p90 spread; floors = bytes / the device-to-device copy
bandwidth measured in the same run):

* ``cegen fwd``: ``cegen.cross_entropy(logits, labels)`` under no_grad (floor: 1 pass);
* ``cegen fwd+bwd``: the call on a leaf, then ``torch.autograd.grad(loss, x, g)`` (3 passes);
* ``cegen fwd+bwd_ow``: ``overwrite_input=True`` on logits that an autograd node hands
  over (restored untimed before each call), then ``loss.backward(g)`` (3 passes);
* ``cegen fused`` / ``fused_ow``: ``grad_weights=g`` and the upstream gradient ``g`` itself
  (the weights tensor: known equal, no rescale; 2 passes);
* ``cegen fwd +outputs`` / ``fused_ow +outputs``: the same calls with ``return_lse``,
  ``return_entropy`` and ``return_argmax`` (issue 17: the entropy and argmax sweep), against
  the same floors;
* ``cegen fused rescaled`` / ``fused_ow rescaled``: ``grad_weights=g`` and upstream ``g * 1``,
  a different tensor of the same values: the backward's device rescale (cegen._rescale)
  runs, one more read and write of the gradient (the floor stays 2 passes);
* the C API's kernels for comparison (``kernel fwd+bwd_ow``, ``kernel fused_ow``,
  gpu_bench's ``Ours``);
* the peers (bench/peers.py, fetched at run time, never committed): flash-attention's
  ``cross_entropy_loss`` (fwd; fwd+bwd with ``inplace_backward`` False and True) and
  Liger-Kernel's ``LigerCrossEntropyFunction`` (reduction none and mean).

Then the host time per call (bench/host_overhead.py's method: loops queued behind a GPU
sleep, so only host work counts) of cegen's forward, forward+backward and fused calls, with
the stages of a forward (the launch plan's among them), PyTorch's floor (a trivial
autograd.Function with cegen's allocations, called the same way: what cegen's Python cannot
remove), and of flash-attention's public function, in the same process.

Writes OUT/results.json, OUT/table.md and OUT/api.png (matplotlib: time per shape as a
multiple of the two-pass floor). ``--device cpu`` runs the harness on host kernels with a
wall clock (a check of the program, not a benchmark).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "python"))

import gpu_bench as gb  # noqa: E402
import host_overhead  # noqa: E402
import peers as peer_mod  # noqa: E402

DEFAULT_SHAPES = "8192x128256,16384x32000,4096x151936,8192x50304,32768x128256"
IGNORE_INDEX = -100
#: issue 16's targets: % of the variant's floor.
TARGETS = {"cegen fused_ow": 85.0, "cegen fwd+bwd_ow": 92.0}
log = gb.log


class Handoff:
    """Logits an autograd node hands over and nothing else holds: what overwrite_input
    needs. ``setup`` copies the pristine logits into a fresh buffer (untimed); the timed
    step's ``node()`` returns that buffer as the output of an autograd Function whose
    backward passes nothing on."""

    def __init__(self, torch: Any, prob: Any):
        self.torch, self.p = torch, prob
        self.anchor = torch.zeros((), device=prob.logits.device, requires_grad=True)
        self.held: List[Any] = []
        self.seen: List[Any] = []  # with keep_gradient: the gradients that arrived
        self.keep_gradient = False
        torch_ = torch

        class Node(torch_.autograd.Function):
            @staticmethod
            def forward(ctx, anchor):  # type: ignore[no-untyped-def]
                return self.held.pop()

            @staticmethod
            def backward(ctx, grad):  # type: ignore[no-untyped-def]
                if self.keep_gradient:
                    self.seen.append(grad)
                return None

        self.node_cls = Node

    def setup(self) -> None:
        self.held.clear()
        buffer = self.torch.empty_like(self.p.pristine)
        buffer.copy_(self.p.pristine)
        self.held.append(buffer)
        del buffer

    def node(self) -> Any:
        return self.node_cls.apply(self.anchor)


def cegen_cases(torch: Any, cegen: Any, p: Any) -> List[Any]:
    """(name, floor passes, step, setup) of the API calls."""
    x = p.logits.detach().requires_grad_(True)
    g = p.grad_loss
    g_copy = g * 1.0  # equal values, another tensor: the rescale runs
    handoff = Handoff(torch, p)
    ce = cegen.cross_entropy

    def fwd() -> None:
        with torch.no_grad():
            ce(p.logits, p.labels, ignore_index=IGNORE_INDEX)

    def fwd_bwd() -> None:
        torch.autograd.grad(ce(x, p.labels, ignore_index=IGNORE_INDEX), x, g)

    def fwd_bwd_ow() -> None:
        ce(handoff.node(), p.labels, ignore_index=IGNORE_INDEX, overwrite_input=True).backward(g)

    def fused(upstream: Any) -> None:
        torch.autograd.grad(ce(x, p.labels, ignore_index=IGNORE_INDEX, grad_weights=g), x, upstream)

    def fused_ow(upstream: Any) -> None:
        ce(handoff.node(), p.labels, ignore_index=IGNORE_INDEX, grad_weights=g,
           overwrite_input=True).backward(upstream)

    def fwd_outputs() -> None:
        with torch.no_grad():
            ce(p.logits, p.labels, ignore_index=IGNORE_INDEX, return_lse=True,
               return_entropy=True, return_argmax=True)

    def fused_ow_outputs() -> None:
        ce(handoff.node(), p.labels, ignore_index=IGNORE_INDEX, grad_weights=g,
           overwrite_input=True, return_lse=True, return_entropy=True,
           return_argmax=True).loss.backward(g)

    return [("cegen fwd", 1, fwd, None),
            # The three outputs of issue 17 (lse, entropy, argmax): the same floor.
            ("cegen fwd +outputs", 1, fwd_outputs, None),
            ("cegen fused_ow +outputs", 2, fused_ow_outputs, handoff.setup),
            ("cegen fwd+bwd", 3, fwd_bwd, None),
            ("cegen fwd+bwd_ow", 3, fwd_bwd_ow, handoff.setup),
            ("cegen fused", 2, lambda: fused(g), None),
            ("cegen fused_ow", 2, lambda: fused_ow(g), handoff.setup),
            ("cegen fused rescaled", 2, lambda: fused(g_copy), None),
            ("cegen fused_ow rescaled", 2, lambda: fused_ow(g_copy), handoff.setup)]


def check_cases(torch: Any, cegen: Any, p: Any, checker: Any) -> Dict[str, float]:
    """Largest relative gradient error on the checker's rows, per API path (untimed)."""
    out: Dict[str, float] = {}
    x = p.logits.detach().requires_grad_(True)
    g = p.grad_loss
    for name, kwargs, upstream in (("fwd+bwd", {}, g), ("fused", {"grad_weights": g}, g),
                                   ("fused rescaled", {"grad_weights": g}, g * 1.0)):
        (grad,) = torch.autograd.grad(
            cegen.cross_entropy(x, p.labels, ignore_index=IGNORE_INDEX, **kwargs), x, upstream)
        out[name] = checker.grad(name, grad)
        del grad
    handoff = Handoff(torch, p)
    handoff.keep_gradient = True
    for name, weights in (("fwd+bwd_ow", None), ("fused_ow", g)):
        handoff.setup()
        pointer = handoff.held[0].data_ptr()
        # No **kwargs: a call through an argument tuple holds the logits once more, and the
        # ownership check (cegen._ownership) would rightly refuse.
        cegen.cross_entropy(handoff.node(), p.labels, ignore_index=IGNORE_INDEX,
                            overwrite_input=True, grad_weights=weights).backward(g)
        grad = handoff.seen.pop()
        if grad.data_ptr() != pointer:
            raise RuntimeError(f"{name}: the gradient was not written over the logits")
        out[name] = checker.grad(name, grad)
        del grad
    return out


def kernel_cases(cegen: Any, rt: Any, bundle: str, p: Any, dev: Any) -> List[Any]:
    kset = gb.open_config(rt, bundle, gb.variant_keys(cegen),
                          "sm_90" if dev.cuda else "host")
    steps = gb.Ours(cegen, rt, kset, p, dev, IGNORE_INDEX).steps()
    return [(f"kernel {name}", passes, steps[name][0], steps[name][1])
            for name, passes in (("fwd", 1), ("fwd+bwd_ow", 3), ("fused_ow", 2))]


def host_times(torch: Any, cegen: Any, dev: Any, bundle: Optional[str],
               flash: Any) -> Dict[str, float]:
    """Host microseconds per call (GPU busy): cegen's paths and stages, flash-attention's."""
    result = host_overhead.measure(torch, cegen, dev.device, bundle=bundle,
                                   tokens=64 if dev.cuda else 8, vocab=4096 if dev.cuda else 64,
                                   dtype=torch.bfloat16, ignore_index=IGNORE_INDEX)
    if flash is not None:
        gen = torch.Generator(device="cpu").manual_seed(1)
        logits = (torch.randn((64, 4096), generator=gen) * 2).to(torch.bfloat16).to(dev.device)
        labels = torch.randint(0, 4096, (64,), generator=gen).to(dev.device)
        g = (torch.rand((64,), generator=gen) + 0.5).to(dev.device)
        x = logits.detach().clone().requires_grad_(True)

        def flash_fwd() -> None:
            with torch.no_grad():
                flash.cross_entropy_loss(logits, labels)

        def flash_fwd_bwd() -> None:
            loss, _ = flash.cross_entropy_loss(x, labels)
            torch.autograd.grad(loss, x, g)

        for name, call in (("flash_ce forward", flash_fwd), ("flash_ce fwd+bwd", flash_fwd_bwd)):
            result[name] = round(host_overhead._per_call_us(torch, dev.cuda, call, 100, 7), 1)
    return result


def plot(results: Dict[str, Any], path: Path) -> Optional[str]:
    """Time per shape as a multiple of the two-pass floor, one bar per variant."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as error:  # noqa: BLE001
        return f"no plot: matplotlib unavailable ({error})"
    wanted = ["cegen fwd+bwd_ow", "cegen fused_ow", "cegen fused_ow +outputs",
              "cegen fused_ow rescaled", "kernel fused_ow",
              "flash_ce fwd+bwd_ow inplace_backward=True", "liger_ce fwd+bwd reduction=none"]
    shapes = list(results["shapes"])
    series = {name: [] for name in wanted}
    for shape in shapes:
        rows = {r["name"]: r for r in results["shapes"][shape]["rows"]}
        floor2 = results["shapes"][shape]["floor_ms_per_pass"] * 2
        for name in wanted:
            row = rows.get(name)
            series[name].append(row["ms"] / floor2 if row else math.nan)
    fig, ax = plt.subplots(figsize=(11, 4.8))
    width = 0.8 / len(wanted)
    for index, name in enumerate(wanted):
        xs = [i + (index - (len(wanted) - 1) / 2) * width for i in range(len(shapes))]
        ax.bar(xs, series[name], width, label=name)
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--", label="two-pass floor")
    ax.axhline(1.5, color="grey", linewidth=1, linestyle=":", label="three-pass floor")
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels(shapes)
    ax.set_ylabel("time / two-pass floor (lower is better)")
    ax.set_title(f"forward + backward through the public API, bf16, {results['device']['name']}, "
                 f"{results['date']}")
    ax.legend(fontsize=7, ncol=3, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def markdown(results: Dict[str, Any]) -> str:
    lines = [f"# API benchmark, {results['date']}, {results['device']['name']}", "",
             f"command: `{results['command']}`", "",
             f"copy bandwidth {results['copy_TBps']:.2f} TB/s (floor per pass = N*V*2 bytes / it)",
             "", "| shape N×V | variant | ms | p10-p90 ms | % of floor | vs flash_ce (fwd; fwd+bwd) | extra GB |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for shape, entry in results["shapes"].items():
        times = {r["name"]: r["ms"] for r in entry["rows"]}
        for r in entry["rows"]:
            forward_only = r["passes"] == 1
            flash = times.get("flash_ce fwd" if forward_only
                              else "flash_ce fwd+bwd inplace_backward=False")
            vs = f"{flash / r['ms']:.2f}x" if flash else "-"
            extra = "-" if r.get("extra_bytes") is None else f"{r['extra_bytes'] / 1e9:.2f}"
            lines.append(f"| {shape} | {r['name']} | {r['ms']:.3f} | {r['p10_ms']:.3f}-{r['p90_ms']:.3f} "
                         f"| {r['pct_floor']:.0f} | {vs} | {extra} |")
    lines += ["", "## Host time per call (us, GPU busy)", ""]
    lines += [f"- {k}: {v}" for k, v in results.get("host_us", {}).items()]
    lines += ["", "## Targets", ""] + [f"- {t}" for t in results.get("targets", [])]
    if results.get("checks"):
        lines += ["", "## Gradient checks (largest relative error on sampled rows vs float64)", ""]
        lines += [f"- {shape}: {check}" for shape, check in results["checks"].items()]
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", default=None)
    parser.add_argument("--bundle", default=None, help="bundle with the flat bf16 kernels")
    parser.add_argument("--peers", default=None, help="directory with the peers' sources")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--reps", type=int, default=None, help="timed calls (default: by time)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--no-host", action="store_true", help="skip the host-time part")
    parser.add_argument("--plot-only", default=None, metavar="RESULTS_JSON",
                        help="only draw OUT/api.png (and table.md) from a run's results.json")
    args = parser.parse_args(argv)
    if args.plot_only:
        results = json.loads(Path(args.plot_only).read_text())
        out = Path(args.out or ".")
        out.mkdir(parents=True, exist_ok=True)
        (out / "table.md").write_text(markdown(results))
        note = plot(results, out / "api.png")
        print(note or f"wrote {out / 'api.png'}")
        return 0

    import torch

    import cegen
    from cegen import _runtime

    if args.runtime:
        cegen.set_runtime_library(args.runtime)
    if args.bundle is None:
        parser.error("--bundle is required (unless --plot-only)")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 0
    import warnings

    # A refused overwrite would time another variant: make it an error.
    warnings.simplefilter("error", cegen.OverwriteRefusedWarning)
    cegen.configure(bundle_dirs=[args.bundle], run_ce_gen=False)
    dev = gb.Dev(torch, args.device)
    rt = _runtime.get_runtime()
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    import torch.nn.functional as F

    shapes = gb.parse_shapes(args.shapes)
    results: Dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
        "device": {"name": torch.cuda.get_device_name() if dev.cuda else platform.processor() or "cpu"},
        "torch": torch.__version__, "shapes": {}, "failures": [], "checks": {}}
    modules, status = ({}, {})
    if args.peers:
        modules, status = peer_mod.load(torch, args.peers, dev.cuda)
        for peer, entry in status.items():
            log(peer_mod.status_line(peer, entry))
    results["peers"] = status
    largest = max(n * v for n, v in shapes) * 2
    ceil = gb.ceilings(torch, dev, min(largest, 4 << 30) if dev.cuda else 64 << 20)
    results["copy_TBps"] = ceil["copy_Bps"] / 1e12
    log(f"copy {ceil['copy_Bps'] / 1e12:.2f} TB/s, read {ceil['read_Bps'] / 1e12:.2f} TB/s")
    for n, v in shapes:
        sname = gb.shape_name((n, v))
        p = gb.Problem(torch, dev, n, v, args.seed)
        floor_ms = p.bytes / ceil["copy_Bps"] * 1e3
        entry: Dict[str, Any] = {"floor_ms_per_pass": floor_ms, "rows": []}
        results["shapes"][sname] = entry
        cases = cegen_cases(torch, cegen, p)
        try:
            cases += kernel_cases(cegen, rt, args.bundle, p, dev)
        except Exception as error:  # noqa: BLE001
            results["failures"].append(f"kernel cases {sname}: {error}")
        for peer, module in modules.items():
            for variant, config, passes, _, step, setup in peer_mod.make(
                    torch, peer, module, p, IGNORE_INDEX).cases():
                name = f"{peer} {variant}" + ("" if config == "-" else f" {config}")
                cases.append((name, passes, step, setup))
        for name, passes, step, setup in cases:
            try:
                timing = gb.time_step(dev, step, setup, args.reps)
                extra = dev.peak_extra(step, setup)
                row = {"name": name, "passes": passes, "ms": timing["ms"],
                       "p10_ms": timing["p10_ms"], "p90_ms": timing["p90_ms"],
                       "min_ms": timing["min_ms"], "reps": timing["reps"],
                       "pct_floor": 100 * passes * floor_ms / timing["ms"], "extra_bytes": extra}
                entry["rows"].append(row)
                log(f"{sname} {name:44s} {timing['ms']:8.3f} ms  ({timing['p10_ms']:.3f}-"
                    f"{timing['p90_ms']:.3f})  {row['pct_floor']:5.1f}% of {passes}-pass floor")
            except Exception as error:  # noqa: BLE001
                results["failures"].append(f"{sname} {name}: {type(error).__name__}: {error}")
                log(f"{sname} {name}: FAILED\n{traceback.format_exc()}")
            p.restore()
        try:
            checker = gb.Checker(torch, F, p, args.seed)
            p.restore()
            results["checks"][sname] = {k: float(f"{v:.3g}") for k, v in
                                        check_cases(torch, cegen, p, checker).items()}
            log(f"{sname} gradient checks (max rel err): {results['checks'][sname]}")
        except Exception as error:  # noqa: BLE001
            results["failures"].append(f"checks {sname}: {type(error).__name__}: {error}")
            log(f"checks {sname}: FAILED\n{traceback.format_exc()}")
        del p, cases
        if dev.cuda:
            torch.cuda.empty_cache()
    if not args.no_host:
        try:
            results["host_us"] = host_times(torch, cegen, dev, args.bundle,
                                            modules.get(peer_mod.FLASH))
            for name, value in results["host_us"].items():
                log(f"host {name:58s} {value:8.2f} us")
        except Exception as error:  # noqa: BLE001
            results["failures"].append(f"host times: {type(error).__name__}: {error}")
            log(f"host times: FAILED\n{traceback.format_exc()}")
    targets = []
    for sname, entry in results["shapes"].items():
        rows = {r["name"]: r for r in entry["rows"]}
        for name, target in TARGETS.items():
            if name in rows:
                pct = rows[name]["pct_floor"]
                targets.append(f"{sname} {name}: {pct:.0f} % of floor (target {target:.0f} %): "
                               f"{'met' if pct >= target else 'missed'}")
    for name, target in host_overhead.TARGETS_US.items():
        value = results.get("host_us", {}).get(name)
        if value is not None:
            floor = {k: v for k, v in results.get("host_us", {}).items()
                     if k.startswith("floor: " + name.split("+")[0])}
            note = "".join(f"; PyTorch's {k[len('floor: '):]}: {v:.0f} us"
                           for k, v in floor.items() if v == v)
            targets.append(f"host {name}: {value:.0f} us (target {target:.0f} us): "
                           f"{'met' if value <= target else 'missed'}{note}")
    results["targets"] = targets
    for line in targets:
        log(line)
    if out:
        (out / "results.json").write_text(json.dumps(results, indent=1))
        (out / "table.md").write_text(markdown(results))
        note = plot(results, out / "api.png")
        if note:
            log(note)
    if results["failures"]:
        log("failures:\n  " + "\n  ".join(results["failures"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
