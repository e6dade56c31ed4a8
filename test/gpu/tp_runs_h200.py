#!/usr/bin/env python3
"""Issue 21's two-GPU runs: vocab-parallel linear cross entropy, the outputs and softcap of
``vocab_parallel_cross_entropy``, and its forward and backward in one CUDA graph, at TP = 2.

Not a CI test (CI covers the same logic with gloo groups on the CPU: test_tensor_parallel.py,
test_linear_cross_entropy.py). On a machine with two CUDA GPUs, from the repository root, with
what test/gpu/prepare_tp_run.sh makes under .dev/tp and, for the reference rows of the
benchmark, Megatron-Core's source in .dev/megatron (never committed)::

    python3 test/gpu/tp_runs_h200.py --runtime .dev/tp/lib/libce_runtime.so \\
        --bundles .dev/tp/bundles/* --megatron .dev/megatron --out $OUT

A dry run on the CPU (two gloo processes, the host kernels ce-gen builds on demand from
build/, small shapes, no graph, the benchmark at a toy shape)::

    /usr/bin/python3 test/gpu/tp_runs_h200.py --device cpu --out /tmp/tp-runs

Checks, every rank (the ranks draw the same inputs; rank r holds columns [r V/2, (r+1) V/2)):

1. ``cegen.linear_cross_entropy(hidden, weight_r, labels, tp_group=...)`` (N = 512, H = 256,
   V = 32000, 1/8 of the labels ignored), ``reduction="mean"`` and a per-token upstream
   gradient, f32 and bf16: the loss, ``d hidden`` and the rank's ``d weight`` slice against
   float64 autograd of the same (rounded) inputs and against the TP = 1 call on the whole
   weight on the same GPU.
2. ``cegen.vocab_parallel_cross_entropy`` with ``return_lse/entropy/argmax`` and without and
   with ``logit_softcap=30`` (logits [S, B, V_local] ~ 4 randn, bf16 and f32): loss, lse,
   entropy, the global argmax (exact) and the gradient slice against float64.
3. The vocab-parallel forward and backward captured in one CUDA graph (NCCL all-reduce
   inside) and replayed on fresh inputs: loss and gradient equal to eager calls (CUDA only).

Benchmark (CUDA: N = 8192, H = 4096, V = 128256, bf16, 64128 rows of the weight per rank,
``reduction="mean"``): forward + backward of ``linear_cross_entropy`` against Megatron-Core's
output layer and loss done by hand (``copy_to_tensor_model_parallel_region``, the GEMM,
``vocab_parallel_cross_entropy``, the mean) and against the three GEMMs alone; the time is
the slower rank's median of 5 (an NCCL barrier before each), the memory each rank's peak
beyond what was allocated before the step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from tp_h200 import _free_port, finish_rank, megatron_group, report_checks  # noqa: E402

REPO = Path(__file__).resolve().parent.parent.parent
IGNORE = -100


def _labels(torch: Any, count: int, vocab: int, gen: Any, device: Any) -> Any:
    """Labels ~ U[0, V) with every eighth ignored (the same on every rank: the generator)."""
    labels = torch.randint(0, vocab, (count,), generator=gen, device="cpu").to(device)
    labels[::8] = IGNORE
    return labels


def _error(got: Any, ref: Any) -> float:
    """max |got - ref| over max(1, max |ref|), NaN-aware (a NaN anywhere is infinite)."""
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    if got.shape != ref.shape:
        return float("inf")
    diff = (got - ref).abs()
    if bool(diff.isnan().any()):
        return float("inf")
    scale = max(1.0, float(ref.abs().max())) if ref.numel() else 1.0
    return float(diff.max()) / scale if diff.numel() else 0.0


def _record(out: List[Dict[str, Any]], name: str, errors: Dict[str, float],
            tolerance: float, grad_tolerance: Optional[float] = None) -> None:
    """``grad_tolerance``: that of the key "grad" (a gradient stored in bf16: its ulps)."""
    limits = {key: grad_tolerance if key == "grad" and grad_tolerance else tolerance
              for key in errors}
    ok = all(errors[key] <= limits[key] for key in errors)
    out.append({"name": name, "ok": ok, "tolerance": limits,
                "errors": {key: f"{value:.3g}" for key, value in errors.items()}})


def check_linear(torch: Any, rank: int, world: int, group: Any, device: Any,
                 out: List[Dict[str, Any]]) -> None:
    """Run 1's checks (see the module's docstring)."""
    import cegen
    cpu = device.type == "cpu"
    N, H, V = (96, 32, 1000) if cpu else (512, 256, 32000)
    local = V // world
    start = rank * local
    gen = torch.Generator().manual_seed(21)
    hidden0 = torch.randn(N, H, generator=gen) * 0.5
    weight0 = torch.randn(V, H, generator=gen) * 0.05
    labels = _labels(torch, N, V, gen, device)
    upstream0 = torch.randn(N, generator=gen)
    # gloo's all-reduce (the dry run's) takes no bf16 d hidden; NCCL's does.
    for dtype in (torch.float32,) if cpu else (torch.float32, torch.bfloat16):
        hidden_in = hidden0.to(dtype)
        weight_in = weight0.to(dtype)
        for schedule in ("mean", "per-token"):
            upstream = upstream0.to(device)

            def run(weight_full: Any, tp: bool) -> Any:
                h = hidden_in.clone().to(device).requires_grad_(True)
                w = (weight_full[start:start + local] if tp else weight_full).clone()
                w = w.to(device).requires_grad_(True)
                kwargs = dict(ignore_index=IGNORE, chunk_tokens=N // 3 + 1)
                if tp:
                    kwargs["tp_group"] = group
                if schedule == "mean":
                    loss = cegen.linear_cross_entropy(h, w, labels, reduction="mean", **kwargs)
                    loss.backward()
                else:
                    loss = cegen.linear_cross_entropy(h, w, labels, **kwargs)
                    loss.backward(upstream)
                return loss.detach(), h.grad, w.grad

            loss, d_hidden, d_weight = run(weight_in, True)
            loss1, d_hidden1, d_weight1 = run(weight_in, False)
            h64 = hidden_in.double().detach().requires_grad_(True)
            w64 = weight_in.double().detach().requires_grad_(True)
            logits = h64 @ w64.t()
            valid = labels.cpu() != IGNORE
            safe = torch.where(valid, labels.cpu(), torch.zeros_like(labels.cpu()))
            per_token = torch.logsumexp(logits, -1) - logits.gather(1, safe[:, None])[:, 0]
            per_token = torch.where(valid, per_token, torch.zeros_like(per_token))
            if schedule == "mean":
                ref = per_token.sum() / valid.sum()
                ref.backward()
            else:
                ref = per_token
                ref.backward(upstream0.double())
            tolerance = 2e-5 if dtype == torch.float32 else 2e-2
            name = f"linear tp{world} {schedule} {str(dtype).split('.')[-1]}"
            _record(out, name + " vs float64", {
                "loss": _error(loss, ref), "d_hidden": _error(d_hidden, h64.grad),
                "d_weight": _error(d_weight, w64.grad[start:start + local])}, tolerance)
            _record(out, name + " vs tp1", {
                "loss": _error(loss, loss1), "d_hidden": _error(d_hidden, d_hidden1),
                "d_weight": _error(d_weight, d_weight1[start:start + local])}, tolerance)


def _outputs_reference(torch: Any, x: Any, labels_bs: Any, upstream_bs: Any, cap: Optional[float],
                       start: int, local: int) -> Dict[str, Any]:
    """float64 loss, lse, entropy, argmax ([B, S]) and the gradient slice ([S, B, local]) of
    the whole logits ``x`` [S, B, V]."""
    x = x.double().requires_grad_(True)
    z = cap * torch.tanh(x / cap) if cap else x
    lse = torch.logsumexp(z, -1)                                   # [S, B]
    p = torch.softmax(z, -1)
    labels = labels_bs.t().cpu()
    valid = labels != IGNORE
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    loss = torch.where(valid, lse - z.gather(-1, safe[..., None])[..., 0], torch.zeros_like(lse))
    loss.backward(upstream_bs.t().double().cpu())
    return {"loss": loss.detach().t(), "lse": lse.detach().t(),
            "entropy": (lse - (p * z).sum(-1)).detach().t(), "argmax": z.argmax(-1).t(),
            "grad": x.grad[..., start:start + local]}


def check_outputs(torch: Any, rank: int, world: int, group: Any, device: Any,
                  out: List[Dict[str, Any]]) -> None:
    """Run 2's checks (see the module's docstring)."""
    import cegen
    cpu = device.type == "cpu"
    S, B, V = (16, 2, 1000) if cpu else (128, 4, 32000)
    local = V // world
    start = rank * local
    gen = torch.Generator().manual_seed(22)
    x0 = torch.randn(S, B, V, generator=gen) * 4
    labels = _labels(torch, S * B, V, gen, device).view(B, S)
    upstream = torch.randn(B, S, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        x_full = x0.to(dtype)
        for cap in (None, 30.0):
            x = x_full[..., start:start + local].contiguous().to(device).requires_grad_(True)
            result = cegen.vocab_parallel_cross_entropy(
                x, labels, group=group, ignore_index=IGNORE, logit_softcap=cap,
                return_lse=True, return_entropy=True, return_argmax=True)
            result.loss.backward(upstream.to(device))
            ref = _outputs_reference(torch, x_full, labels, upstream, cap, start, local)
            # The softcap's z is within 16 ulps of the cap of float64's (lowering.md).
            tolerance = 2e-5 if cap is None else 2e-4
            name = f"outputs tp{world} {str(dtype).split('.')[-1]} cap={cap}"
            _record(out, name, {
                "loss": _error(result.loss, ref["loss"]), "lse": _error(result.lse, ref["lse"]),
                "entropy": _error(result.entropy, ref["entropy"]),
                "grad": _error(x.grad, ref["grad"])}, tolerance,
                # A bf16 gradient: two ulps of bf16 at the largest |gradient| (<= 1).
                grad_tolerance=2.0 ** -7 if dtype == torch.bfloat16 else None)
            same = torch.equal(result.argmax.cpu(), ref["argmax"])
            out.append({"name": name + " argmax", "ok": bool(same),
                        "errors": {"rows differing":
                                   int((result.argmax.cpu() != ref["argmax"]).sum())}})


def check_graph(torch: Any, rank: int, world: int, group: Any, device: Any,
                out: List[Dict[str, Any]]) -> None:
    """Run 3: forward and backward in one CUDA graph, replayed, against eager calls."""
    import cegen
    S, B, V = 256, 4, 32000
    local = V // world
    gen = torch.Generator().manual_seed(23)

    def draw() -> Any:
        x = torch.randn(S, B, V, generator=gen) * 4
        return (x[..., rank * local:(rank + 1) * local].contiguous().to(torch.bfloat16),
                _labels(torch, S * B, V, gen, "cpu").view(B, S), torch.randn(B, S, generator=gen))

    x = torch.zeros(S, B, local, dtype=torch.bfloat16, device=device, requires_grad=True)
    labels = torch.zeros(B, S, dtype=torch.int64, device=device)
    upstream = torch.zeros(B, S, device=device)

    def step() -> Any:
        loss = cegen.vocab_parallel_cross_entropy(x, labels, group=group, ignore_index=IGNORE)
        loss.backward(upstream)
        return loss

    first = draw()
    with torch.no_grad():
        x.copy_(first[0]), labels.copy_(first[1]), upstream.copy_(first[2])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up outside the capture (NCCL's communicator, cegen's kernels)
            x.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step()
    static_grad = x.grad
    for trial in range(3):
        inputs = draw()
        with torch.no_grad():
            x.copy_(inputs[0]), labels.copy_(inputs[1]), upstream.copy_(inputs[2])
        graph.replay()
        torch.cuda.synchronize()
        eager_x = inputs[0].to(device).requires_grad_(True)
        eager = cegen.vocab_parallel_cross_entropy(eager_x, inputs[1].to(device), group=group,
                                                   ignore_index=IGNORE)
        eager.backward(inputs[2].to(device))
        equal = torch.equal(static_loss, eager) and torch.equal(static_grad, eager_x.grad)
        out.append({"name": f"graph tp{world} replay {trial}", "ok": bool(equal),
                    "errors": {"loss": f"{_error(static_loss, eager):.3g}",
                               "grad": f"{_error(static_grad, eager_x.grad):.3g}"}})


def _timed(torch: Any, device: Any, group: Any, fn: Callable[[], Any],
           setup: Optional[Callable[[], Any]] = None, reps: int = 5) -> Dict[str, float]:
    """Median ms of ``reps`` calls (two warm-ups), peak memory beyond the allocation before
    (``setup``, untimed, first: the previous call's gradients released)."""
    import torch.distributed as dist
    cuda = device.type == "cuda"
    barrier = torch.ones(1, device=device)
    for _ in range(2):
        fn()
    times, peaks = [], []
    for _ in range(reps):
        if setup:
            setup()
        dist.all_reduce(barrier, group=group)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(begin.elapsed_time(end))
            peaks.append((torch.cuda.max_memory_allocated() - before) / 2 ** 30)
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    return {"ms": statistics.median(times), "extra_GiB": max(peaks) if peaks else float("nan")}


def bench_linear(torch: Any, rank: int, world: int, group: Any, device: Any, megatron: bool,
                 out: Dict[str, Any]) -> None:
    """Run 1's timing and memory (see the module's docstring)."""
    import cegen
    cpu = device.type == "cpu"
    N, H, V = (256, 64, 2000) if cpu else (8192, 4096, 128256)
    dtype = torch.float32 if cpu else torch.bfloat16
    local = V // world
    gen = torch.Generator(device=device).manual_seed(24 + rank)
    hidden = (torch.randn(N, H, generator=gen, device=device) * 0.5).to(dtype)
    hidden = hidden.requires_grad_(True)
    weight = (torch.randn(local, H, generator=gen, device=device) * 0.02).to(dtype)
    weight = weight.requires_grad_(True)
    labels = _labels(torch, N, V, torch.Generator().manual_seed(25), device)

    def clear() -> None:
        hidden.grad = None
        weight.grad = None

    def cegen_step() -> None:
        cegen.linear_cross_entropy(hidden, weight, labels, ignore_index=IGNORE,
                                   reduction="mean", tp_group=group).backward()

    def gemms() -> None:
        with torch.no_grad():
            logits = hidden @ weight.t()
            logits @ weight
            logits.t() @ hidden

    rows = {"cegen linear_cross_entropy fwd+bwd": _timed(torch, device, group, cegen_step, clear),
            "three GEMMs alone": _timed(torch, device, group, gemms, clear)}
    if megatron:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy as mcore_ce
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        def megatron_step() -> None:
            logits = copy_to_tensor_model_parallel_region(hidden) @ weight.t()
            losses = mcore_ce(logits.view(N, 1, local), labels.view(N, 1).clamp(min=0))
            valid = (labels != IGNORE).view(N, 1)
            (losses * valid).sum().div(valid.sum()).backward()

        rows["megatron-core output layer + vocab_parallel_cross_entropy"] = _timed(
            torch, device, group, megatron_step, clear)
    out["rows"] = rows
    out["shape"] = {"N": N, "H": H, "V": V, "V_local": local, "dtype": str(dtype)}


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    sys.path.insert(0, str(REPO / "python"))
    if args.megatron:
        sys.path.insert(0, str(Path(args.megatron).resolve()))
    import cegen
    cuda = args.device == "cuda"
    if cuda:
        cegen.configure(runtime_library=str(Path(args.runtime).resolve()),
                        bundle_dirs=tuple(str(Path(b).resolve()) for b in args.bundles),
                        run_ce_gen=False)
        torch.cuda.set_device(rank)
    else:
        cegen.configure(cache_dir=str(Path(args.out) / "cache"))
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    result: Dict[str, Any] = {"rank": rank, "device": torch.cuda.get_device_name(rank)
                              if cuda else "cpu", "started": time.strftime("%H:%M:%S")}
    group = dist.group.WORLD
    megatron = False
    if args.megatron:
        tp_group = megatron_group(world, result)
        if tp_group is not None:
            group, megatron = tp_group, True
    checks: List[Dict[str, Any]] = []
    parts = [("linear", check_linear), ("outputs", check_outputs)]
    if cuda:
        parts.append(("graph", check_graph))
    for name, part in parts:
        try:
            part(torch, rank, world, group, device, checks)
        except Exception:  # noqa: BLE001 - every rank fails alike; the next part still runs
            result[f"{name}_error"] = traceback.format_exc()[-3000:]
        print(f"rank {rank}: {name} done", flush=True)
    result["checks"] = checks
    finish_rank(args, result,
                lambda out: bench_linear(torch, rank, world, group, device, megatron, out),
                f"tp_runs_rank{rank}.json")


def report(args: argparse.Namespace, world: int) -> int:
    results = [json.loads((Path(args.out) / f"tp_runs_rank{r}.json").read_text())
               for r in range(world)]
    failed = report_checks(results, show_passed=True)
    benches = [r["bench"] for r in results if r.get("bench")]
    if benches and all("rows" in b for b in benches):
        shape = benches[0]["shape"]
        print(f"\nN={shape['N']} H={shape['H']} V={shape['V']} over {world} ranks "
              f"(V_local={shape['V_local']}), {shape['dtype']}, reduction mean")
        print("| step | ms (slower rank) | extra GiB (larger rank) |\n|---|---:|---:|")
        for name in benches[0]["rows"]:
            ms = max(b["rows"][name]["ms"] for b in benches)
            extra = max(b["rows"][name]["extra_GiB"] for b in benches)
            print(f"| {name} | {ms:.3f} | {extra:.2f} |")
    print(f"{failed} failures")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--runtime", help="libce_runtime.so (CUDA)")
    parser.add_argument("--bundles", nargs="*", default=[], help="sm_90 bundle directories")
    parser.add_argument("--megatron", default=None, help="Megatron-Core's source (optional)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--no-bench", action="store_true")
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    import torch
    import torch.multiprocessing as mp
    if args.device == "cuda":
        if not args.runtime or not args.bundles:
            parser.error("--device cuda needs --runtime and --bundles")
        if torch.cuda.device_count() < args.world:
            print(f"needs {args.world} GPUs, found {torch.cuda.device_count()}")
            return 2
    mp.spawn(worker, args=(args.world, _free_port(), args), nprocs=args.world, join=True)
    return report(args, args.world)


if __name__ == "__main__":
    sys.exit(main())
