#!/usr/bin/env python3
"""Vocab-parallel cross entropy on two CUDA GPUs with NCCL: checks, then a benchmark.

Not a CI test (CI runs the gloo tests in test/python/test_tensor_parallel.py). On a
machine with two GPUs, from the repository root, with what test/gpu/prepare_tp_run.sh
makes under .dev/tp (runtime library and sm_90 bundles) and, optionally, Megatron-Core's
source in .dev/megatron (never committed)::

    python3 test/gpu/tp_h200.py --runtime .dev/tp/lib/libce_runtime.so \\
        --bundles .dev/tp/bundles --megatron .dev/megatron --out $OUT

Two processes, one per GPU, one NCCL group (rendezvous on a free TCP port).

Checks (each rank, S=256, B=4, V=32000 split in two, bf16 and f32 logits ~ 4*randn,
labels [B, S] ~ U[0, V) with 1/8 ignored (-100)): cegen.vocab_parallel_cross_entropy's
per-token loss and logits-gradient slice (upstream gradient ~ randn, overwrite-input off
and on) against a float64 reference of the same formula on the full logits (Megatron's
local smoothing, global smoothing, z-loss), against the single-GPU cegen kernels on the
full vocabulary (TP=1), and against Megatron-Core's own vocab_parallel_cross_entropy on the
same two-rank group when its source is given. A bad label raises LabelOutOfRangeError.

Benchmark (S=4096, B=2: N=8192 tokens, V=128256, bf16, each GPU holding 64128 columns):
forward (statistics kernel + one all-reduce + combine), backward with overwrite-input, and
both; the all-reduce and the combine alone; Megatron-Core's vocab_parallel_cross_entropy
forward and forward+backward on the same tensors; the single-GPU cegen kernels on the
whole vocabulary. Timing as bench/gpu_bench.py (L2 flush, GPU sleep, CUDA events, medians)
plus an NCCL barrier before each timed call so both GPUs start together; the reported time
is the slower rank's median. Floors: per GPU N*V_local*2 bytes read (forward) and twice
that moved (backward), over the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import traceback
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parent.parent.parent
IGNORE = -100


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def reference(x: Any, labels: Any, g: Any, *, alpha: float, z: float, global_smoothing: bool,
              start: int, stop: int) -> Any:
    """float64 per-token loss and gradient slice [start, stop) of one rank ([N, V] logits,
    [N] labels). Local smoothing: Megatron's V_s = V_local and the slice's own mean."""
    import torch
    x = x.double()
    vocab, local = x.shape[-1], stop - start
    lse = torch.logsumexp(x, dim=-1)
    valid = labels != IGNORE
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    target = x.gather(-1, safe[:, None])[:, 0]
    loss = lse - target
    grad = torch.exp(x[:, start:stop] - lse[:, None])
    if z:
        grad = grad * (1 + 2 * z * lse[:, None])
    onehot = torch.zeros_like(grad)
    in_slice = (safe >= start) & (safe < stop)
    onehot[in_slice, (safe - start)[in_slice]] = 1.0
    if alpha:
        vs = vocab if global_smoothing else local
        s = alpha * vs / (vs - 1)
        mean = x.mean(-1) if global_smoothing else x[:, start:stop].mean(-1)
        loss = (1 - s) * loss + s * (lse - mean)
        grad = grad - (1 - s) * onehot - s / vs
    else:
        grad = grad - onehot
    if z:
        loss = loss + z * lse * lse
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    grad = torch.where(valid[:, None], grad * g.double()[:, None], torch.zeros_like(grad))
    return loss, grad


def _probe_class() -> Any:
    import torch

    class Probe(torch.autograd.Function):
        """Identity into a fresh buffer; records where its output and its gradient live."""

        pointers: Dict[str, int] = {}

        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            out = x.detach().clone()
            Probe.pointers["out"] = out.data_ptr()
            return out

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            Probe.pointers["grad"] = grad.data_ptr()
            return grad

    return Probe


def run_checks(rank: int, world: int, group: Any, megatron: bool, out: List[Dict[str, Any]]) -> None:
    import torch
    import cegen
    from cegen import _kernels
    from cegen import tensor_parallel as tp

    device = torch.device("cuda", rank)
    Probe = _probe_class()
    S, B, V = 256, 4, 32000
    local = V // world
    start, stop = rank * local, (rank + 1) * local
    for dtype in (torch.bfloat16, torch.float32):
        gen = torch.Generator(device=device).manual_seed(1234)
        full = (4 * torch.randn(S, B, V, generator=gen, device=device)).to(dtype)
        labels = torch.randint(0, V, (B, S), generator=gen, device=device)
        labels[torch.rand(B, S, generator=gen, device=device) < 0.125] = IGNORE
        g = torch.randn(B, S, generator=gen, device=device)
        # [B, S] token order for the reference.
        x_bs = full.transpose(0, 1).reshape(B * S, V)
        for alpha, z, glob in ((0.0, 0.0, False), (0.1, 0.0, False), (0.1, 0.0, True),
                               (0.0, 1e-4, False)):
            ref_loss, ref_grad = reference(x_bs, labels.reshape(-1), g.reshape(-1), alpha=alpha,
                                           z=z, global_smoothing=glob, start=start, stop=stop)
            for overwrite in (False, True):
                leaf = full[..., start:stop].clone().requires_grad_(True)
                Probe.pointers.clear()
                with _kernels.poison_outputs():
                    # Non-leaf logits that nothing else references, as a model's output.
                    loss = tp.vocab_parallel_cross_entropy(
                        Probe.apply(leaf), labels, group=group, ignore_index=IGNORE,
                        label_smoothing=alpha, z_loss=z, global_smoothing=glob,
                        overwrite_input=overwrite)
                    loss.backward(g)
                grad = leaf.grad
                shares = Probe.pointers["out"] == Probe.pointers["grad"]
                grad_bs = grad.transpose(0, 1).reshape(B * S, local).double()
                loss_err = (loss.double().reshape(-1) - ref_loss).abs().max().item()
                scale = ref_grad.abs().max().item()
                grad_err = (grad_bs - ref_grad).abs().max().item()
                tol_grad = (2 ** -7 if dtype == torch.bfloat16 else 1e-5) * max(scale, 1e-3)
                ok = (loss_err < 2e-4 * max(1.0, ref_loss.abs().max().item())
                      and grad_err <= tol_grad and shares == overwrite)
                out.append({"check": "reference", "dtype": str(dtype), "alpha": alpha, "z": z,
                            "global_smoothing": glob, "overwrite": overwrite,
                            "loss_err": loss_err, "grad_err": grad_err, "grad_tol": tol_grad,
                            "grad_in_logits": shares, "ok": ok})
                # TP=1: the single-GPU kernels on the whole vocabulary give the same loss
                # (unless local smoothing, which is defined per slice) and gradient slice.
                if not (alpha and not glob):
                    whole = full.clone().requires_grad_(True)
                    loss1 = cegen.cross_entropy(whole, labels, ignore_index=IGNORE,
                                                label_smoothing=alpha, z_loss=z)
                    loss1.backward(g)
                    d_loss = (loss1 - loss).abs().max().item()
                    d_grad = (whole.grad[..., start:stop].float() - grad.float()).abs().max().item()
                    out.append({"check": "tp1", "dtype": str(dtype), "alpha": alpha, "z": z,
                                "overwrite": overwrite, "loss_diff": d_loss, "grad_diff": d_grad,
                                "ok": d_loss < 2e-4 and d_grad <= tol_grad})
        if megatron:
            from megatron.core.tensor_parallel import vocab_parallel_cross_entropy as mcore_ce
            for alpha in (0.0, 0.1):
                ours_logits = full[..., start:stop].clone().requires_grad_(True)
                theirs_logits = full[..., start:stop].clone().float().requires_grad_(True)
                valid = labels != IGNORE
                safe = torch.where(valid, labels, torch.zeros_like(labels))
                ours = tp.vocab_parallel_cross_entropy(ours_logits, safe, group=group,
                                                       label_smoothing=alpha)
                theirs = mcore_ce(theirs_logits, safe.t().contiguous(), alpha).t()
                ours.backward(g)
                theirs.backward(g)
                d_loss = (ours - theirs).abs().max().item()
                d_grad = (ours_logits.grad.float() - theirs_logits.grad).abs().max().item()
                tol = 2 ** -7 * theirs_logits.grad.abs().max().item()
                out.append({"check": "megatron-core", "dtype": str(dtype), "alpha": alpha,
                            "loss_diff": d_loss, "grad_diff": d_grad, "grad_tol": tol,
                            "ok": d_loss < 1e-3 and d_grad <= tol})
    # A bad label raises on every rank.
    logits = torch.randn(16, 4, local, device=device, dtype=torch.bfloat16)
    bad = torch.randint(0, V, (4, 16), device=device)
    bad[1, 7] = V + 5
    try:
        tp.vocab_parallel_cross_entropy(logits, bad, group=group, ignore_index=IGNORE)
        cegen.check_labels(device)
        out.append({"check": "bad label", "ok": False, "why": "no error"})
    except cegen.LabelOutOfRangeError as error:
        out.append({"check": "bad label", "ok": True, "message": str(error)[:300]})


def run_bench(rank: int, world: int, group: Any, megatron: bool, out: Dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from cegen import _kernels
    from cegen import tensor_parallel as tp
    sys.path.insert(0, str(REPO / "bench"))
    from gpu_bench import Dev, time_step

    torch.cuda.set_device(rank)
    dev = Dev(torch, "cuda")
    S, B, V = 4096, 2, 128256
    local = V // world
    start = rank * local
    gen = torch.Generator(device=dev.device).manual_seed(7)
    pristine = torch.randn(S, B, local, generator=gen, device=dev.device).to(torch.bfloat16)
    labels = torch.randint(0, V, (B, S), generator=gen, device=dev.device)
    g = torch.randn(B, S, generator=gen, device=dev.device)
    logits = pristine.clone()
    options = _kernels.KernelOptions(ignore_index=IGNORE,
                                     shard=_kernels.Shard(start, V))
    ones = torch.ones(1, device=dev.device)

    def setup():
        logits.copy_(pristine)
        dist.all_reduce(ones, group=group)  # both GPUs start the timed call together

    def fwd():
        return tp._sharded_forward(logits, labels, group, rank, world, options)

    loss, lse, lse_low = fwd()  # (loss, lse, lse's low part): tensor_parallel._sharded_forward
    gathered = torch.zeros(world, B, S, 4, device=dev.device)
    _kernels.shard_stats(logits, labels, options, out=gathered[rank])

    def allreduce():
        dist.all_reduce(gathered, group=group)

    def combine():
        return tp.combine_shard_stats(gathered, labels, ignore_index=IGNORE, label_smoothing=0.0,
                                      z_loss=0.0, vocab_local=local, vocab=V,
                                      global_smoothing=False, rank=rank)

    def stats_only():
        _kernels.shard_stats(logits, labels, options, out=gathered[rank])

    def bwd_ow():
        _kernels.backward(logits, labels, lse, g, options, overwrite=True, lse_low=lse_low)

    def fwd_bwd_ow():
        loss_, lse_, low_ = fwd()
        _kernels.backward(logits, labels, lse_, g, options, overwrite=True, lse_low=low_)

    rows = {}
    for name, step in (("cegen tp fwd", fwd), ("cegen shard_stats kernel", stats_only),
                       ("all_reduce 16 B/token", allreduce), ("combine", combine),
                       ("cegen tp bwd_ow", bwd_ow), ("cegen tp fwd+bwd_ow", fwd_bwd_ow)):
        rows[name] = time_step(dev, step, setup, None)
    if megatron:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy as mcore_ce
        labels_sb = labels.t().contiguous()
        holder = {}

        def mc_setup():
            setup()
            holder["x"] = pristine.clone().requires_grad_(True)

        def mc_fwd():
            with torch.no_grad():
                return mcore_ce(holder["x"], labels_sb, 0.0)

        def mc_fwd_bwd():
            loss_ = mcore_ce(holder["x"], labels_sb, 0.0)
            loss_.backward(g.t())

        rows["megatron-core fwd"] = time_step(dev, mc_fwd, mc_setup, None)
        rows["megatron-core fwd+bwd"] = time_step(dev, mc_fwd_bwd, mc_setup, None)
    # The copy bandwidth of this GPU (read + written), for the floors.
    src = torch.empty(2 * 1024 ** 3, dtype=torch.uint8, device=dev.device)
    dst = torch.empty_like(src)
    copy = time_step(dev, lambda: dst.copy_(src), None, 20)
    out["copy_TBps"] = 2 * src.numel() / copy["ms"] / 1e9
    src = dst = None  # released before the next part
    out["rows"] = rows
    out["shape"] = {"S": S, "B": B, "V": V, "V_local": local}


def megatron_group(world: int, result: Dict[str, Any]) -> Any:
    """Megatron-Core's tensor-parallel group of ``world`` ranks (``initialize_model_parallel``),
    or None with the reason in ``result["megatron_error"]``."""
    try:
        from megatron.core import parallel_state
        parallel_state.initialize_model_parallel(world, 1, create_gloo_process_groups=False)
        return parallel_state.get_tensor_model_parallel_group()
    except Exception:  # noqa: BLE001 - recorded, the rest runs without it
        result["megatron_error"] = traceback.format_exc()[-2000:]
        return None


def finish_rank(args: argparse.Namespace, result: Dict[str, Any], bench: Any, name: str) -> None:
    """Runs ``bench(out)`` unless ``--no-bench`` (an exception is recorded), then writes this
    rank's ``result`` as ``OUT/name`` and leaves the process group."""
    import torch.distributed as dist
    out: Dict[str, Any] = {}
    if not args.no_bench:
        try:
            bench(out)
        except Exception:  # noqa: BLE001
            result["bench_error"] = traceback.format_exc()[-3000:]
    result["bench"] = out
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / name).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    sys.path.insert(0, str(REPO / "python"))
    if args.megatron:
        sys.path.insert(0, str(Path(args.megatron).resolve()))
    import cegen
    cegen.configure(runtime_library=str(Path(args.runtime).resolve()),
                    bundle_dirs=tuple(str(Path(b).resolve()) for b in args.bundles),
                    run_ce_gen=False)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    result: Dict[str, Any] = {"rank": rank, "device": torch.cuda.get_device_name(rank)}
    group = megatron_group(world, result) if args.megatron else None
    megatron = group is not None
    checks: List[Dict[str, Any]] = []
    try:
        run_checks(rank, world, group, megatron, checks)
    except Exception:  # noqa: BLE001
        result["checks_error"] = traceback.format_exc()[-3000:]
    result["checks"] = checks
    finish_rank(args, result, lambda out: run_bench(rank, world, group, megatron, out),
                f"tp_rank{rank}.json")


