"""Runs cegen's AMD kernels in tinygrad's CDNA emulator, launched by cegen's own runtime.

The runtime's HIP backend (runtime/lib/HipDriver.cpp, GpuBackend.cpp) runs unchanged against
test/amd/emulator_hip.c, a libamdhip64.so whose device is this module: ``hipModuleLoadData``
keeps a copy of the HSACO, ``hipModuleLaunchKernel`` hands the code object, the kernel's
name, grid, block, dynamic LDS bytes and the runtime's ``void **params`` to
:meth:`Emulator.launch`. That does what HIP and the command processor do for a dispatch:

- reads the kernel's descriptor (``SYMBOL.kd``) and its entry in the code object's metadata
  (the AMDGPU note, msgpack);
- packs the kernel arguments: ``params[i]`` (``.size`` bytes) at ``.offset`` for every entry of
  the metadata's ``.args``, in a kernarg segment of ``.kernarg_segment_size`` bytes (16-byte
  aligned), refusing hidden arguments this launcher does not fill;
- loads the ELF's PT_LOAD segments at their virtual addresses (so PC-relative references to
  the code object's data hold) and starts at the descriptor's entry;
- sets the user SGPRs the descriptor enables, in the hardware's order (private segment buffer
  (4), dispatch ptr (2), queue ptr (2), kernarg segment ptr (2), dispatch id (2), flat scratch
  init (2), private segment size (1), then the preloaded kernel arguments) and checks that
  their count is ``COMPUTE_PGM_RSRC2.USER_SGPR``;
- writes the LDS size (the descriptor's static group segment plus the launch's dynamic bytes)
  into ``COMPUTE_PGM_RSRC2.LDS_SIZE``, which is where the emulator reads it;
- runs the grid (``run_asm``, ``cdna`` mode, wave64), with the ``s_setreg_imm32_b32`` writes of
  MODE's denormal bits that flushing kernels put around an f32 division made ``s_nop`` (the
  emulator cannot run them and flushes denormals regardless: :func:`_skip_denorm_mode_write`);
- on gfx90a code objects, runs the unfused multiply-adds that CDNA2 has and CDNA3/4 dropped
  (``v_mad_f32``, ``v_mac_f32``, ``v_madmk_f32``, ``v_madak_f32``), which tinygrad's tables,
  built from the CDNA4 ISA, do not know or decode as other instructions (:class:`Gfx90aOps`).

What the emulator is and is not: see docs/AMD-TESTS.md (no ``s_waitcnt``/hazard model, f32
denormals flushed, not validated against CDNA silicon).
"""

from __future__ import annotations

import ctypes
import hashlib
import struct
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent

# -- msgpack (the subset the AMDGPU metadata note uses) --------------------------------------


def unpack_msgpack(data: bytes):
    def read(at: int):
        b = data[at]
        at += 1
        if b <= 0x7F:
            return b, at
        if b >= 0xE0:
            return b - 0x100, at
        if 0x80 <= b <= 0x8F:
            return read_map(at, b & 0x0F)
        if 0x90 <= b <= 0x9F:
            return read_array(at, b & 0x0F)
        if 0xA0 <= b <= 0xBF:
            n = b & 0x1F
            return data[at:at + n].decode(), at + n
        if b == 0xC0:
            return None, at
        if b in (0xC2, 0xC3):
            return b == 0xC3, at
        fixed = {0xCA: ">f", 0xCB: ">d", 0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q",
                 0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}
        if b in fixed:
            size = struct.calcsize(fixed[b])
            return struct.unpack_from(fixed[b], data, at)[0], at + size
        lengths = {0xC4: ">B", 0xC5: ">H", 0xC6: ">I", 0xD9: ">B", 0xDA: ">H", 0xDB: ">I",
                   0xDC: ">H", 0xDD: ">I", 0xDE: ">H", 0xDF: ">I"}
        if b in lengths:
            n = struct.unpack_from(lengths[b], data, at)[0]
            at += struct.calcsize(lengths[b])
            if b in (0xC4, 0xC5, 0xC6):
                return bytes(data[at:at + n]), at + n
            if b in (0xD9, 0xDA, 0xDB):
                return data[at:at + n].decode(), at + n
            return (read_array if b in (0xDC, 0xDD) else read_map)(at, n)
        raise ValueError(f"msgpack: unsupported byte 0x{b:02x} at {at - 1}")

    def read_array(at: int, n: int):
        items = []
        for _ in range(n):
            item, at = read(at)
            items.append(item)
        return items, at

    def read_map(at: int, n: int):
        items = {}
        for _ in range(n):
            key, at = read(at)
            value, at = read(at)
            items[key] = value
        return items, at

    return read(0)[0]


