//===- ElfChecker.h - The ELF checks' shared state --------------*- C++ -*-===//
//
// Private to ElfCheck.cpp (the ELF header, program and section headers) and
// ElfDynamicCheck.cpp (the dynamic section and the tables it points to):
// the constants they read, and the checker they share. Not installed.
//
//===----------------------------------------------------------------------===//

#ifndef CE_RUNTIME_LIB_ELFCHECKER_H
#define CE_RUNTIME_LIB_ELFCHECKER_H

#include "ObjectCheck.h"

#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace ce::elf {

// Constants of the System V gABI, the x86-64 psABI and LLVM's AMDGPU and
// NVPTX machine numbers, spelled here rather than taken from <elf.h>, whose
// machine list varies with the C library.
constexpr uint64_t kHeaderBytes = 64, kSegmentBytes = 56, kSectionBytes = 64;
constexpr uint64_t kSymbolBytes = 24, kRelaBytes = 24, kDynamicBytes = 16;
constexpr uint64_t kPageBytes = 4096;

constexpr uint16_t kTypeExec = 2, kTypeDyn = 3;
constexpr uint16_t kMachineX86_64 = 62, kMachineCuda = 190,
                   kMachineAmdgpu = 224;
constexpr uint8_t kOsAbiNone = 0, kOsAbiGnu = 3, kOsAbiAmdgpuHsa = 64;

constexpr uint32_t kPtLoad = 1, kPtDynamic = 2, kPtNote = 4, kPtPhdr = 6,
                   kPtTls = 7, kPtGnuEhFrame = 0x6474e550,
                   kPtGnuStack = 0x6474e551, kPtGnuRelro = 0x6474e552,
                   kPtGnuProperty = 0x6474e553;
constexpr uint32_t kPfX = 1, kPfW = 2;

constexpr uint32_t kShtNull = 0, kShtSymtab = 2, kShtStrtab = 3, kShtRela = 4,
                   kShtHash = 5, kShtDynamic = 6, kShtNobits = 8,
                   kShtDynsym = 11, kShtInitArray = 14, kShtFiniArray = 15,
                   kShtPreinitArray = 16, kShtGnuHash = 0x6ffffff6,
                   kShtGnuVerDef = 0x6ffffffd, kShtGnuVerNeed = 0x6ffffffe,
                   kShtGnuVerSym = 0x6fffffff;
constexpr uint64_t kShfWrite = 1, kShfAlloc = 2, kShfExecInstr = 4,
                   kShfTls = 0x400;
constexpr uint16_t kShnUndef = 0, kShnAbs = 0xfff1;

constexpr uint8_t kSttFunc = 2, kSttTls = 6, kSttGnuIfunc = 10;

enum DynamicTag : int64_t {
  DtNull = 0,
  DtNeeded = 1,
  DtPltRelSz = 2,
  DtPltGot = 3,
  DtHash = 4,
  DtStrTab = 5,
  DtSymTab = 6,
  DtRela = 7,
  DtRelaSz = 8,
  DtRelaEnt = 9,
  DtStrSz = 10,
  DtSymEnt = 11,
  DtInit = 12,
  DtFini = 13,
  DtSoName = 14,
  DtRPath = 15,
  DtRel = 17,
  DtPltRel = 20,
  DtTextRel = 22,
  DtJmpRel = 23,
  DtInitArray = 25,
  DtFiniArray = 26,
  DtInitArraySz = 27,
  DtFiniArraySz = 28,
  DtRunPath = 29,
  DtFlags = 30,
  DtPreinitArray = 32,
  DtPreinitArraySz = 33,
  DtRelrSz = 35,
  DtRelr = 36,
  DtRelrEnt = 37,
  DtGnuHash = 0x6ffffef5,
  DtVerSym = 0x6ffffff0,
  DtRelaCount = 0x6ffffff9,
  DtVerDef = 0x6ffffffc,
  DtVerNeed = 0x6ffffffe,
};
constexpr uint64_t kDfTextRel = 4;