def report_checks(results: List[Dict[str, Any]], show_passed: bool = False) -> int:
    """Prints each rank's errors (a part that raised; Megatron's absence is not a failure)
    and failed checks (every check with ``show_passed``); returns the failures."""
    failed = 0
    for result in results:
        for key in sorted(k for k in result if k.endswith("_error")):
            print(f"rank {result['rank']} {key}:\n{result[key]}")
            failed += key != "megatron_error"
        for check in result["checks"]:
            if show_passed or not check["ok"]:
                print(("ok    " if check["ok"] else "FAIL  ") + f"rank {result['rank']} "
                      f"{check.get('name', '')}: {check.get('errors', check)}")
            failed += not check["ok"]
        print(f"rank {result['rank']}: {sum(c['ok'] for c in result['checks'])}/"
              f"{len(result['checks'])} checks passed")
    return failed


def report(args: argparse.Namespace, world: int) -> int:
    results = [json.loads((Path(args.out) / f"tp_rank{r}.json").read_text()) for r in range(world)]
    failed = report_checks(results)
    benches = [r["bench"] for r in results if r["bench"]]
    if benches and all("rows" in b for b in benches):
        shape = benches[0]["shape"]
        copy = min(b["copy_TBps"] for b in benches)
        read_bytes = shape["S"] * shape["B"] * shape["V_local"] * 2
        floors = {"fwd": read_bytes, "bwd": 2 * read_bytes, "fwd+bwd": 3 * read_bytes}
        print(f"\nS={shape['S']} B={shape['B']} V={shape['V']} over {world} GPUs "
              f"(V_local={shape['V_local']}), bf16; copy {copy:.2f} TB/s")
        print(f"{'step':32s} {'ms (slower rank)':>16s} {'% of floor':>10s}")
        for name in benches[0]["rows"]:
            ms = max(b["rows"][name]["ms"] for b in benches)
            kind = ("fwd+bwd" if "fwd+bwd" in name else "bwd" if "bwd" in name else
                    "fwd" if ("fwd" in name or "shard_stats" in name) else None)
            pct = f"{100 * floors[kind] / (ms * 1e-3) / (copy * 1e12):.0f}%" if kind else ""
            print(f"{name:32s} {ms:16.3f} {pct:>10s}")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime", required=True)
    parser.add_argument("--bundles", nargs="+", required=True)
    parser.add_argument("--megatron", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--no-bench", action="store_true")
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    import torch
    import torch.multiprocessing as mp
    if torch.cuda.device_count() < args.world:
        print(f"needs {args.world} GPUs, found {torch.cuda.device_count()}")
        return 2
    mp.spawn(worker, args=(args.world, _free_port(), args), nprocs=args.world, join=True)
    return report(args, args.world)


if __name__ == "__main__":
    sys.exit(main())