# -- the code object --------------------------------------------------------------------------

#: kernel_code_properties bits and the user SGPRs each enables, in the order the hardware
#: (the command processor) writes them from s0 up.
USER_SGPRS = [(1 << 0, "private_segment_buffer", 4), (1 << 1, "dispatch_ptr", 2),
              (1 << 2, "queue_ptr", 2), (1 << 3, "kernarg_segment_ptr", 2),
              (1 << 4, "dispatch_id", 2), (1 << 5, "flat_scratch_init", 2),
              (1 << 6, "private_segment_size", 1)]

RSRC2_SCRATCH_EN = 1 << 0
RSRC2_USER_SGPR_SHIFT, RSRC2_USER_SGPR_MASK = 1, 0x1F
RSRC2_TG_SIZE_EN = 1 << 10
RSRC2_LDS_SHIFT, RSRC2_LDS_MASK = 15, 0x1FF
#: The emulator reads COMPUTE_PGM_RSRC2.LDS_SIZE in 512-byte granules.
LDS_GRANULE = 512


#: EF_AMDGPU_MACH values of the chips cegen targets (llvm/BinaryFormat/ELF.h).
EF_AMDGPU_MACH = {0x3F: "gfx90a", 0x4C: "gfx942", 0x4F: "gfx950"}


@dataclass
class KernelDescriptor:
    address: int  # virtual address of SYMBOL.kd in the code object
    group_segment_fixed_size: int
    private_segment_fixed_size: int
    kernarg_size: int
    entry_offset: int
    rsrc1: int
    rsrc2: int
    rsrc3: int
    code_properties: int
    kernarg_preload: int

    @staticmethod
    def parse(address: int, raw: bytes) -> "KernelDescriptor":
        group, private, kernarg = struct.unpack_from("<III", raw, 0)
        (entry,) = struct.unpack_from("<q", raw, 16)
        rsrc3, rsrc1, rsrc2 = struct.unpack_from("<III", raw, 44)
        properties, preload = struct.unpack_from("<HH", raw, 56)
        return KernelDescriptor(address, group, private, kernarg, entry, rsrc1, rsrc2, rsrc3,
                                properties, preload)


