#!/usr/bin/env python3
"""cegen's AMD kernels executed in tinygrad's CDNA emulator against the float64 reference.

No AMD GPU is reachable; this runs the gfx942, gfx950 and gfx90a HSACO that ce-gen emits,
launched through cegen's own runtime (libce_runtime's HIP backend: its argument packing, grid,
block and LDS bytes) against test/amd/emulator_hip.c, a libamdhip64.so whose launches run in
tinygrad's mock AMD GPU (test/amd/emulator.py). The numerics are test/gpu/test_h200.py's:
its Problem (inputs, views, special rows, Megatron labels), its float64 reference and
tolerances, its run_case and bad-label checks with option values drawn per case (run_kernel), on its CASES as they are (``--case-set h200``)
or at smaller shapes (``small``), plus a case of rows whose probabilities are f32 subnormals.
The rescale kernels (op=rescale, ``ce_rescale``) run test/amd/rescale_cases.py's cases
(RescaleTest.cpp's contract: every (g, w) pair kind, strided and stride-0 upstream gradients,
0-d weights), and ``--mutate`` changes one comparison, then one bit, of a rescale kernel too.
The tensor-parallel kernels run test/amd/shard_cases.py's cases: ``shard_stats`` kernels, and
the backward kernels without z-loss or overwrite called on a vocabulary slice (``--shard-only``:
those alone); ``--mutate`` also changes executed instructions of a shard_stats kernel.
Run from the repository root with Debian's python3 (it has torch)::

    /usr/bin/python3 test/amd/run_emulated.py --tinygrad /path/to/tinygrad \\
        [--targets gfx942,gfx950,gfx90a] [--set full|smoke] [--case-set h200|small] \\
        [--filter TEXT] [--mutate] [--shard-only]

tinygrad is never part of this repository: pass a checkout of tinygrad/tinygrad (its
``test/mockgpu/amd/emu.py``); without one the script prints SKIP and exits 0. Bundles are made
with ``ce-gen --target=CHIP`` into ``--work`` (default .dev/amd, git-ignored). Results go to
WORK/results-SET-CHIPS.json and WORK/log-SET-CHIPS.txt; docs/AMD-TESTS.md has a run's numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "test" / "gpu"))
sys.path.insert(0, str(REPO / "test" / "amd"))

import rescale_cases as rescale  # noqa: E402
import shard_cases as shard  # noqa: E402

#: gcnArchName of each chip's device, as the runtime reads it (the suffix is dropped).
CHIPS = {"gfx942": "gfx942:sramecc+:xnack-", "gfx950": "gfx950:sramecc+:xnack-",
         "gfx90a": "gfx90a:sramecc+:xnack-"}


def log(message: str = "") -> None:
    print(message, flush=True)
    LOG.append(message)


LOG: List[str] = []

# -- bundles ----------------------------------------------------------------------------------

#: name -> ce-gen options (with --target and -o added). "full" is test/gpu/prepare_device_run.sh's
#: three bundles for the H200 (test/runtime/CMakeLists.txt's numerics bundles): every op, dtype,
#: label dtype and layout; smoothing off/on x z-loss off/on; overwrite on and off (fused kernels
#: take per-token weights: a scalar weight is one of stride 0, a case of its own). "smoke" is a
#: few of them (ctest). Bundle format version 3: the option values
#: (ignore_index, the smoothing and z-loss coefficients) are kernel arguments, which every case
#: draws for itself (test_h200.draw_values).
BUNDLE_SETS = {
    "full": {
        "dtypes": ["--op=forward,backward,fused", "--logits=bf16,f16,f32", "--labels=i32,i64",
                   "--layout=flat,sbv_bs,sbv_sb", "--label-smoothing=off", "--z-loss=off",
                   "--overwrite=0", "--weights=token"],
        "options": ["--op=forward,backward,fused", "--logits=bf16,f16,f32", "--labels=i64",
                    "--layout=sbv_bs", "--label-smoothing=off,on", "--z-loss=off,on",
                    "--overwrite=0", "--weights=token"],
        "overwrite": ["--op=forward,backward,fused", "--logits=bf16,f16,f32", "--labels=i64",
                      "--layout=flat,sbv_sb", "--label-smoothing=on", "--z-loss=on",
                      "--overwrite=1", "--weights=token"],
        # The fused gradient's correction: one kernel per dtype and layout (its key's other
        # fields are canonical).
        "rescale": ["--op=rescale", "--logits=bf16,f16,f32", "--layout=flat,sbv_bs,sbv_sb"],
        # Tensor parallelism's partial statistics (test/amd/shard_cases.py; the sharded
        # backward runs on the backward kernels above that have no z-loss and no overwrite).
        "shard": ["--op=shard_stats", "--logits=bf16,f16,f32", "--labels=i32,i64",
                  "--layout=flat,sbv_bs,sbv_sb", "--label-smoothing=off,on"],
        # The logit softcap (issue 17): the GPUs' approximate division in the tanh
        # (v_rcp_f32), each case with a cap drawn in [1, 64] (test_h200.draw_values).
        "softcap": ["--op=forward,backward,fused", "--logits=bf16,f32", "--labels=i64",
                    "--layout=sbv_bs", "--label-smoothing=off,on", "--z-loss=off,on",
                    "--overwrite=0,1", "--weights=token", "--softcap=on"],
    },
    "smoke": {
        "smoke": ["--op=forward,backward,fused", "--logits=bf16,f32", "--labels=i32",
                  "--layout=sbv_bs", "--label-smoothing=on", "--z-loss=on", "--overwrite=0",
                  "--weights=token"],
        "rescale": ["--op=rescale", "--logits=bf16,f32", "--layout=sbv_bs"],
        "shard": ["--op=shard_stats", "--logits=bf16", "--labels=i32", "--layout=sbv_bs",
                  "--label-smoothing=on"],
        "softcap": ["--op=forward,backward,fused", "--logits=bf16", "--labels=i32",
                    "--layout=sbv_bs", "--label-smoothing=on", "--z-loss=on", "--overwrite=0",
                    "--weights=token", "--softcap=on"],
    },
}


def make_bundles(ce_gen: Path, work: Path, chip: str, set_name: str) -> List[Path]:
    directories = []
    for name, options in BUNDLE_SETS[set_name].items():
        out = work / "bundles" / set_name / chip / name
        # Regenerated when the command or the ce-gen binary changes.
        stamp = out / ".ce-gen-command"
        command = [str(ce_gen), f"--target={chip}", "-o", str(out)] + options
        info = ce_gen.stat()
        text = " ".join(command) + f"\n{info.st_size} {info.st_mtime_ns}\n"
        if not (stamp.is_file() and stamp.read_text() == text
                and (out / "manifest.json").is_file()):
            subprocess.run(command, check=True)
            stamp.write_text(text)
        directories.append(out)
    return directories


# -- cases ------------------------------------------------------------------------------------


def emulator_cases(h200) -> list:
    """test_h200.CASES at smaller shapes (same flags, fewer tokens, V up to 32000 once), the
    last one a case of its own: rows whose probabilities are f32 subnormals."""
    Case = h200.Case
    return [
        Case("empty", 0, 0, 3, 7, False, False, False, False),
        Case("vocab1", 1, 1, 1, 1, False, False, False, False),
        Case("vocab2", 9, 3, 3, 2, False, False, False, False),
        Case("views-vocab7", 15, 5, 3, 7, True, True, True, False),
        Case("vocab4095", 8, 2, 4, 4095, False, True, False, False),
        Case("views-vocab32000", 1, 1, 1, 32000, True, True, True, False),
        Case("special-vocab1500", 7, 7, 1, 1500, False, True, False, False),
        Case("all-ignored", 4, 2, 2, 7, True, False, False, True),
        Case("megatron-labels-vocab7", 15, 5, 3, 7, True, True, True, False, True),
        Case("megatron-labels-vocab600", 12, 3, 4, 600, False, True, False, False, True),
        Case(SUBNORMAL_CASE, 4, 2, 2, 300, False, False, False, False),
    ]


#: Rows x_j = -j * 0.35 (j < V = 300): p_j = exp(x_j - lse) falls below 2^-126 from j ~ 250
#: on, so the exact gradient has f32 subnormals, which CDNA keeps (our kernels run with f32
#: denormals on) and the emulator flushes to 0 (it runs with DAZ+FTZ).
SUBNORMAL_CASE = "subnormal-probabilities"
F32_MIN_NORMAL = 2.0 ** -126


@dataclass
class Worst:
    """The largest error of each kind, as a fraction of its tolerance, and where."""
    values: Dict[str, tuple] = field(default_factory=dict)

    def note(self, what: str, ratio: float, where: str) -> None:
        if math.isnan(ratio):
            ratio = math.inf
        if ratio > self.values.get(what, (-1.0, ""))[0]:
            self.values[what] = (ratio, where)


class Instrumented:
    """Wraps test_h200's checks: records the worst error per kind and chip, and separates
    the subnormal case's flushed elements (a documented difference) from failures."""

    def __init__(self, h200, torch):
        self.h200, self.torch = h200, torch
        self.original_values = h200.check_token_values
        self.original_grad = h200.check_grad
        self.original_problem = h200.Problem
        self.worst = Worst()
        self.flushed: Dict[str, int] = {}
        self.chip = ""
        #: Off during the mutation check, whose failures are the point.
        self.recording = True
        h200.check_token_values = self.check_token_values
        h200.check_grad = self.check_grad
        outer = self

        class Problem(h200.Problem):
            def __init__(self, key, case, device, gen):
                super().__init__(key, case, device, gen)
                if case.name == SUBNORMAL_CASE:
                    j = outer.torch.arange(self.vocab, dtype=outer.torch.float64)
                    self.x[:] = self.round(-0.35 * j)[None, :]

        h200.Problem = Problem

    def check_token_values(self, report, p, what, kernel, ref, exact_zero, case):
        torch = self.torch
        k = kernel.to(torch.float64).cpu()
        finite = torch.isfinite(ref) & torch.isfinite(k) & ~exact_zero
        if finite.any() and self.recording:
            ratio = ((k - ref).abs() / (1e-5 * ref.abs().clamp(min=1.0)))[finite]
            at = int(ratio.argmax())
            self.worst.note(f"{self.chip} {what} (rel err / 1e-5)", float(ratio[at]),
                            f"{p.key.text} {case}")
        self.original_values(report, p, what, kernel, ref, exact_zero, case)

    def check_grad(self, report, p, kernel_rows, ref, term, case, flush=None, rows=None):
        torch = self.torch
        if ref.numel() and self.recording:
            k = kernel_rows.to(torch.float64).cpu()
            if case.partition(" (")[0] == SUBNORMAL_CASE:  # the name, then the values
                # Elements whose exact probability exp(x_j - lse) or exact gradient is an
                # f32 subnormal and that the emulator returned as 0 are counted apart (the
                # hardware keeps the subnormal, the emulator flushes it), then compared as
                # the kernel's 0.
                z = p.key.transform(p.x)  # the logits the kernel sees (issue 17)
                lse = self.h200.reference_stats(z).lse
                prob = torch.exp(z - lse[:, None])
                tiny = ((prob < F32_MIN_NORMAL) & (prob > 0)) | (ref.abs() < F32_MIN_NORMAL)
                # Only those that would fail: an f16 output rounds such values to 0 anyway.
                outside = (k - ref).abs() > self.h200.grad_tolerance(p.key.logits, ref, term)
                sub = tiny & (k == 0) & (ref != 0) & outside
                self.flushed[self.chip] = self.flushed.get(self.chip, 0) + int(sub.sum())
                ref = torch.where(sub, k, ref)
                term = torch.where(sub, torch.zeros_like(term), term)
            tolerance = self.h200.grad_tolerance(p.key.logits, ref, term)
            if flush is not None:
                tolerance = tolerance + flush[:, None]
            error = torch.where(k == ref, torch.zeros_like(k), (k - ref).abs())
            if rows is not None:
                error = torch.where(rows[:, None], error, torch.zeros_like(error))
            ratio = torch.where(error == 0, torch.zeros_like(error), error / tolerance)
            ratio = torch.where(torch.isnan(ratio), torch.full_like(ratio, math.inf), ratio)
            at = int(ratio.argmax())
            self.worst.note(f"{self.chip} grad (err / tolerance), {p.key.logits}",
                            float(ratio.flatten()[at]), f"{p.key.text} {case}")
        self.original_grad(report, p, kernel_rows, ref, term, case, flush=flush, rows=rows)


