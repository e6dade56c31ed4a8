#!/usr/bin/env python3
"""Benchmark of the output layer plus its loss: ``cegen.linear_cross_entropy`` against the
GEMMs alone, the materialized-logits references and (when their sources are given) Liger's
fused linear cross entropy and Cut Cross-Entropy, side by side in one process; and a bf16
accuracy check of each against float64 (issue 18).

A program, not a test. On a CUDA machine, from the repository root::

    python3 bench/linear_bench.py --runtime .dev/linear/lib/libce_runtime.so \\
        --bundle .dev/linear/bundles/api --peers .dev/peers-linear --out $OUT/linear

``--peers DIR`` is put first on ``sys.path`` and may hold (fetched for the run, never
committed; ``DIR/SOURCES.md`` names the commits)::

    liger_kernel/__init__.py, utils.py            upstream
    liger_kernel/ops/__init__.py                  empty (the real one imports every op)
    liger_kernel/ops/cross_entropy.py, utils.py, fused_linear_cross_entropy.py   upstream
    cut_cross_entropy/...                         upstream package (without transformers/)

A peer that cannot be imported is reported with the reason and skipped.

What one step is, for each implementation (bf16 hidden ``[N, H]`` and weight ``[V, H]``,
labels ~ U[0, V), forward and backward producing d hidden and d weight):

* ``3 GEMMs``: ``logits = h W^T``, ``dh = G W``, ``dW = G^T h`` with G the logits buffer
  itself: the floor of any implementation that computes the logits (DESIGN.md section 2);
* ``matmul + F.cross_entropy``: torch's matmul, then ``F.cross_entropy(logits.float())``
  with reduction mean, autograd;
* ``matmul + cegen``: torch's matmul, then ``cegen.cross_entropy(..., overwrite_input=True)``
  with ``loss.mean()``, autograd;
* ``cegen linear (mean)``: ``cegen.linear_cross_entropy(..., reduction="mean")``: the fused
  kernel finishes the gradients in the forward (three GEMMs), the backward scales them;
* ``cegen linear (mean, upstream 2)``: the same, ``(loss * 2).backward()``: the backward
  scales d hidden and d weight by 2 (one pass over d weight; an upstream of exactly 1
  leaves them untouched);
* ``cegen linear (token, grad_weights)``: per-token loss with ``grad_weights=g`` and
  ``loss.backward(g)`` (the same tensor): three GEMMs;
* ``cegen linear (token, grad_weights, upstream 2 g)``: the same forward,
  ``loss.backward(2 * g)`` (another tensor, as Megatron's loss mask times a number): the
  factor 2 found and checked on the device, d weight scaled by it: three GEMMs;
* ``cegen linear (token, recompute)``: per-token loss, ``loss.backward(g)`` with no
  ``grad_weights``: each chunk's logits recomputed (four GEMMs);
* ``cegen linear (mean, chunk C)`` for ``--chunks``: the chunk size's time/memory trade-off
  (the default chunk holds at most 256 MiB of logits, the tokens split into equal chunks of
  a multiple of 128 tokens: 1024 at V = 128256 in bf16);
* ``Liger FLCE (mean)``: ``LigerFusedLinearCrossEntropyFunction.apply(h, W, labels)``
  (reduction mean, its defaults); ``CCE (mean)``: ``cut_cross_entropy.linear_cross_entropy(
  h, W, labels)`` (reduction mean, its defaults, gradient filtering included).

Times are medians of ``--reps`` steps after two warm-up steps, each between CUDA events,
after a 256 MB write that flushes L2. ``extra GB`` is ``torch.cuda.max_memory_allocated``
during the step minus what was allocated before it, with the inputs' ``.grad`` freed
before: it counts the gradients d hidden and d weight (1.12 GB at N = 8192), and whatever the
implementation holds besides. The issue's memory target is ``d weight`` + ``d hidden`` + one
chunk of logits. ``--long N`` adds one large N (up to 131072), run by the implementations
whose memory does not grow with N's logits (and ``matmul + F.cross_entropy``, which is
expected not to fit: its out-of-memory error is reported with the bytes its logits need).

Accuracy (``--check-tokens``, default 1024): the same bf16 inputs, loss (mean), d hidden and
d weight of each implementation against float64 (logits, softmax and both gradients computed
in float64 from the bf16 values): relative Frobenius error, and the largest element error
relative to the largest reference element.

``--profile "cegen linear (mean);3 GEMMs"`` runs those implementations once more under
torch.profiler at the first N and writes each operator's device time (OUT/profile-*.txt): where
the time over the GEMMs goes.

Writes OUT/results.json, OUT/table.md and OUT/linear.png (time over the three GEMMs per N),
rewritten after every row, so that a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
GEMMS = "3 GEMMs"
TORCH = "matmul + F.cross_entropy"


def log(message: str) -> None:
    print(message, flush=True)


def timed(step: Callable[[], None], zero: Callable[[], None], reps: int,
          flush: torch.Tensor) -> Dict[str, float]:
    if flush.device.type == "cpu":  # --device cpu: a dry run of the program, no figures
        zero()
        begin = time.perf_counter()
        step()
        return {"ms": (time.perf_counter() - begin) * 1e3, "min_ms": math.nan,
                "extra_GB": math.nan}
    for _ in range(2):
        zero()
        step()
    torch.cuda.synchronize()
    times: List[float] = []
    extra: List[float] = []
    for _ in range(reps):
        zero()
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


def load_peers(directory: Optional[str]) -> Dict[str, Any]:
    """{name: callable(h, W, labels) -> mean loss, or the reason it is missing}."""
    peers: Dict[str, Any] = {}
    if not directory:
        return {"Liger FLCE (mean)": "no --peers", "CCE (mean)": "no --peers"}
    sys.path.insert(0, str(Path(directory).resolve()))
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import \
            LigerFusedLinearCrossEntropyFunction as liger

        peers["Liger FLCE (mean)"] = lambda h, w, y: liger.apply(h, w, y)[0]
    except Exception as error:  # noqa: BLE001
        peers["Liger FLCE (mean)"] = f"not importable: {type(error).__name__}: {error}"
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        peers["CCE (mean)"] = lambda h, w, y: cce(h, w, y)
    except Exception as error:  # noqa: BLE001
        peers["CCE (mean)"] = f"not importable: {type(error).__name__}: {error}"
    return peers


def accuracy(cegen: Any, bundle: Optional[str], peers: Dict[str, Any], n: int, h_dim: int,
             v: int, gen: torch.Generator, dev: torch.device) -> List[Dict[str, Any]]:
    """Loss (mean), d hidden and d weight of each implementation on bf16 inputs against
    float64 computed from the same bf16 values."""
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    hidden = (torch.randn((n, h_dim), device=dev, generator=gen) * 0.5).to(dtype)
    weight = (torch.randn((v, h_dim), device=dev, generator=gen) * 0.02).to(dtype)
    labels = torch.randint(0, v, (n,), device=dev, generator=gen)
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    ref_loss = F.cross_entropy(h64 @ w64.t(), labels)
    ref_loss.backward()
    refs = {"loss": ref_loss.detach(), "dh": h64.grad, "dW": w64.grad}
    del h64, w64
    empty_cache(dev)

    def linear_mean(h, w):
        return cegen.linear_cross_entropy(h, w, labels, reduction="mean", bundle=bundle)

    def torch_ce(h, w):
        return F.cross_entropy((h @ w.t()).float(), labels)

    def matmul_cegen(h, w):
        return cegen.cross_entropy(h @ w.t(), labels, overwrite_input=True, bundle=bundle).mean()

    impls: Dict[str, Any] = {TORCH: torch_ce, "matmul + cegen": matmul_cegen,
                             "cegen linear (mean)": linear_mean}
    impls.update({name: (lambda f: lambda h, w: f(h, w, labels))(fn)
                  for name, fn in peers.items() if callable(fn)})
    rows = []
    for name, fn in impls.items():
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        try:
            loss = fn(h, w)
            loss.backward()
            row = {"impl": name, "N": n}
            for key, got in (("loss", loss.detach()), ("dh", h.grad), ("dW", w.grad)):
                want = refs[key]
                diff = got.double() - want
                row[f"{key}_rel_fro"] = float(diff.norm() / want.norm().clamp_min(1e-300))
                row[f"{key}_max_rel"] = float(diff.abs().max() / want.abs().max().clamp_min(1e-300))
        except Exception as error:  # noqa: BLE001
            row = {"impl": name, "N": n, "error": f"{type(error).__name__}: {error}"}
        rows.append(row)
        log(json.dumps(row))
        del h, w
        empty_cache(dev)
    return rows


def profile(name: str, n: int, step: Callable[[], None], zero: Callable[[], None],
            dev: torch.device, out: Optional[Path]) -> None:
    """One more step under torch.profiler: the operators' device (or host) time, largest
    first, printed and written to OUT/profile-N-<name>.txt."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    zero()
    with torch.profiler.profile(activities=activities) as prof:
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    table = None
    for key in (("self_cuda_time_total", "self_device_time_total") if dev.type == "cuda"
                else ("self_cpu_time_total",)):
        try:
            table = prof.key_averages().table(sort_by=key, row_limit=30)
            break
        except Exception:  # noqa: BLE001  (the key's name differs between torch versions)
            continue
    text = f"# {name}, N = {n}\n\n{table}\n"
    log(text)
    if out is not None:
        slug = "".join(c if c.isalnum() else "-" for c in name).strip("-")
        out.mkdir(parents=True, exist_ok=True)
        (out / f"profile-{n}-{slug}.txt").write_text(text)
    zero()


