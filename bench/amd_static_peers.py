#!/usr/bin/env python3
"""Compiles the peers' Triton cross-entropy kernels for gfx942, gfx950, gfx90a and sm_90 (issue 19, item 3).

Runs where Triton 3.6 and PyTorch with a CUDA GPU are (the device machine; no ROCm needed: Triton's
HIP backend compiles and links in-process). The peers are imported unmodified from DIR (never
committed; ``.dev/peers-amd/SOURCES.md`` names the commits)::

    flash_attn/ops/triton/cross_entropy.py     flash-attention 2.8.4 (bench/peers.py's flash_ce)
    liger_kernel/ops/cross_entropy.py, ...     Liger-Kernel 0.8.2 (liger_ce)
    primus_turbo/triton/cross_entropy.py       Primus-Turbo's kernels
    primus_turbo/pytorch/ops/cross_entropy.py  its autograd wrapper (block and warps chosen there)

How each kernel gets its compile-time arguments: every peer's own Python wrapper is called on CUDA
tensors of the benchmark's shapes (bf16 logits, int64 labels; bench/gpu_bench.py's five shapes),
with ``JITFunction.run`` replaced by a recorder that launches nothing. For each recorded launch and
each target, the recorder does what ``JITFunction.run`` does on a miss, with that target's backend:
the binder (``create_function_from_signature``) turns the real arguments into the specialization
(16-byte alignment, integers equal to 1 or divisible by 16, and on HIP the buffer-ops ``pointer_range
32`` mark for tensors of at most 2 GiB, decided from the tensor's real storage size), then
``JITFunction._pack_args`` gives signature, constexprs, attributes and options, and
``triton.compile(ASTSource(...), target=GPUTarget("hip", CHIP, 64))`` compiles. Wrappers that choose
differently on ROCm (Liger: ``num_warps`` 16 on HIP, 32 on CUDA) run twice: once with their
``is_hip()`` answering True, for the AMD targets, and once as they are, for sm_90. For sm_90 the
JIT's own compilation (``run(..., warmup=True)``) is done too and its PTX compared with ours, which
checks the recorder.

Cases (the calls bench/peers.py times, plus Primus-Turbo's): flash ``fwd`` (no grad) and
``fwd+bwd`` with ``inplace_backward`` False/True (forward kernel, then its backward kernel); Liger
``fwd`` (no grad: ``HAS_GRADIENTS`` False) and ``fused`` (grad: the kernel writes the gradient over
the logits) for reduction ``none`` and ``mean`` (its backward is a torch multiply, or nothing, and is
not a Triton kernel); Primus ``fwd+bwd`` with ``overwrite_input`` False (the forward copies the logits)
and True.

Writes OUT/peers-amd.tar.gz: ``index.json`` (versions, every record, which shapes share a compiled
kernel), and per distinct kernel ``NAME.hsaco``, ``NAME.amdgcn``, ``NAME.json`` (Triton's metadata)
for AMD, ``NAME.ptx``, ``NAME.cubin``, ``NAME.sass`` for sm_90. With ``--cegen-ptx DIR``, each
``*.ptx`` under DIR (cegen's sm_90 kernels) is assembled by ptxas for sm_90 too (``cegen-sm90/``: SASS
and ``ptxas -v``), for the calibration in bench/amd_static_table.py.

    python3 bench/amd_static_peers.py --peers .dev/peers-amd --out $OUT \\
        --cegen-ptx .dev/amd-static/cegen-sm90
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import inspect
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tarfile
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Tuple

SHAPES = [(8192, 128256), (16384, 32000), (4096, 151936), (8192, 50304), (32768, 128256)]
CHIPS = ["gfx942", "gfx950", "gfx90a"]
MODULES = {
    "flash": "flash_attn.ops.triton.cross_entropy",
    "liger": "liger_kernel.ops.cross_entropy",
    "primus": "primus_turbo.pytorch.ops.cross_entropy",
}

# filled by the recorder
FNS: Dict[str, Any] = {}
JOBS: Dict[str, Dict[str, Any]] = {}
RECORDS: List[Dict[str, Any]] = []
STATE: Dict[str, Any] = {"label": None, "mode": None, "targets": []}


def log(*parts: Any) -> None:
    print(*parts, flush=True)


def jit_of(obj: Any) -> Any:
    """The JITFunction under a Heuristics/Autotuner wrapper."""
    from triton.runtime.jit import JITFunction
    while not isinstance(obj, JITFunction):
        obj = obj.fn
    return obj


def run_adds_instrumentation() -> bool:
    from triton.runtime.jit import JITFunction
    return "instrumentation_mode" in inspect.getsource(JITFunction.run)


def specialize(fn: Any, args: Tuple, kwargs: Dict[str, Any], target: Any) -> Tuple[Any, ...]:
    """What JITFunction.run computes on a cache miss, for `target` instead of the current device."""
    from triton import knobs
    from triton.compiler import make_backend
    try:
        from triton.runtime.jit import create_function_from_signature
    except ImportError:
        create_function_from_signature = None  # type: ignore[assignment]
    backend = make_backend(target)
    try:
        if create_function_from_signature is None:
            raise TypeError("no create_function_from_signature")
        binder = create_function_from_signature(fn.signature, fn.params, backend)
    except TypeError:  # another Triton's helper: build the JIT's own binder with the target swapped
        from triton.runtime import driver
        real = driver.active.get_current_target
        driver.active.get_current_target = lambda: target
        try:
            cached = fn.create_binder()
        finally:
            driver.active.get_current_target = real
        backend, binder = cached[-2], cached[-1]
    kw = dict(kwargs)
    kw["debug"] = kw.get("debug", fn.debug) or knobs.runtime.debug
    if run_adds_instrumentation():
        kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    bound_args, specialization, options = binder(*args, **kw)
    options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound_args, specialization, options)
    return signature, constexprs, attrs, dict(options.__dict__)


def target_name(target: Any) -> str:
    return target.arch if target.backend == "hip" else f"sm_{target.arch}"


def recording_run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
    """Replaces JITFunction.run: records the launch for every target, launches nothing."""
    fname = f"{self.fn.__module__}.{self.fn.__name__}"
    FNS[fname] = self
    for target in STATE["targets"]:
        tname = target_name(target)
        try:
            signature, constexprs, attrs, options = specialize(self, args, kwargs, target)
        except Exception as error:  # reported, the other targets go on
            RECORDS.append({"label": STATE["label"], "kernel": fname, "target": tname,
                            "error": f"{type(error).__name__}: {error}"})
            log(f"  specialize failed {fname} {tname}: {error}")
            continue
        key_text = repr((fname, tname, sorted(signature.items()), sorted(constexprs.items()),
                         sorted(attrs.items()), sorted((k, repr(v)) for k, v in options.items())))
        key = hashlib.sha1(key_text.encode()).hexdigest()[:10]
        name = f"{self.fn.__name__}-{tname}-{key}"
        if name not in JOBS:
            JOBS[name] = {"fn": fname, "module_attr": module_attr(self),
                          "target": (target.backend, target.arch, target.warp_size),
                          "signature": signature, "constexprs": constexprs, "attrs": attrs,
                          "options": options, "labels": []}
        JOBS[name]["labels"].append(STATE["label"])
        RECORDS.append({"label": STATE["label"], "kernel": fname, "target": tname, "name": name,
                        "num_warps": options.get("num_warps"),
                        "constexprs": {str(k): repr(v) for k, v in constexprs.items()},
                        "attrs": {str(k): v for k, v in attrs.items()}})
        if target.backend == "cuda" and STATE.get("jit_check"):
            # the JIT's own sm_90 compilation of the same launch, to check the recorder against
            try:
                kernel = ORIGINAL_RUN(self, *args, grid=grid, warmup=True, **kwargs)
                JOBS[name]["jit_ptx_sha1"] = hashlib.sha1(kernel.asm["ptx"].encode()).hexdigest()
            except Exception as error:
                JOBS[name]["jit_ptx_sha1"] = f"error {type(error).__name__}: {error}"
    return None


ORIGINAL_RUN: Any = None


def module_attr(fn: Any) -> str:
    """module.attribute under which the peer's module holds this kernel (maybe a Heuristics)."""
    module = sys.modules[fn.fn.__module__]
    for attr, value in vars(module).items():
        for _ in range(4):  # a JITFunction, or a Heuristics/Autotuner around one
            if value is fn:
                return f"{module.__name__}.{attr}"
            if type(value).__name__ not in ("Heuristics", "Autotuner"):
                break
            value = value.fn
    raise LookupError(f"{fn} not found in {module.__name__}")