# -- the harness: test_h200's, on emulated HIP devices ------------------------------------------


def make_harness(h200, runtime: str, bundle_dirs: List[Path], chip: str, index: int):
    import torch
    from cegen import _runtime

    class EmulatedHarness(h200.Harness):
        """test_h200's Harness with CPU tensors (host memory is the emulated device's) on HIP
        device `index`, whose gcnArchName is `chip`'s."""

        def __init__(self):
            super().__init__(runtime, [], torch.device("cpu"))
            self.target = chip
            self.bundles = [self.rt.open_bundle(d.resolve()) for d in bundle_dirs]
            self.kernels = {}
            for bundle in self.bundles:
                for key, target in bundle.kernels():
                    if target == chip:
                        self.kernels.setdefault(key, bundle)
            self.device_type = _runtime.Device.HIP
            self.index = index

    return EmulatedHarness()


def run_chip(h200, emulator, instrumented, harness, chip: str, cases, seed: int,
             filter_text: str, bad_labels: bool, results: Dict, rescale_cases: list,
             shard_cases: list, shard_only: bool = False) -> None:
    report = h200.Report()
    instrumented.chip = chip
    keys = sorted(k for k in harness.kernels if filter_text in k and (
        not shard_only or k.startswith("op=shard_stats,") or shard.wanted_backward(k)))
    started = time.time()
    launches_before = len(emulator.launches)
    gfx90a_before = dict(emulator.gfx90a.decoded)
    log(f"{chip}: {len(keys)} kernels x "
        + ("" if shard_only else f"{len(cases)} cases{' + 4 bad-label cases' if bad_labels else ''}"
           f" (rescale kernels: {len(rescale_cases)} cases of test/amd/rescale_cases.py), ")
        + f"shard_stats and sharded backward: {len(shard_cases)} cases of "
        f"test/amd/shard_cases.py + 1 bad label each")
    coverage: Dict[str, set] = {}
    rescale_kernels = rescale_checks = shard_kernels = shard_backward = shard_checks = 0
    note = (lambda what, ratio, where: instrumented.worst.note(f"{chip} {what}", ratio, where)
            if instrumented.recording else None)
    for index, text in enumerate(keys):
        before = report.failures
        t0 = time.time()
        if text.startswith("op=rescale,"):
            rescale_kernels += 1
            checks_before = report.checks
            rescale.run_kernel(harness, report, text, rescale_cases, seed, h200.mix,
                               lambda what, ratio, where: instrumented.worst.note(
                                   f"{chip} {what}", ratio, where)
                               if instrumented.recording else None)
            rescale_checks += report.checks - checks_before
        elif text.startswith("op=shard_stats,"):
            shard_kernels += 1
            checks_before = report.checks
            shard.run_kernel(harness, report, text, shard_cases, seed, h200.mix, note)
            shard_checks += report.checks - checks_before
        else:
            # test_h200's loop: each case with option values of its own, then the bad labels.
            if not shard_only:
                h200.run_kernel(harness, report, text, cases, seed, bad_labels, coverage)
            if shard.wanted_backward(text):  # and on a vocabulary slice
                shard_backward += 1
                checks_before = report.checks
                shard.run_kernel(harness, report, text, shard_cases, seed, h200.mix, note)
                shard_checks += report.checks - checks_before
        failed = report.failures - before
        log(f"  [{'FAIL' if failed else ' ok '}] {index + 1}/{len(keys)} {text} "
            f"({time.time() - t0:.1f} s)")
    launches = emulator.launches[launches_before:]
    gfx90a_ops = {name: n - gfx90a_before.get(name, 0)
                  for name, n in emulator.gfx90a.decoded.items() if n > gfx90a_before.get(name, 0)}
    results[chip] = {
        "kernels": len(keys), "checks": report.checks, "failures": report.failures,
        # op=rescale's share: one check per gradient element, plus status, padding, inputs
        "rescale_kernels": rescale_kernels, "rescale_checks": rescale_checks,
        # test/amd/shard_cases.py's share: shard_stats kernels, backward kernels run sharded
        "shard_stats_kernels": shard_kernels, "sharded_backward_kernels": shard_backward,
        "shard_checks": shard_checks,
        "failed_kernels": sorted(report.failed_kernels)[:50], "launches": len(launches),
        "subnormal_elements_flushed": instrumented.flushed.get(chip, 0),
        # gfx90a-only instructions run through the launcher's layer (decoded per launch)
        "gfx90a_layer_instructions": dict(sorted(gfx90a_ops.items())),
        "user_sgprs": sorted({" ".join(r.user_sgprs) for r in launches}),
        "lds_bytes": sorted({r.lds_bytes for r in launches}),
        "coverage": {field: sorted(values) for field, values in sorted(coverage.items())},
        "seconds": round(time.time() - started, 1), "pass": report.failures == 0 and bool(keys),
    }
    log(f"{chip}: option values covered {json.dumps(results[chip]['coverage'])}")
    log(f"{chip}: {len(keys)} kernels, {len(launches)} launches, {report.checks} checks, "
        f"{report.failures} failures ({rescale_kernels} rescale kernels: {rescale_checks} "
        f"checks; {shard_kernels} shard_stats kernels and {shard_backward} backward kernels "
        f"sharded: {shard_checks} checks), {instrumented.flushed.get(chip, 0)} subnormal gradient "
        f"elements flushed by the emulator, {time.time() - started:.0f} s")
    if gfx90a_ops:
        log(f"{chip}: gfx90a-only instructions run by the launcher's layer (decoded per launch): "
            f"{json.dumps(results[chip]['gfx90a_layer_instructions'])}")