class CodeObject:
    """An HSACO: its segments loaded into host memory, its kernels' descriptors and metadata."""

    def __init__(self, image: bytes):
        self.image = image
        if image[:4] != b"\x7fELF" or image[4] != 2:
            raise ValueError("not an ELF64 code object")
        (self.machine,) = struct.unpack_from("<H", image, 0x12)
        (self.flags,) = struct.unpack_from("<I", image, 0x30)
        phoff, shoff = struct.unpack_from("<QQ", image, 0x20)
        phentsize, phnum, shentsize, shnum, shstrndx = struct.unpack_from("<HHHHH", image, 0x36)
        self.sections = []
        for i in range(shnum):
            name, kind, _flags, addr, offset, size, link, _info, _align, entsize = \
                struct.unpack_from("<IIQQQQIIQQ", image, shoff + i * shentsize)
            self.sections.append((name, kind, addr, offset, size, link, entsize))
        self.segments = []
        for i in range(phnum):
            kind, _flags, offset, vaddr, _paddr, filesz, memsz, _align = \
                struct.unpack_from("<IIQQQQQQ", image, phoff + i * phentsize)
            if kind == 1:  # PT_LOAD
                self.segments.append((offset, vaddr, filesz, memsz))
        #: EF_AMDGPU_MACH (the low byte of e_flags): the chip the code was compiled for.
        self.chip = EF_AMDGPU_MACH.get(self.flags & 0xFF, f"mach 0x{self.flags & 0xFF:x}")
        self.symbols = self._symbols()
        self.metadata = self._metadata()
        self.kernels_metadata = {k[".name"]: k for k in self.metadata.get("amdhsa.kernels", [])}
        self._memory = None
        self.base = 0

    def _symbols(self) -> Dict[str, Tuple[int, int]]:
        symbols: Dict[str, Tuple[int, int]] = {}
        for _name, kind, _addr, offset, size, link, entsize in self.sections:
            if kind not in (2, 11):  # SHT_SYMTAB, SHT_DYNSYM
                continue
            strtab = self.sections[link][3]
            for at in range(offset, offset + size, entsize or 24):
                name_at, _info, _other, _shndx, value, sym_size = struct.unpack_from(
                    "<IBBHQQ", self.image, at)
                end = self.image.index(b"\0", strtab + name_at)
                name = self.image[strtab + name_at:end].decode()
                if name:
                    symbols[name] = (value, sym_size)
        return symbols

    def _metadata(self) -> dict:
        for _name, kind, _addr, offset, size, _link, _entsize in self.sections:
            if kind != 7:  # SHT_NOTE
                continue
            at = offset
            while at + 12 <= offset + size:
                namesz, descsz, note_type = struct.unpack_from("<III", self.image, at)
                name = self.image[at + 12:at + 12 + namesz].rstrip(b"\0")
                desc_at = at + 12 + ((namesz + 3) & ~3)
                if name == b"AMDGPU" and note_type == 32:  # NT_AMDGPU_METADATA
                    return unpack_msgpack(self.image[desc_at:desc_at + descsz])
                at = desc_at + ((descsz + 3) & ~3)
        raise ValueError("code object has no AMDGPU metadata note")

    def read_virtual(self, address: int, size: int) -> bytes:
        for offset, vaddr, filesz, _memsz in self.segments:
            if vaddr <= address and address + size <= vaddr + filesz:
                return self.image[offset + address - vaddr:offset + address - vaddr + size]
        raise ValueError(f"address 0x{address:x} is in no loaded segment")

    def virtual_address(self, file_offset: int) -> int:
        for offset, vaddr, filesz, _memsz in self.segments:
            if offset <= file_offset < offset + filesz:
                return vaddr + file_offset - offset
        raise ValueError(f"file offset {file_offset} is in no loaded segment")

    def descriptor(self, symbol: str) -> KernelDescriptor:
        if symbol + ".kd" not in self.symbols:
            raise KeyError(f"the code object has no kernel descriptor {symbol}.kd "
                           f"(kernels: {sorted(self.kernels_metadata)})")
        address, _ = self.symbols[symbol + ".kd"]
        return KernelDescriptor.parse(address, self.read_virtual(address, 64))

    def load(self) -> int:
        """Maps the PT_LOAD segments into host memory once; returns the load base."""
        if self._memory is None:
            span = max(vaddr + memsz for _o, vaddr, _f, memsz in self.segments)
            self._memory = ctypes.create_string_buffer(span + 4096 + 64)
            self.base = (ctypes.addressof(self._memory) + 4095) & ~4095
            for offset, vaddr, filesz, _memsz in self.segments:
                ctypes.memmove(self.base + vaddr, self.image[offset:offset + filesz], filesz)
        return self.base

    def text_range(self) -> Tuple[int, int]:
        """The .text section's (file offset, size)."""
        shstr = self.sections[struct.unpack_from("<H", self.image, 0x3E)[0]][3]
        for name, _kind, _addr, offset, size, _link, _entsize in self.sections:
            end = self.image.index(b"\0", shstr + name)
            if self.image[shstr + name:end] == b".text":
                return offset, size
        raise ValueError("no .text section")


# -- the launcher -----------------------------------------------------------------------------

#: gfx9 SOPK ``s_setreg_imm32_b32`` (opcode 20) and its hwreg operand's register id HW_REG_MODE.
SETREG_IMM32_OPCODE = 20
HW_REG_MODE = 1
#: MODE's FP_DENORM field: bits 4-7 (f32, then f64/f16).
MODE_FP_DENORM_BITS = 0xF0
S_NOP_0 = 0xBF800000