def record_shape(torch: Any, mods: Dict[str, Any], n: int, v: int, mode: str) -> None:
    """Calls each peer's wrapper as bench/peers.py does (Primus-Turbo as its op is called)."""
    dev = "cuda"
    logits = torch.empty((n, v), dtype=torch.bfloat16, device=dev)
    labels = torch.randint(0, v, (n,), dtype=torch.int64, device=dev)
    grad = torch.rand(n, dtype=torch.float32, device=dev)
    shape = f"{n}x{v}"

    def leaf() -> Any:
        return logits.detach().requires_grad_(True)

    def case(label: str, call: Any) -> None:
        STATE["label"] = f"{label}|{shape}|{mode}"
        try:
            call()
        except Exception as error:  # reported; the other cases go on
            RECORDS.append({"label": STATE["label"], "error": f"{type(error).__name__}: {error}"})
            log(f"  case {STATE['label']} failed: {type(error).__name__}: {error}")
        finally:
            STATE["label"] = None

    if "flash" in mods:
        ce = mods["flash"].cross_entropy_loss

        def flash_fwd() -> None:
            with torch.no_grad():
                ce(logits, labels, ignore_index=-100)

        def flash_fwd_bwd(inplace: bool) -> None:
            x = leaf()
            loss, _ = ce(x, labels, ignore_index=-100, inplace_backward=inplace)
            torch.autograd.grad(loss, x, grad)

        case("flash|fwd", flash_fwd)
        case("flash|fwd+bwd", lambda: flash_fwd_bwd(False))
        case("flash|fwd+bwd_ow", lambda: flash_fwd_bwd(True))
    if "liger" in mods:
        fn = mods["liger"].LigerCrossEntropyFunction

        def liger_fwd(reduction: str) -> None:
            with torch.no_grad():
                fn.apply(logits, labels, None, -100, 0.0, 0.0, reduction)

        for reduction in ("none", "mean"):
            case(f"liger|fwd[{reduction}]", lambda r=reduction: liger_fwd(r))
            # forward with grad: the kernel writes the gradient over the logits; the backward
            # (a torch multiply for 'none', nothing for 'mean') launches no Triton kernel
            case(f"liger|fused[{reduction}]",
                 lambda r=reduction: fn.apply(leaf(), labels, None, -100, 0.0, 0.0, r))
    if "primus" in mods:
        ce_p = mods["primus"].cross_entropy

        def primus(overwrite: bool) -> None:
            x = leaf()
            loss = ce_p(x, labels, ignore_index=-100, overwrite_input=overwrite)
            torch.autograd.grad(loss, x, grad)

        case("primus|fwd+bwd", lambda: primus(False))
        case("primus|fwd+bwd_ow", lambda: primus(True))


