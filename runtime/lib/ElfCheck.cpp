//===- ElfCheck.cpp - ELF code objects before a loader sees them ----------===//
//
// dlopen maps a shared object's segments from the file and then follows the
// pointers of its dynamic section through memory: a segment that ends past
// the end of the file faults (SIGBUS) when it is touched, and a pointer that
// leads outside the loaded image faults (SIGSEGV). hipModuleLoadData is
// given no size and trusts the headers for it. So before any loader sees an
// object, this checks with the whole file in hand that everything a loader
// reads lies inside the file and that the headers agree with each other:
//
// - the ELF header: magic, 64-bit little-endian, the object's machine, type
//   and (host) OS ABI, header and entry sizes;
// - the program headers: inside the file, every segment's file range inside
//   the file; PT_LOAD segments sorted, disjoint, with offsets congruent to
//   addresses modulo the page size; PT_DYNAMIC, PT_GNU_RELRO and the like
//   inside a PT_LOAD; notes well formed;
// - the section headers (if any): inside the file, every section's bytes
//   inside the file, every allocated section inside a PT_LOAD at the file
//   offset its address implies, with that segment's permissions;
// - for ET_DYN objects, the dynamic section and the tables it points to
//   (ElfDynamicCheck.cpp).
//
// The checks are structural: they keep the loaders inside the file, they do
// not prove the code right. The manifest's SHA-256 (ObjectCheck.cpp) is what
// catches a changed byte.
//
//===----------------------------------------------------------------------===//

#include "ElfChecker.h"

#include <algorithm>

