#!/usr/bin/env python3
"""First-launch latency of a GPU bundle: the module load (for PTX, the driver's JIT) and the first
call, then a second call of the same kernel and the first call of another (issue 15).

A program, not a test. On a CUDA machine, from the repository root::

    CUDA_CACHE_DISABLE=1 python3 bench/first_launch.py --runtime .dev/lib/libce_runtime.so \\
        --bundle BUNDLE --op fused --out $OUT

BUNDLE needs bf16 forward or fused (token weights) kernels with label smoothing off and on, e.g.
``ce-gen --target=sm_90 --op=forward,fused --logits=bf16 --labels=i64 --layout=flat
--label-smoothing=off,on --weights=token``. ``CUDA_CACHE_DISABLE=1`` keeps the driver's JIT cache
out (without it a second process finds the compiled kernels there). Prints and writes
OUT/first_launch_OP.json (seconds). docs/packaging.md has a run's numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime", required=True)
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--op", choices=("forward", "fused"), default="fused")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch
    from cegen import _runtime

    rt = _runtime.Runtime(Path(args.runtime))
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    result = {"bundle": args.bundle, "op": args.op,
              "cuda_cache_disable": os.environ.get("CUDA_CACHE_DISABLE")}
    start = time.perf_counter()
    bundle = rt.open_bundle(Path(args.bundle).resolve())
    result["open_s"] = time.perf_counter() - start
    codes = {torch.bfloat16: _runtime.DType.BF16, torch.float32: _runtime.DType.F32,
             torch.int64: _runtime.DType.I64}

    def desc(t):
        return _runtime.TensorDesc.make(t.data_ptr(), codes[t.dtype], list(t.shape),
                                        list(t.stride()), _runtime.Device.CUDA, 0)

    def call(smoothing: float) -> float:
        """Seconds of one 64x1000 bf16 call, module load included when it is the first."""
        x = torch.randn(64, 1000, device="cuda").to(torch.bfloat16)
        y = torch.randint(0, 1000, (64,), device="cuda")
        loss = torch.empty(64, device="cuda")
        lse = torch.empty(64, device="cuda")
        options = rt.default_options()
        options.label_smoothing = smoothing
        stream = torch.cuda.current_stream().cuda_stream
        torch.cuda.synchronize()
        begin = time.perf_counter()
        if args.op == "forward":
            rt.forward(bundle, options, desc(x), desc(y), desc(loss), desc(lse), stream)
        else:
            weights = torch.ones(64, device="cuda")
            grad = torch.empty_like(x)
            rt.fused(bundle, options, desc(x), desc(y), desc(weights), desc(loss), desc(lse),
                     desc(grad), stream)
        torch.cuda.synchronize()
        return time.perf_counter() - begin

    result["first_call_s"] = call(0.0)
    result["second_call_same_kernel_s"] = call(0.0)
    result["first_call_other_kernel_s"] = call(0.1)
    print(json.dumps(result))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"first_launch_{args.op}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