# -- the mutation check -----------------------------------------------------------------------


def find_instruction(emulator, co, symbol: str, want, last: bool = False, executed=None,
                     start: int = -1):
    """(file offset, op name) of the first (or last) instruction of the function `symbol` for
    which `want(op name, its bytes)` holds, decoding from its entry to its end as the emulator
    runs it (tinygrad's decoder, with the launcher's gfx90a layer on gfx90a); with `executed`
    (code addresses), only among the instructions at those addresses; only past file offset
    `start`."""
    from emulator import decode_name

    address, size = co.symbols[symbol]
    offset = next(o + address - v for o, v, f, _m in co.segments if v <= address < v + f)
    end, found, previous = offset + size, None, ("", b"")
    while offset < end:
        name, length = decode_name(emulator.emu, co.image[offset:offset + 16], co.chip)
        raw = co.image[offset:offset + length]
        if executed is not None and co.virtual_address(offset) not in executed:
            pass  # only instructions that ran (emulator.executed of an unmutated run)
        elif offset <= start:
            pass
        elif want(name, raw) if want.__code__.co_argcount == 2 else want(name, raw, previous):
            found = (offset, name)
            if not last:
                break
        previous = (name, raw)
        offset += length
    if found is None:
        raise LookupError(f"no matching instruction in {symbol}")
    return found


