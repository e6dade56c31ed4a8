#!/usr/bin/env python3
"""The rescale kernels (``ce_rescale``) under compute-sanitizer, with their float64 checks.

``test/gpu/sanitize_h200.py`` covers forward, backward, fused and shard_stats; this covers
the fused gradient's correction. On a CUDA machine, from the repository root, with the runtime
and sm_90 rescale bundles of ``test/gpu/prepare_api_run.sh``::

    python3 test/gpu/sanitize_rescale.py --runtime .dev/lib/libce_runtime.so \\
        --bundle .dev/api/bundles/rescale --out $OUT/sanitize-rescale

It starts itself once per tool (memcheck, racecheck with ``--racecheck-report all``) under
``compute-sanitizer`` with PyTorch's caching allocator off, and each run calls every rescale
kernel of the bundle through ``bench/rescale_bench.py``'s float64 check (every (g, w) case of
the contract, strided and stride-0 upstreams, 0-d weights, rows of V = 7 to 4099 with padding).
Pass: 0 errors for every tool and 0 numerical failures. Without a GPU or compute-sanitizer it
prints SKIP and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ERROR_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")
HAZARDS = re.compile(r"RACECHECK SUMMARY: (\d+) hazards?")


def inner(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(REPO / "python"))
    sys.path.insert(0, str(REPO / "bench"))
    import torch
    import cegen
    import rescale_bench
    from cegen import _rescale

    cegen.set_runtime_library(args.runtime)
    cegen.configure(bundle_dirs=[args.bundle], run_ce_gen=False)

    def kernel_only(grad, w, g, layout):  # type: ignore[no-untyped-def]
        if not _rescale._rescale_with_kernel(grad, w, g, layout):
            raise RuntimeError("no rescale kernel in the bundle")

    failures = checks = 0
    seed = 7000
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for shape, layout in (([9, 7], "bs"), ([37, 1031], "bs"), ([5, 3, 4099], "bs"),
                              ([4, 6, 130], "sb")):
            for scalar_weight, broadcast_g in ((False, False), (True, False), (False, True)):
                seed += 1
                result = rescale_bench.check(torch, kernel_only, dtype, shape, layout,
                                             scalar_weight, broadcast_g, seed)
                checks += result["checks"]
                failures += result["failures"]
    torch.cuda.synchronize()
    print(f"rescale checks: {checks} values, {failures} failures", flush=True)
    return 1 if failures else 0


def outer(args: argparse.Namespace) -> int:
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        print("SKIP: no compute-sanitizer")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    results = {}
    for tool in ("memcheck", "racecheck"):
        command = [sanitizer, "--tool", tool]
        if tool == "racecheck":
            command += ["--racecheck-report", "all"]
        command += [sys.executable, __file__, "--inner", "--runtime", args.runtime,
                    "--bundle", args.bundle]
        run = subprocess.run(command, env=env, capture_output=True, text=True,
                             timeout=args.timeout)
        text = run.stdout + run.stderr
        (out / f"sanitize-rescale-{tool}.log").write_text(text)
        errors = ERROR_SUMMARY.findall(text)
        hazards = HAZARDS.findall(text)
        checked = re.findall(r"rescale checks: (\d+) values, (\d+) failures", text)
        results[tool] = {
            "returncode": run.returncode,
            "errors": int(errors[-1]) if errors else None,
            "hazards": int(hazards[-1]) if hazards else None,
            "checks": int(checked[-1][0]) if checked else 0,
            "failures": int(checked[-1][1]) if checked else None,
        }
        print(f"{tool}: {results[tool]}", flush=True)
    (out / "sanitize-rescale.json").write_text(json.dumps(results, indent=1))
    # memcheck reports errors, racecheck hazards (its ERROR SUMMARY line is absent).
    ok = (all(r["returncode"] == 0 and r["failures"] == 0 and r["checks"] > 0
              for r in results.values())
          and results["memcheck"]["errors"] == 0 and results["racecheck"]["hazards"] == 0)
    print("PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime", required=True)
    parser.add_argument("--bundle", required=True, help="a bundle with sm_90 rescale kernels")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--inner", action="store_true")
    args = parser.parse_args()
    try:
        import torch
        if not torch.cuda.is_available():
            print("SKIP: no CUDA device")
            return 0
    except ImportError:
        print("SKIP: no torch")
        return 0
    return inner(args) if args.inner else outer(args)


if __name__ == "__main__":
    sys.exit(main())
