#!/usr/bin/env python3
"""Static side-by-side of cegen's AMD code objects and the peers' (issue 19, items 3-4).

Reads, here (no GPU; LLVM 22's llvm-readelf, llvm-objdump and llvm-mca):

* the peers' code objects that bench/amd_static_peers.py compiled on the device machine
  (``--peers DIR``: the unpacked ``peers-amd/`` of its tarball: ``index.json``, ``kernels/``,
  ``cegen-sm90/``);
* cegen's own HSACO for gfx942, gfx950, gfx90a, made by ``ce-gen`` with the benchmark's options
  (``--cegen DIR``; ``--build`` makes it with ``--ce-gen``).

Per code object and kernel: VGPRs, AGPRs, SGPRs, LDS (the descriptor's static bytes plus the
launch's dynamic bytes: Triton's ``shared``, cegen's manifest ``lds_bytes``), scratch, and waves per
SIMD (registers: min(8, 512 / (VGPRs + AGPRs rounded up to 8)), 800 SGPRs; then whole workgroups and
the LDS per CU: 64 KB on gfx90a/gfx942, 160 KB on gfx950). Then the main loop(s) from the
disassembly: the natural loops of the control-flow graph (a back edge to a dominating block; blocks
the compiler placed out of line count with their loop); the main loops are the innermost loops that
load the logits with vector loads (8 bytes or wider; a kernel without one: the whole kernel). Per loop:
the loads per lane and iteration, logits per lane and iteration (cegen: loaded bytes / 2; Triton:
BLOCK_SIZE / threads, the loads as a check), instructions per logit (all; VALU), and

* ``VALU cyc/logit``: a simple issue model, per SIMD: a wave64 VALU instruction takes 4 cycles
  (16 lanes), a transcendental (v_exp/v_log/v_rcp/v_rsq/v_sqrt) 16 on gfx90a/gfx942 and 8 on
  gfx950 (CDNA4 doubled the transcendental rate: an assumption from AMD's CDNA4 description);
  divided by 64 x logits per lane per iteration. Per kernel kind, ``headroom`` = the logits per ns
  the chip could take if VALU issue were the only limit (CUs x 4 SIMDs x clock / those cycles;
  gfx942 as MI300X 304 CUs 2.1 GHz, gfx950 as MI355X 256 CUs 2.4 GHz, gfx90a as one MI250X GCD 110
  CUs 1.7 GHz) over the logits per ns its HBM traffic allows (5.3, 8.0, 1.6 TB/s over 2 bytes a
  logit for a forward, 6 for forward + backward and for a fused kernel without a row cache).
  The sm_90 calibration below says what a headroom means in time.
* ``mca``: llvm-mca -mcpu=CHIP on the loop body (branches dropped), 100 iterations: cycles per
  iteration for one wave, per logit. LLVM's AMDGPU model issues one instruction per cycle with unit
  throughput for every VALU (no 4-cycle wave64 passes, no quarter-rate transcendentals) and 80
  cycles per VMEM load, so its ``Block RThroughput`` is the instruction count and the useful number
  is this one-wave latency-bound estimate.

sm_90 (the calibration, ``--sm90``): the peers' and cegen's SASS (ptxas of Triton's PTX and of
cegen's PTX, cuobjdump -sass on the device) the same way (natural loops; logits per thread from
LDG/LDGSTS bytes, or BLOCK_SIZE / threads), instructions per logit, the headroom with one warp
instruction per scheduler and cycle and the H200's measured copy rate, against the measured
ratios and fractions of the floor (docs/PERFORMANCE.md, run 7). No llvm-mca for NVIDIA.

``--variant LABEL=OPTIONS`` compiles cegen's kernels again under ce-gen's own tuning overrides
(e.g. ``--unroll=4 --flush-denormals=1``) and prints them the same way: what a tuning change would
do to the code, with nothing in the compiler changed.

    /usr/bin/python3 bench/amd_static_table.py --peers .dev/amd-static/device-run1/peers-amd \\
        --cegen .dev/amd-static/cegen-amd --build --sm90 \\
        --variant "flush=--flush-denormals=1" --variant "u4flush=--unroll=4 --flush-denormals=1"
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parent.parent
LLVM = Path("/usr/lib/llvm-22/bin")
# the benchmark's bundle (docs/perf-log/2026-11-29-2214-run1.md), for the three AMD chips, in
# bundle format version 3's spelling (the ignore_index is a run-time argument)
CEGEN_OPTIONS = ["--op=forward,backward,fused", "--logits=bf16", "--labels=i64", "--layout=flat",
                 "--label-smoothing=off", "--z-loss=off", "--overwrite=0,1", "--weights=token"]
CHIPS = {
    "gfx942": {"part": "MI300X", "cus": 304, "ghz": 2.1, "hbm_tbs": 5.3, "lds_cu": 65536, "trans": 16},
    "gfx950": {"part": "MI355X", "cus": 256, "ghz": 2.4, "hbm_tbs": 8.0, "lds_cu": 163840, "trans": 8},
    "gfx90a": {"part": "MI250X GCD", "cus": 110, "ghz": 1.7, "hbm_tbs": 1.6, "lds_cu": 65536, "trans": 16},
}
TRANSCENDENTAL = re.compile(r"^v_(exp|log|rcp|rsq|sqrt|sin|cos)_f(32|16)")
LOAD_BYTES = {"ubyte": 1, "sbyte": 1, "ushort": 2, "sshort": 2, "short_d16": 2, "short_d16_hi": 2,
              "ubyte_d16": 1, "dword": 4, "dwordx2": 8, "dwordx3": 12, "dwordx4": 16}
# measured on the H200 (docs/PERFORMANCE.md, run 7, 05:52 UTC): flash_ce's time / cegen's,
# per shape in SHAPES order
SHAPES = ["8192x128256", "16384x32000", "4096x151936", "8192x50304", "32768x128256"]
# run 7's times (ms) of flash_ce, and cegen's fraction of its floor (docs/PERFORMANCE.md)
MEASURED_MS = {"flash fwd": [0.652, 0.363, 0.414, 0.333, 2.533],
               "flash fwd+bwd": [1.732, 0.897, 1.052, 0.761, 6.859]}
PERCENT_OF_FLOOR = {"cegen fwd": [100, 97, 95, 94, 104], "cegen fwd+bwd": [97, 96, 95, 95, 99],
                    "cegen fused": [90, 94, 85, 90, 91]}
H200 = {"sms": 132, "ghz": 1.98, "copy_tbs": 4.28}
MEASURED_H200 = {
    "fwd": [1.32, 1.44, 1.35, 1.62, 1.34],
    "fwd+bwd": [1.14, 1.18, 1.15, 1.25, 1.15],
    "fused": [1.59, 1.72, 1.53, 1.78, 1.59],
}


@dataclass
class Insn:
    addr: int
    mnem: str
    text: str
    target: Optional[int] = None


@dataclass
class Loop:
    start: int  # index of the first instruction
    end: int  # index of the backward branch
    insns: List[Insn]
    load_bytes: int = 0
    loads: Dict[str, int] = field(default_factory=dict)


@dataclass
class Kernel:
    source: str  # "cegen" or the peer
    role: str  # e.g. "fwd", "bwd", "fused[none]"
    chip: str
    symbol: str
    threads: int
    vgpr: int = 0
    agpr: int = 0
    sgpr: int = 0
    lds: int = 0
    scratch: int = 0
    shapes: str = "all"
    per_lane: Optional[int] = None  # logits per lane and iteration known from the config
    insns: List[Insn] = field(default_factory=list)
    mains: List[Loop] = field(default_factory=list)
    whole: bool = False  # no loop: the whole kernel is the body


def run(cmd: List[str], stdin: Optional[str] = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True)


# -- AMD code objects ---------------------------------------------------------------------------


def notes(hsaco: Path) -> Dict[str, dict]:
    import yaml  # Debian's python3-yaml; only the code-object reading needs it

    text = run([str(LLVM / "llvm-readelf"), "--notes", str(hsaco)]).stdout
    body = text[text.index("---"):]
    body = body[:body.index("\n...") + 4] if "\n..." in body else body
    meta = yaml.safe_load(body.split("---", 1)[1].rsplit("...", 1)[0])
    return {k[".name"]: k for k in meta["amdhsa.kernels"]}


INSN_RE = re.compile(r"^\t(\S+)\s*(.*?)\s*// ([0-9A-F]+):[0-9A-F ]+(?:<(\S+)\+0x([0-9a-f]+)>)?\s*$")
SYM_RE = re.compile(r"^([0-9a-f]+) <(\S+)>:$")


def disassemble(hsaco: Path, chip: str) -> Dict[str, List[Insn]]:
    text = run([str(LLVM / "llvm-objdump"), "-d", f"--mcpu={chip}", str(hsaco)]).stdout
    symbols: Dict[str, List[Insn]] = {}
    starts: Dict[str, int] = {}
    current: Optional[str] = None
    for line in text.splitlines():
        m = SYM_RE.match(line)
        if m:
            current = m.group(2)
            starts[current] = int(m.group(1), 16)
            symbols[current] = []
            continue
        m = INSN_RE.match(line)
        if m and current:
            mnem, ops, addr = m.group(1), m.group(2), int(m.group(3), 16)
            target = None
            if m.group(4):
                target = starts.get(m.group(4), 0) + int(m.group(5), 16)
            symbols[current].append(Insn(addr, mnem, f"{mnem} {ops}".strip(), target))
    return symbols


def load_width(mnem: str) -> Optional[int]:
    m = re.match(r"^(global|buffer|flat)_load_(\w+?)(?:_e\d+)?$", mnem)
    return LOAD_BYTES.get(m.group(2)) if m else None


def natural_loops(insns: List[Insn], conditional, unconditional, final) -> List[List[int]]:
    """Natural loops of the control-flow graph, as sorted instruction indices (one per header).

    Basic blocks start at the first instruction, at branch targets and after a branch or an end;
    an edge u -> h is a back edge when h dominates u; the loop is h plus every block that reaches u
    without passing h. Blocks the compiler placed out of line (after the loop, branching back into
    it) belong to the loop this way, as they should: they run in every iteration that takes them.
    """
    if not insns:
        return []
    index = {i.addr: n for n, i in enumerate(insns)}
    leaders = {0}
    for n, i in enumerate(insns):
        if conditional(i) or unconditional(i) or final(i):
            if n + 1 < len(insns):
                leaders.add(n + 1)
            if i.target in index:
                leaders.add(index[i.target])
    starts = sorted(leaders)
    block_of = {}
    blocks = []
    for b, first in enumerate(starts):
        last = (starts[b + 1] if b + 1 < len(starts) else len(insns)) - 1
        blocks.append((first, last))
        for n in range(first, last + 1):
            block_of[n] = b
    succ: List[List[int]] = []
    for b, (first, last) in enumerate(blocks):
        tail = insns[last]
        out = []
        if tail.target in index and (conditional(tail) or unconditional(tail)):
            out.append(block_of[index[tail.target]])
        if not unconditional(tail) and not final(tail) and b + 1 < len(blocks):
            out.append(b + 1)
        succ.append(out)
    pred: List[List[int]] = [[] for _ in blocks]
    for b, out in enumerate(succ):
        for t in out:
            pred[t].append(b)
    # dominators (iterative; the entry is block 0), over the blocks reachable from the entry
    # (padding after the last s_endpgm, say, is not)
    reached, stack = {0}, [0]
    while stack:
        for t in succ[stack.pop()]:
            if t not in reached:
                reached.add(t)
                stack.append(t)
    dom = [set(reached) for _ in blocks]
    dom[0] = {0}
    changed = True
    while changed:
        changed = False
        for b in sorted(reached - {0}):
            new = set.intersection(*(dom[p] for p in pred[b] if p in reached)) | {b}
            if new != dom[b]:
                dom[b], changed = new, True
    bodies: Dict[int, set] = {}
    for u, out in enumerate(succ):
        for h in out:
            if u in reached and h in dom[u]:
                body = bodies.setdefault(h, {h})
                stack = [u]
                while stack:
                    x = stack.pop()
                    if x not in body and x in reached:
                        body.add(x)
                        stack.extend(pred[x])
    loops = []
    for h, body in bodies.items():
        loops.append(sorted(n for b in body for n in range(blocks[b][0], blocks[b][1] + 1)))
    return loops


def amd_conditional(i: Insn) -> bool:
    return i.mnem.startswith("s_cbranch")


def amd_unconditional(i: Insn) -> bool:
    return i.mnem == "s_branch"


def amd_final(i: Insn) -> bool:
    return i.mnem in ("s_endpgm", "s_setpc_b64", "s_trap")


def loops_of(insns: List[Insn]) -> List[Loop]:
    loops = []
    for members in natural_loops(insns, amd_conditional, amd_unconditional, amd_final):
        body = [insns[n] for n in members]
        loop = Loop(members[0], members[-1], body)
        loop.members = set(members)  # type: ignore[attr-defined]
        for i in body:
            width = load_width(i.mnem)
            if width:
                loop.loads[i.mnem] = loop.loads.get(i.mnem, 0) + 1
                loop.load_bytes += width
        loops.append(loop)
    return loops


def main_loops(loops: List[Loop]) -> List[Loop]:
    vector = [lp for lp in loops if any(load_width(m) and load_width(m) >= 8 for m in lp.loads)]
    # innermost: no other such loop inside it
    inner = [lp for lp in vector
             if not any(o is not lp and o.members < lp.members for o in vector)]  # type: ignore[attr-defined]
    return sorted(inner, key=lambda lp: lp.start)


def amd_kernel(kernel: Kernel, hsaco: Path, dynamic_lds: int) -> Kernel:
    meta = notes(hsaco)[kernel.symbol]
    kernel.vgpr = meta[".vgpr_count"]
    kernel.agpr = meta.get(".agpr_count", 0)
    kernel.sgpr = meta[".sgpr_count"]
    kernel.lds = meta[".group_segment_fixed_size"] + dynamic_lds
    kernel.scratch = meta[".private_segment_fixed_size"]
    kernel.insns = disassemble(hsaco, kernel.chip)[kernel.symbol]
    kernel.mains = main_loops(loops_of(kernel.insns))
    if not kernel.mains:
        whole = Loop(0, len(kernel.insns) - 1, kernel.insns)
        whole.members = set(range(len(kernel.insns)))  # type: ignore[attr-defined]
        for i in kernel.insns:
            width = load_width(i.mnem)
            if width:
                whole.loads[i.mnem] = whole.loads.get(i.mnem, 0) + 1
                whole.load_bytes += width
        kernel.mains, kernel.whole = [whole], True
    return kernel


def waves_per_simd(k: Kernel) -> Tuple[int, int]:
    """(the register limit, what whole workgroups and the CU's LDS allow)."""
    arch = -(-k.vgpr // 4) * 4
    total = -(-(arch + k.agpr) // 8) * 8
    by_vgpr = min(8, 512 // max(total, 8))
    by_sgpr = min(8, 800 // max(-(-k.sgpr // 16) * 16, 16))
    limit = min(by_vgpr, by_sgpr)
    per_simd = -(-(-(-k.threads // 64)) // 4)  # waves of one workgroup on each SIMD
    groups = limit // per_simd
    if k.lds:
        groups = min(groups, CHIPS[k.chip]["lds_cu"] // k.lds)
    return limit, groups * per_simd


def per_lane(k: Kernel, loop: Loop) -> float:
    return float(k.per_lane) if k.per_lane else loop.load_bytes / 2


def valu_cycles(loop: Loop, chip: str) -> int:
    cycles = 0
    for i in loop.insns:
        if i.mnem.startswith("v_"):
            cycles += CHIPS[chip]["trans"] if TRANSCENDENTAL.match(i.mnem) else 4
    return cycles


def mca(loop: Loop, chip: str) -> Tuple[Optional[float], int]:
    """llvm-mca's cycles per iteration for one wave, and how many lines it could not parse."""
    lines = [i.text for i in loop.insns if not i.mnem.startswith(("s_cbranch", "s_branch", "s_endpgm"))]
    dropped = 0
    for _ in range(40):
        result = run([str(LLVM / "llvm-mca"), "-mtriple=amdgcn-amd-amdhsa", f"-mcpu={chip}",
                      "-iterations=100", "-"], "\n".join(lines) + "\n")
        m = re.search(r"Total Cycles:\s+(\d+)", result.stdout)
        if m:
            return int(m.group(1)) / 100.0, dropped
        bad = re.search(r"<stdin>:(\d+):", result.stderr)
        if not bad:
            return None, dropped
        del lines[int(bad.group(1)) - 1]
        dropped += 1
    return None, dropped


def loop_row(k: Kernel, loop: Loop) -> Dict[str, object]:
    lanes = per_lane(k, loop)
    n = len(loop.insns)
    valu = sum(1 for i in loop.insns if i.mnem.startswith("v_"))
    trans = sum(1 for i in loop.insns if TRANSCENDENTAL.match(i.mnem))
    vcyc = valu_cycles(loop, k.chip)
    cycles, dropped = mca(loop, k.chip)
    loads = ", ".join(f"{c}x {m.replace('_load_', ' ')}" for m, c in sorted(loop.loads.items()))
    return {"insns": n, "per_lane": lanes, "loads": loads or "-", "load_bytes": loop.load_bytes,
            "instr_per_logit": n / lanes, "valu_per_logit": valu / lanes, "trans_per_logit": trans / lanes,
            "valu_cyc_per_logit": vcyc / (64 * lanes),
            "mca_per_logit": cycles / lanes if cycles else None, "mca_dropped": dropped}


# -- the peers' records -------------------------------------------------------------------------


ROLES = {  # (peer, label in amd_static_peers.py, kernel function) -> role in the table
    ("flash", "fwd", "cross_entropy_fwd_kernel"): "fwd",
    ("flash", "fwd+bwd", "cross_entropy_bwd_kernel"): "bwd",
    ("liger", "fwd[none]", "liger_cross_entropy_kernel"): "fwd",
    ("liger", "fused[none]", "liger_cross_entropy_kernel"): "fused[none]",
    ("liger", "fused[mean]", "liger_cross_entropy_kernel"): "fused[mean]",
    ("primus", "fwd+bwd_ow", "turbo_cross_entropy_forward_kernel"): "fwd (overwrite)",
    ("primus", "fwd+bwd", "turbo_cross_entropy_forward_kernel"): "fwd (copies logits)",
    ("primus", "fwd+bwd_ow", "turbo_cross_entropy_backward_kernel"): "bwd",
}


def peer_kernels(peers: Path, target: str) -> List[Kernel]:
    index = json.loads((peers / "index.json").read_text())
    out = []
    for name, job in sorted(index["jobs"].items()):
        if not name.split("-")[-2] == target:
            continue
        fname = job["fn"].rsplit(".", 1)[1]
        shapes: Dict[str, List[str]] = {}
        for label in job["labels"]:
            peer, case, shape, _mode = label.split("|")
            shapes.setdefault(f"{peer}|{case}", []).append(shape)
        for pc, shape_list in shapes.items():
            peer, case = pc.split("|")
            role = ROLES.get((peer, case, fname))
            if role is None:
                continue
            constexprs = job["constexprs"]
            block = next(int(v) for k, v in constexprs.items()
                         if int(k.strip("(,)")) == fn_param(job, "BLOCK_SIZE"))
            warps = int(job["options"]["num_warps"])
            warp = 64 if target.startswith("gfx") else 32
            meta = json.loads((peers / "kernels" / f"{name}.json").read_text())
            k = Kernel(peer, role, target, fname, warps * warp, shapes=shape_class(shape_list),
                       per_lane=block // (warps * warp))
            k.lds = int(meta.get("shared") or 0)
            k.name = name  # type: ignore[attr-defined]
            out.append(k)
    return out


def fn_param(job: dict, param: str) -> int:
    """Position of a kernel parameter, read off the recorded signature's order."""
    return list(job["signature"]).index(param)


def shape_class(shapes: List[str]) -> str:
    shapes = sorted(set(shapes), key=SHAPES.index)
    return "all" if len(shapes) == len(SHAPES) else ",".join(shapes)


# -- cegen ---------------------------------------------------------------------------------------


CEGEN_ROLES = {"forward": "fwd", "backward": "bwd", "fused": "fused"}


def cegen_kernels(directory: Path, chip: str) -> List[Kernel]:
    manifest = json.loads((directory / "manifest.json").read_text())
    out = []
    for entry in manifest["kernels"]:
        if entry["target"] != chip:
            continue
        key = dict(kv.split("=", 1) for kv in entry["key"].split(","))
        if key["op"] != "forward" and key["overwrite"] != "1":
            continue  # the _ow kernels, as the table of run 7
        k = Kernel("cegen", CEGEN_ROLES[key["op"]], chip, entry["symbol"], entry["launch"]["block_size"])
        amd_kernel(k, directory / entry["object"], entry["launch"].get("lds_bytes", 0))
        out.append(k)
    return out


def build_cegen(ce_gen: Path, directory: Path) -> None:
    cmd = [str(ce_gen), "--target=gfx942,gfx950,gfx90a", *CEGEN_OPTIONS, "-o", str(directory)]
    result = run(cmd)
    if result.returncode != 0:
        sys.exit(f"ce-gen failed: {' '.join(cmd)}\n{result.stderr}")


# -- sm_90 SASS ----------------------------------------------------------------------------------


SASS_RE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")


def sass_functions(path: Path) -> Dict[str, List[Insn]]:
    functions: Dict[str, List[Insn]] = {}
    current = None
    for line in path.read_text().splitlines():
        m = re.match(r"^\s+Function : (\S+)", line)
        if m:
            current = m.group(1)
            functions[current] = []
            continue
        m = SASS_RE.match(line)
        if m and current:
            text = m.group(2).strip()
            body = re.sub(r"^@!?U?P\w+\s+", "", text)
            mnem = body.split()[0] if body else ""
            target = None
            t = re.search(r"\bBRA\b(?:\.\S+)?\s+(?:!?U?P\w+,\s*)?(?:\S+,\s*)?0x([0-9a-f]+)", body)
            if mnem.startswith("BRA") and t:
                target = int(t.group(1), 16)
            functions[current].append(Insn(int(m.group(1), 16), mnem, text, target))
    return functions


def sass_load_bytes(mnem: str) -> int:
    if not mnem.startswith(("LDG", "LDGSTS")):
        return 0
    m = re.search(r"\.(128|64|32|U16|S16|U8|S8)\b", mnem)
    return {"128": 16, "64": 8, "32": 4, "U16": 2, "S16": 2, "U8": 1, "S8": 1}.get(m.group(1), 4) if m else 4


def sass_conditional(i: Insn) -> bool:
    return i.mnem.startswith("BRA") and (i.text.startswith("@") or "BRA.DIV" in i.text)


def sass_unconditional(i: Insn) -> bool:
    return i.mnem.startswith("BRA") and not sass_conditional(i)


def sass_final(i: Insn) -> bool:
    return i.mnem in ("EXIT", "RET") and not i.text.startswith("@")


def sass_main(insns: List[Insn], known_per_thread: Optional[int]) -> List[Dict[str, object]]:
    loops = []
    for members in natural_loops(insns, sass_conditional, sass_unconditional, sass_final):
        body = [insns[n] for n in members]
        vec = sum(sass_load_bytes(b.mnem) for b in body if sass_load_bytes(b.mnem) >= 8)
        if vec:
            loops.append((set(members), body, vec))
    inner = [lp for lp in loops if not any(o is not lp and o[0] < lp[0] for o in loops)]
    if not inner:
        vec = sum(sass_load_bytes(b.mnem) for b in insns if sass_load_bytes(b.mnem) >= 8)
        inner = [(set(range(len(insns))), insns, vec)]
    rows = []
    for _members, body, vec in sorted(inner, key=lambda lp: min(lp[0])):
        body = [b for b in body if b.mnem != "NOP"]
        lanes = known_per_thread or vec / 2
        rows.append({"insns": len(body), "per_lane": lanes, "load_bytes": vec,
                     "instr_per_logit": len(body) / lanes,
                     "mufu_per_logit": sum(1 for b in body if b.mnem.startswith("MUFU")) / lanes})
    return rows


# -- tables --------------------------------------------------------------------------------------


def fmt(x: object, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def amd_tables(peers: Optional[Path], cegen: Path, chips: List[str]) -> Dict[str, List[Tuple[Kernel, List[dict]]]]:
    result = {}
    for chip in chips:
        kernels = cegen_kernels(cegen, chip)
        if peers:
            for k in peer_kernels(peers, chip):
                amd_kernel(k, peers / "kernels" / f"{k.name}.hsaco", k.lds)  # type: ignore[attr-defined]
                kernels.append(k)
        result[chip] = [(k, [loop_row(k, lp) for lp in k.mains]) for k in kernels]
    return result


ORDER = {"cegen": 0, "flash": 1, "liger": 2, "primus": 3}
ROLE_ORDER = ["fwd", "fwd (overwrite)", "fwd (copies logits)", "bwd", "fused", "fused[none]", "fused[mean]"]


def shown(k: Kernel, large: str) -> bool:
    """The peers' kernels for the shapes up to 2 GiB of logits, or for 32768x128256, or both."""
    if k.shapes == "all" or large == "both":
        return True
    return ("32768x128256" in k.shapes) == (large == "only")


def print_amd(tables: Dict[str, List[Tuple[Kernel, List[dict]]]], large: str) -> None:
    for chip, rows in tables.items():
        c = CHIPS[chip]
        print(f"\n### {chip} ({c['part']}: {c['cus']} CUs, {c['ghz']} GHz, HBM {c['hbm_tbs']} TB/s)\n")
        print("| kernel | peers' shapes | threads | VGPR / AGPR / SGPR | LDS B | scratch | waves/SIMD "
              "(regs / with WGs, LDS) | loads per lane per iteration | logits/lane/iter | instr/logit "
              "| VALU/logit | VALU cyc/logit | mca cyc/logit (1 wave) |")
        print("|---|---|---:|---|---:|---:|---|---|---:|---:|---:|---:|---:|")
        for k, loops in sorted(rows, key=lambda r: (ORDER[r[0].source], ROLE_ORDER.index(r[0].role),
                                                    r[0].shapes)):
            if not shown(k, large):
                continue
            limit, eff = waves_per_simd(k)
            shapes = k.shapes if k.shapes in ("all", "32768x128256") else "<= 2 GiB"
            for n, lp in enumerate(loops):
                name = f"{k.source} {k.role}" + (f" (loop {n + 1})" if len(loops) > 1 else "")
                name += " (no loop)" if k.whole else ""
                print(f"| {name} | {shapes} | {k.threads} | {k.vgpr} / {k.agpr} / {k.sgpr} | {k.lds} | "
                      f"{k.scratch} | {limit} / {eff} | {lp['loads']} | {fmt(lp['per_lane'], 0)} | "
                      f"{fmt(lp['instr_per_logit'], 1)} | {fmt(lp['valu_per_logit'], 1)} | "
                      f"{fmt(lp['valu_cyc_per_logit'], 3)} | {fmt(lp['mca_per_logit'], 1)} |")


BYTES_PER_LOGIT = {"fwd": 2, "bwd": 4, "fused": 6}  # fused on gfx9: no row cache, the second read counted


def headroom(chip: str, valu_cycles: float, nbytes: float) -> Tuple[float, float, float]:
    """(issue-bound, HBM-bound logits per ns, their ratio): above 1, VALU issue is not the limit."""
    c = CHIPS[chip]
    issue = c["cus"] * 4 * c["ghz"] / valu_cycles
    memory = c["hbm_tbs"] * 1e3 / nbytes
    return issue, memory, issue / memory


def kind_summary(tables: Dict[str, List[Tuple[Kernel, List[dict]]]]) -> None:
    """Per chip and kernel kind: the sum over the kernel(s)' main loops (every logit passes each once)."""
    print("\n### Per kernel kind, summed over each pass of a logit (the peers' kernels for shapes "
          "up to 2 GiB)\n")
    kinds = {
        "forward": [("cegen", ["fwd"]), ("flash", ["fwd"]), ("liger", ["fwd"]), ("primus", ["fwd (overwrite)"])],
        "fwd+bwd": [("cegen", ["fwd", "bwd"]), ("flash", ["fwd", "bwd"]), ("primus", ["fwd (overwrite)", "bwd"])],
        "fused": [("cegen", ["fused"]), ("liger", ["fused[none]"]), ("liger", ["fused[mean]"])],
    }
    print("| chip | kind | kernel(s) | waves/SIMD | instr/logit | VALU/logit | VALU cyc/logit "
          "| issue-bound logits/ns | HBM B/logit | HBM-bound logits/ns | headroom | mca cyc/logit |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for chip, rows in tables.items():
        for kind, entries in kinds.items():
            for source, roles in entries:
                total = {"instr_per_logit": 0.0, "valu_per_logit": 0.0, "valu_cyc_per_logit": 0.0,
                         "mca_per_logit": 0.0}
                waves = []
                nbytes = 0
                found = 0
                for role in roles:
                    match = [(k, lps) for k, lps in rows if k.source == source and k.role == role
                             and (k.shapes == "all" or "32768x128256" not in k.shapes)]
                    if not match:
                        continue
                    k, lps = match[0]
                    found += 1
                    waves.append(str(waves_per_simd(k)[1]))
                    nbytes += BYTES_PER_LOGIT[role.split()[0].split("[")[0]]
                    for lp in lps:
                        for key in total:
                            total[key] += lp[key] or 0.0
                if found != len(roles):
                    continue
                issue, memory, ratio = headroom(chip, total["valu_cyc_per_logit"], nbytes)
                label = " + ".join(roles) if source != "liger" else roles[0]
                print(f"| {chip} | {kind} | {source} {label} | {' + '.join(waves)} | "
                      f"{total['instr_per_logit']:.1f} | {total['valu_per_logit']:.1f} | "
                      f"{total['valu_cyc_per_logit']:.3f} | {issue:.0f} | {nbytes} | {memory:.0f} | "
                      f"{ratio:.2f} | {total['mca_per_logit']:.1f} |")


def variant_table(ce_gen: Path, variants: List[str], chips: List[str], work: Path) -> None:
    """cegen's kernels under ce-gen's tuning overrides (nothing in the compiler changes)."""
    print("\n### cegen under ce-gen's tuning overrides (per logit, summed over each kernel's passes)\n")
    print("| chip | ce-gen options | kernel | VGPR | waves/SIMD | loads per lane per iteration "
          "| VALU/logit | VALU cyc/logit | headroom |")
    print("|---|---|---|---:|---:|---|---:|---:|---:|")
    for variant in variants:
        label, _, flags = variant.partition("=")
        directory = work / f"variant-{label}"
        cmd = [str(ce_gen), "--target=" + ",".join(chips), *CEGEN_OPTIONS, *flags.split(), "-o", str(directory)]
        result = run(cmd)
        if result.returncode != 0:
            print(f"| - | {flags} | ce-gen failed: {result.stderr.strip()[:200]} | | | | | | |")
            continue
        for chip in chips:
            for k in cegen_kernels(directory, chip):
                rows = [loop_row(k, lp) for lp in k.mains]
                cyc = sum(r["valu_cyc_per_logit"] for r in rows)
                ratio = headroom(chip, cyc, BYTES_PER_LOGIT[k.role])[2]
                print(f"| {chip} | {flags or '(the table)'} | {k.role} | {k.vgpr} | {waves_per_simd(k)[1]} | "
                      f"{rows[0]['loads']} | {sum(r['valu_per_logit'] for r in rows):.1f} | {cyc:.3f} | "
                      f"{ratio:.2f} |")


def sm90_table(peers: Path) -> None:
    print("\n### sm_90 calibration: SASS instructions per logit in the main loop(s)\n")
    rows: Dict[str, Dict[str, float]] = {}
    print("| kernel | registers | logits/thread/iter | instr/logit | MUFU/logit |")
    print("|---|---:|---:|---:|---:|")
    peer_roles = {("flash", "fwd"): "flash fwd", ("flash", "bwd"): "flash bwd",
                  ("liger", "fwd"): "liger fwd", ("liger", "fused[none]"): "liger fused[none]",
                  ("primus", "fwd (overwrite)"): "primus fwd (overwrite)", ("primus", "bwd"): "primus bwd"}
    for k in peer_kernels(peers, "sm_90"):
        label = peer_roles.get((k.source, k.role))
        if label is None or label in rows:
            continue
        name = k.name  # type: ignore[attr-defined]
        functions = sass_functions(peers / "kernels" / f"{name}.sass")
        insns = next(iter(functions.values()))
        regs = re.search(r"REG:(\d+)", (peers / "kernels" / f"{name}.res").read_text())
        loops = sass_main(insns, k.per_lane)
        rows[label] = {"instr": sum(lp["instr_per_logit"] for lp in loops)}
        print(f"| {label} | {regs.group(1) if regs else '-'} | {fmt(loops[0]['per_lane'], 0)} | "
              f"{' + '.join(fmt(lp['instr_per_logit'], 1) for lp in loops)} | "
              f"{' + '.join(fmt(lp['mufu_per_logit'], 2) for lp in loops)} |")
    cegen_sass = peers / "cegen-sm90" / "sm_90.sass"
    res = (peers / "cegen-sm90" / "sm_90.res").read_text()
    functions = sass_functions(cegen_sass)
    for symbol, label in (("ce_forward_0", "cegen fwd"), ("ce_backward_2", "cegen bwd (V <= 64k)"),
                          ("ce_backward_2_rows128k", "cegen bwd (rows past 128 KB)"),
                          ("ce_fused_4", "cegen fused (rows up to 64 KB)"),
                          ("ce_fused_4_rows64k", "cegen fused (64-128 KB)"),
                          ("ce_fused_4_rows128k", "cegen fused (past 128 KB)")):
        loops = sass_main(functions[symbol], None)
        regs = re.search(rf"Function {symbol}:\s*\n\s*REG:(\d+)", res)
        rows[label] = {"instr": sum(lp["instr_per_logit"] for lp in loops)}
        print(f"| {label} | {regs.group(1) if regs else '-'} | "
              f"{' / '.join(fmt(lp['per_lane'], 0) for lp in loops)} | "
              f"{' + '.join(fmt(lp['instr_per_logit'], 1) for lp in loops)} | "
              f"{' + '.join(fmt(lp['mufu_per_logit'], 2) for lp in loops)} |")
    print("\nStatic ratio (flash_ce's SASS instructions per logit / cegen's) against the H200's measured "
          "time ratio (flash_ce / cegen, run 7), and the ratio of bytes moved:\n")
    print("| kind | static instr ratio | bytes ratio | measured " + " | ".join(SHAPES) + " |")
    print("|---|---:|---:|" + "---:|" * len(SHAPES))
    r = {k: v["instr"] for k, v in rows.items()}
    long_rows = {"8192x128256", "4096x151936", "32768x128256"}
    for kind, ours, theirs, bytes_ratio in (
            ("fwd", [("cegen fwd", "cegen fwd")], r["flash fwd"], 1.0),
            ("fwd+bwd", None, r["flash fwd"] + r["flash bwd"], 1.0),
            ("fused", None, r["flash fwd"] + r["flash bwd"], 1.5)):
        if kind == "fwd":
            static = [theirs / r["cegen fwd"]] * len(SHAPES)
        elif kind == "fwd+bwd":
            static = [theirs / (r["cegen fwd"] + r["cegen bwd (rows past 128 KB)" if s in long_rows
                                                       else "cegen bwd (V <= 64k)"]) for s in SHAPES]
        else:
            pick = {"8192x128256": "cegen fused (past 128 KB)", "4096x151936": "cegen fused (past 128 KB)",
                    "32768x128256": "cegen fused (past 128 KB)", "16384x32000": "cegen fused (rows up to 64 KB)",
                    "8192x50304": "cegen fused (64-128 KB)"}
            static = [theirs / r[pick[s]] for s in SHAPES]
        text = " / ".join(f"{x:.2f}" for x in sorted(set(round(s, 2) for s in static)))
        print(f"| {kind} | {text} | {bytes_ratio:.2f} | " +
              " | ".join(f"{m:.2f}" for m in MEASURED_H200[kind]) + " |")
    print("\nHeadroom on the H200 (issue-bound logits/ns: 132 SMs x 4 schedulers x 1.98 GHz / SASS "
          f"instructions per logit; HBM-bound: the measured copy, {H200['copy_tbs']} TB/s, / bytes per logit) "
          "against the achieved fraction of the floor in run 7:\n")
    print("| kernel(s) | SASS instr/logit | B/logit | headroom | achieved % of floor, " + " / ".join(SHAPES) + " |")
    print("|---|---:|---:|---:|---|")
    cases = (("cegen fwd", r["cegen fwd"], 2, PERCENT_OF_FLOOR["cegen fwd"]),
             ("flash fwd", r["flash fwd"], 2, floor_percent("flash fwd", 1)),
             ("cegen fwd + bwd (V <= 64k kernel)", r["cegen fwd"] + r["cegen bwd (V <= 64k)"], 6,
              PERCENT_OF_FLOOR["cegen fwd+bwd"]),
             ("flash fwd + bwd", r["flash fwd"] + r["flash bwd"], 6, floor_percent("flash fwd+bwd", 3)),
             ("cegen fused (row cache: 4 B)", r["cegen fused (rows up to 64 KB)"], 4, PERCENT_OF_FLOOR["cegen fused"]))
    for label, instr, nbytes, achieved in cases:
        issue = H200["sms"] * 4 * H200["ghz"] * 32 / instr
        ratio = issue / (H200["copy_tbs"] * 1e3 / nbytes)
        print(f"| {label} | {instr:.1f} | {nbytes} | {ratio:.2f} | {' / '.join(f'{x:.0f}' for x in achieved)} |")


def floor_percent(which: str, passes: int) -> List[float]:
    """flash_ce's fraction of the floor in run 7: passes x N x V x 2 bytes at the copy rate / its time."""
    out = []
    for shape, ms in zip(SHAPES, MEASURED_MS[which]):
        n, v = (int(x) for x in shape.split("x"))
        out.append(100 * passes * n * v * 2 / (H200["copy_tbs"] * 1e12) / (ms * 1e-3))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", help="peers-amd/ unpacked from amd_static_peers.py's tarball")
    parser.add_argument("--cegen", required=True, help="cegen's AMD bundle (gfx942/gfx950/gfx90a)")
    parser.add_argument("--build", action="store_true", help="make --cegen with --ce-gen first")
    parser.add_argument("--ce-gen", default=str(REPO / "build" / "bin" / "ce-gen"))
    parser.add_argument("--chips", default="gfx942,gfx950,gfx90a")
    parser.add_argument("--sm90", action="store_true", help="also the sm_90 calibration (needs --peers)")
    parser.add_argument("--peer-shapes", choices=("small", "only", "both"), default="small",
                        help="peers' kernels for the shapes up to 2 GiB of logits (default), 32768x128256, both")
    parser.add_argument("--variant", action="append", default=[],
                        help="LABEL=CE-GEN-OPTIONS: cegen's kernels again under these overrides")
    parser.add_argument("--work", default=str(REPO / ".dev" / "amd-static"), help="for the variants' bundles")
    args = parser.parse_args()
    cegen = Path(args.cegen)
    if args.build:
        build_cegen(Path(args.ce_gen), cegen)
    peers = Path(args.peers) if args.peers else None
    tables = amd_tables(peers, cegen, [c for c in args.chips.split(",") if c])
    print_amd(tables, args.peer_shapes)
    kind_summary(tables)
    if args.variant:
        variant_table(Path(args.ce_gen), args.variant, [c for c in args.chips.split(",") if c], Path(args.work))
    if args.sm90 and peers:
        sm90_table(peers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