def mutation_check(h200, emulator, harness, chip: str, seed: int, results: Dict) -> None:
    """Runs a forward kernel with one instruction, then one constant, of its code changed
    (in the code object the emulator maps, after hipModuleLoadData) and shows the loss wrong;
    then the unchanged kernel on the same inputs."""
    import hashlib
    import struct

    from emulator import decode_name

    texts = sorted(k for k in harness.kernels if k.startswith("op=forward,logits=f32,"))
    # The plainest one: no smoothing, no z-loss, when the bundles have it (its cases run with
    # no ignore_index and coefficients 0: Key.parse's values).
    text = next((k for k in texts if "label_smoothing=off,z_loss=off," in k),
                texts[0] if texts else None)
    if text is None:
        log("mutation: no f32 forward kernel in the bundles")
        return
    bundle = harness.kernels[text]
    manifest = json.loads((Path(bundle.path) / "manifest.json").read_text())
    kernel = next(k for k in manifest["kernels"] if k["key"] == text and k["target"] == chip)
    image = (Path(bundle.path) / kernel["object"]).read_bytes()
    co = emulator._code_object(image)
    symbol = kernel["symbol"]
    digest = hashlib.sha256(image).hexdigest()

    mutations = []

    def vop2(name: str, new_op: int, last: bool, after=None, start: int = -1):
        """The first (last) VOP2 `name` (right after an instruction for which `after(op name,
        bytes, this instruction's bytes)` holds, if given; past file offset `start`) with its
        opcode (bits 30:25) replaced by `new_op`."""
        at, inst = find_instruction(
            emulator, co, symbol,
            lambda op, raw, previous: op == name and (after is None or after(*previous, raw)),
            last, start=start)
        word = struct.unpack_from("<I", image, at)[0]
        patch = struct.pack("<I", (word & ~(0x3F << 25)) | (new_op << 25))
        return ("instruction", at, patch, inst,
                decode_name(emulator.emu, patch + co.image[at + 4:at + 16], co.chip)[0])

    # The epilogue's log(sum) ends with the literal ln(2) (high part, 0x3f317200), the last
    # in the kernel (the entropy and argmax code after the lse store has none).
    lit = struct.pack("<I", 0x3F317200)
    at, inst = find_instruction(emulator, co, symbol,
                                lambda name, raw: len(raw) == 8 and raw[4:] == lit, last=True)
    # One instruction: the first v_add_f32 (VOP2 op 1) after it, lse = max + log(sum),
    # becomes v_sub_f32 (op 2). (Once the kernel's last v_add_f32; the outputs' code now
    # follows the lse store.)
    if co.chip != "gfx90a":
        mutations.append(vop2("V_ADD_F32_E32", 0x02, last=False, start=at))
    else:
        # gfx90a forms lse as v_mad_f32 (s max + log(sum), unfused): its third source is
        # negated (VOP3 NEG bit 2, bit 31 of the second dword), lse = s max - log(sum).
        mad_at, mad = find_instruction(emulator, co, symbol,
                                       lambda op, raw: op == "V_MAD_F32", start=at)
        word = struct.unpack_from("<I", image, mad_at + 4)[0]
        patch = struct.pack("<I", word ^ (1 << 31))
        mutations.append(("instruction", mad_at + 4, patch, f"{mad} v, a, b, c",
                          f"{mad} v, a, b, -c"))
    # One constant: that ln(2), which scales the exponent of the sum, becomes 0.75.
    patch = struct.pack("<I", 0x3F400000)
    mutations.append(("constant", at + 4, patch, f"{inst} 0x3f317200", f"{inst} 0x3f400000"))
    # gfx90a's flushed code merges two lanes' (max, sum) states with v_mac_f32 (run by the
    # emulator's gfx90a layer), sums kept without the maximum's own 1: S = S_a + e^(m_b - m_a)
    # (1 + S_b), the 1 + S_b from the v_add_f32 just before. The first such v_mac_f32 becomes
    # v_mul_f32 (op 5), which drops S_a. (The main loop's v_mac_f32 adds a rounding-correction
    # term, within the tolerance when dropped; the long-row path merges with v_pk_fma_f32.)
    def plus_one_feeds(prev_name: str, prev_raw: bytes, raw: bytes) -> bool:
        if prev_name != "V_ADD_F32_E32" or prev_raw[0] | (prev_raw[1] & 1) << 8 != 242:
            return False  # not v_add_f32_e32 vD, 1.0, vX (src0 242: the inline 1.0)
        word, prev = struct.unpack_from("<I", raw)[0], struct.unpack_from("<I", prev_raw)[0]
        dest = (prev >> 17) & 0xFF
        return (word & 0x1FF) == 256 + dest or (word >> 9) & 0xFF == dest

    if co.chip == "gfx90a":
        try:
            mutations.append(vop2("V_MAC_F32_E32", 0x05, last=False, after=plus_one_feeds))
        except LookupError:
            log(f"mutation ({chip}): {symbol} has no v_mac_f32_e32 (denormals kept)")
    # Once a control that the arithmetic tolerated (it only lowered the shift the exponentials
    # are taken against): the first v_max_f32 (op 11) becomes v_min_f32 (op 10). The first is
    # now in the statistics sweep that accumulates the outputs, whose step maximum the argmax
    # compares the elements with exactly: detected there. (gfx950's forward kernels have no
    # v_max_f32_e32.)
    try:
        mutations.append(vop2("V_MAX_F32_E32", 0x0A, last=False))
    except LookupError:
        log(f"mutation ({chip}): {symbol} has no v_max_f32_e32; no control mutation")
    # Rows long enough for the main (unrolled) loop, and a short one for the tail code.
    cases = [c for c in h200.CASES if c.name in ("views-vocab7", "views-vocab32000",
                                                   "vocab50257")]
    key = h200.Key.parse(text)
    outcome = []
    for kind, at, patch, before, after in mutations:
        # Every launch hands the hook the runtime's copy of the object; the hook maps the
        # patched bytes (a CodeObject of their own) while the mutation is set.
        emulator.mutation = (digest, at, patch)
        emulator.mutation_executed = False
        report = h200.Report()
        for c in cases:
            gen = h200.torch.Generator().manual_seed(h200.mix(seed, "mutation/" + c.name))
            h200.run_case(harness, report, key, c, gen)
        emulator.mutation = None
        executed = emulator.mutation_executed
        outcome.append({"kind": kind, "file_offset": at, "before": before, "after": after,
                        "executed": executed, "checks": report.checks,
                        "failures": report.failures})
        log(f"mutation ({chip}, {symbol}, {kind} at byte {at}): {before} -> {after}: "
            f"{'executed' if executed else 'NOT EXECUTED'}, {report.failures} of "
            f"{report.checks} checks fail{'' if report.failures else ' (not detected)'}")
    # The unmutated kernel again, on the same inputs: it passes.
    report = h200.Report()
    for c in cases:
        gen = h200.torch.Generator().manual_seed(h200.mix(seed, "mutation/" + c.name))
        h200.run_case(harness, report, key, c, gen)
    log(f"mutation ({chip}): unmutated on the same inputs: {report.failures} of "
        f"{report.checks} checks fail")
    results.setdefault("mutation", {})[chip] = {"kernel": text, "mutations": outcome,
                                                "unmutated_failures": report.failures}