def _skip_denorm_mode_write(pc: int) -> None:
    """Turns an ``s_setreg_imm32_b32`` of MODE's FP_DENORM bits at `pc` into two ``s_nop 0``.

    With f32 denormals flushed, LLVM brackets each IEEE f32 division's ``v_div_scale`` /
    ``v_div_fmas`` sequence with such writes (denormals on, then off again). tinygrad's CDNA
    pcode for the instruction does not compile (it reads WAVE_STATUS), and the emulator runs
    every instruction with DAZ+FTZ whatever MODE says, so skipping the write changes nothing
    it computes. Only that exact instruction, decoded at an instruction boundary, is touched."""
    word = ctypes.c_uint32.from_address(pc).value
    if word >> 28 != 0xB or (word >> 23) & 0x1F != SETREG_IMM32_OPCODE:
        return
    hwreg = word & 0xFFFF
    offset, size = (hwreg >> 6) & 0x1F, (hwreg >> 11) + 1
    field = ((1 << size) - 1) << offset
    if hwreg & 0x3F == HW_REG_MODE and field & ~MODE_FP_DENORM_BITS == 0:
        ctypes.c_uint32.from_address(pc).value = S_NOP_0
        ctypes.c_uint32.from_address(pc + 4).value = S_NOP_0


class LaunchError(RuntimeError):
    pass


# -- gfx90a-only instructions -----------------------------------------------------------------

#: VOP2 opcode field (bits 30:25, bit 31 clear) and VOP3 opcode field (bits 25:16 under the
#: 0b110100 prefix) of gfx9's unfused f32 multiply-adds, which gfx90a (CDNA2) has and gfx940+
#: (CDNA3/4) dropped: LLVM forms them only when f32 denormals are flushed (they flush). Each
#: maps to the CDNA4 instruction with the same operand layout (its FMA) and the pcode that
#: tinygrad runs for it instead: the product rounded to f32, then the sum rounded (two
#: roundings, not an FMA's one). tinygrad decodes VOP2 22 as v_dot2c_f32_bf16, 23/24 as
#: v_fmamk/v_fmaak_f32 (fused) and VOP3 0x116 as v_dot2c_f32_bf16_e64 (all silently wrong for
#: gfx90a code), and VOP3 0x1c1 not at all.
#:
#: The product is taken in f64 (exact for two f32) and rounded to f32 by a conversion: written
#: ``S0.f32 * S1.f32 + S2.f32``, tinygrad renders one C expression that clang (-O2, its default
#: -ffp-contract=on, -march=native) compiles to a single vfmadd, i.e. an FMA. The f64 -> f32
#: conversion rounds as an f32 multiply would and flushes a subnormal product (FTZ), which
#: gfx90a's v_mad_f32 does too.
def _mad_pcode(a: str, b: str, c: str) -> str:
    return f"D0.f32 = 32'F(64'F({a}) * 64'F({b})) + {c}"


GFX90A_VOP2 = {22: ("v_mac_f32_e32", 59, _mad_pcode("S0.f32", "S1.f32", "D0.f32")),
               23: ("v_madmk_f32", 23, _mad_pcode("S0.f32", "SIMM32.f32", "S1.f32")),
               24: ("v_madak_f32", 24, _mad_pcode("S0.f32", "S1.f32", "SIMM32.f32"))}
GFX90A_VOP3 = {0x116: ("v_mac_f32_e64", 0x13B, _mad_pcode("S0.f32", "S1.f32", "D0.f32")),
               0x1C1: ("v_mad_f32", 0x1CB, _mad_pcode("S0.f32", "S1.f32", "S2.f32"))}
#: gfx90a-only VOP3 opcodes no cegen kernel uses, refused rather than run as something else:
#: v_mad_legacy_f32 (0 * anything = 0) and the VOP3 forms of v_madmk/v_madak (none exist).
GFX90A_VOP3_REFUSED = {0x1C0: "v_mad_legacy_f32"}
VOP3_PREFIX, VOP3_OPCODE_SHIFT, VOP3_OPCODE_MASK = 0b110100, 16, 0x3FF
SRC0_SDWA, SRC0_DPP = 0xF9, 0xFA


