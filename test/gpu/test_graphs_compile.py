#!/usr/bin/env python3
"""The public API in CUDA graphs and under torch.compile, on an H100/H200 (issue 16, item 3).

Run from the repository root on the GPU machine, with a runtime library and sm_90 bundles
built elsewhere (test/gpu/prepare_api_run.sh makes both)::

    python3 test/gpu/test_graphs_compile.py --runtime .dev/api/lib/libce_runtime.so \\
        --bundles .dev/api/bundles/api .dev/api/bundles/shard --out $OUT/graphs

Without a CUDA device it prints SKIP and exits 0.

graphs     every path of ``cegen.cross_entropy`` (and ``vocab_parallel_cross_entropy``)
           captured whole (forward, and backward through ``torch.autograd.grad``) with
           ``torch.cuda.graph`` after a warm-up on a side stream, then replayed on fresh
           inputs written into the static ones; each replay's outputs must equal an eager
           call's on the same inputs (bitwise: the same kernels and ops run). Paths: forward
           (no_grad), forward + backward, overwrite (logits of a matmul made inside the
           graph), fused with the upstream gradient the weights tensor itself, fused
           rescaled (upstream != weights), fused overwrite, vocab-parallel (a group of
           one), and a fused backward meeting a zero-weight token in a replay: its row is
           NaN and the next eager call raises ZeroWeightGradientError, once per replay.
compile    ``torch.compile(fullgraph=True)`` of a small model whose loss is cegen's
           (``h @ W.T`` then ``cegen.cross_entropy``): the plain path (mean), the fused path
           (``grad_weights`` a scalar and per-token, rescaled), each against eager (loss and
           both gradients), with ``torch._dynamo.explain``'s graph-break count (must be 0);
           and the plain path under ``mode="reduce-overhead"`` (Inductor's CUDA graphs).

Results go to OUT/results.json; the last lines printed are a summary table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))

import torch  # noqa: E402

V = 32000


def log(message: str) -> None:
    print(message, flush=True)


def same(a: torch.Tensor, b: torch.Tensor) -> Tuple[bool, bool, float]:
    """(bitwise equal, equal within 1e-6 relative, max abs difference); NaN == NaN."""
    a, b = a.detach().float(), b.detach().float()
    both_nan = torch.isnan(a) & torch.isnan(b)
    diff = torch.where(both_nan, torch.zeros_like(a), (a - b).abs())
    worst = float(diff.max()) if diff.numel() else 0.0
    scale = float(b.abs().max()) if b.numel() else 0.0
    exact = bool(torch.equal(torch.nan_to_num(a, nan=7.0), torch.nan_to_num(b, nan=7.0)))
    return exact, worst <= 1e-6 * max(1.0, scale), worst


class Case:
    """A path: static inputs, a step using them, and a fill with fresh values."""

    def __init__(self, name: str, inputs: Dict[str, torch.Tensor], fill: Callable[[], None],
                 step: Callable[[], Tuple[torch.Tensor, ...]]):
        self.name, self.inputs, self.fill, self.step = name, inputs, fill, step


def capture_and_compare(case: Case, replays: int = 3) -> Dict[str, Any]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    case.fill()
    with torch.cuda.stream(side):
        for _ in range(3):
            case.step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.cuda.graph(graph):
            static_out = case.step()
    refused = [str(w.message) for w in caught if "Overwrite" in type(w.message).__name__]
    rows = []
    for replay in range(replays):
        case.fill()
        graph.replay()
        torch.cuda.synchronize()
        replayed = [t.detach().clone() for t in static_out]
        eager = case.step()
        torch.cuda.synchronize()
        for index, (r, e) in enumerate(zip(replayed, eager)):
            exact, close, worst = same(r, e)
            rows.append({"replay": replay, "output": index, "bitwise": exact, "close": close,
                         "max_abs": worst})
    ok = all(row["close"] for row in rows) and not refused
    return {"pass": ok, "bitwise": all(row["bitwise"] for row in rows),
            "outputs": len(static_out), "replays": replays, "overwrite_refused": refused,
            "worst_abs": max(row["max_abs"] for row in rows)}


def graph_cases(cegen: Any, dev: torch.device, gen: torch.Generator) -> List[Case]:
    n, h_dim = 256, 128
    static = {
        "logits": torch.empty((n, V), dtype=torch.bfloat16, device=dev),
        "labels": torch.empty((n,), dtype=torch.int64, device=dev),
        "g": torch.empty((n,), device=dev),
        "w": torch.empty((n,), device=dev),
        "h": torch.empty((n, h_dim), dtype=torch.bfloat16, device=dev),
        "W": torch.empty((V, h_dim), dtype=torch.bfloat16, device=dev),
    }
    x = static["logits"].requires_grad_(True)
    h = static["h"].requires_grad_(True)
    W = static["W"].requires_grad_(True)
    labels, g, w = static["labels"], static["g"], static["w"]

    def fill() -> None:
        with torch.no_grad():
            static["logits"].copy_(torch.randn((n, V), generator=gen, device=dev) * 3)
            labels.copy_(torch.randint(0, V, (n,), generator=gen, device=dev))
            g.uniform_(0.5, 1.5, generator=gen)
            w.uniform_(0.5, 1.5, generator=gen)
            h.copy_(torch.randn((n, h_dim), generator=gen, device=dev))
            W.copy_(torch.randn((V, h_dim), generator=gen, device=dev) * 0.2)

    def fwd():
        with torch.no_grad():
            return (cegen.cross_entropy(x, labels),)

    def fwd_bwd():
        loss = cegen.cross_entropy(x, labels)
        return (loss,) + torch.autograd.grad(loss, x, g)

    def overwrite():
        loss = cegen.cross_entropy(h @ W.t(), labels, overwrite_input=True)
        return (loss,) + torch.autograd.grad(loss, (h, W), g)

    def fused_same():
        loss = cegen.cross_entropy(x, labels, grad_weights=g)
        return (loss,) + torch.autograd.grad(loss, x, g)

    def fused_rescaled():
        loss = cegen.cross_entropy(x, labels, grad_weights=w)
        return (loss,) + torch.autograd.grad(loss, x, g)

    def fused_scalar_mean():
        loss = cegen.cross_entropy(x, labels, grad_weights=1.0 / n)
        return (loss,) + torch.autograd.grad(loss.mean(), x)

    def fused_overwrite():
        loss = cegen.cross_entropy(h @ W.t(), labels, grad_weights=w, overwrite_input=True)
        return (loss,) + torch.autograd.grad(loss, (h, W), g)

    def vocab_parallel():
        loss = cegen.vocab_parallel_cross_entropy(x, labels)
        return (loss,) + torch.autograd.grad(loss, x, g)

    return [Case(name, static, fill, step) for name, step in (
        ("forward", fwd), ("fwd+bwd", fwd_bwd), ("overwrite", overwrite),
        ("fused, upstream is the weights", fused_same), ("fused, rescaled", fused_rescaled),
        ("fused, scalar weight, loss.mean()", fused_scalar_mean),
        ("fused overwrite", fused_overwrite), ("vocab-parallel", vocab_parallel))]


def zero_weight_in_graph(cegen: Any, dev: torch.device, gen: torch.Generator) -> Dict[str, Any]:
    from cegen import _gradient_status

    n = 64
    x = (torch.randn((n, V), generator=gen, device=dev) * 2).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, V, (n,), generator=gen, device=dev)
    w = torch.ones((n,), device=dev)
    g = torch.ones((n,), device=dev)

    def step():
        loss = cegen.cross_entropy(x, labels, grad_weights=w)
        return torch.autograd.grad(loss, x, g)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (grad,) = step()
    failures = []
    for replay in range(2):
        w.fill_(1.0)
        w[5 + replay] = 0.0  # weight 0, upstream 1: an error in this replay
        graph.replay()
        torch.cuda.synchronize()
        nan_rows = torch.isnan(grad.float()).all(dim=1).nonzero().flatten().tolist()
        if nan_rows != [5 + replay]:
            failures.append(f"replay {replay}: NaN rows {nan_rows}")
        try:
            cegen.cross_entropy(x.detach(), labels)  # the next call: posts the copy
            torch.cuda.synchronize()
            cegen.cross_entropy(x.detach(), labels)  # ... and reports it
            failures.append(f"replay {replay}: not reported by the next calls")
        except _gradient_status.ZeroWeightGradientError as error:
            if "captured into a CUDA graph" not in str(error) or "1 token" not in str(error):
                failures.append(f"replay {replay}: message {error}")
        try:
            _gradient_status.check_fused_gradients(dev)
        except _gradient_status.ZeroWeightGradientError:
            failures.append(f"replay {replay}: reported twice")
    w.fill_(1.0)
    graph.replay()
    _gradient_status.check_fused_gradients(dev)  # a clean replay reports nothing
    return {"pass": not failures, "failures": failures}


def compile_checks(cegen: Any, dev: torch.device, gen: torch.Generator) -> Dict[str, Any]:
    import torch._dynamo

    n, h_dim = 512, 256
    h0 = torch.randn((n, h_dim), generator=gen, device=dev).to(torch.bfloat16)
    w0 = (torch.randn((V, h_dim), generator=gen, device=dev) * 0.1).to(torch.bfloat16)
    labels = torch.randint(0, V, (n,), generator=gen, device=dev)
    upstream = torch.rand((n,), generator=gen, device=dev) + 0.5
    weights = torch.rand((n,), generator=gen, device=dev) + 0.5

    def plain(h, W, y):
        return cegen.cross_entropy(h @ W.t(), y).mean()

    def fused_scalar(h, W, y):
        return cegen.cross_entropy(h @ W.t(), y, grad_weights=1.0).sum()

    def fused_token(h, W, y):
        return (cegen.cross_entropy(h @ W.t(), y, grad_weights=weights) * upstream).sum()

    results: Dict[str, Any] = {}
    for name, fn, mode in (("plain", plain, None), ("fused, scalar weight", fused_scalar, None),
                           ("fused, token weights rescaled", fused_token, None),
                           ("plain, reduce-overhead", plain, "reduce-overhead")):
        entry: Dict[str, Any] = {}
        try:
            if mode is None:
                torch._dynamo.reset()
                explained = torch._dynamo.explain(fn)(h0.clone().requires_grad_(True),
                                                      w0.clone().requires_grad_(True), labels)
                entry["graph_breaks"] = explained.graph_break_count
                entry["break_reasons"] = [str(r.reason)[:300] for r in explained.break_reasons]
            torch._dynamo.reset()
            compiled = torch.compile(fn, fullgraph=True, mode=mode)
            started = time.time()
            grads = []
            for run in ((fn, 1), (compiled, 3)):
                function, times = run
                for _ in range(times):
                    h = h0.clone().requires_grad_(True)
                    W = w0.clone().requires_grad_(True)
                    loss = function(h, W, labels)
                    loss.backward()
                    grads.append((loss.detach().clone(), h.grad.clone(), W.grad.clone()))
            entry["compile_and_run_s"] = round(time.time() - started, 1)
            eager, last = grads[0], grads[-1]
            entry["max_abs"] = [same(a, b)[2] for a, b in zip(last, eager)]
            close = all(torch.allclose(a.float(), b.float(), rtol=2e-2, atol=1e-5)
                        for a, b in zip(last, eager))
            entry["pass"] = close and entry.get("graph_breaks", 0) == 0
        except Exception as error:  # noqa: BLE001
            entry.update(passed=False, error=f"{type(error).__name__}: {str(error)[:1500]}",
                         traceback=traceback.format_exc()[-3000:])
            entry["pass"] = False
        results[name] = entry
        log(f"compile {name}: {json.dumps({k: v for k, v in entry.items() if k != 'traceback'})[:800]}")
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime", help="libce_runtime.so")
    parser.add_argument("--bundles", nargs="+", default=[], help="sm_90 bundle directories")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--parts", default="graphs,compile")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device (test/gpu/test_graphs_compile.py runs on an H100/H200)")
        return 0
    import cegen

    if args.runtime:
        cegen.set_runtime_library(args.runtime)
    cegen.configure(bundle_dirs=args.bundles, run_ce_gen=False)
    dev = torch.device("cuda", 0)
    seed = args.seed if args.seed is not None else int(time.time() * 1000) % (2 ** 31)
    gen = torch.Generator(device=dev).manual_seed(seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: Dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.gmtime()),
                               "seed": seed, "torch": torch.__version__,
                               "device": torch.cuda.get_device_name(dev),
                               "command": " ".join(sys.argv)}
    log(f"test_graphs_compile: seed {seed}, torch {torch.__version__}, {results['device']}")
    parts = args.parts.split(",")
    if "graphs" in parts:
        graphs: Dict[str, Any] = {}
        for case in graph_cases(cegen, dev, gen):
            try:
                graphs[case.name] = capture_and_compare(case)
            except Exception as error:  # noqa: BLE001
                graphs[case.name] = {"pass": False, "error": f"{type(error).__name__}: {error}",
                                     "traceback": traceback.format_exc()[-3000:]}
            log(f"graph {case.name}: {json.dumps({k: v for k, v in graphs[case.name].items() if k != 'traceback'})[:600]}")
        try:
            graphs["fused, zero weight in a replay"] = zero_weight_in_graph(cegen, dev, gen)
        except Exception as error:  # noqa: BLE001
            graphs["fused, zero weight in a replay"] = {
                "pass": False, "error": f"{type(error).__name__}: {error}",
                "traceback": traceback.format_exc()[-3000:]}
        log(f"graph zero weight: {json.dumps(graphs['fused, zero weight in a replay'])[:600]}")
        results["graphs"] = graphs
    if "compile" in parts:
        results["compile"] = compile_checks(cegen, dev, gen)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    log("")
    log(f"{'part':<8} {'case':<36} result")
    ok = True
    for part in ("graphs", "compile"):
        for name, entry in results.get(part, {}).items():
            ok &= bool(entry.get("pass"))
            detail = {k: entry[k] for k in ("bitwise", "graph_breaks", "error", "failures",
                                            "max_abs") if k in entry}
            log(f"{part:<8} {name:<36} {'pass' if entry.get('pass') else 'FAIL'} "
                f"{json.dumps(detail)[:300]}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