def mutation_check_rescale(emulator, harness, chip: str, seed: int, cases, results: Dict,
                           mix) -> None:
    """Runs a rescale kernel with one comparison of its code changed (as mutation_check does:
    in the code object the emulator maps), then one bit of its ratio, on rescale_cases.py's
    cases and shows the check fail; then the unchanged kernel on the same inputs. Both
    comparisons differ from the right one only for a NaN upstream gradient, so what fails is
    the contract's NaN row; the negated ratio fails every rescaled element (and a negated
    quotient, which the fixup's sign rule undoes, is a control that must pass)."""
    import hashlib
    import struct

    from emulator import decode_name

    texts = sorted(k for k in harness.kernels if k.startswith("op=rescale,"))
    if not texts:
        log("mutation: no rescale kernel in the bundles")
        return
    text = texts[0]
    bundle = harness.kernels[text]
    manifest = json.loads((Path(bundle.path) / "manifest.json").read_text())
    kernel = next(k for k in manifest["kernels"] if k["key"] == text and k["target"] == chip)
    image = (Path(bundle.path) / kernel["object"]).read_bytes()
    co = emulator._code_object(image)
    symbol = kernel["symbol"]
    digest = hashlib.sha256(image).hexdigest()

    def patched(at: int, word: int):
        patch = struct.pack("<I", word)
        return patch, decode_name(emulator.emu, patch + co.image[at + 4:at + 16], co.chip)[0]

    mutations = []
    # The row skip, g == w: v_cmp_eq_f32 (VOPC, op bits 24:17: 0x42, ordered equal; a NaN g
    # is not equal, so its row is rescaled into NaN) becomes v_cmp_nlg_f32 (0x4a, unordered
    # or equal): a NaN g then skips its row.
    at, inst = find_instruction(emulator, co, symbol,
                                lambda name, raw: name == "V_CMP_EQ_F32_E32")
    word = struct.unpack_from("<I", image, at)[0]
    mutations.append((at, inst) + patched(at, (word & ~(0xFF << 17)) | (0x4A << 17)))
    # The early exit itself: the s_cbranch_vccnz after that compare becomes s_nop 0, so rows
    # with g == w are rescaled too: by 1 (bitwise the same) or, where g == w == 0, by the
    # ratio 0, which zeroes the row and its -0/+0 twin: what the untouched-row check sees.
    at, inst = find_instruction(emulator, co, symbol,
                                lambda name, raw: name == "S_CBRANCH_VCCNZ")
    mutations.append((at, inst) + patched(at, 0xBF800000))
    # The ratio's select, g != 0: v_cmp_neq_f32_e64 (VOP3, op bits 25:16: 0x4d, unordered
    # not-equal) becomes v_cmp_lg_f32 (0x45, ordered): a NaN g then gets the ratio 0.
    at, inst = find_instruction(emulator, co, symbol,
                                lambda name, raw: "CMP_NEQ_F32" in name and len(raw) == 8)
    word = struct.unpack_from("<I", image, at)[0]
    mutations.append((at, inst) + patched(at, (word & ~(0x3FF << 16)) | (0x45 << 16)))
    # The ratio: the negate bit of v_div_fixup_f32's third source, the numerator g (VOP3 bit
    # 63), set: the fixup gives the quotient the sign of numerator times denominator, so every
    # rescaled row gets -g/w, which the float64 comparison sees. (Negating its first source,
    # the quotient, changes nothing, for the same reason: a control, run first.)
    try:
        at, inst = find_instruction(emulator, co, symbol,
                                    lambda name, raw: name.startswith("V_DIV_FIXUP_F32"))
        word = struct.unpack_from("<I", image, at + 4)[0]
        for bit, was, now in ((29, "q, w, g", "-q, w, g"), (31, "q, w, g", "q, w, -g")):
            mutations.append((at + 4, f"{inst} {was}", struct.pack("<I", word | (1 << bit)),
                              f"{inst} {now}"))
    except LookupError:
        log(f"mutation ({chip}): {symbol} has no v_div_fixup_f32")
    outcome = []
    for at, before, patch, after in mutations:
        emulator.mutation = (digest, at, patch)
        emulator.mutation_executed = False
        report = h200_report()
        rescale.run_kernel(harness, report, text, cases, seed, mix, lambda *a: None)
        emulator.mutation = None
        executed = emulator.mutation_executed
        outcome.append({"file_offset": at, "before": before, "after": after,
                        "executed": executed, "checks": report.checks,
                        "failures": report.failures})
        log(f"mutation ({chip}, {symbol} {text}, instruction at byte {at}): {before} -> "
            f"{after}: {'executed' if executed else 'NOT EXECUTED'}, {report.failures} of "
            f"{report.checks} checks fail{'' if report.failures else ' (not detected)'}")
    report = h200_report()
    rescale.run_kernel(harness, report, text, cases, seed, mix, lambda *a: None)
    log(f"mutation ({chip}, rescale): unmutated on the same inputs: {report.failures} of "
        f"{report.checks} checks fail")
    results.setdefault("mutation_rescale", {})[chip] = {
        "kernel": text, "mutations": outcome, "unmutated_failures": report.failures}