namespace ce::elf {

bool ElfChecker::checkHeader() {
  if (file.size() < kHeaderBytes)
    return fail("truncated: " + std::to_string(file.size()) +
                " bytes, less than an ELF header");
  if (std::memcmp(file.data(),
                  "\x7f"
                  "ELF",
                  4) != 0)
    return fail("not an ELF file (no ELF magic number)");
  if (file[4] != 2)
    return fail("not a 64-bit ELF object (EI_CLASS " +
                std::to_string(uint8_t(file[4])) + ")");
  if (file[5] != 1)
    return fail("not a little-endian ELF object (EI_DATA " +
                std::to_string(uint8_t(file[5])) + ")");
  if (file[6] != 1 || u32(20) != 1)
    return fail("unknown ELF version");
  uint16_t type = u16(16), machine = u16(18);
  uint16_t wantMachine = kind == ElfKind::HostSharedObject ? kMachineX86_64
                         : kind == ElfKind::Hsaco          ? kMachineAmdgpu
                                                           : kMachineCuda;
  if (machine != wantMachine)
    return fail("ELF machine " + std::to_string(machine) + ", expected " +
                std::to_string(wantMachine) +
                (kind == ElfKind::HostSharedObject ? " (x86-64)"
                 : kind == ElfKind::Hsaco          ? " (AMDGPU)"
                                                   : " (CUDA)"));
  uint16_t wantType = kind == ElfKind::Cubin ? kTypeExec : kTypeDyn;
  if (type != wantType)
    return fail("ELF type " + std::to_string(type) + ", expected " +
                (wantType == kTypeDyn ? "ET_DYN (a shared object)"
                                      : "ET_EXEC (a linked cubin)"));
  uint8_t osAbi = file[7], abiVersion = file[8];
  if (x86() && ((osAbi != kOsAbiNone && osAbi != kOsAbiGnu) || abiVersion))
    return fail("unexpected OS ABI " + std::to_string(osAbi) + " version " +
                std::to_string(abiVersion) + " for Linux");
  if (kind == ElfKind::Hsaco && osAbi != kOsAbiAmdgpuHsa)
    return fail("OS ABI " + std::to_string(osAbi) + " is not AMDGPU HSA (64)");
  for (int i = 9; i < 16; ++i)
    if (file[i] != 0)
      return fail("nonzero padding in e_ident");

  if (x86() && u32(48) != 0)
    return fail("nonzero e_flags " + hex(u32(48)) + " for x86-64");
  if (u16(52) != kHeaderBytes)
    return fail("ELF header size " + std::to_string(u16(52)) + ", expected 64");

  phoff = u64(32);
  phnum = u16(56);
  if (phnum == 0xffff)
    return fail("extended program header numbering is not supported");
  if (phnum == 0 && loadable())
    return fail("no program headers");
  if (phnum && u16(54) != kSegmentBytes)
    return fail("program header size " + std::to_string(u16(54)) +
                ", expected 56");
  if (phnum && phoff % 8)
    return fail("misaligned program header table at " + hex(phoff));
  if (!fits(phoff, phnum * kSegmentBytes, file.size()))
    return truncated("the program header table", phoff, phnum * kSegmentBytes);
  return true;
}

bool ElfChecker::checkSegments() {
  for (uint64_t i = 0; i < phnum; ++i) {
    uint64_t at = phoff + i * kSegmentBytes;
    segments.push_back({u32(at), u32(at + 4), u64(at + 8), u64(at + 16),
                        u64(at + 32), u64(at + 40), u64(at + 48)});
  }
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment &segment = segments[i];
    if (segment.filesz && !fits(segment.offset, segment.filesz, file.size()))
      return truncated(segmentLabel(i), segment.offset, segment.filesz);
    if (!isPowerOfTwoOrZero(segment.align))
      return fail(segmentLabel(i) + " has alignment " + hex(segment.align) +
                  ", not a power of two");
    if (segment.type == kPtNote && !checkNotes(i))
      return false;
    if (!loadable() || segment.type != kPtLoad)
      continue;
    uint64_t end;
    if (segment.filesz > segment.memsz ||
        __builtin_add_overflow(segment.vaddr, segment.memsz, &end))
      return fail(segmentLabel(i) + " has file size " + hex(segment.filesz) +
                  " and memory size " + hex(segment.memsz));
    if ((segment.vaddr - segment.offset) % kPageBytes ||
        (segment.align > 1 && (segment.vaddr - segment.offset) % segment.align))
      return fail(segmentLabel(i) + ": file offset " + hex(segment.offset) +
                  " and address " + hex(segment.vaddr) +
                  " differ modulo the page size or alignment");
    if (!loads.empty() &&
        segment.vaddr < loads.back()->vaddr + loads.back()->memsz)
      return fail(segmentLabel(i) + " at address " + hex(segment.vaddr) +
                  " overlaps or precedes the PT_LOAD before it");
    loads.push_back(&segment);
  }
  if (!loadable())
    return true;
  if (loads.empty())
    return fail("no PT_LOAD segment");

  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment &segment = segments[i];
    switch (segment.type) {
    case kPtDynamic:
      if (dynamicSegment)
        return fail("two PT_DYNAMIC segments");
      dynamicSegment = &segment;
      [[fallthrough]];
    case kPtGnuRelro:
    case kPtGnuEhFrame:
    case kPtGnuProperty:
    case kPtTls:
    case kPtPhdr: {
      // The loader reads these through memory (of PT_TLS, the initial
      // image of `filesz` bytes).
      uint64_t size = segment.type == kPtTls ? segment.filesz : segment.memsz;
      bool inside = loadHolding(segment.vaddr, size) != nullptr;
      // lld ends PT_GNU_RELRO at a page boundary, past its PT_LOAD's memory
      // but inside that PT_LOAD's last page.
      if (segment.type == kPtGnuRelro && !inside)
        if (const Segment *load = loadHolding(segment.vaddr, 0)) {
          uint64_t pageEnd =
              (load->vaddr + load->memsz + kPageBytes - 1) & ~(kPageBytes - 1);
          inside = size <= pageEnd - segment.vaddr;
        }
      if (!inside)
        return fail(segmentLabel(i) + " (" + hex(size) + " bytes at address " +
                    hex(segment.vaddr) + ") is not inside a PT_LOAD segment");
      break;
    }
    default:
      break;
    }
    if (segment.type == kPtPhdr &&
        (segment.offset != phoff || segment.filesz != phnum * kSegmentBytes))
      return fail("PT_PHDR does not describe the program header table");
  }
  if (!dynamicSegment)
    return fail("no PT_DYNAMIC segment");
  const Segment &dynamic = *dynamicSegment;
  const Segment *load = loadHolding(dynamic.vaddr, dynamic.filesz, true);
  if (!load || dynamic.offset - load->offset != dynamic.vaddr - load->vaddr ||
      dynamic.filesz < kDynamicBytes || dynamic.vaddr % 8)
    return fail("PT_DYNAMIC (" + byteRange(dynamic.offset, dynamic.filesz) +
                " at address " + hex(dynamic.vaddr) +
                ") is not where a PT_LOAD segment loads those bytes");
  bool phdrsLoaded = std::any_of(loads.begin(), loads.end(), [&](auto *l) {
    return phoff >= l->offset &&
           fits(phoff - l->offset, phnum * kSegmentBytes, l->filesz);
  });
  if (!phdrsLoaded)
    return fail("the program header table is not inside a PT_LOAD segment");
  if (x86()) {
    // Without PT_GNU_STACK, or with PF_X in it, glibc makes the process's
    // stack executable.
    auto stack = std::find_if(segments.begin(), segments.end(),
                              [](auto &s) { return s.type == kPtGnuStack; });
    if (stack == segments.end() || (stack->flags & kPfX))
      return fail("the object asks for an executable stack");
  }
  return true;
}