def gfx90a_only(data: bytes) -> Optional[Tuple[str, bytes, str]]:
    """For an instruction of gfx90a code starting at `data` (at least 8 bytes): None if it means
    the same on CDNA4, else (gfx90a mnemonic, the CDNA4 bytes to decode in its place, the pcode
    to compile for it). Raises LaunchError for a gfx90a-only form this layer does not run."""
    word = struct.unpack_from("<I", data, 0)[0]
    if word >> 31 == 0 and (word >> 25) & 0x3F in GFX90A_VOP2:  # VOP2 (bit 31 clear)
        name, opcode, pcode = GFX90A_VOP2[(word >> 25) & 0x3F]
        if word & 0x1FF in (SRC0_SDWA, SRC0_DPP):
            raise LaunchError(f"gfx90a {name} with SDWA/DPP is not emulated")
        new = (word & ~(0x3F << 25)) | (opcode << 25)
        return name, struct.pack("<I", new) + data[4:], pcode
    if word >> 26 == VOP3_PREFIX:
        op = (word >> VOP3_OPCODE_SHIFT) & VOP3_OPCODE_MASK
        if op in GFX90A_VOP3_REFUSED:
            raise LaunchError(f"gfx90a {GFX90A_VOP3_REFUSED[op]} is not emulated")
        if op in GFX90A_VOP3:
            name, opcode, pcode = GFX90A_VOP3[op]
            if (struct.unpack_from("<I", data, 4)[0] >> 27) & 3:
                raise LaunchError(f"gfx90a {name} with an output modifier is not emulated")
            new = (word & ~(VOP3_OPCODE_MASK << VOP3_OPCODE_SHIFT)) | (opcode << VOP3_OPCODE_SHIFT)
            return name, struct.pack("<I", new) + data[4:], pcode
    return None


class Gfx90aOps:
    """Compiles gfx90a's unfused multiply-adds for tinygrad's emulator, as tinygrad compiles an
    instruction (``emu._get_runner``), but from the CDNA4 FMA of the same operand layout with
    the unfused pcode in place of the FMA's; the operand fields are read from the instruction's
    own bytes at run time, as for every instruction. Runners are shared between instructions
    that differ only in those fields (tinygrad's canonical masks), kept apart from tinygrad's
    own caches so that a real ``v_fma_f32`` never runs the unfused code."""

    def __init__(self, emu):
        self.emu = emu
        self.runners: List[Tuple[int, int, int, object]] = []  # (base, mask, size, runner)
        #: mnemonic -> instructions decoded (once per instruction and launch) through this layer
        self.decoded: Dict[str, int] = {}

    def runner(self, data: bytes, cdna_bytes: bytes, pcode: str):
        emu = self.emu
        from tinygrad.renderer.amd import decode_inst

        inst = decode_inst(cdna_bytes, "cdna")
        size = inst.size()
        value = int.from_bytes(cdna_bytes[:size], "little")
        for base, mask, known_size, runner in self.runners:
            if known_size == size and value & mask == base:
                return runner, inst
        handler = next(emu._INST_HANDLERS[c] for c in type(inst).__mro__
                       if c in emu._INST_HANDLERS)
        ctx = emu._Ctx(size, 64)
        fma_pcode = emu.get_pcode
        emu.get_pcode = lambda op: pcode if op is inst.op else fma_pcode(op)
        try:
            sink = handler(inst, ctx)
        finally:
            emu.get_pcode = fma_pcode
        base, mask, size = ctx.canonical_mask(cdna_bytes)
        name = f"gfx90a_mad_{inst.op.name.lower()}_{base.to_bytes(size, 'little').hex()}"
        sink = sink.replace(arg=emu.KernelInfo(name=name)).rtag(1)
        with emu.Context(NOOPT=1, CHECK_OOB=0, TUPLE_ORDER=0, EMULATED_DTYPES="",
                         CAPTURE_PROCESS_REPLAY=0, PROFILE=0):
            program = emu.to_program(sink, emu.Device["CPU"].renderer)
            runtime = emu.get_runtime("CPU", program)
        runner = (program, runtime)
        self.runners.append((base, mask, size, runner))
        return runner, inst