def mutation_check_shard(emulator, harness, chip: str, seed: int, cases, results: Dict,
                         mix) -> None:
    """Runs a shard_stats kernel (with smoothing, so it sums the row too) with one instruction
    changed (as mutation_check does), on shard_cases.py's cases, and shows the checks fail;
    then the unchanged kernel on the same inputs. The instructions, one at a time, among those
    an unmutated run executed: the first and the last v_exp_f32 (the slice's exponentials)
    become v_log_f32, the first and the last v_add_f32 become v_sub_f32; each is reported
    executed or not (the emulator records whether the changed bytes were decoded)."""
    import hashlib
    import struct

    from emulator import decode_name

    texts = sorted(k for k in harness.kernels
                   if k.startswith("op=shard_stats,") and "label_smoothing=on" in k)
    if not texts:
        log("mutation: no shard_stats kernel with smoothing in the bundles")
        return
    text = next((k for k in texts if "logits=f32," in k), texts[0])
    bundle = harness.kernels[text]
    manifest = json.loads((Path(bundle.path) / "manifest.json").read_text())
    kernel = next(k for k in manifest["kernels"] if k["key"] == text and k["target"] == chip)
    image = (Path(bundle.path) / kernel["object"]).read_bytes()
    co = emulator._code_object(image)
    symbol = kernel["symbol"]
    digest = hashlib.sha256(image).hexdigest()
    outcome = []
    # The unmutated kernel first, recording the instructions it runs: the mutations are chosen
    # among those.
    emulator.executed = set()
    report = h200_report()
    shard.run_kernel(harness, report, text, cases, seed, mix, lambda *a: None)
    ran, emulator.executed = emulator.executed, None
    log(f"mutation ({chip}, shard_stats): unmutated: {report.failures} of {report.checks} "
        f"checks fail, {len(ran)} distinct instructions run")

    def vop1_exp_to_log(last: bool):
        # v_exp_f32 (VOP1, op bits 16:9: 0x20 on gfx9) becomes v_log_f32 (0x21).
        at, inst = find_instruction(emulator, co, symbol,
                                    lambda name, raw: name == "V_EXP_F32_E32", last=last,
                                    executed=ran)
        word = struct.unpack_from("<I", image, at)[0]
        return at, inst, struct.pack("<I", (word & ~(0xFF << 9)) | (0x21 << 9))

    def vop2_add_to_sub(last: bool):
        at, inst = find_instruction(emulator, co, symbol,
                                    lambda name, raw: name == "V_ADD_F32_E32", last=last,
                                    executed=ran)
        word = struct.unpack_from("<I", image, at)[0]
        return at, inst, struct.pack("<I", (word & ~(0x3F << 25)) | (0x02 << 25))

    for which, make in (("first v_exp_f32", lambda: vop1_exp_to_log(False)),
                        ("last v_exp_f32", lambda: vop1_exp_to_log(True)),
                        ("first v_add_f32", lambda: vop2_add_to_sub(False)),
                        ("last v_add_f32", lambda: vop2_add_to_sub(True))):
        try:
            at, inst, patch = make()
        except LookupError:
            log(f"mutation ({chip}): {symbol} has no {which}")
            continue
        after = decode_name(emulator.emu, patch + co.image[at + 4:at + 16], co.chip)[0]
        emulator.mutation = (digest, at, patch)
        emulator.mutation_executed = False
        report = h200_report()
        shard.run_kernel(harness, report, text, cases, seed, mix, lambda *a: None)
        emulator.mutation = None
        executed = emulator.mutation_executed
        outcome.append({"file_offset": at, "before": inst, "after": after, "executed": executed,
                        "which": which, "checks": report.checks, "failures": report.failures})
        log(f"mutation ({chip}, {symbol} {text}, {which} at byte {at}): {inst} -> {after}: "
            f"{'executed' if executed else 'NOT EXECUTED'}, {report.failures} of "
            f"{report.checks} checks fail{'' if report.failures else ' (not detected)'}")
    report = h200_report()
    shard.run_kernel(harness, report, text, cases, seed, mix, lambda *a: None)
    log(f"mutation ({chip}, shard_stats): unmutated on the same inputs: {report.failures} of "
        f"{report.checks} checks fail")
    results.setdefault("mutation_shard", {})[chip] = {
        "kernel": text, "mutations": outcome, "unmutated_failures": report.failures}


