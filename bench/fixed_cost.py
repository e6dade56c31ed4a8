"""The forward's fixed cost per launch (docs/PERFORMANCE.md, "The forward's fixed cost").

Per shape, with gpu_bench's timing method (256 MB L2 flush by writing, GPU sleep, CUDA events,
median of 15): our forward, ``dst.copy_(src)`` of the same bytes, torch's ``logits.sum()``, and
the forward again after a read-only flush (L2 left clean). Floors are bytes over a 4 GB copy's
bandwidth. Prints one JSON line per shape and writes them all to OUT.

    python3 bench/fixed_cost.py --runtime .dev/lib/libce_runtime.so \\
        --bundle DIR --out $OUT/fixed_cost.json
"""
import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "python"))

import gpu_bench as gb  # noqa: E402

SHAPES = [(16384, 32000), (8192, 50304), (4096, 151936), (8192, 128256), (32768, 128256),
          (4096, 32000), (8192, 32000), (32768, 32000), (65536, 32000), (2640, 128256),
          (5280, 128256)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", required=True, help="libce_runtime.so")
    parser.add_argument("--bundle", required=True, help="sm_90 bundle (gpu_bench's variants)")
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args()

    import torch
    import cegen
    from cegen import _runtime

    cegen.set_runtime_library(args.runtime)
    rt = _runtime.get_runtime()
    dev = gb.Dev(torch, "cuda")
    kset = gb.open_config(rt, args.bundle, gb.variant_keys(cegen), "sm_90")

    def t(step):
        return gb.time_step(dev, step, None, 15)["ms"]

    def clean(step):
        write_flush = dev.flush
        dev.flush = lambda: dev.flush_buf.sum()  # read-only: no dirty lines left
        try:
            return t(step)
        finally:
            dev.flush = write_flush

    big = 4 << 30
    a = torch.empty(big // 2, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    copy_bps = 2 * big / (t(lambda: b.copy_(a)) * 1e-3)
    rows = []
    for n, v in SHAPES:
        p = gb.Problem(torch, dev, n, v, 1)
        ours = gb.Ours(cegen, rt, kset, p, dev, -100)
        nbytes = n * v * 2
        src, dst = a[: nbytes // 2], b[: nbytes // 2]
        floor = nbytes / copy_bps * 1e3
        fwd, cp, rd = t(ours.forward), t(lambda: dst.copy_(src)), t(lambda: p.logits.sum())
        fwd_c, cp_c = clean(ours.forward), clean(lambda: dst.copy_(src))
        row = dict(shape=f"{n}x{v}", MB=nbytes / 1e6, floor_ms=floor, fwd_ms=fwd,
                   fwd_pct=100 * floor / fwd, fwd_clean_ms=fwd_c, fwd_clean_pct=100 * floor / fwd_c,
                   copy_same_bytes_ms=cp, copy_pct=100 * 2 * floor / cp,
                   copy_clean_pct=100 * 2 * floor / cp_c, sum_ms=rd, sum_pct=100 * floor / rd,
                   excess_us=(fwd - floor) * 1e3)
        rows.append(row)
        print(json.dumps({k: round(x, 3) if isinstance(x, float) else x for k, x in row.items()}),
              flush=True)
        del p, ours
    Path(args.out).write_text(json.dumps({"copy_4GB_TBps": copy_bps / 1e12, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
