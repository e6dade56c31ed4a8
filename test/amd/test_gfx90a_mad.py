#!/usr/bin/env python3
"""gfx90a's unfused f32 multiply-adds in the CDNA emulator (test/amd/emulator.py's gfx90a layer).

gfx90a code with f32 denormals flushed uses ``v_mad_f32``, ``v_mac_f32`` (e32 and e64),
``v_madmk_f32`` and ``v_madak_f32``: the product rounded to f32, then the sum rounded, denormals
flushed. tinygrad's CDNA tables (CDNA4) lack them or decode their encodings as other
instructions. Here a small program assembled for gfx90a by LLVM's ``llvm-mc`` runs each of them
on 64 lanes whose inputs make the unfused and the fused result differ in about half the lanes,
and every output must equal, bit for bit, the two-rounding reference computed in numpy float32
(with the flush); the mutations (``v_mad_f32`` made ``v_fma_f32`` or ``v_mul_f32``, one opcode
field) must make that check fail. Also: tinygrad's decoding of the program, through the layer,
names every instruction as llvm-objdump does.

Run with Debian's python3 and a tinygrad checkout (skipped without one, or without LLVM 22)::

    CE_TINYGRAD=/path/to/tinygrad /usr/bin/python3 test/amd/test_gfx90a_mad.py -v
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import sys
import unittest
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

from emulator import GFX90A_VOP3, Emulator, decode_name  # noqa: E402

LLVM_MC = shutil.which("llvm-mc-22") or "/usr/lib/llvm-22/bin/llvm-mc"
TINYGRAD = os.environ.get("CE_TINYGRAD") or str(REPO / ".dev" / "tinygrad")
LANES = 64
K = 0x3F800800  # 1 + 2^-12: the literal of v_madmk_f32
MINUS_ONE = 0xBF800000

#: Inputs a, b, c at s[0:1] + 0, 256, 512; outputs at s[2:3] + 256 i, one row per instruction.
PROGRAM = f"""
v_lshlrev_b32_e32 v1, 2, v0
global_load_dword v2, v1, s[0:1]
global_load_dword v3, v1, s[0:1] offset:256
global_load_dword v4, v1, s[0:1] offset:512
s_waitcnt vmcnt(0)
v_mad_f32 v5, v2, v3, v4
global_store_dword v1, v5, s[2:3]
v_mov_b32_e32 v6, v4
v_mac_f32_e32 v6, v2, v3
global_store_dword v1, v6, s[2:3] offset:256
v_madmk_f32 v7, v2, 0x{K:08x}, v4
global_store_dword v1, v7, s[2:3] offset:512
v_madak_f32 v8, v2, v3, 0x{MINUS_ONE:08x}
global_store_dword v1, v8, s[2:3] offset:768
v_mov_b32_e32 v9, v4
v_mac_f32_e64 v9, v2, v3
global_store_dword v1, v9, s[2:3] offset:1024
v_mad_f32 v10, -v2, v3, -v4
global_store_dword v1, v10, s[2:3] offset:1280
v_mad_f32 v11, |v2|, -v3, v4
global_store_dword v1, v11, s[2:3] offset:1536
s_endpgm
"""
ROWS = ["v_mad_f32", "v_mac_f32_e32", "v_madmk_f32", "v_madak_f32", "v_mac_f32_e64",
        "v_mad_f32 -a -c", "v_mad_f32 |a| -b"]


def f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def flush(x: np.ndarray) -> np.ndarray:
    """f32 denormals to (signed) zero, as gfx90a's v_mad_f32 and the emulator's DAZ+FTZ do."""
    x = f32(x)
    return np.where(np.abs(x) < np.float32(2.0 ** -126), np.copysign(np.float32(0), x), x)


def mad(a, b, c) -> np.ndarray:
    """round(round(a * b) + c) in f32, denormals flushed: the unfused multiply-add."""
    with np.errstate(over="ignore", invalid="ignore"):
        return flush(flush(flush(a) * flush(b)) + flush(c))


def fma(a, b, c) -> np.ndarray:
    """round(a * b + c) once (float64 holds a * b of two f32 exactly), denormals flushed."""
    exact = flush(a).astype(np.float64) * flush(b).astype(np.float64)
    return flush((exact + flush(c).astype(np.float64)).astype(np.float32))


def inputs() -> tuple:
    """Lanes where the product's rounding decides: a = 1 + i 2^-12, b = 1 + j 2^-12,
    c = -(1 + (i + j) 2^-12), so a b + c = i j 2^-24 exactly, which f32's product keeps only
    for even i j; then a few ordinary lanes and ones whose product or result is subnormal."""
    rng = np.random.default_rng(20261202)
    i = rng.integers(1, 2048, LANES)
    j = rng.integers(1, 2048, LANES)
    a = f32(1 + i * 2.0 ** -12)
    b = f32(1 + j * 2.0 ** -12)
    c = f32(-(1 + (i + j) * 2.0 ** -12))
    a[48:56] = f32(rng.standard_normal(8) * 100)
    b[48:56] = f32(rng.standard_normal(8))
    c[48:56] = f32(rng.standard_normal(8) * 10)
    a[56:60], b[56:60], c[56:60] = f32(2.0 ** -70), f32(2.0 ** -60), f32([0, 2.0 ** -120, 0, 1])
    a[60:64], b[60:64], c[60:64] = f32(2.0 ** -100), f32(2.0 ** -27), f32(2.0 ** -126)
    return a, b, c


def expected(a, b, c, combine=mad) -> np.ndarray:
    k, minus_one = (np.frombuffer(struct.pack("<I", v), np.float32)[0] for v in (K, MINUS_ONE))
    return np.stack([combine(a, b, c), combine(a, b, c), combine(a, k, c),
                     combine(a, b, minus_one), combine(a, b, c), combine(-a, b, -c),
                     combine(np.abs(a), -b, c)])


def assemble(source: str) -> tuple:
    """(machine code, [(mnemonic, encoding bytes)]) from llvm-mc for gfx90a."""
    out = subprocess.run([LLVM_MC, "-arch=amdgcn", "-mcpu=gfx90a", "-show-encoding"],
                         input=source, capture_output=True, text=True, check=True).stdout
    code, listing = b"", []
    for line in out.splitlines():
        m = re.match(r"\s+(\S+).*; encoding: \[(.*)\]", line)
        if m:
            raw = bytes(int(x, 16) for x in m.group(2).split(","))
            listing.append((m.group(1), raw))
            code += raw
    return code, listing


@unittest.skipUnless(Path(TINYGRAD, "test/mockgpu/amd/emu.py").is_file(),
                     f"no tinygrad checkout at {TINYGRAD} (set CE_TINYGRAD)")
@unittest.skipUnless(Path(LLVM_MC).exists(), "no llvm-mc (LLVM 22)")
class Gfx90aMad(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.emulator = Emulator(Path(TINYGRAD), None)
        cls.code, cls.listing = assemble(PROGRAM)
        cls.a, cls.b, cls.c = inputs()

    def run_program(self, code: bytes) -> np.ndarray:
        data = np.concatenate([self.a, self.b, self.c]).astype(np.float32)
        out = np.full(len(ROWS) * LANES, np.nan, np.float32)
        self.emulator.run_code(code, "gfx90a", [data.ctypes.data & 0xFFFFFFFF,
                                                data.ctypes.data >> 32,
                                                out.ctypes.data & 0xFFFFFFFF,
                                                out.ctypes.data >> 32])
        return out.reshape(len(ROWS), LANES)

    def mismatches(self, got: np.ndarray, want: np.ndarray) -> dict:
        """Lanes per row whose bits differ."""
        bad = got.view(np.uint32) != want.view(np.uint32)
        return {ROWS[r]: int(bad[r].sum()) for r in range(len(ROWS)) if bad[r].any()}

    def test_inputs_tell_unfused_from_fused(self):
        # The check below can only see an FMA where the two differ: in 14-31 lanes of 64 a row.
        differ = (expected(self.a, self.b, self.c, mad).view(np.uint32)
                  != expected(self.a, self.b, self.c, fma).view(np.uint32))
        for r, row in enumerate(ROWS):
            self.assertGreater(int(differ[r].sum()), 10, row)

    def test_unfused_multiply_adds(self):
        got = self.run_program(self.code)
        self.assertEqual(self.mismatches(got, expected(self.a, self.b, self.c)), {})

    def test_decoding_matches_llvm(self):
        # The layer's decoding of each instruction, as the emulator runs it, against llvm-mc's
        # mnemonic and length (tinygrad alone calls v_mac_f32_e32 v_dot2c_f32_bf16 and
        # v_madmk_f32 v_fmamk_f32, and cannot decode v_mad_f32).
        for mnemonic, raw in self.listing:
            name, size = decode_name(self.emulator.emu, raw + b"\0" * 16, "gfx90a")
            self.assertEqual((name.lower().replace("_e32", "").replace("_e64", ""), size),
                             (mnemonic.replace("_e32", "").replace("_e64", ""), len(raw)))

    def mutated(self, new_opcode: int) -> bytes:
        """The program with its first v_mad_f32's VOP3 opcode field replaced."""
        mad_opcode = next(op for op, entry in GFX90A_VOP3.items() if entry[0] == "v_mad_f32")
        offset = 0
        for mnemonic, raw in self.listing:
            if mnemonic == "v_mad_f32":
                word = struct.unpack_from("<I", raw)[0]
                self.assertEqual((word >> 16) & 0x3FF, mad_opcode)
                patched = struct.pack("<I", (word & ~(0x3FF << 16)) | (new_opcode << 16))
                return self.code[:offset] + patched + self.code[offset + 4:]
            offset += len(raw)
        raise AssertionError("no v_mad_f32 in the program")

    def test_mutation_fma_is_caught(self):
        # v_mad_f32 -> v_fma_f32 (VOP3 0x1cb): one rounding; the first row must fail.
        got = self.run_program(self.mutated(0x1CB))
        bad = self.mismatches(got, expected(self.a, self.b, self.c))
        self.assertEqual(list(bad), ["v_mad_f32"])
        self.assertGreater(bad["v_mad_f32"], 16)
        # ... and it computed the FMA exactly: the reference of the fused form holds there.
        self.assertTrue(np.array_equal(got[0].view(np.uint32),
                                       fma(self.a, self.b, self.c).view(np.uint32)))

    def test_mutation_dropped_add_is_caught(self):
        # v_mad_f32 -> v_mul_f32_e64 (VOP3 0x105): the add is gone.
        got = self.run_program(self.mutated(0x105))
        bad = self.mismatches(got, expected(self.a, self.b, self.c))
        self.assertEqual(list(bad), ["v_mad_f32"])
        self.assertGreater(bad["v_mad_f32"], 60)


if __name__ == "__main__":
    unittest.main()