bool ElfChecker::checkNotes(size_t index) {
  // Each note: namesz, descsz, type, the name, the descriptor; the
  // descriptor and the next note start at the segment's alignment (4, or 8
  // for 8-aligned segments), counted from the note's start.
  const Segment &segment = segments[index];
  uint64_t align = segment.align == 8 ? 8 : 4;
  uint64_t at = segment.offset, end = segment.offset + segment.filesz;
  while (end - at >= 12) {
    uint64_t nameSize = u32(at), descSize = u32(at + 4);
    uint64_t descAt = at + ((12 + nameSize + align - 1) & ~(align - 1));
    uint64_t next = at + ((descAt - at + descSize + align - 1) & ~(align - 1));
    if (descAt > end || next > end)
      return fail("a note of " + segmentLabel(index) +
                  " runs past the end of its segment");
    at = next;
  }
  return true;
}

bool ElfChecker::checkSections() {
  uint64_t shoff = u64(40), shnum = u16(60), shstrndx = u16(62);
  if (shoff == 0) {
    if (shnum)
      return fail("section headers without a section header table");
    return true;
  }
  if (shnum == 0)
    return fail("extended section numbering is not supported");
  if (u16(58) != kSectionBytes)
    return fail("section header size " + std::to_string(u16(58)) +
                ", expected 64");
  if (shoff % 8)
    return fail("misaligned section header table at " + hex(shoff));
  if (!fits(shoff, shnum * kSectionBytes, file.size()))
    return truncated("the section header table", shoff, shnum * kSectionBytes);
  for (uint64_t i = 0; i < shnum; ++i) {
    uint64_t at = shoff + i * kSectionBytes;
    sections.push_back({u32(at), u32(at + 4), u32(at + 40), u64(at + 8),
                        u64(at + 16), u64(at + 24), u64(at + 32)});
  }
  if (sections[0].type != kShtNull)
    return fail("section 0 is not SHT_NULL");
  for (size_t i = 1; i < sections.size(); ++i) {
    const Section &section = sections[i];
    if (section.type != kShtNobits &&
        !fits(section.offset, section.size, file.size()))
      return truncated(sectionLabel(i), section.offset, section.size);
    if (section.link >= shnum)
      return fail(sectionLabel(i) + " links to section " +
                  std::to_string(section.link) + " of " +
                  std::to_string(shnum));
  }
  if (shstrndx != kShnUndef) {
    if (shstrndx >= shnum || sections[shstrndx].type != kShtStrtab)
      return fail("the section name table index " + std::to_string(shstrndx) +
                  " is not a string table");
    const Section &table = sections[shstrndx];
    for (size_t i = 1; i < sections.size(); ++i)
      if (sections[i].name >= table.size ||
          !std::memchr(file.data() + table.offset + sections[i].name, 0,
                       table.size - sections[i].name))
        return fail("the name of section " + std::to_string(i) +
                    " is not inside the section name table");
    names = &table;
  }
  return true;
}