def empty_cache(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def markdown(results: Dict[str, Any]) -> str:
    lines = [f"# linear_bench, {results['date']}, {results['device']}", "",
             f"command: `{results['command']}`", "",
             f"torch {results['torch']}, H = {results['H']}, V = {results['V']}, bf16; "
             "time: median of the steps; extra: peak memory during the step beyond the inputs "
             "(d hidden and d weight included); target: d weight + d hidden + one default "
             "chunk of logits", "",
             "| N | implementation | ms | x 3 GEMMs | extra GB | target GB |",
             "|---|---|---:|---:|---:|---:|"]
    for row in results["rows"]:
        target = f"{row['target_GB']:.2f}" if "target_GB" in row else ""
        if "error" in row:
            lines.append(f"| {row['N']} | {row['impl']} | {row['error']} | | | {target} |")
            continue
        ratio = f"{row['vs_3_gemms']:.3f}" if "vs_3_gemms" in row else "-"
        lines.append(f"| {row['N']} | {row['impl']} | {row['ms']:.2f} | {ratio} | "
                     f"{row['extra_GB']:.2f} | {target} |")
    if results.get("accuracy"):
        lines += ["", f"Accuracy against float64 (N = {results['accuracy'][0]['N']}, the same bf16 "
                  "inputs; rel: ||x - ref|| / ||ref||, max: max|x - ref| / max|ref|):", "",
                  "| implementation | loss rel | dh rel / max | dW rel / max |",
                  "|---|---:|---:|---:|"]
        for row in results["accuracy"]:
            if "error" in row:
                lines.append(f"| {row['impl']} | {row['error']} | | |")
                continue
            lines.append(f"| {row['impl']} | {row['loss_rel_fro']:.1e} | "
                         f"{row['dh_rel_fro']:.1e} / {row['dh_max_rel']:.1e} | "
                         f"{row['dW_rel_fro']:.1e} / {row['dW_max_rel']:.1e} |")
    for name, reason in results.get("peers_missing", {}).items():
        lines.append(f"\n{name}: {reason}")
    return "\n".join(lines) + "\n"


def plot(results: Dict[str, Any], path: Path) -> Optional[str]:
    """Time over the three GEMMs' time per N, one bar per implementation."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as error:  # noqa: BLE001
        return f"no plot: matplotlib unavailable ({error})"
    rows = [r for r in results["rows"] if "vs_3_gemms" in r]
    shapes = sorted({r["N"] for r in rows})
    names = [n for n in dict.fromkeys(r["impl"] for r in rows) if n != GEMMS]
    if not shapes or not names:
        return "no plot: nothing timed against the GEMMs"
    fig, ax = plt.subplots(figsize=(11, 4.8))
    width = 0.8 / len(names)
    for index, name in enumerate(names):
        values = [next((r["vs_3_gemms"] for r in rows if r["N"] == s and r["impl"] == name),
                       math.nan) for s in shapes]
        xs = [i + (index - (len(names) - 1) / 2) * width for i in range(len(shapes))]
        ax.bar(xs, values, width, label=name)
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--", label="floor: the 3 GEMMs")
    ax.axhline(1.05, color="grey", linewidth=1, linestyle=":", label="target 1.05x")
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels([f"N={s}" for s in shapes])
    ax.set_ylabel("time / the three GEMMs' time (lower is better)")
    ax.set_title(f"output layer + loss, H={results['H']}, V={results['V']}, bf16, "
                 f"{results['device']}, {results['date']}")
    ax.legend(fontsize=7, ncol=3, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def write(results: Dict[str, Any], out: Optional[Path]) -> None:
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text(markdown(results))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime", default=None, help="libce_runtime.so")
    parser.add_argument("--bundle", default=None, help="sm_90 bundle directory (default: cache)")
    parser.add_argument("--peers", default=None, help="directory of Liger's and CCE's sources")
    parser.add_argument("--tokens", default="8192,16384", help="N values, comma separated")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--long", type=int, default=131072,
                        help="one large N for the implementations that do not hold the logits "
                             "(0: skip)")
    parser.add_argument("--chunks", default="2048,4096",
                        help="chunk_tokens values to time cegen linear (mean) at too")
    parser.add_argument("--check-tokens", type=int, default=1024,
                        help="N of the float64 accuracy check (0: skip)")
    parser.add_argument("--profile", default="",
                        help="implementations (names as in the table, ';' between them) to run "
                             "once more under torch.profiler at the first N: OUT/profile-*.txt")
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda",
                        help="cuda, or cpu for a dry run of the program at small shapes "
                             "(host kernels; times and memory meaningless)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        log("SKIP: no CUDA device")
        return 0
    sys.path.insert(0, str(REPO / "python"))
    import cegen

    if args.runtime:
        cegen.set_runtime_library(args.runtime)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    h_dim, v = args.hidden, args.vocab
    out = Path(args.out) if args.out else None
    peers = load_peers(args.peers)
    results: Dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
        "command": " ".join(shlex.quote(a) for a in ["python3"] + sys.argv),
        "H": h_dim, "V": v, "rows": [], "accuracy": [],
        "peers_missing": {name: fn for name, fn in peers.items() if not callable(fn)},
    }
    flush = torch.empty(64 << 20 if dev.type == "cuda" else 1, dtype=torch.float32, device=dev)
    gen = torch.Generator(device=dev).manual_seed(1234)
    found = ", ".join(f"{k}: {'ok' if callable(f) else f}" for k, f in peers.items())
    log(f"linear_bench: H={h_dim} V={v} {dtype}, {results['device']}, torch "
        f"{torch.__version__}; peers: {found}")

    if args.check_tokens:
        try:
            results["accuracy"] = accuracy(cegen, args.bundle, peers, args.check_tokens, h_dim,
                                           v, gen, dev)
        except Exception as error:  # noqa: BLE001
            results["accuracy"] = [{"impl": "all", "N": args.check_tokens,
                                    "error": f"{type(error).__name__}: {error}"}]
            log(traceback.format_exc())
        write(results, out)

    from cegen.linear import default_chunk_tokens

    chunk_default = default_chunk_tokens(1 << 30, v, 2)
    profiled = {name.strip() for name in args.profile.split(";") if name.strip()}
    sizes = [int(x) for x in args.tokens.split(",") if x]
    for n in sizes + ([args.long] if args.long else []):
        long_run = n == args.long and n not in sizes
        hidden = (torch.randn((n, h_dim), device=dev, generator=gen) * 0.5).to(dtype)
        weight = (torch.randn((v, h_dim), device=dev, generator=gen) * 0.02).to(dtype)
        labels = torch.randint(0, v, (n,), device=dev, generator=gen)
        upstream = torch.rand((n,), device=dev, generator=gen) / n
        hidden.requires_grad_(True)
        weight.requires_grad_(True)

        def zero() -> None:
            hidden.grad = None
            weight.grad = None

        def gemms() -> None:
            with torch.no_grad():
                logits = hidden @ weight.t()
                hidden.grad = logits @ weight
                weight.grad = logits.t() @ hidden

        def torch_ce() -> None:
            F.cross_entropy((hidden @ weight.t()).float(), labels).backward()

        def matmul_cegen() -> None:
            # the product passed straight in: no other reference, so the gradient is
            # written over the logits (a local variable would make cegen refuse, with a
            # warning, and take a fresh buffer)
            cegen.cross_entropy(hidden @ weight.t(), labels, overwrite_input=True,
                                bundle=args.bundle).mean().backward()

        def linear_mean(chunk: Optional[int] = None) -> Callable[[], None]:
            def step() -> None:
                cegen.linear_cross_entropy(hidden, weight, labels, reduction="mean",
                                           chunk_tokens=chunk, bundle=args.bundle).backward()
            return step

        def linear_mean_scaled() -> None:
            # an upstream other than 1 (a loss scale): d weight and d hidden scaled once
            (cegen.linear_cross_entropy(hidden, weight, labels, reduction="mean",
                                        bundle=args.bundle) * 2.0).backward()

        def linear_token_fused() -> None:
            cegen.linear_cross_entropy(hidden, weight, labels, grad_weights=upstream,
                                       bundle=args.bundle).backward(upstream)

        def linear_token_multiple() -> None:
            # Megatron's case: the upstream is grad_weights times a factor, another tensor;
            # the factor found and checked on the device, d weight scaled by it
            cegen.linear_cross_entropy(hidden, weight, labels, grad_weights=upstream,
                                       bundle=args.bundle).backward(upstream * 2.0)

        def linear_token_recompute() -> None:
            cegen.linear_cross_entropy(hidden, weight, labels,
                                       bundle=args.bundle).backward(upstream)

        def peer(fn: Callable[..., torch.Tensor]) -> Callable[[], None]:
            return lambda: fn(hidden, weight, labels).backward()

        impls: List[Any] = []
        if not long_run:
            impls += [(GEMMS, gemms), (TORCH, torch_ce), ("matmul + cegen", matmul_cegen)]
        impls += [("cegen linear (mean)", linear_mean()),
                  ("cegen linear (mean, upstream 2)", linear_mean_scaled),
                  ("cegen linear (token, grad_weights)", linear_token_fused),
                  ("cegen linear (token, grad_weights, upstream 2 g)", linear_token_multiple),
                  ("cegen linear (token, recompute)", linear_token_recompute)]
        if not long_run:
            impls += [(f"cegen linear (mean, chunk {c})", linear_mean(int(c)))
                      for c in args.chunks.split(",") if c and int(c) < n]
        impls += [(name, peer(fn)) for name, fn in peers.items() if callable(fn)]
        if long_run:
            impls.append((TORCH, torch_ce))  # expected: out of memory
        floor = None
        for name, step in impls:
            log(f"N={n}: {name} ...")
            row: Dict[str, Any] = {"N": n, "impl": name,
                                   "target_GB": (v * h_dim * 2 + n * h_dim * 2
                                                 + min(n, chunk_default) * v * 2) / 1e9}
            try:
                row.update(timed(step, zero, args.reps, flush))
            except torch.cuda.OutOfMemoryError as error:
                row["error"] = (f"out of memory (its logits alone: {n * v * 2 / 1e9:.1f} GB bf16 "
                                f"+ {n * v * 4 / 1e9:.1f} GB fp32): "
                                f"{str(error).splitlines()[0][:120]}")
            except Exception as error:  # noqa: BLE001
                row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                log(traceback.format_exc())
            zero()
            empty_cache(dev)
            if name == GEMMS and "ms" in row:
                floor = row["ms"]
            if floor and "ms" in row:
                row["vs_3_gemms"] = row["ms"] / floor
            results["rows"].append(row)
            log(json.dumps(row))
            write(results, out)
            if name in profiled and n == sizes[0] and "error" not in row:
                profile(name, n, step, zero, dev, out)
        del hidden, weight, labels, upstream
        empty_cache(dev)

    log("\n" + markdown(results))
    if out is not None:
        write(results, out)
        problem = plot(results, out / "linear.png")
        if problem:
            log(problem)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