def decode_name(emu, data: bytes, chip: str) -> Tuple[str, int]:
    """(mnemonic in tinygrad's spelling, V_ADD_F32_E32; size in bytes) of the instruction at
    `data` as this launcher runs it on `chip`: tinygrad's CDNA decoding, or this layer's for
    gfx90a-only instructions."""
    from tinygrad.renderer.amd import decode_inst

    if chip == "gfx90a":
        special = gfx90a_only(data[:16])
        if special is not None:
            return special[0].upper(), decode_inst(special[1], "cdna").size()
    inst = decode_inst(data[:16], "cdna")
    return emu._op_name(inst), inst.size()


@dataclass
class LaunchRecord:
    symbol: str
    grid: Tuple[int, int, int]
    block: Tuple[int, int, int]
    device: int
    lds_bytes: int  # static + dynamic, as handed to the emulator
    user_sgprs: List[str]
    kernarg_bytes: int
    seconds: float


HOOK_TYPE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_char_p,
                             ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                             ctypes.c_uint32, ctypes.POINTER(ctypes.c_void_p))


def build_fake_hip(out_dir: Path) -> Path:
    """Compiles emulator_hip.c into OUT_DIR/libamdhip64.so."""
    out_dir.mkdir(parents=True, exist_ok=True)
    library = out_dir / "libamdhip64.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror",
                    "-fvisibility=hidden", "-Wl,-soname,libamdhip64.so", "-o", str(library),
                    str(HERE / "emulator_hip.c")], check=True)
    return library