def worker_init(peers: str) -> None:
    sys.path.insert(0, peers)


def compile_job(name: str, job: Dict[str, Any], outdir: str) -> Dict[str, Any]:
    """Runs in a spawned worker: compiles one distinct kernel and writes its files."""
    import importlib
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    module, _, attr = job["module_attr"].rpartition(".")
    fn = jit_of(getattr(importlib.import_module(module), attr))
    target = GPUTarget(*job["target"])
    began = time.time()
    try:
        src = ASTSource(fn, job["signature"], job["constexprs"], job["attrs"])
        kernel = triton.compile(src, target=target, options=job["options"])
    except Exception as error:
        return {"name": name, "error": f"{type(error).__name__}: {error}",
                "trace": traceback.format_exc()[-2000:]}
    out = Path(outdir)
    files = []
    for ext in ("hsaco", "amdgcn", "ptx", "cubin", "ttgir"):
        if ext in kernel.asm:
            data = kernel.asm[ext]
            path = out / f"{name}.{ext}"
            if isinstance(data, bytes):
                path.write_bytes(data)
            else:
                path.write_text(data)
            files.append(path.name)
    meta = kernel.metadata
    meta = meta._asdict() if hasattr(meta, "_asdict") else dict(vars(meta))
    (out / f"{name}.json").write_text(json.dumps(meta, indent=1, default=str))
    files.append(f"{name}.json")
    result = {"name": name, "files": files, "seconds": round(time.time() - began, 2),
              "shared": meta.get("shared")}
    if "ptx" in kernel.asm:
        result["ptx_sha1"] = hashlib.sha1(kernel.asm["ptx"].encode()).hexdigest()
    return result