def h200_report():
    import test_h200

    return test_h200.Report()


# -- main -------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tinygrad", default=os.environ.get("CE_TINYGRAD"),
                        help="a tinygrad/tinygrad checkout (or $CE_TINYGRAD)")
    parser.add_argument("--runtime", default=None,
                        help="libce_runtime.so (default: build/lib, else .dev/lib)")
    parser.add_argument("--ce-gen", default=str(REPO / "build" / "bin" / "ce-gen"))
    parser.add_argument("--work", default=str(REPO / ".dev" / "amd"),
                        help="bundles, the fake HIP library and results (git-ignored)")
    parser.add_argument("--targets", default="gfx942,gfx950,gfx90a")
    parser.add_argument("--set", default="full", choices=sorted(BUNDLE_SETS))
    parser.add_argument("--case-set", default="h200", choices=["h200", "small"],
                        help="h200: test_h200.CASES as they are (V up to 128256); small: "
                             "the same kinds of case at smaller shapes")
    parser.add_argument("--cases", default="", help="comma-separated case names (default all)")
    parser.add_argument("--filter", default="", help="only kernels whose key contains this")
    parser.add_argument("--no-bad-labels", action="store_true")
    parser.add_argument("--mutate", action="store_true", help="run the mutation check")
    parser.add_argument("--shard-only", action="store_true",
                        help="only test/amd/shard_cases.py: shard_stats kernels and the sharded "
                             "backward (no test_h200 or rescale cases)")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()

    tinygrad_path = args.tinygrad or os.environ.get("CE_TINYGRAD")
    tinygrad = Path(tinygrad_path) if tinygrad_path else None
    if tinygrad is None or not (tinygrad / "test" / "mockgpu" / "amd" / "emu.py").is_file():
        print(f"SKIP: no tinygrad checkout with test/mockgpu/amd/emu.py "
              f"({'--tinygrad not given' if tinygrad is None else tinygrad}); "
              "fetch tinygrad/tinygrad and pass --tinygrad PATH")
        return 0
    try:
        import torch  # noqa: F401
    except ImportError:
        print(f"SKIP: {sys.executable} has no torch (use Debian's /usr/bin/python3)")
        return 0
    import test_h200 as h200

    from emulator import Emulator, build_fake_hip

    runtime = args.runtime
    if runtime is None:
        for candidate in (REPO / "build" / "lib" / "libce_runtime.so",
                          REPO / ".dev" / "lib" / "libce_runtime.so"):
            if candidate.exists() and candidate.resolve().is_file():
                runtime = str(candidate)
                break
    if runtime is None:
        print("FAIL: no libce_runtime.so; build it or pass --runtime")
        return 1
    work = Path(args.work)
    seed = args.seed if args.seed is not None else int(time.time() * 1000) % (2 ** 31)
    commit = subprocess.run(["git", "-C", str(tinygrad), "rev-parse", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "unknown"
    log(f"run_emulated: seed {seed}, tinygrad {tinygrad} ({commit}), runtime {runtime}, "
        f"set {args.set}")

    emulator = Emulator(tinygrad, build_fake_hip(work / "hip"), log)
    chips = [c for c in args.targets.split(",") if c]
    indices = {chip: emulator.add_device(CHIPS[chip]) for chip in chips}
    instrumented = Instrumented(h200, h200.torch)
    cases = emulator_cases(h200) if args.case_set == "small" else \
        list(h200.CASES) + [emulator_cases(h200)[-1]]
    if args.cases:
        wanted = args.cases.split(",")
        cases = [c for c in cases if c.name in wanted]
    rescale_set = [c for c in rescale.CASES
                   if args.set != "smoke" or c.name in rescale.SMOKE_CASES]
    shard_set = [c for c in shard.CASES if args.set != "smoke" or c.name in shard.SMOKE_CASES]
    results: Dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "seed": seed,
                     "tinygrad": commit, "command": " ".join(sys.argv), "set": args.set,
                     "cases": [c.name for c in cases]}
    for chip in chips:
        bundles = make_bundles(Path(args.ce_gen), work, chip, args.set)
        harness = make_harness(h200, runtime, bundles, chip, indices[chip])
        run_chip(h200, emulator, instrumented, harness, chip, cases, seed, args.filter,
                 not args.no_bad_labels, results, rescale_set, shard_set, args.shard_only)
        if args.mutate:
            instrumented.recording = False
            if not args.shard_only:
                mutation_check(h200, emulator, harness, chip, seed, results)
                mutation_check_rescale(emulator, harness, chip, seed, rescale_set, results,
                                       h200.mix)
            mutation_check_shard(emulator, harness, chip, seed, shard_set, results, h200.mix)
            instrumented.recording = True
        results["worst"] = {k: [round(v[0], 4), v[1]] for k, v in instrumented.worst.values.items()}
        (work / f"results-{args.set}-{'-'.join(chips)}.json").write_text(
            json.dumps(results, indent=1))
    log("")
    log("worst errors (as a fraction of the tolerance; < 1 passes):")
    for what, (ratio, where) in sorted(instrumented.worst.values.items()):
        log(f"  {what}: {ratio:.3g} at {where}")
    ok = all(results[c]["pass"] for c in chips)
    for chip in chips:
        r = results[chip]
        log(f"{chip:<7} {'pass' if r['pass'] else 'FAIL'} {r['kernels']} kernels, "
            f"{r['launches']} launches, {r['checks']} checks, {r['failures']} failures, "
            f"{r['subnormal_elements_flushed']} flushed subnormals, {r['seconds']} s")
    (work / f"log-{args.set}-{'-'.join(chips)}.txt").write_text("\n".join(LOG) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