class Emulator:
    """tinygrad's CDNA emulator behind emulator_hip.c's launch hook."""

    def __init__(self, tinygrad: Path, fake_hip: Optional[Path],
                 log: Callable[[str], None] = print):
        self.tinygrad = Path(tinygrad).resolve()
        if not (self.tinygrad / "test/mockgpu/amd/emu.py").is_file():
            raise FileNotFoundError(f"{self.tinygrad} has no test/mockgpu/amd/emu.py")
        if str(self.tinygrad) not in sys.path:
            sys.path.insert(0, str(self.tinygrad))
        import test.mockgpu.amd.emu as emu  # noqa: E402  (tinygrad's, from its checkout)

        self.emu = emu
        self.gfx90a = Gfx90aOps(emu)
        self.log = log
        self.hip = None
        if fake_hip is not None:  # None: raw code only (run_code), no HIP device
            # Loaded before libce_runtime: its dlopen("libamdhip64.so") matches this soname.
            self.hip = ctypes.CDLL(str(fake_hip), mode=ctypes.RTLD_GLOBAL)
            self.hip.emulator_hip_add_device.argtypes = [ctypes.c_char_p]
            self.hip.emulator_hip_launches.restype = ctypes.c_int64
            self._hook = HOOK_TYPE(self._launch_hook)  # kept alive as long as the emulator
            self.hip.emulator_hip_set_launch_hook(self._hook)
        self.code_objects: Dict[str, CodeObject] = {}
        self.launches: List[LaunchRecord] = []
        self.last_error: Optional[str] = None
        #: (sha256 of a code object, file offset, new bytes): while set, launches from that
        #: object run a copy with those bytes replaced (the mutation check).
        self.mutation: Optional[Tuple[str, int, bytes]] = None
        self.mutation_executed = False
        #: While a set: the code addresses (relative to the loaded object) decoded, i.e. run.
        self.executed: Optional[set] = None
        self._mutated_key = ""

    def add_device(self, arch: str) -> int:
        """A HIP device of gcnArchName `arch` ("gfx942:sramecc+:xnack-"); its index. All
        devices are added before the runtime's first HIP call (hipGetDeviceCount)."""
        index = self.hip.emulator_hip_add_device(arch.encode())
        if index < 0:
            raise RuntimeError("too many emulated devices")
        return index

    def _code_object(self, image: bytes) -> CodeObject:
        digest = hashlib.sha256(image).hexdigest()
        if self.mutation and self.mutation[0] == digest:
            offset, patch = self.mutation[1], self.mutation[2]
            image = image[:offset] + patch + image[offset + len(patch):]
            digest += f"+{patch.hex()}@{offset}"
            self._mutated_key = digest
        if digest not in self.code_objects:
            self.code_objects[digest] = CodeObject(image)
        return self.code_objects[digest]

    def _launch_hook(self, image, image_bytes, symbol, grid, block, shared, params) -> int:
        try:
            self.launch(ctypes.string_at(image, image_bytes), symbol.decode(),
                        (grid[0], grid[1], grid[2]), (block[0], block[1], block[2]), shared,
                        params)
            return 0
        except Exception as error:  # noqa: BLE001 - reported through the runtime's error
            self.last_error = f"{type(error).__name__}: {error}"
            self.log(f"    emulator: {self.last_error}")
            if not isinstance(error, LaunchError):
                self.log(traceback.format_exc()[-1500:])
            return 719  # hipErrorLaunchFailure

    def launch(self, image: bytes, symbol: str, grid: Tuple[int, int, int],
               block: Tuple[int, int, int], dynamic_lds: int, params) -> None:
        started = time.time()
        co = self._code_object(image)
        kd = co.descriptor(symbol)
        meta = co.kernels_metadata.get(symbol)
        if meta is None:
            raise LaunchError(f"no metadata for kernel {symbol}")
        if meta.get(".wavefront_size", 64) != 64 or kd.code_properties & (1 << 10):
            raise LaunchError(f"{symbol} is not a wave64 kernel")

        # The kernarg segment, packed from the runtime's params by the metadata (as HIP does).
        size = meta[".kernarg_segment_size"]
        if size != kd.kernarg_size:
            raise LaunchError(f"metadata kernarg size {size} != descriptor's {kd.kernarg_size}")
        kernarg = ctypes.create_string_buffer(size + 16)
        kernarg_at = (ctypes.addressof(kernarg) + 15) & ~15
        for index, arg in enumerate(meta.get(".args", [])):
            kind = arg[".value_kind"]
            if kind.startswith("hidden_"):
                raise LaunchError(f"{symbol} takes hidden argument {kind}, not filled here")
            if not params[index]:
                raise LaunchError(f"the runtime passed no parameter {index} ({kind}, offset "
                                  f"{arg['.offset']}); the kernel takes "
                                  f"{len(meta['.args'])}")
            ctypes.memmove(kernarg_at + arg[".offset"], params[index], arg[".size"])
        self._kernarg = kernarg  # alive until the next launch

        # User SGPRs, in the hardware's order.
        user_data: List[int] = []
        names: List[str] = []
        dispatch = ctypes.create_string_buffer(64 + 64)
        for bit, name, count in USER_SGPRS:
            if not kd.code_properties & bit:
                continue
            names.append(name)
            if name == "kernarg_segment_ptr":
                value = kernarg_at
            elif name == "dispatch_ptr":
                value = self._dispatch_packet(dispatch, grid, block, kd, dynamic_lds, kernarg_at)
            elif name == "private_segment_buffer":
                if kd.private_segment_fixed_size:
                    raise LaunchError(f"{symbol} uses {kd.private_segment_fixed_size} bytes of "
                                      "scratch through the private segment buffer, not set up")
                value = 0  # a null buffer resource: no scratch is used
            elif name in ("queue_ptr", "flat_scratch_init") and kd.private_segment_fixed_size:
                raise LaunchError(f"{symbol} enables {name} and uses scratch; not set up")
            else:
                value = kd.private_segment_fixed_size if name == "private_segment_size" else 0
            for i in range(count):
                user_data.append((value >> (32 * i)) & 0xFFFFFFFF)
        preload_dwords, preload_offset = kd.kernarg_preload & 0x7F, kd.kernarg_preload >> 7
        if preload_dwords:
            names.append(f"kernarg_preload[{preload_dwords}]")
            raw = ctypes.string_at(kernarg_at + 4 * preload_offset, 4 * preload_dwords)
            user_data += list(struct.unpack(f"<{preload_dwords}I", raw))
        rsrc2 = kd.rsrc2
        declared = (rsrc2 >> RSRC2_USER_SGPR_SHIFT) & RSRC2_USER_SGPR_MASK
        if declared != len(user_data):
            raise LaunchError(f"{symbol}: COMPUTE_PGM_RSRC2.USER_SGPR is {declared}, the enabled "
                              f"user SGPRs {names} make {len(user_data)}")
        if rsrc2 & RSRC2_TG_SIZE_EN:
            raise LaunchError(f"{symbol} enables the workgroup-info SGPR, not set by the emulator")
        if rsrc2 & RSRC2_SCRATCH_EN or kd.private_segment_fixed_size:
            raise LaunchError(f"{symbol} uses scratch ({kd.private_segment_fixed_size} bytes)")
        lds = kd.group_segment_fixed_size + dynamic_lds
        granules = (lds + LDS_GRANULE - 1) // LDS_GRANULE
        if granules > RSRC2_LDS_MASK:
            raise LaunchError(f"{symbol}: {lds} bytes of LDS do not fit COMPUTE_PGM_RSRC2")
        rsrc2 = (rsrc2 & ~(RSRC2_LDS_MASK << RSRC2_LDS_SHIFT)) | (granules << RSRC2_LDS_SHIFT)

        base = co.load()
        entry = base + kd.address + kd.entry_offset
        code_end = base + max(v + m for _o, v, _f, m in co.segments)
        target = (base + co.virtual_address(self.mutation[1])
                  if self.mutation and co is self.code_objects.get(self._mutated_key) else None)
        self._base = base
        self._run(co.chip, entry, code_end - entry, grid, block, kernarg_at, rsrc2, user_data,
                  target)
        device = self.hip.emulator_hip_current_device()
        self.launches.append(LaunchRecord(symbol, grid, block, device, lds, names, size,
                                          time.time() - started))

    def _run(self, chip: str, entry: int, size: int, grid, block, kernarg_at: int, rsrc2: int,
             user_data: List[int], target: Optional[int] = None) -> None:
        """run_asm on `chip`'s code at `entry`, decoding through this launcher's layer: the
        denormal-mode writes skipped, gfx90a's own instructions (on gfx90a), and the mutation
        target's execution recorded."""
        decode = self.emu._decode_at

        def decoding(pc: int, arch: str):
            _skip_denorm_mode_write(pc)
            special = gfx90a_only(ctypes.string_at(pc, 16)) if chip == "gfx90a" else None
            if special is not None:
                runner, inst = self.gfx90a.runner(ctypes.string_at(pc, 16), special[1],
                                                  special[2])
                self.gfx90a.decoded[special[0]] = self.gfx90a.decoded.get(special[0], 0) + 1
            else:
                runner, inst = decode(pc, arch)
            if self.executed is not None:
                self.executed.add(pc - self._base)
            if target is not None and pc <= target < pc + inst.size():
                # Record whether the changed bytes were decoded (run) in this launch.
                self.mutation_executed = True
            return runner, inst

        self.emu._decode_at = decoding
        try:
            self.emu.run_asm(entry, size, grid[0], grid[1], grid[2], block[0], block[1],
                             block[2], kernarg_at, rsrc2, 0, "cdna", user_data)
        finally:
            self.emu._decode_at = decode

    def run_code(self, code: bytes, chip: str, user_sgprs: List[int], threads: int = 64) -> None:
        """Runs raw machine code (ending in s_endpgm) as one workgroup of `threads` work-items
        with `user_sgprs` in s0, s1, ... (instruction tests: test_gfx90a_mad.py)."""
        memory = ctypes.create_string_buffer(len(code) + 4096 + 64)
        entry = (ctypes.addressof(memory) + 4095) & ~4095
        ctypes.memmove(entry, code, len(code))
        rsrc2 = len(user_sgprs) << RSRC2_USER_SGPR_SHIFT
        self._run(chip, entry, len(code), (1, 1, 1), (threads, 1, 1), 0, rsrc2,
                  list(user_sgprs))

    @staticmethod
    def _dispatch_packet(buffer, grid, block, kd: KernelDescriptor, dynamic_lds: int,
                         kernarg_at: int) -> int:
        """An hsa_kernel_dispatch_packet_t for the launch (grid sizes in work-items)."""
        at = (ctypes.addressof(buffer) + 63) & ~63
        packet = struct.pack("<HHHHHHIIIIIQQQ", 2, 1, block[0], block[1], block[2], 0,
                             grid[0] * block[0], grid[1] * block[1], grid[2] * block[2],
                             kd.private_segment_fixed_size,
                             kd.group_segment_fixed_size + dynamic_lds, 0, kernarg_at, 0)
        ctypes.memmove(at, packet, len(packet))
        return at