def nvidia_tool(name: str) -> str:
    import triton
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    for candidate in (shutil.which(name), f"/usr/local/cuda/bin/{name}", str(bundled)):
        if candidate and Path(candidate).is_file():
            return candidate
    raise FileNotFoundError(name)


def sass_of(cubin: Path) -> Tuple[str, str]:
    cuobjdump = nvidia_tool("cuobjdump")
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True).stdout
    usage = subprocess.run([cuobjdump, "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    return sass, usage


def cegen_sass(ptx_dir: Path, out: Path) -> List[Dict[str, Any]]:
    """ptxas for sm_90 on cegen's PTX (what the driver's JIT does at load), SASS and ptxas -v."""
    ptxas = nvidia_tool("ptxas")
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for ptx in sorted(ptx_dir.rglob("*.ptx")):
        stem = ptx.stem
        cubin = out / f"{stem}.cubin"
        run = subprocess.run([ptxas, "-arch=sm_90", "-v", "-o", str(cubin), str(ptx)],
                             capture_output=True, text=True)
        entry = {"ptx": str(ptx.relative_to(ptx_dir)), "rc": run.returncode,
                 "ptxas_v": (run.stdout + run.stderr)[-3000:]}
        if run.returncode == 0:
            sass, usage = sass_of(cubin)
            (out / f"{stem}.sass").write_text(sass)
            (out / f"{stem}.res").write_text(usage + "\n" + entry["ptxas_v"])
            cubin.unlink()
        results.append(entry)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", required=True, help="directory holding the peers' sources")
    parser.add_argument("--out", required=True, help="directory for peers-amd.tar.gz")
    parser.add_argument("--chips", default=",".join(CHIPS))
    parser.add_argument("--no-sm90", action="store_true", help="skip the sm_90 calibration compile")
    parser.add_argument("--cegen-ptx", help="cegen's sm_90 PTX files to assemble (calibration)")
    parser.add_argument("--shapes", default=",".join(f"{n}x{v}" for n, v in SHAPES))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 4)
    parser.add_argument("--deadline-s", type=float, default=170.0,
                        help="stop starting compiles after this many seconds (reported)")
    args = parser.parse_args()
    began = time.time()
    os.environ.setdefault("TRITON_CACHE_DIR", "/tmp/amd-static-triton-cache")

    global ORIGINAL_RUN
    import torch
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    work = Path("/tmp/amd-static-peers")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    info: Dict[str, Any] = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "triton": triton.__version__, "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "amd_use_buffer_ops": getattr(getattr(knobs, "amd", None), "use_buffer_ops", None),
    }
    log(json.dumps(info))
    sys.path.insert(0, str(Path(args.peers).resolve()))
    mods: Dict[str, Any] = {}
    for peer, module in MODULES.items():
        try:
            import importlib
            mods[peer] = importlib.import_module(module)
            path = Path(mods[peer].__file__)
            blob = hashlib.sha1(b"blob %d\0" % path.stat().st_size + path.read_bytes()).hexdigest()
            info[f"{peer}_module"] = {"file": str(path), "blob": blob}
        except Exception as error:
            info[f"{peer}_module"] = {"error": f"{type(error).__name__}: {error}"}
            log(f"{peer}: import failed: {error}")
    for name in ("primus_turbo.triton.cross_entropy",):
        path = Path(sys.modules[name].__file__) if name in sys.modules else None
        if path:
            info["primus_kernels_blob"] = hashlib.sha1(
                b"blob %d\0" % path.stat().st_size + path.read_bytes()).hexdigest()

    ORIGINAL_RUN = JITFunction.run
    JITFunction.run = recording_run
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    amd_targets = [GPUTarget("hip", chip, 64) for chip in args.chips.split(",") if chip]
    liger = mods.get("liger")
    try:
        # AMD: the wrappers' ROCm branches taken (Liger's is_hip); then sm_90 as they are
        for mode, targets in (("hip", amd_targets), ("cuda", [] if args.no_sm90 else [GPUTarget("cuda", 90, 32)])):
            if not targets:
                continue
            STATE["targets"] = targets
            saved = liger.is_hip if liger is not None else None
            if liger is not None and mode == "hip":
                liger.is_hip = lambda: True
            try:
                for index, (n, v) in enumerate(shapes):
                    STATE["jit_check"] = mode == "cuda" and index == 0
                    record_shape(torch, mods, n, v, mode)
                    torch.cuda.empty_cache()
            finally:
                if liger is not None:
                    liger.is_hip = saved
            log(f"recorded mode {mode}: {len(RECORDS)} records, {len(JOBS)} distinct kernels, "
                f"{time.time() - began:.1f} s")
    finally:
        JITFunction.run = ORIGINAL_RUN

    kdir = work / "kernels"
    kdir.mkdir()
    results: Dict[str, Any] = {}
    names = sorted(JOBS, key=lambda name: (JOBS[name]["target"][0] != "hip", name))
    ctx = mp.get_context("spawn")
    pool = cf.ProcessPoolExecutor(max_workers=max(1, args.jobs), mp_context=ctx,
                                  initializer=worker_init, initargs=(str(Path(args.peers).resolve()),))
    futures = {pool.submit(compile_job, name, JOBS[name], str(kdir)): name for name in names}
    done, late = cf.wait(futures, timeout=max(1.0, args.deadline_s - (time.time() - began)))
    for future in done:
        name = futures[future]
        try:
            results[name] = future.result()
        except Exception as error:
            results[name] = {"name": name, "error": f"{type(error).__name__}: {error}"}
        r = results[name]
        log(f"  {name}: {r.get('error') or str(r.get('seconds')) + ' s'}")
    if late:
        log(f"deadline reached: {len(late)} compiles not finished")
        for future in late:
            future.cancel()
        for process in list(getattr(pool, "_processes", {}).values()):
            process.kill()
    pool.shutdown(wait=not late, cancel_futures=True)
    for name in names:
        results.setdefault(name, {"name": name, "error": "not compiled (deadline)"})

    for name, r in results.items():
        cubin = kdir / f"{name}.cubin"
        if cubin.is_file():
            try:
                sass, usage = sass_of(cubin)
                (kdir / f"{name}.sass").write_text(sass)
                (kdir / f"{name}.res").write_text(usage)
            except Exception as error:
                r["sass_error"] = str(error)
        jit = JOBS[name].get("jit_ptx_sha1")
        if jit is not None:
            r["jit_ptx_sha1"] = jit
            r["jit_ptx_matches"] = jit == r.get("ptx_sha1")

    if args.cegen_ptx and Path(args.cegen_ptx).is_dir():
        try:
            info["cegen_sm90"] = cegen_sass(Path(args.cegen_ptx), work / "cegen-sm90")
        except Exception as error:
            info["cegen_sm90"] = {"error": f"{type(error).__name__}: {error}"}

    jobs_out = {name: {k: (v if k != "constexprs" else {str(a): repr(b) for a, b in v.items()})
                       for k, v in job.items() if k not in ("attrs", "options")}
                for name, job in JOBS.items()}
    for name, job in JOBS.items():
        jobs_out[name]["attrs"] = {str(k): v for k, v in job["attrs"].items()}
        jobs_out[name]["options"] = {k: repr(v) for k, v in job["options"].items()}
    info["seconds"] = round(time.time() - began, 1)
    (work / "index.json").write_text(json.dumps(
        {"info": info, "jobs": jobs_out, "results": results, "records": RECORDS}, indent=1, default=str))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out / "peers-amd.tar.gz", "w:gz") as tar:
        tar.add(work, arcname="peers-amd")
    failed = [n for n, r in results.items() if r.get("error")]
    log(f"{len(results)} kernels, {len(failed)} failed, {info['seconds']} s; "
        f"{(out / 'peers-amd.tar.gz').stat().st_size} bytes")
    for n in failed:
        log(f"FAILED {n}: {results[n]['error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