constexpr uint32_t kRX86_64_64 = 1, kRX86_64GlobDat = 6, kRX86_64JumpSlot = 7,
                   kRX86_64Relative = 8, kRX86_64IRelative = 37;

/// Tags whose value the checks read; each may appear once.
constexpr int64_t kSingleTags[] = {
    DtPltRelSz,    DtPltGot,  DtHash,      DtStrTab,       DtSymTab,
    DtRela,        DtRelaSz,  DtRelaEnt,   DtStrSz,        DtSymEnt,
    DtInit,        DtFini,    DtSoName,    DtRPath,        DtRel,
    DtPltRel,      DtJmpRel,  DtInitArray, DtFiniArray,    DtInitArraySz,
    DtFiniArraySz, DtRunPath, DtFlags,     DtPreinitArray, DtPreinitArraySz,
    DtRelrSz,      DtRelr,    DtRelrEnt,   DtGnuHash,      DtVerSym,
    DtRelaCount,   DtVerDef,  DtVerNeed};

struct Segment {
  uint32_t type, flags;
  uint64_t offset, vaddr, filesz, memsz, align;
};

struct Section {
  uint32_t name, type, link;
  uint64_t flags, addr, offset, size;
};

/// `size` bytes at `offset` lie inside `[0, limit)`.
inline bool fits(uint64_t offset, uint64_t size, uint64_t limit) {
  return size <= limit && offset <= limit - size;
}

inline bool isPowerOfTwoOrZero(uint64_t value) {
  return (value & (value - 1)) == 0;
}

inline std::string hex(uint64_t value) {
  static const char digits[] = "0123456789abcdef";
  std::string text;
  do {
    text.insert(text.begin(), digits[value & 15]);
    value >>= 4;
  } while (value);
  return "0x" + text;
}

/// "bytes 0x100..0x180" (the end is exclusive).
inline std::string byteRange(uint64_t offset, uint64_t size) {
  uint64_t end;
  if (__builtin_add_overflow(offset, size, &end))
    return "bytes " + hex(offset) + " + " + hex(size);
  return "bytes " + hex(offset) + ".." + hex(end);
}

inline const char *segmentName(uint32_t type) {
  switch (type) {
  case kPtLoad:
    return "PT_LOAD";
  case kPtDynamic:
    return "PT_DYNAMIC";
  case kPtNote:
    return "PT_NOTE";
  case kPtPhdr:
    return "PT_PHDR";
  case kPtTls:
    return "PT_TLS";
  case kPtGnuEhFrame:
    return "PT_GNU_EH_FRAME";
  case kPtGnuRelro:
    return "PT_GNU_RELRO";
  case kPtGnuProperty:
    return "PT_GNU_PROPERTY";
  default:
    return "segment";
  }
}

/// Checks one object; run() returns the first problem found, or "".
class ElfChecker {
public:
  ElfChecker(std::string_view file, ElfKind kind) : file(file), kind(kind) {}

  std::string run() {
    if (checkHeader() && checkSegments() && checkSections() &&
        (!loadable() || (checkSectionsInSegments() && checkDynamic())))
      return "";
    return problem;
  }

private:
  bool loadable() const { return kind != ElfKind::Cubin; }
  bool x86() const { return kind == ElfKind::HostSharedObject; }

  bool fail(std::string what) {
    problem = std::move(what);
    return false;
  }
  bool truncated(const std::string &what, uint64_t offset, uint64_t size) {
    return fail("truncated or corrupt: " + what + " (" +
                byteRange(offset, size) + ") ends past the end of the file (" +
                std::to_string(file.size()) + " bytes)");
  }

  /// A little-endian field of `bytes` bytes; the caller checked the range.
  uint64_t get(uint64_t offset, int bytes) const {
    uint64_t value = 0;
    for (int i = bytes; i-- > 0;)
      value = value << 8 | static_cast<uint8_t>(file[offset + i]);
    return value;
  }
  uint16_t u16(uint64_t offset) const { return uint16_t(get(offset, 2)); }
  uint32_t u32(uint64_t offset) const { return uint32_t(get(offset, 4)); }
  uint64_t u64(uint64_t offset) const { return get(offset, 8); }

