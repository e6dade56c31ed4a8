#!/usr/bin/env python3
"""Benchmark of the output layer plus its loss: ``cegen.linear_cross_entropy`` against the
GEMMs alone and the materialized-logits references, side by side in one process.

A program, not a test. On a CUDA machine, from the repository root::

    python3 bench/linear_bench.py --runtime .dev/lib/libce_runtime.so \\
        --bundle .dev/linear/bundle --out $OUT

What one step is, for each implementation (bf16 hidden ``[N, H]`` and weight ``[V, H]``,
labels ~ U[0, V), forward and backward producing d hidden and d weight):

* ``3 GEMMs``: ``logits = h W^T``, ``dh = G W``, ``dW = G^T h`` with G the logits buffer
  itself: the floor of any implementation that computes the logits (DESIGN.md section 2);
* ``matmul + F.cross_entropy``: torch's matmul, then ``F.cross_entropy(logits.float())``
  with reduction mean, autograd;
* ``matmul + cegen``: torch's matmul, then ``cegen.cross_entropy(..., overwrite_input=True)``
  with ``loss.mean()``, autograd;
* ``cegen linear (mean)``: ``cegen.linear_cross_entropy(..., grad_weights=1/N).mean()``:
  the fused kernel finishes the gradients in the forward (three GEMMs);
* ``cegen linear (per-token)``: ``cegen.linear_cross_entropy(...)`` with a per-token upstream
  gradient known only in backward: each chunk's logits recomputed (four GEMMs);
* ``--chunks C,...`` adds ``cegen linear (mean)`` at ``chunk_tokens=C``: the time/memory
  trade-off of the chunk size (the default chunk holds 256 MiB of logits).

Times are medians of ``--reps`` steps after two warm-up steps, each between CUDA events,
after a 256 MB write that flushes L2; ``extra GB`` is ``torch.cuda.max_memory_allocated``
during the step minus what was allocated before it (inputs and their .grad excluded: the
grads are preallocated by a first step and zeroed, not freed). Every implementation's loss
and gradients are compared with ``matmul + F.cross_entropy``'s (max relative error,
reported). The table is printed as Markdown and, with --out, written with a PNG plot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent


def log(message: str) -> None:
    print(message, flush=True)


def timed(step: Callable[[], None], reps: int, flush: torch.Tensor) -> Dict[str, float]:
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    times: List[float] = []
    extra: List[float] = []
    for _ in range(reps):
        flush.fill_(1.0)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        extra.append((torch.cuda.max_memory_allocated() - before) / 1e9)
    return {"ms": statistics.median(times), "min_ms": min(times), "extra_GB": max(extra)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime", default=None, help="libce_runtime.so")
    parser.add_argument("--bundle", default=None, help="sm_90 bundle directory (default: cache)")
    parser.add_argument("--tokens", default="8192,16384", help="N values, comma separated")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--long", type=int, default=131072,
                        help="one N run by cegen linear (mean) only, for its peak memory (0: skip)")
    parser.add_argument("--chunks", default="",
                        help="chunk_tokens values to time cegen linear (mean) at too, e.g. 2048,4096")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        log("SKIP: no CUDA device")
        return 0
    sys.path.insert(0, str(REPO / "python"))
    import cegen

    if args.runtime:
        cegen.set_runtime_library(args.runtime)
    dev = torch.device("cuda")
    h_dim, v = args.hidden, args.vocab
    flush = torch.empty(64 << 20, dtype=torch.float32, device=dev)
    gen = torch.Generator(device=dev).manual_seed(1234)
    rows: List[Dict] = []
    log(f"linear_bench: H={h_dim} V={v} bf16, {torch.cuda.get_device_name()}, torch "
        f"{torch.__version__}; INFO: the first cegen call of each schedule loads its kernels")

    for n in [int(x) for x in args.tokens.split(",")] + ([args.long] if args.long else []):
        long_run = n == args.long
        hidden = (torch.randn((n, h_dim), device=dev, generator=gen) * 0.5).to(torch.bfloat16)
        weight = (torch.randn((v, h_dim), device=dev, generator=gen) * 0.02).to(torch.bfloat16)
        labels = torch.randint(0, v, (n,), device=dev, generator=gen)
        upstream = torch.rand((n,), device=dev, generator=gen) + 0.5
        hidden.requires_grad_(True)
        weight.requires_grad_(True)
        results: Dict[str, Dict] = {}

        def zero() -> None:
            hidden.grad = None
            weight.grad = None

        def gemms() -> None:
            with torch.no_grad():
                logits = hidden @ weight.t()
                hidden.grad = logits @ weight
                weight.grad = logits.t() @ hidden

        def torch_ce() -> None:
            zero()
            logits = hidden @ weight.t()
            F.cross_entropy(logits.float(), labels).backward()

        def matmul_cegen() -> None:
            zero()
            logits = hidden @ weight.t()
            cegen.cross_entropy(logits, labels, overwrite_input=True,
                                bundle=args.bundle).mean().backward()

        def linear_mean() -> None:
            zero()
            cegen.linear_cross_entropy(hidden, weight, labels, grad_weights=1.0 / n,
                                       bundle=args.bundle).mean().backward()

        def linear_token() -> None:
            zero()
            cegen.linear_cross_entropy(hidden, weight, labels,
                                       bundle=args.bundle).backward(upstream)

        def linear_mean_chunk(chunk: int) -> Callable[[], None]:
            def step() -> None:
                zero()
                cegen.linear_cross_entropy(hidden, weight, labels, grad_weights=1.0 / n,
                                           chunk_tokens=chunk, bundle=args.bundle).mean().backward()
            return step

        impls = [("cegen linear (mean)", linear_mean)] if long_run else [
            ("3 GEMMs", gemms), ("matmul + F.cross_entropy", torch_ce),
            ("matmul + cegen", matmul_cegen), ("cegen linear (mean)", linear_mean),
            ("cegen linear (per-token)", linear_token)] + [
            (f"cegen linear (mean, chunk {c})", linear_mean_chunk(int(c)))
            for c in args.chunks.split(",") if c and int(c) < n]
        reference = None
        for name, step in impls:
            log(f"N={n}: {name} ...")
            try:
                results[name] = timed(step, args.reps, flush)
            except torch.cuda.OutOfMemoryError as error:
                results[name] = {"error": f"out of memory: {str(error).splitlines()[0]}"}
                zero()
                torch.cuda.empty_cache()
                continue
            if name == "3 GEMMs":
                continue
            grads = (hidden.grad.float(), weight.grad.float())
            if name == "matmul + F.cross_entropy":
                reference = grads
            elif reference is not None:
                scale = 1.0 if name != "cegen linear (per-token)" else None
                if scale is not None:
                    results[name]["rel_err_dh"] = float(
                        (grads[0] - reference[0]).norm() / reference[0].norm())
                    results[name]["rel_err_dW"] = float(
                        (grads[1] - reference[1]).norm() / reference[1].norm())
        floor = results.get("3 GEMMs", {}).get("ms")
        for name, result in results.items():
            row = {"N": n, "impl": name, **result}
            if floor and "ms" in result:
                row["vs_3_gemms"] = result["ms"] / floor
            rows.append(row)
            log(json.dumps(row))
        del hidden, weight, labels, upstream
        torch.cuda.empty_cache()

    lines = ["| N | implementation | ms | x 3 GEMMs | extra GB | rel. err dh / dW vs F.cross_entropy |",
             "|---|---|---:|---:|---:|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['N']} | {row['impl']} | {row['error']} | | | |")
            continue
        err = (f"{row['rel_err_dh']:.1e} / {row['rel_err_dW']:.1e}" if "rel_err_dh" in row
               else "-")
        ratio = f"{row['vs_3_gemms']:.3f}x" if "vs_3_gemms" in row else "-"
        lines.append(f"| {row['N']} | {row['impl']} | {row['ms']:.2f} | {ratio} | "
                     f"{row['extra_GB']:.2f} | {err} |")
    table = "\n".join(lines)
    log("\n" + table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "linear_bench.json").write_text(json.dumps(rows, indent=1))
        (out / "linear_bench.md").write_text(
            f"# linear_bench {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}\n\n"
            f"{torch.cuda.get_device_name()}, torch {torch.__version__}, H={h_dim}, V={v}, bf16\n\n"
            f"{table}\n")
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            shapes = sorted({row["N"] for row in rows if "vs_3_gemms" in row})
            names = [name for name in dict.fromkeys(row["impl"] for row in rows)
                     if name != "3 GEMMs"]
            fig, ax = plt.subplots(figsize=(8, 4))
            width = 0.8 / max(1, len(names))
            for k, name in enumerate(names):
                values = [next((r["vs_3_gemms"] for r in rows if r["N"] == s and r["impl"] == name
                                and "vs_3_gemms" in r), float("nan")) for s in shapes]
                ax.bar([i + k * width for i in range(len(shapes))], values, width, label=name)
            ax.axhline(1.0, color="k", linestyle="--", label="floor: the 3 GEMMs")
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))])
            ax.set_xticklabels([f"N={s}" for s in shapes])
            ax.set_ylabel("time / the three GEMMs' time")
            ax.set_title(f"output layer + loss, H={h_dim}, V={v}, bf16 (lower is better)")
            ax.legend(fontsize=7)
            fig.tight_layout()
            fig.savefig(out / "linear_bench.png", dpi=120)
        except ImportError:
            log("no matplotlib: no plot")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
