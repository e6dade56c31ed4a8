"""bench/amd_static_table.py's reading of machine code: the natural loops, the main loops, the
waves per SIMD, on small hand-made instruction lists (no LLVM needed), and, where build/bin/ce-gen
and LLVM 22 are there, on cegen's own gfx942 forward kernel."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import amd_static_table as T  # noqa: E402


def amd(*rows):
    """Instructions at addresses 0, 4, 8, ...; a row is (mnemonic, branch target address or None)."""
    return [T.Insn(4 * n, mnem, mnem, target) for n, (mnem, target) in enumerate(rows)]


class NaturalLoops(unittest.TestCase):
    def test_simple_loop(self):
        insns = amd(("s_mov_b32", None),
                    ("global_load_dwordx4", None),  # 4: header
                    ("v_add_f32_e32", None),
                    ("s_cbranch_scc1", 4),  # back edge
                    ("s_endpgm", None))
        loops = T.loops_of(insns)
        self.assertEqual([sorted(lp.members) for lp in loops], [[1, 2, 3]])
        self.assertEqual(loops[0].load_bytes, 16)

    def test_out_of_line_block_belongs_to_its_loop(self):
        # Triton's masked loads on gfx9: the loop jumps to a block placed after the kernel's end,
        # which branches back into the middle of the loop. That backward branch is no loop.
        insns = amd(("s_mov_b32", None),            # 0
                    ("v_add_f32_e32", None),        # 1 (4): header
                    ("s_cbranch_execnz", 32),       # 2: to the out-of-line load
                    ("v_mul_f32_e32", None),        # 3 (12): rejoin
                    ("s_cbranch_scc0", 24),         # 4: leave the loop
                    ("s_branch", 4),                # 5: back edge
                    ("s_endpgm", None),             # 6 (24)
                    ("s_nop", None),                # 7
                    ("global_load_dwordx4", None),  # 8 (32): out of line
                    ("s_branch", 12))               # 9: back into the loop
        loops = T.loops_of(insns)
        self.assertEqual([sorted(lp.members) for lp in loops], [[1, 2, 3, 4, 5, 8, 9]])
        mains = T.main_loops(loops)
        self.assertEqual(len(mains), 1)
        self.assertEqual(mains[0].loads, {"global_load_dwordx4": 1})
        self.assertEqual(len(mains[0].insns), 7)

    def test_innermost_vector_loop_is_the_main_loop(self):
        insns = amd(("s_mov_b32", None),            # 0
                    ("global_load_dwordx4", None),  # 1 (4): outer header
                    ("buffer_load_dwordx4", None),  # 2 (8): inner header
                    ("v_exp_f32_e32", None),        # 3
                    ("s_cbranch_vccnz", 8),         # 4: inner back edge
                    ("global_load_ushort", None),   # 5
                    ("s_cbranch_scc1", 4),          # 6: outer back edge
                    ("s_endpgm", None))
        mains = T.main_loops(T.loops_of(insns))
        self.assertEqual([sorted(lp.members) for lp in mains], [[2, 3, 4]])

    def test_scalar_loads_make_no_main_loop(self):
        insns = amd(("global_load_ushort", None), ("v_add_f32_e32", None), ("s_cbranch_scc1", 0),
                    ("s_endpgm", None))
        self.assertEqual(T.main_loops(T.loops_of(insns)), [])


class Sass(unittest.TestCase):
    # as cuobjdump -sass prints it (indented; the encodings after the ';' left out)
    SASS = "\n".join([
        "\tcode for sm_90",
        "\t\tFunction : k",
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        "        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;",
        "        /*0020*/                   FADD R0, R4, R5 ;",
        "        /*0030*/                   NOP ;",
        "        /*0040*/              @P0 BRA 0x10 ;",
        "        /*0050*/                   EXIT ;",
        "        /*0060*/                   BRA 0x60;",
    ]) + "\n"

    def test_predicated_branch_closes_the_loop(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "k.sass"
            path.write_text(self.SASS)
            insns = T.sass_functions(path)["k"]
        rows = T.sass_main(insns, None)
        self.assertEqual(len(rows), 1)
        self.assertEqual(rows[0]["insns"], 3)  # LDG, FADD, BRA; the NOP not counted
        self.assertEqual(rows[0]["per_lane"], 8)  # 16 bytes of bf16
        self.assertAlmostEqual(rows[0]["instr_per_logit"], 3 / 8)


class Waves(unittest.TestCase):
    def kernel(self, vgpr, threads, lds=0, agpr=0, chip="gfx942"):
        return T.Kernel("x", "fwd", chip, "k", threads, vgpr=vgpr, agpr=agpr, sgpr=40, lds=lds)

    def test_registers_then_whole_workgroups(self):
        self.assertEqual(T.waves_per_simd(self.kernel(64, 256)), (8, 8))
        self.assertEqual(T.waves_per_simd(self.kernel(66, 256)), (7, 7))
        # 81 VGPRs allow 5 waves, but a 1024-thread workgroup takes 4 on each SIMD
        self.assertEqual(T.waves_per_simd(self.kernel(81, 1024)), (5, 4))
        self.assertEqual(T.waves_per_simd(self.kernel(128, 256)), (4, 4))
        # AGPRs share the file (gfx90a+): 60 + 40 -> 104 -> 4 waves
        self.assertEqual(T.waves_per_simd(self.kernel(60, 256, agpr=40)), (4, 4))

    def test_lds_limits_workgroups(self):
        # 40 KB of LDS: one 256-thread workgroup per CU on gfx942, four on gfx950 (160 KB)
        self.assertEqual(T.waves_per_simd(self.kernel(32, 256, lds=40960)), (8, 1))
        self.assertEqual(T.waves_per_simd(self.kernel(32, 256, lds=40960, chip="gfx950")), (8, 4))


@unittest.skipUnless((REPO / "build" / "bin" / "ce-gen").exists() and (T.LLVM / "llvm-objdump").exists()
                     and shutil.which("true"), "needs build/bin/ce-gen and LLVM 22's tools")
class CegenForward(unittest.TestCase):
    def test_forward_main_loop(self):
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([str(REPO / "build" / "bin" / "ce-gen"), "--target=gfx942", "--op=forward",
                            "--logits=bf16", "--labels=i64", "--layout=flat",
                            "--label-smoothing=off", "--z-loss=off", "--overwrite=0", "--weights=token",
                            "-o", tmp], check=True, capture_output=True)
            kernels = T.cegen_kernels(Path(tmp), "gfx942")
        self.assertEqual([k.role for k in kernels], ["fwd"])
        k = kernels[0]
        # Three main loops (issue 17): the plain statistics sweep; the one that also
        # accumulates the entropy and argmax (taken with flag bit 4 or 5; its argmax branch,
        # v_min_i32, inside the loop); and the outputs' own sweep, one vector per step, for
        # the rows swept again exactly.
        self.assertEqual(len(k.mains), 3)
        self.assertFalse(k.whole)

        def has_min(loop):
            return any(i.mnem.startswith(("v_min_i32", "v_min3_i32")) for i in loop.insns)

        wide = [m for m in k.mains if m.loads == {"global_load_dwordx4": 4}]
        self.assertEqual(len(wide), 2)
        plain = [m for m in wide if not has_min(m)]
        accumulating = [m for m in wide if has_min(m)]
        self.assertEqual((len(plain), len(accumulating)), (1, 1))
        own = [m for m in k.mains if m not in wide]
        self.assertEqual(own[0].loads, {"global_load_dwordx4": 1})
        self.assertTrue(has_min(own[0]))
        loop = plain[0]
        # gfx942's forward tuning (issue 19 item 4): 256 threads x unroll 4, four 16-byte loads
        self.assertEqual(T.per_lane(k, loop), 32)
        self.assertTrue(any(i.mnem.startswith("v_exp_f32") for i in loop.insns))
        self.assertEqual(T.per_lane(k, accumulating[0]), 32)
        self.assertEqual(k.scratch, 0)


if __name__ == "__main__":
    unittest.main()
