#!/usr/bin/env python3
"""The emulator's decoding of cegen's AMD code objects against LLVM's disassembler.

For every instruction of the given HSACO files, ``llvm-objdump-22 -d --mcpu=CHIP`` gives the
mnemonic and the encoding; test/amd/emulator.py's ``decode_name`` (tinygrad's CDNA decoder, with
the launcher's gfx90a layer on gfx90a) must give the same mnemonic (``_e32``/``_e64``/``_sdwa``
suffixes aside) and the same length. Also counts what the emulator does not model and the code
uses: output modifiers (``mul:2``, ``div:2``), and lists each float opcode whose tinygrad pcode
holds a product and a sum in one expression (clang may fuse those into an FMA). Usage::

    /usr/bin/python3 test/amd/compare_decoder.py --tinygrad .dev/tinygrad \\
        gfx942:.dev/amd/bundles/full/gfx942/dtypes/gfx942.hsaco gfx90a:...

Exit status 1 when a mnemonic or a length differs.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from emulator import CodeObject, Emulator, decode_name  # noqa: E402

LINE = re.compile(r"^\s+([a-z_0-9]+)(.*?)//\s*([0-9A-F]+):((?: [0-9A-F]{8})+)\s*$")
SUFFIXES = ("_e32", "_e64", "_sdwa", "_dpp")
#: LLVM's names on gfx90a/gfx94x/gfx950 -> the CDNA ISA documents' (tinygrad's) for the same
#: opcode: VOP3P 0x20-0x22, which AMD's CDNA3/4 ISA calls V_MAD_MIX* and describes as fused.
ALIASES = {"v_fma_mix_f32": "v_mad_mix_f32", "v_fma_mixlo_f16": "v_mad_mixlo_f16",
           "v_fma_mixhi_f16": "v_mad_mixhi_f16"}


def normal(name: str) -> str:
    name = name.lower()
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return ALIASES.get(name, name)


def compare(emulator: Emulator, chip: str, path: Path, objdump: str) -> dict:
    co = CodeObject(path.read_bytes())
    if co.chip != chip:
        raise SystemExit(f"{path} is {co.chip}, not {chip}")
    text = subprocess.run([objdump, "-d", f"--mcpu={chip}", str(path)], capture_output=True,
                          text=True, check=True).stdout
    counts = collections.Counter()
    mismatches = collections.Counter()
    omod = collections.Counter()
    for line in text.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        mnemonic, operands, address, words = m.groups()
        raw = b"".join(int(w, 16).to_bytes(4, "little") for w in words.split())
        file_offset = next(o + int(address, 16) - v for o, v, f, _m in co.segments
                           if v <= int(address, 16) < v + f)
        if co.image[file_offset:file_offset + len(raw)] != raw:
            raise SystemExit(f"{path}: objdump's bytes at {address} are not the file's")
        counts[mnemonic] += 1
        if re.search(r"\b(mul:[24]|div:2)\b", operands):
            omod[mnemonic] += 1
        try:
            name, size = decode_name(emulator.emu, co.image[file_offset:file_offset + 16], chip)
        except Exception as error:  # noqa: BLE001 - an undecodable instruction is a mismatch
            name, size = f"<{type(error).__name__}: {error}>", 0
        if normal(name) != normal(mnemonic) or size != len(raw):
            mismatches[(mnemonic, name.lower(), len(raw), size)] += 1
    return {"instructions": sum(counts.values()), "mnemonics": counts,
            "mismatches": mismatches, "omod": omod}


def fused_pcode(emulator: Emulator, mnemonics) -> list:
    """Float opcodes among `mnemonics` whose tinygrad pcode multiplies and adds in one
    statement without fma(): clang's contraction may fuse them (see emulator.GFX90A_VOP2)."""
    from tinygrad.runtime.autogen.amd.cdna import enum

    emu, found = emulator.emu, []
    names = {normal(m) for m in mnemonics}
    for cls in (enum.VOP1Op, enum.VOP2Op, enum.VOP3Op, enum.VOP3POp):
        for op in cls:
            if normal(op.name) not in names or not re.search(r"F(16|32|64)", op.name):
                continue
            try:
                pcode = emu.get_pcode(op)
            except KeyError:
                continue
            for statement in re.split(r"[;\n]", pcode):
                if re.search(r"\*.*\+|\+.*\*", statement) and "fma(" not in statement \
                        and "**" not in statement:
                    found.append((op.name, statement.strip()))
                    break
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tinygrad", required=True)
    parser.add_argument("--objdump", default="llvm-objdump-22")
    parser.add_argument("objects", nargs="+", help="CHIP:PATH of an HSACO")
    args = parser.parse_args()
    emulator = Emulator(Path(args.tinygrad), None)
    failed, used = False, set()
    for item in args.objects:
        chip, _, path = item.partition(":")
        result = compare(emulator, chip, Path(path), args.objdump)
        used |= set(result["mnemonics"])
        bad = sum(result["mismatches"].values())
        failed |= bad > 0
        print(f"{chip} {path}: {result['instructions']} instructions, "
              f"{len(result['mnemonics'])} mnemonics, {bad} decoded differently, "
              f"{sum(result['omod'].values())} with an output modifier")
        for mnemonic in sorted(m for m in result["mnemonics"] if normal(m) in ALIASES.values()
                               and m.lower() in ALIASES):
            print(f"  {result['mnemonics'][mnemonic]:6d} x llvm {mnemonic} = emulator "
                  f"{ALIASES[mnemonic]} (the ISA document's name)")
        for (mnemonic, name, size, got), n in sorted(result["mismatches"].items()):
            print(f"  {n:6d} x llvm {mnemonic} ({size} B) -> emulator {name} ({got} B)")
        for mnemonic, n in sorted(result["omod"].items()):
            print(f"  {n:6d} x {mnemonic} with mul:/div: (tinygrad ignores output modifiers)")
    for name, statement in fused_pcode(emulator, used):
        print(f"pcode with a product and a sum in one statement: {name}: {statement}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
