#!/usr/bin/env python3
"""cegen's kernels under NVIDIA compute-sanitizer: memcheck, racecheck, synccheck, initcheck.

Run on a machine with an NVIDIA GPU of compute capability 9.0 (H100/H200), PyTorch and
compute-sanitizer, from the repository root, with a runtime library and sm_90 bundles built
elsewhere by ``test/gpu/prepare_sanitize_run.sh DIR``::

    python3 test/gpu/sanitize_h200.py --runtime DIR/lib/libce_runtime.so \\
        --bundles DIR/kinds DIR/plain DIR/softcap --shard-bundles DIR/shards DIR/slices \\
        --out $OUT

The script starts itself once per tool under ``compute-sanitizer --tool T`` (racecheck with
``--racecheck-report all``; the tools run side by side, one process each), and each run
launches every kernel kind of the bundles on CUDA tensors: forward, backward, fused (the
runtime picks the short-, 64 KB- and 128 KB-row kernels by V) and shard_stats, on rows of
V = 7 to 128256 (odd V; rows whose whole vector part fits the fused kernels' row cache, with
a masked last step, and rows that do not), offset and strided views of every tensor (the
cases of test_h200.py: padding around every view must survive), ``[S,B,V]`` layouts,
overwrite on and off, token and 0-d (scalar) weights, label smoothing and z-loss on and off
(the option values drawn per case, as test_h200.py draws them: bundle format version 3;
every other case and shard backward passes lse_low, version 4, which kernels write and read),
special rows (-inf rows, maxima past 2^24: the exact re-sweep), an all-ignored batch, and a
bad label per kernel; and the kernels of the shard bundles (shard_stats, and backward, which
takes every slice since the key has no shard field) on vocabulary slices at 0 and 1000 of a
larger vocabulary, smoothing over the slice and over the whole vocabulary (the run-time
``shard_global_smoothing``), every other one also writing the slice's entropy and argmax.
Every other forward and fused case asks for the entropy and argmax too (test_h200's draw), and
the softcap bundle (``DIR/softcap``) holds the logit-softcap kernels. Each result is checked against the float64 reference of
test_h200.py (the slices against their own), so a run that the tools pass also computed the
right numbers.
PyTorch's caching allocator is off in the checked processes (``PYTORCH_NO_CUDA_MEMORY_CACHING``),
so that memcheck sees every tensor as an allocation of its own.

Pass criterion: for every tool, 0 errors (racecheck: 0 hazards of any severity) in every
kernel of the process, cegen's and PyTorch's, every case run, and no numerical failure.
Results go to OUT/sanitize.json (counts per tool, per kernel and per code offset) and the
tools' full output to OUT/sanitize-TOOL.log. Without a CUDA device (or compute-sanitizer)
the script prints SKIP and exits 0; ``--inner --device cpu`` runs the cases once, without a
sanitizer, on host bundles (``ce-gen --target=host``), which checks the harness where no GPU is
reachable. Results of the runs: docs/GPU-TESTS.md.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")

#: A cegen kernel and a code offset in a tool's report, e.g. ``ce_fused_3+0x25f0``.
KERNEL_AT = re.compile(r"\b(ce_[a-z_]+_\d+(?:_rows\d+k)?)\+(0x[0-9a-f]+)")
#: Any kernel named in a report line (``... in KERNEL`` / ``at KERNEL+0x..``).
ANY_AT = re.compile(r"(?:\bat |\bin )(\S.*?)\+0x[0-9a-f]+")
ERROR_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")
RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, "
                          r"(\d+) warnings?\)")


# -- the cases (run inside each sanitized process) --------------------------------------------


def cases():
    from test_h200 import Case

    # Case(name, flat tokens, seq, batch, V, views, special rows, broadcast scale, all ignored).
    # Row lengths against the sm_90 fused kernels (bf16 / f32 elements): a whole-row cache
    # (vector part and masked last step) in the short-row kernel up to 24576 / 12288, in the
    # 64 KB-row kernel up to 57344 / 28672, in the 128 KB-row kernel up to 98304 / 49152.
    return [
        Case("views-vocab7", 45, 5, 9, 7, True, True, True, False),
        Case("vocab1000", 6, 2, 3, 1000, False, False, False, False),
        Case("views-vocab1000", 6, 2, 3, 1000, True, True, False, False),
        Case("views-vocab4095", 8, 2, 4, 4095, True, True, False, False),
        Case("vocab20001", 3, 1, 3, 20001, False, False, False, False),
        Case("views-vocab32000", 3, 1, 3, 32000, True, True, True, False, scalar_weight=True),
        Case("views-vocab40961", 2, 2, 1, 40961, True, False, False, False),
        Case("vocab80001", 2, 1, 2, 80001, False, True, False, False),
        Case("views-vocab128256", 2, 1, 2, 128256, True, False, False, False),
        Case("all-ignored", 16, 4, 4, 7, True, False, False, True),
    ]


SHARD_VOCABS = [7, 1000, 4095, 32000, 50257, 128256]


def shard_reference(x, labels, start: int, vocab: int, ignore_index: Optional[int],
                    smoothing: bool):
    """(max, sum exp(x - max) - 1, target or 0, row sum or 0) per row, float64."""
    import torch

    top = x.max(dim=-1).values
    at_top = x == top.unsqueeze(-1)
    terms = torch.where(at_top, torch.zeros_like(x), torch.exp(x - top.unsqueeze(-1)))
    rest = terms.sum(dim=-1) + (at_top.sum(dim=-1) - 1)
    local = labels - start
    inside = (local >= 0) & (local < x.shape[-1])
    picked = x.gather(-1, torch.where(inside, local, torch.zeros_like(local)).unsqueeze(-1))[:, 0]
    target = torch.where(inside, picked, torch.zeros_like(picked))
    if ignore_index is not None:
        target = torch.where(labels == ignore_index, torch.zeros_like(target), target)
    total = x.sum(dim=-1) if smoothing else torch.zeros_like(top)
    return torch.stack([top, rest, target, total], dim=-1), x.abs().sum(dim=-1)


def shard_backward_reference(full, labels, scale, start: int, stop: int,
                             ignore_index: Optional[int], alpha: float, z: float,
                             global_smoothing: bool):
    """The float64 gradient slice [start, stop) of rows `full` (the whole vocabulary) for the
    upstream gradient `scale`: g ((1 + 2 z lse) p - (1 - s) onehot - s / V_s), V_s the whole
    vocabulary or the slice's (tp_h200.py's reference, with any ignore_index)."""
    import torch

    lse = torch.logsumexp(full, dim=-1)
    grad = torch.exp(full[:, start:stop] - lse[:, None]) * (1 + 2 * z * lse[:, None])
    local = labels - start
    inside = (local >= 0) & (local < stop - start)
    onehot = torch.zeros_like(grad)
    onehot[inside, local[inside]] = 1.0
    vs = full.shape[-1] if global_smoothing else stop - start
    s = alpha * vs / (vs - 1) if alpha else 0.0
    grad = grad - (1 - s) * onehot - s / vs
    ignored = (torch.zeros_like(labels, dtype=torch.bool) if ignore_index is None
               else labels == ignore_index)
    grad = grad * scale[:, None]
    return torch.where(ignored[:, None], torch.zeros_like(grad), grad), lse


def run_shard_backward(bundle: str, text: str, seed: int, failures: List[str], dev) -> int:
    """Backward kernel `text` of `bundle` on slices of V of SHARD_VOCABS entries at 0 and at
    1000 of the whole vocabulary (V + 1017 entries), smoothing over the slice and over the
    whole vocabulary in turn (``Shard.global_smoothing``, a run-time flag), the option values
    drawn per V as test_h200's cases draw them, the logits and the gradient strided views;
    the gradient against :func:`shard_backward_reference`. Returns the number of launches."""
    import torch

    from cegen import _kernels
    from test_h200 import Case, Key, draw_values, mix

    key = Key.parse(text)
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[key.logits]
    launches = 0
    for index, v in enumerate(SHARD_VOCABS):
        s, b = 3, 2
        n = s * b
        start, vocab = (0, 1000)[index % 2], v + 1017
        global_smoothing = (index // 2) % 2 == 1
        values = draw_values(key, Case(f"shard-vocab{v}", n, s, b, v, True, False, False, False),
                             False, mix(seed, f"{text}/{v}/options"))
        options = _kernels.KernelOptions(
            ignore_index=values.ignore_index, label_smoothing=values.label_smoothing,
            z_loss=values.z_loss, label_layout="bs", bundle=bundle,
            shard=_kernels.Shard(start, vocab, global_smoothing))
        gen = torch.Generator().manual_seed(mix(seed, f"{text}/{v}"))
        full = (torch.randn((n, vocab), generator=gen, dtype=torch.float64) * 2).to(dtype)
        full = full.to(torch.float64)
        labels = torch.randint(0, vocab, (n,), generator=gen)
        inside = torch.rand((n,), generator=gen) < 0.5
        labels = torch.where(inside, start + torch.randint(0, v, (n,), generator=gen), labels)
        if values.ignore_index is not None:
            labels[0] = values.ignore_index
        scale = torch.empty((n,), dtype=torch.float32).uniform_(-2, 2, generator=gen)
        ref, lse = shard_backward_reference(full, labels, scale.to(torch.float64), start,
                                            start + v, values.ignore_index,
                                            values.label_smoothing, values.z_loss,
                                            global_smoothing)
        storage = torch.full((n * (v + 3) + 8,), -7777.0, dtype=dtype, device=dev)
        rows = storage.as_strided((n, v), (v + 3, 1), 5)
        rows.copy_(full[:, start:start + v].to(dtype).to(dev))
        # lse's low part (bundle format 4), on every other launch: the kernel reads it.
        high = lse.to(torch.float32)
        low = (lse - high.to(torch.float64)).to(torch.float32) if launches % 2 else None
        if key.layout == "flat":
            logits, labels_dev = rows, labels.to(dev)
            lse_dev, scale_dev = high.to(dev), scale.to(dev)
            low_dev = None if low is None else low.to(dev)
        else:
            # [S,B,V] logits with [B,S] token tensors: token (b, s) is row s*B + b.
            logits = rows.view(s, b, v)
            labels_dev = labels.view(s, b).t().contiguous().to(dev)
            lse_dev = high.view(s, b).t().contiguous().to(dev)
            low_dev = None if low is None else low.view(s, b).t().contiguous().to(dev)
            scale_dev = scale.view(s, b).t().contiguous().to(dev)
        grad = _kernels.backward(logits, labels_dev, lse_dev, scale_dev, options,
                                 overwrite=key.overwrite, lse_low=low_dev)
        if key.overwrite:
            grad = logits
        if dev.type == "cuda":
            torch.cuda.synchronize()
        launches += 1
        got = grad.reshape(n, v).to(torch.float64).cpu()
        # One ulp of the logits dtype (bf16, f16), 1e-5 (f32), of the row's largest |r|.
        unit = {"bf16": 2.0 ** -8, "f16": 2.0 ** -11, "f32": 1e-5}[key.logits]
        tolerance = unit * ref.abs().amax(dim=-1, keepdim=True).clamp(min=1e-3)
        bad = ~((got - ref).abs() <= tolerance)
        if bad.any() or not bool((storage[:5] == -7777.0).all()):
            where = bad.nonzero()[:3].tolist()
            failures.append(f"backward {text} V={v} slice at {start} of {vocab} "
                            f"{'global' if global_smoothing else 'local'} smoothing "
                            f"({values.values_text()}): {int(bad.sum())} values off, first "
                            f"{where}: {got[bad][:3].tolist()} vs {ref[bad][:3].tolist()}")
    return launches


def check_shard_outputs(z, z_atol: float, entropy, argmax, start: int, sbv: bool, pads,
                        what: str, failures: List[str]) -> None:
    """The slice's entropy (within 2e-5 max(1, H) of float64, plus 2 cap z_atol for a
    softcap kernel) and argmax (the lowest index of the maximum as a global id; a softcap
    kernel's f32 z may tie or order values within 2 z_atol of each other otherwise) of the
    transformed rows ``z`` (float64, in row order), read from the ``[B,S]`` views when
    ``sbv``; the padding between the views' elements intact."""
    import torch

    p = torch.softmax(z, dim=-1)
    ref_h = -(p * torch.log_softmax(z, dim=-1)).sum(dim=-1)
    top = z.max(dim=-1, keepdim=True).values
    first = torch.argmax((z == top).to(torch.int8), dim=-1)  # the lowest index of the max
    got_h = entropy.to(torch.float64).cpu()
    got_i = argmax.cpu()
    if sbv:
        got_h, got_i = (t.t().reshape(-1) for t in (got_h, got_i))  # [B,S] -> rows s*B + b
    cap = z.abs().max().item() if z_atol else 0.0
    h_bad = ~((got_h - ref_h).abs() <= 2e-5 * ref_h.abs().clamp(min=1.0) + 2 * cap * z_atol)
    local = got_i - start
    inside = (local >= 0) & (local < z.shape[-1])
    picked = z.gather(-1, torch.where(inside, local, 0).unsqueeze(-1))[:, 0]
    if z_atol:
        i_bad = ~inside | (picked < top[:, 0] - 2 * z_atol)
    else:
        i_bad = local != first
    pads_ok = bool(pads[0][0::2].isnan().all()) and bool((pads[1][0::2] == -5).all())
    if h_bad.any() or i_bad.any() or not pads_ok:
        failures.append(f"{what}: entropy of {int(h_bad.sum())} and argmax of "
                        f"{int(i_bad.sum())} tokens off (first entropy "
                        f"{got_h[h_bad][:2].tolist()} vs {ref_h[h_bad][:2].tolist()}, argmax "
                        f"{got_i[i_bad][:2].tolist()} vs {(start + first)[i_bad][:2].tolist()}"
                        f"), padding {'intact' if pads_ok else 'written'}")


def run_shard_stats(bundle_dirs: List[str], seed: int, failures: List[str], dev) -> int:
    """Every shard_stats kernel of the bundles on every V of SHARD_VOCABS, flat and [S,B,V],
    the logits a strided view, a slice at 0 or at 1000 of a 300000-entry vocabulary, smoothing
    over the slice or the whole vocabulary (``Shard.global_smoothing``; run-time arguments
    since bundle format version 3, as the ignore_index, drawn per V as test_h200's cases draw
    it); and every backward kernel of the bundles on slices (:func:`run_shard_backward`).
    Returns the number of launches."""
    import torch

    from cegen import _kernels
    from cegen import _runtime
    from test_h200 import Case, Key, draw_values, log, mix

    rt = _runtime.get_runtime()
    target = "sm_90" if dev.type == "cuda" else "host"
    launches = 0
    for directory in bundle_dirs:
        bundle = rt.open_bundle(Path(directory).resolve())
        for text, kernel_target in bundle.kernels():
            if kernel_target != target:
                continue
            key = Key.parse(text)
            if key.op == "backward":
                t0 = time.time()
                before = len(failures)
                launches += run_shard_backward(str(Path(directory).resolve()), text, seed,
                                               failures, dev)
                log(f"[{'FAIL' if len(failures) > before else ' ok '}] {text} sliced "
                    f"({time.time() - t0:.2f} s)")
                continue
            if key.op != "shard_stats":
                continue
            dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[key.logits]
            t0 = time.time()
            before = len(failures)
            for index, v in enumerate(SHARD_VOCABS):
                s, b = 3, 2
                n = s * b
                start, vocab = (0, 1000)[index % 2], 300000
                global_smoothing = (index // 2) % 2 == 1
                # The ignore_index of the case; smoothing only says whether the kernel sums
                # the row (a coefficient of 0 would select the "off" kernel).
                values = draw_values(key, Case(f"shard-vocab{v}", n, s, b, v, True, False,
                                               False, False),
                                     False, mix(seed, f"{text}/{v}/options"))
                # A softcap kernel with the case's cap (scale 1: the combine applies none).
                options = _kernels.KernelOptions(
                    ignore_index=values.ignore_index,
                    label_smoothing=0.1 if key.smoothing_on else 0.0, z_loss=0.0,
                    logit_softcap=values.logit_softcap if key.softcap_on else None,
                    label_layout="bs", bundle=str(Path(directory).resolve()),
                    shard=_kernels.Shard(start, vocab, global_smoothing))
                values = dataclasses.replace(values, logit_scale=1.0)
                gen = torch.Generator().manual_seed(mix(seed, f"{text}/{v}"))
                x = (torch.randn((n, v), generator=gen, dtype=torch.float64) * 2).to(dtype)
                labels = torch.randint(0, vocab, (n,), generator=gen)
                inside = torch.rand((n,), generator=gen) < 0.5
                labels = torch.where(inside, start + torch.randint(0, v, (n,), generator=gen),
                                     labels)
                if values.ignore_index is not None:
                    labels[0] = values.ignore_index
                # A strided view: rows V + 3 apart, starting 5 elements in (odd offsets).
                storage = torch.full((n * (v + 3) + 8,), -7777.0, dtype=dtype, device=dev)
                rows = storage.as_strided((n, v), (v + 3, 1), 5)
                rows.copy_(x.to(dev))
                if key.layout == "flat":
                    logits, labels_dev = rows, labels.to(dev)
                    token_labels = labels
                else:
                    # [S,B,V] logits with [B,S] labels: token (b, s) is row s*B + b.
                    logits = rows.view(s, b, v)
                    labels_bs = labels.view(s, b).t().contiguous()
                    labels_dev = labels_bs.to(dev)
                    token_labels = labels  # row-major over [S, B] = the rows' order
                # Every other V also asks for the slice's entropy and argmax (flag bits 4
                # and 5: the accumulating statistics sweep), written through strided views
                # with NaN padding that must survive.
                outputs = index % 2 == 1
                token_shape = (n,) if key.layout == "flat" else (b, s)
                pads = (torch.full((2 * n + 3,), float("nan"), device=dev),
                        torch.full((2 * n + 3,), -5, dtype=torch.int64, device=dev))
                entropy, argmax = (pad[3::2].view(token_shape) if outputs else None
                                   for pad in pads)
                out = _kernels.shard_stats(logits, labels_dev, options, entropy=entropy,
                                           argmax=argmax)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                launches += 1
                got = out.to(torch.float64).cpu()
                if key.layout != "flat":
                    got = got.transpose(0, 1).reshape(n, 4)  # [B,S,4] -> rows s*B + b
                z = values.transform(x.to(torch.float64))
                ref, abs_sum = shard_reference(z, token_labels, start, vocab,
                                               values.ignore_index, key.smoothing_on)
                # A softcap kernel's f32 z is within z_atol of float64's (0 without a cap).
                z_atol = values.z_atol()
                zeros = torch.zeros(n, dtype=torch.float64)
                tolerance = torch.stack([
                    zeros + z_atol,
                    1e-5 * ref[:, 1].abs().clamp(min=1.0) + 2 * z_atol * (ref[:, 1] + 1),
                    zeros + z_atol,
                    1e-5 * abs_sum.clamp(min=1.0) + v * z_atol], dim=-1)
                if outputs:
                    check_shard_outputs(z, z_atol, entropy, argmax, start,
                                        key.layout != "flat", pads,
                                        f"shard_stats {text} V={v} slice at {start}", failures)
                bad = ~((got - ref).abs() <= tolerance)
                if bad.any() or not bool((storage[:5] == -7777.0).all()):
                    where = bad.nonzero()[:3].tolist()
                    failures.append(f"shard_stats {text} V={v} slice at {start} of {vocab} "
                                    f"{'global' if global_smoothing else 'local'} smoothing "
                                    f"({values.values_text()}): {int(bad.sum())} values off, "
                                    f"first {where}: {got[bad][:3].tolist()} vs "
                                    f"{ref[bad][:3].tolist()}")
            log(f"[{'FAIL' if len(failures) > before else ' ok '}] {text} "
                f"({time.time() - t0:.2f} s)")
    return launches


def inner(args: argparse.Namespace) -> int:
    """The checked process: every kernel on every case, numbers against float64."""
    sys.path.insert(0, str(HERE))
    import torch

    import test_h200 as T

    seed = args.seed
    dev = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    h = T.Harness(args.runtime, args.bundles, dev)
    report = T.Report()
    # The fused kernels first (the row cache), then the forward and backward ones.
    order = {"fused": 0, "forward": 1, "backward": 2}
    keys = sorted(h.kernels, key=lambda k: (order.get(T.Key.parse(k).op, 3), k))
    started = time.time()
    skipped = []
    for text in keys:
        if time.time() - started > args.budget_s:
            skipped.append(text)
            continue
        before, t0 = report.failures, time.time()
        # Each case with option values of its own (test_h200's draw), then one bad label.
        T.run_kernel(h, report, text, cases(), seed, bad_label_cases=False)
        bad_key = T.draw_values(T.Key.parse(text), T.BAD_LABEL_CASE, True,
                                T.mix(seed, text + "/bad/options"))
        gen = torch.Generator().manual_seed(T.mix(seed, text + "/bad-label"))
        T.run_bad_label(h, report, bad_key, 4, 7, gen)
        T.log(f"[{'FAIL' if report.failures > before else ' ok '}] {text} "
              f"({time.time() - t0:.2f} s)")
    failures: List[str] = []
    shard_launches = run_shard_stats(args.shard_bundles, seed, failures, dev)
    summary = {"kernels": len(keys) - len(skipped), "skipped": len(skipped),
               "checks": report.checks, "failures": report.failures,
               "failed_kernels": sorted(report.failed_kernels)[:20],
               "shard_stats_launches": shard_launches, "shard_failures": failures[:20],
               "seconds": round(time.time() - started, 1)}
    print("SANITIZE-INNER " + json.dumps(summary), flush=True)
    ok = (report.failures == 0 and not failures and bool(keys) and not skipped
          and shard_launches > 0)
    return 0 if ok else 1


# -- the driver -----------------------------------------------------------------------------


def parse_report(tool: str, text: str) -> Dict:
    """Counts from one tool's output: its summary, per cegen kernel and offset, and the
    other kernels named in reports; the inner process's own summary line."""
    entry: Dict = {"tool": tool}
    summary = ERROR_SUMMARY.findall(text)
    entry["errors"] = int(summary[-1]) if summary else None
    race = RACE_SUMMARY.findall(text)
    if race:
        hazards, errors, warnings = (int(v) for v in race[-1])
        entry.update(hazards=hazards, race_errors=errors, race_warnings=warnings)
    report_lines = [line for line in text.splitlines()
                    if line.startswith("=========") and "SUMMARY" not in line]
    at = collections.Counter()
    kernels = collections.Counter()
    others = collections.Counter()
    for line in report_lines:
        for kernel, offset in KERNEL_AT.findall(line):
            at[f"{kernel}+{offset}"] += 1
            kernels[kernel] += 1
        for name in ANY_AT.findall(line):
            if not name.startswith("ce_"):
                others[name.strip()[:80]] += 1
    entry["by_kernel"] = dict(kernels.most_common())
    entry["top_offsets"] = dict(at.most_common(12))
    entry["other_kernels"] = dict(others.most_common(12))
    inner_lines = [line for line in text.splitlines() if line.startswith("SANITIZE-INNER ")]
    entry["run"] = json.loads(inner_lines[-1][len("SANITIZE-INNER "):]) if inner_lines else None
    return entry


def passed(entry: Dict) -> bool:
    run = entry.get("run") or {}
    if entry["tool"] == "racecheck":
        clean = entry.get("hazards") == 0 and entry.get("errors") in (None, 0)
    else:
        clean = entry.get("errors") == 0
    numbers = (entry.get("rc") == 0 and run.get("failures") == 0 and run.get("kernels", 0) > 0
               and run.get("skipped") == 0
               and not run.get("shard_failures") and run.get("shard_stats_launches", 0) > 0)
    return bool(clean and numbers)


def outer(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sanitizer = shutil.which("compute-sanitizer") or next(
        (str(p) for p in sorted(Path("/usr/local").glob("cuda*/bin/compute-sanitizer"))), None)
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu or not sanitizer:
        print("SKIP: needs a CUDA device and compute-sanitizer (test/gpu/sanitize_h200.py)")
        return 0
    seed = args.seed if args.seed is not None else int(time.time() * 1000) % (2 ** 31)
    version = subprocess.run([sanitizer, "--version"], capture_output=True, text=True).stdout
    results: Dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.gmtime()), "seed": seed,
        "label": args.label, "command": " ".join(sys.argv), "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0),
        "compute_sanitizer": version.strip().splitlines()[-1] if version.strip() else "?",
        "tools": {}}
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1", PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="2")
    inner_cmd = [sys.executable, str(Path(__file__).resolve()), "--inner", "--seed", str(seed),
                 "--budget-s", str(args.budget_s),
                 "--runtime", args.runtime, "--bundles", *args.bundles,
                 "--shard-bundles", *args.shard_bundles]
    processes = {}
    for tool in args.tools.split(","):
        options = ["--tool", tool, "--print-limit", "10000000"]
        if tool == "racecheck":
            options += ["--racecheck-report", "all"]
        log_path = out / f"sanitize-{args.label}-{tool}.log"
        command = [sanitizer, *options, *inner_cmd]
        stream = open(log_path, "w")
        stream.write("$ " + " ".join(command) + "\n")
        stream.flush()
        processes[tool] = (subprocess.Popen(command, stdout=stream, stderr=subprocess.STDOUT,
                                            env=env, cwd=str(HERE.parents[1])),
                           stream, log_path, time.time(), command)
    ok = True
    finished: Dict[str, object] = {}
    deadline = time.time() + args.timeout
    while len(finished) < len(processes):
        for tool, (process, _, _, t0, _) in processes.items():
            if tool not in finished and process.poll() is not None:
                finished[tool] = (process.returncode, round(time.time() - t0, 1))
        if time.time() > deadline:
            for tool, (process, _, _, t0, _) in processes.items():
                if tool not in finished:
                    process.kill()
                    process.wait()
                    finished[tool] = ("timeout", round(time.time() - t0, 1))
        time.sleep(0.5)
    for tool, (process, stream, log_path, t0, command) in processes.items():
        rc, seconds = finished[tool]
        stream.close()
        entry = parse_report(tool, log_path.read_text(errors="replace"))
        entry.update(rc=rc, seconds=seconds,
                     command=" ".join(command[:6]) + " ...")
        entry["pass"] = passed(entry)
        ok &= entry["pass"]
        results["tools"][tool] = entry
        run = entry.get("run") or {}
        print(f"{args.label} {tool:<9} {'pass' if entry['pass'] else 'FAIL'}: errors "
              f"{entry.get('errors')} hazards {entry.get('hazards', '-')} "
              f"(kernels {json.dumps(entry['by_kernel'])[:200]}; offsets "
              f"{json.dumps(entry['top_offsets'])[:200]}; others "
              f"{json.dumps(entry['other_kernels'])[:120]}); {run.get('kernels')} keys, "
              f"{run.get('checks')} checks, {run.get('failures')} failures, "
              f"{run.get('skipped')} keys left out (budget), "
              f"{run.get('shard_stats_launches')} slice launches (shard_stats, backward); "
              f"rc {rc}, "
              f"{entry['seconds']} s", flush=True)
    results["pass"] = ok
    with open(out / f"sanitize-{args.label}.json", "w") as stream:
        json.dump(results, stream, indent=1)
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime", required=True, help="libce_runtime.so to load")
    parser.add_argument("--bundles", nargs="+", required=True,
                        help="bundles with forward/backward/fused kernels")
    parser.add_argument("--shard-bundles", nargs="*", default=[],
                        help="bundles with shard_stats (and backward) kernels, run on "
                             "vocabulary slices")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--label", default="run", help="names the output files")
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--timeout", type=float, default=540.0,
                        help="seconds each sanitized process may take")
    parser.add_argument("--budget-s", type=float, default=1e9,
                        help="stop starting kernels after this many seconds in each checked "
                             "process (the run then does not pass: kernels left out)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--inner", action="store_true",
                        help="run the cases in this process, without a sanitizer")
    parser.add_argument("--device", default="cuda",
                        help="with --inner: cuda, or cpu to check the harness on host bundles")
    args = parser.parse_args()
    if args.inner:
        return inner(args)
    return outer(args)


if __name__ == "__main__":
    sys.exit(main())