bool ElfChecker::checkSectionsInSegments() {
  for (size_t i = 1; i < sections.size(); ++i) {
    const Section &section = sections[i];
    bool nobits = section.type == kShtNobits;
    if (!(section.flags & kShfAlloc) || section.size == 0 ||
        (nobits && (section.flags & kShfTls)))
      continue;
    const Segment *load = loadHolding(section.addr, section.size);
    if (!load)
      return fail(sectionLabel(i) + " (" + hex(section.size) +
                  " bytes at address " + hex(section.addr) +
                  ") is not inside a PT_LOAD segment");
    if (nobits && section.addr < load->vaddr + load->filesz)
      return fail(sectionLabel(i) +
                  " holds no file data, but its segment loads file bytes "
                  "over it");
    if (!nobits &&
        (section.addr + section.size > load->vaddr + load->filesz ||
         section.offset - load->offset != section.addr - load->vaddr))
      return fail(sectionLabel(i) + " at address " + hex(section.addr) +
                  " is not loaded from its file offset " + hex(section.offset));
    if (((section.flags & kShfWrite) && !(load->flags & kPfW)) ||
        ((section.flags & kShfExecInstr) && !(load->flags & kPfX)))
      return fail(sectionLabel(i) +
                  " is writable or executable, its PT_LOAD segment is not");
    if (section.type == kShtDynamic &&
        (section.addr != dynamicSegment->vaddr ||
         section.offset != dynamicSegment->offset))
      return fail("the dynamic section and PT_DYNAMIC disagree");
  }
  // After relocation the loader makes the pages of PT_GNU_RELRO read-only,
  // from its start rounded down to its end rounded down. They must hold no
  // writable data outside it: nothing before its start, and no section
  // that is written after loading (.data, .bss and their .data.*, .bss.*
  // kin, .data.rel.ro* aside), which a changed size could cover.
  auto writtenLater = [&](const Section &section) {
    if (!names)
      return false;
    std::string_view name(file.data() + names->offset + section.name);
    auto is = [&](std::string_view base) {
      return name == base ||
             (name.size() > base.size() &&
              name.substr(0, base.size()) == base && name[base.size()] == '.');
    };
    return (is(".data") && !is(".data.rel.ro")) || is(".bss");
  };
  for (const Segment &relro : segments) {
    if (relro.type != kPtGnuRelro)
      continue;
    uint64_t pagesBegin = relro.vaddr & ~(kPageBytes - 1);
    uint64_t pagesEnd = (relro.vaddr + relro.memsz) & ~(kPageBytes - 1);
    for (size_t i = 1; i < sections.size(); ++i) {
      const Section &section = sections[i];
      if ((section.flags & (kShfAlloc | kShfWrite | kShfTls)) !=
              (kShfAlloc | kShfWrite) ||
          !section.size || section.addr >= pagesEnd ||
          section.addr + section.size <= pagesBegin)
        continue;
      if (section.addr < relro.vaddr || writtenLater(section))
        return fail("PT_GNU_RELRO would make writable " + sectionLabel(i) +
                    " read-only");
    }
  }
  return true;
}

} // namespace ce::elf

std::string ce::checkElf(std::string_view file, ElfKind kind) {
  return elf::ElfChecker(file, kind).run();
}