  std::string segmentLabel(size_t index) const {
    return "program header " + std::to_string(index) + " (" +
           segmentName(segments[index].type) + ")";
  }
  std::string sectionLabel(size_t index) const {
    std::string label = "section " + std::to_string(index);
    if (names && sections[index].name < names->size)
      label += " (" +
               std::string(file.data() + names->offset + sections[index].name) +
               ")";
    return label;
  }

  /// The PT_LOAD whose memory (`fileBacked`: whose file-backed part) holds
  /// `size` bytes at address `vaddr`, or null. A size of 0 asks for the
  /// address itself, the end of the segment included.
  const Segment *loadHolding(uint64_t vaddr, uint64_t size,
                             bool fileBacked = false) const {
    for (const Segment *load : loads) {
      uint64_t length = fileBacked ? load->filesz : load->memsz;
      if (vaddr >= load->vaddr && fits(vaddr - load->vaddr, size, length))
        return load;
    }
    return nullptr;
  }
  /// Translates `size` file-backed bytes at `vaddr` to a file offset.
  bool translate(uint64_t vaddr, uint64_t size, uint64_t &offset) const {
    const Segment *load = loadHolding(vaddr, size, /*fileBacked=*/true);
    if (load)
      offset = load->offset + (vaddr - load->vaddr);
    return load != nullptr;
  }
  /// translate(), or fails naming `what`.
  bool mapped(uint64_t vaddr, uint64_t size, const std::string &what,
              uint64_t &offset) {
    if (!translate(vaddr, size, offset))
      return fail(what + " (" + hex(size) + " bytes at address " + hex(vaddr) +
                  ") is not inside the file-backed part of a PT_LOAD segment");
    return true;
  }
  bool inWritable(uint64_t vaddr, uint64_t size) const {
    const Segment *load = loadHolding(vaddr, size);
    return load && (load->flags & kPfW);
  }
  bool inExecutable(uint64_t vaddr) const {
    const Segment *load = loadHolding(vaddr, 1);
    return load && (load->flags & kPfX);
  }

  /// A NUL-terminated string at `index` of the dynamic string table.
  bool dynamicString(uint64_t index, const std::string &what) {
    if (index >= strSize ||
        !std::memchr(file.data() + strOffset + index, 0, strSize - index))
      return fail(what + " (string table offset " + hex(index) +
                  ") is not a string inside the dynamic string table (" +
                  hex(strSize) + " bytes)");
    return true;
  }

  bool checkHeader();
  bool checkSegments();
  bool checkNotes(size_t index);
  bool checkSections();
  bool checkSectionsInSegments();
  bool checkDynamic();
  bool checkTablesAgainstSections();
  bool checkHashTables();
  bool checkSymbols();
  bool checkVersions();
  bool checkRelocations(int64_t addressTag, int64_t sizeTag, const char *name);
  bool checkRelr();
  bool checkInitArrays();

  std::string_view file;
  ElfKind kind;
  std::string problem;

  uint64_t phoff = 0, phnum = 0;
  std::vector<Segment> segments;
  std::vector<const Segment *> loads;
  const Segment *dynamicSegment = nullptr;
  std::vector<Section> sections;
  const Section *names = nullptr;

  std::map<int64_t, uint64_t> tags;
  std::vector<uint64_t> needed;
  uint64_t strOffset = 0, strSize = 0, symOffset = 0, symbolCount = 0;
  /// Relocated 8-byte slots: address -> (x86-64 type, symbol, addend).
  struct Fixup {
    uint32_t type;
    uint64_t symbol;
    uint64_t addend;
  };
  std::map<uint64_t, Fixup> fixups;
};

} // namespace ce::elf

#endif // CE_RUNTIME_LIB_ELFCHECKER_H
