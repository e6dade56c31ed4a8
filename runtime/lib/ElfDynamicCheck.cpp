//===- ElfDynamicCheck.cpp - An ELF object's dynamic section --------------===//
//
// The checks of ElfCheck.cpp for ET_DYN objects past their headers: what
// dlopen (and AMD's loader) follow from the dynamic section. It must be
// terminated; its string, symbol, hash, version and relocation tables lie in
// the file-backed part of a PT_LOAD and, with section headers, are the
// sections of their types; names end inside the string table; symbol indices
// stay inside the symbol table; defined symbols lie inside the image,
// functions in executable segments; relocations write into writable
// segments; and on x86-64 what glibc assumes without looking holds:
// DT_RELACOUNT, IRELATIVE resolvers, DT_INIT/DT_FINI, the init/fini arrays.
//
//===----------------------------------------------------------------------===//

#include "ElfChecker.h"

#include <algorithm>
#include <tuple>

namespace ce::elf {

bool ElfChecker::checkDynamic() {
  const Segment &dynamic = *dynamicSegment;
  bool terminated = false;
  for (uint64_t at = dynamic.offset;
       at + kDynamicBytes <= dynamic.offset + dynamic.filesz;
       at += kDynamicBytes) {
    int64_t tag = static_cast<int64_t>(u64(at));
    uint64_t value = u64(at + 8);
    if (tag == DtNull) {
      terminated = true;
      break;
    }
    if (tag == DtNeeded) {
      needed.push_back(value);
      continue;
    }
    if (std::find(std::begin(kSingleTags), std::end(kSingleTags), tag) ==
        std::end(kSingleTags))
      continue;
    if (!tags.emplace(tag, value).second)
      return fail("dynamic tag " + hex(uint64_t(tag)) + " appears twice");
  }
  if (!terminated)
    return fail("the dynamic section has no DT_NULL terminator");
  auto has = [&](int64_t tag) { return tags.count(tag) != 0; };
  if (has(DtTextRel) || (tags.count(DtFlags) && (tags[DtFlags] & kDfTextRel)))
    return fail("text relocations are not supported");
  if (has(DtRel))
    return fail("DT_REL relocations are not supported (ELF64 uses DT_RELA)");
  for (int64_t tag : {DtStrTab, DtStrSz, DtSymTab})
    if (!has(tag))
      return fail("the dynamic section has no " +
                  std::string(tag == DtStrTab  ? "DT_STRTAB"
                              : tag == DtStrSz ? "DT_STRSZ"
                                               : "DT_SYMTAB"));
  if (!has(DtHash) && !has(DtGnuHash))
    return fail("the dynamic section has no symbol hash table");
  if ((has(DtSymEnt) && tags[DtSymEnt] != kSymbolBytes) ||
      (has(DtRelaEnt) && tags[DtRelaEnt] != kRelaBytes) ||
      (has(DtRelrEnt) && tags[DtRelrEnt] != 8) ||
      (has(DtJmpRel) && (!has(DtPltRel) || tags[DtPltRel] != DtRela)))
    return fail("unexpected symbol or relocation entry size or type");

  // glibc reads the size (and entry size) of every table it is given
  // without looking, and applies DT_JMPREL when it sees DT_PLTREL.
  struct Needs {
    int64_t tag, needed;
    const char *names;
  };
  for (Needs needs :
       {Needs{DtRela, DtRelaSz, "DT_RELA needs DT_RELASZ"},
        Needs{DtRela, DtRelaEnt, "DT_RELA needs DT_RELAENT"},
        Needs{DtRelr, DtRelrSz, "DT_RELR needs DT_RELRSZ"},
        Needs{DtRelr, DtRelrEnt, "DT_RELR needs DT_RELRENT"},
        Needs{DtJmpRel, DtPltRelSz, "DT_JMPREL needs DT_PLTRELSZ"},
        Needs{DtPltRel, DtJmpRel, "DT_PLTREL needs DT_JMPREL"},
        Needs{DtInitArray, DtInitArraySz,
              "DT_INIT_ARRAY needs DT_INIT_ARRAYSZ"},
        Needs{DtFiniArray, DtFiniArraySz,
              "DT_FINI_ARRAY needs DT_FINI_ARRAYSZ"},
        Needs{DtPreinitArray, DtPreinitArraySz,
              "DT_PREINIT_ARRAY needs DT_PREINIT_ARRAYSZ"}})
    if (has(needs.tag) && !has(needs.needed))
      return fail(needs.names);
  if (!checkTablesAgainstSections())
    return false;

  strSize = tags[DtStrSz];
  if (strSize == 0 ||
      !mapped(tags[DtStrTab], strSize, "the dynamic string table", strOffset))
    return fail(problem.empty() ? "empty dynamic string table" : problem);
  for (uint64_t name : needed)
    if (!dynamicString(name, "a DT_NEEDED name"))
      return false;
  for (int64_t tag : {DtSoName, DtRPath, DtRunPath})
    if (has(tag) && !dynamicString(tags[tag], "DT_SONAME, DT_RPATH or "
                                              "DT_RUNPATH"))
      return false;
  // glibc writes the first three words of the PLT GOT for lazy binding.
  if (has(DtPltGot) && !inWritable(tags[DtPltGot], 24))
    return fail("DT_PLTGOT " + hex(tags[DtPltGot]) +
                " is not inside a writable segment");
  for (int64_t tag : {DtInit, DtFini})
    if (has(tag) && !inExecutable(tags[tag]))
      return fail(std::string(tag == DtInit ? "DT_INIT" : "DT_FINI") + " " +
                  hex(tags[tag]) + " is not inside an executable segment");
  return checkHashTables() && checkSymbols() && checkVersions() &&
         checkRelocations(DtRela, DtRelaSz, "DT_RELA") &&
         checkRelocations(DtJmpRel, DtPltRelSz, "DT_JMPREL") && checkRelr() &&
         checkInitArrays();
}

bool ElfChecker::checkTablesAgainstSections() {
  // With section headers, every table the dynamic section points to must
  // be the section of its type there, its size that section's: a changed
  // pointer or size does not pass for a plausible one.
  if (sections.empty())
    return true;
  auto startsSection = [&](uint64_t address, uint32_t type) {
    return std::any_of(sections.begin(), sections.end(), [&](auto &section) {
      return section.type == type && section.addr == address;
    });
  };
  auto endsSection = [&](uint64_t end, uint32_t type) {
    return std::any_of(sections.begin(), sections.end(), [&](auto &section) {
      return section.type == type && section.addr + section.size == end;
    });
  };
  struct Table {
    int64_t tag, sizeTag;
    uint32_t type;
    const char *name;
  };
  for (Table table :
       {Table{DtHash, -1, kShtHash, "DT_HASH"},
        Table{DtGnuHash, -1, kShtGnuHash, "DT_GNU_HASH"},
        Table{DtRela, DtRelaSz, kShtRela, "DT_RELA"},
        Table{DtJmpRel, DtPltRelSz, kShtRela, "DT_JMPREL"},
        Table{DtInitArray, DtInitArraySz, kShtInitArray, "DT_INIT_ARRAY"},
        Table{DtFiniArray, DtFiniArraySz, kShtFiniArray, "DT_FINI_ARRAY"},
        Table{DtPreinitArray, DtPreinitArraySz, kShtPreinitArray,
              "DT_PREINIT_ARRAY"},
        Table{DtVerSym, -1, kShtGnuVerSym, "DT_VERSYM"},
        Table{DtVerNeed, -1, kShtGnuVerNeed, "DT_VERNEED"},
        Table{DtVerDef, -1, kShtGnuVerDef, "DT_VERDEF"}}) {
    if (!tags.count(table.tag))
      continue;
    uint64_t address = tags[table.tag];
    // A table may span consecutive sections of its type (.rela.dyn and
    // .rela.plt under one DT_RELASZ).
    if (!startsSection(address, table.type) ||
        (table.sizeTag >= 0 &&
         !endsSection(address + tags[table.sizeTag], table.type)))
      return fail(std::string(table.name) + " " + hex(address) +
                  (table.sizeTag >= 0
                       ? " (" + hex(tags[table.sizeTag]) + " bytes)"
                       : std::string()) +
                  " is not a section of its type");
  }
  // dlopen calls DT_INIT (and dlclose DT_FINI): the gABI's .init and .fini,
  // or, where a tool moved them (BOLT), the functions _init and _fini.
  for (auto [tag, name, function] :
       {std::tuple{DtInit, ".init", "_init"}, {DtFini, ".fini", "_fini"}}) {
    if (!tags.count(tag))
      continue;
    uint64_t address = tags[tag];
    bool known = false;
    for (size_t i = 1; i < sections.size() && !known; ++i) {
      const Section &section = sections[i];
      if (names && section.addr == address &&
          std::strcmp(file.data() + names->offset + section.name, name) == 0)
        known = true;
      if (section.type != kShtSymtab && section.type != kShtDynsym)
        continue;
      const Section &strings = sections[section.link];
      for (uint64_t at = section.offset;
           !known && at + kSymbolBytes <= section.offset + section.size;
           at += kSymbolBytes) {
        uint64_t nameAt = u32(at);
        known = (uint8_t(file[at + 4]) & 15) == kSttFunc &&
                u64(at + 8) == address && strings.type == kShtStrtab &&
                nameAt + std::strlen(function) < strings.size &&
                std::memcmp(file.data() + strings.offset + nameAt, function,
                            std::strlen(function) + 1) == 0;
      }
    }
    if (!known && !sections.empty())
      return fail(std::string(tag == DtInit ? "DT_INIT " : "DT_FINI ") +
                  hex(address) + " is neither " + name + " nor " + function);
  }
  return true;
}

bool ElfChecker::checkHashTables() {
  uint64_t hashCount = 0, gnuCount = 0, offset;
  if (tags.count(DtHash)) {
    // nbucket, nchain, buckets, chains: every index below nchain, the
    // number of symbols.
    if (!mapped(tags[DtHash], 8, "the DT_HASH table", offset))
      return false;
    uint64_t buckets = u32(offset), chains = u32(offset + 4);
    if (!mapped(tags[DtHash], 8 + 4 * (buckets + chains), "the DT_HASH table",
                offset))
      return false;
    for (uint64_t i = 0; i < buckets + chains; ++i)
      if (u32(offset + 8 + 4 * i) >= chains)
        return fail("the DT_HASH table has an entry past its " +
                    std::to_string(chains) + " symbols");
    hashCount = chains;
  }
  if (tags.count(DtGnuHash)) {
    // nbuckets, symoffset, bloom words, shift; bloom; buckets; chains, each
    // ending at an odd hash value.
    if (!mapped(tags[DtGnuHash], 16, "the DT_GNU_HASH table", offset))
      return false;
    uint64_t buckets = u32(offset), first = u32(offset + 4),
             bloom = u32(offset + 8);
    if (buckets == 0 || bloom == 0 || !isPowerOfTwoOrZero(bloom))
      return fail("the DT_GNU_HASH table has " + std::to_string(buckets) +
                  " buckets and " + std::to_string(bloom) + " bloom words");
    uint64_t headerBytes = 16 + 8 * bloom + 4 * buckets;
    if (!mapped(tags[DtGnuHash], headerBytes, "the DT_GNU_HASH table", offset))
      return false;
    uint64_t chainsAt = tags[DtGnuHash] + headerBytes;
    std::vector<uint64_t> starts;
    for (uint64_t b = 0; b < buckets; ++b)
      if (uint64_t symbol = u32(offset + 16 + 8 * bloom + 4 * b)) {
        if (symbol < first)
          return fail("a DT_GNU_HASH bucket starts below its first symbol");
        starts.push_back(symbol);
      }
    // A chain that starts inside one already walked ends where it does, so
    // every chain word is read once.
    std::sort(starts.begin(), starts.end());
    gnuCount = first;
    for (uint64_t symbol : starts) {
      if (symbol < gnuCount)
        continue;
      for (;; ++symbol) {
        uint64_t chainOffset;
        if (!mapped(chainsAt + 4 * (symbol - first), 4, "a DT_GNU_HASH chain",
                    chainOffset))
          return false;
        if (u32(chainOffset) & 1)
          break;
      }
      gnuCount = symbol + 1;
    }
  }

  // The number of symbols: the .dynsym section's where there is one (and it
  // must be the table DT_SYMTAB names), else the hash tables'.
  const Section *dynsym = nullptr;
  for (const Section &section : sections)
    if (section.type == kShtDynsym) {
      dynsym = &section;
      break;
    }
  if (dynsym) {
    const Section &strings = sections[dynsym->link];
    if (dynsym->addr != tags[DtSymTab] || dynsym->size % kSymbolBytes ||
        strings.addr != tags[DtStrTab] || strings.size != strSize)
      return fail("DT_SYMTAB and DT_STRTAB disagree with the .dynsym and "
                  ".dynstr sections");
    symbolCount = dynsym->size / kSymbolBytes;
  } else {
    symbolCount = tags.count(DtHash) ? hashCount : gnuCount;
  }
  if ((tags.count(DtHash) && hashCount != symbolCount) ||
      gnuCount > symbolCount)
    return fail("the symbol hash tables index " +
                std::to_string(std::max(hashCount, gnuCount)) +
                " symbols, the symbol table has " +
                std::to_string(symbolCount));
  return true;
}

bool ElfChecker::checkSymbols() {
  if (!mapped(tags[DtSymTab], symbolCount * kSymbolBytes,
              "the dynamic symbol table", symOffset))
    return false;
  for (uint64_t i = 1; i < symbolCount; ++i) {
    uint64_t at = symOffset + i * kSymbolBytes;
    uint32_t name = u32(at);
    uint8_t type = uint8_t(file[at + 4]) & 15;
    uint16_t index = u16(at + 6);
    uint64_t value = u64(at + 8), size = u64(at + 16);
    std::string label = "dynamic symbol " + std::to_string(i);
    if (!dynamicString(name, "the name of " + label))
      return false;
    // The loader looks at no other section index (BOLT leaves stale ones).
    if (index == kShnUndef)
      continue;
    if (index == kShnAbs || type == kSttTls)
      continue;
    label += " (" + std::string(file.data() + strOffset + name) + ")";
    if (!loadHolding(value, size))
      return fail(label + " at address " + hex(value) +
                  " is not inside a PT_LOAD segment");
    if ((type == kSttFunc || type == kSttGnuIfunc) && !inExecutable(value))
      return fail(label + " is a function outside every executable segment");
  }
  return true;
}

bool ElfChecker::checkVersions() {
  // glibc walks both chains until a zero `next` and indexes its version
  // array with the symbols' DT_VERSYM entries.
  uint64_t highest = 0, offset;
  size_t budget = file.size() / 8 + 1;
  if (tags.count(DtVerNeed)) {
    uint64_t entry = tags[DtVerNeed];
    for (;;) {
      if (!--budget || !mapped(entry, 16, "a DT_VERNEED entry", offset))
        return fail(problem.empty() ? "DT_VERNEED entries loop" : problem);
      if (u16(offset) != 1 ||
          !dynamicString(u32(offset + 4), "a DT_VERNEED file name"))
        return fail(problem.empty() ? "unknown DT_VERNEED version" : problem);
      uint64_t aux = entry + u32(offset + 8), next = u32(offset + 12);
      for (uint64_t count = u16(offset + 2); count; --count) {
        uint64_t auxOffset;
        if (!--budget ||
            !mapped(aux, 16, "a DT_VERNEED auxiliary entry", auxOffset) ||
            !dynamicString(u32(auxOffset + 8), "a DT_VERNEED version name"))
          return fail(problem.empty() ? "DT_VERNEED entries loop" : problem);
        highest = std::max<uint64_t>(highest, u16(auxOffset + 6) & 0x7fff);
        if (u32(auxOffset + 12) == 0)
          break;
        aux += u32(auxOffset + 12);
      }
      if (next == 0)
        break;
      entry += next;
    }
  }
  if (tags.count(DtVerDef)) {
    uint64_t entry = tags[DtVerDef];
    for (;;) {
      uint64_t auxOffset;
      if (!--budget || !mapped(entry, 20, "a DT_VERDEF entry", offset))
        return fail(problem.empty() ? "DT_VERDEF entries loop" : problem);
      if (u16(offset) != 1 ||
          !mapped(entry + u32(offset + 12), 8, "a DT_VERDEF auxiliary entry",
                  auxOffset) ||
          !dynamicString(u32(auxOffset), "a DT_VERDEF version name"))
        return fail(problem.empty() ? "unknown DT_VERDEF version" : problem);
      highest = std::max<uint64_t>(highest, u16(offset + 4));
      if (u32(offset + 16) == 0)
        break;
      entry += u32(offset + 16);
    }
  }
  if (tags.count(DtVerSym)) {
    if (!mapped(tags[DtVerSym], 2 * symbolCount, "the DT_VERSYM table", offset))
      return false;
    if (tags.count(DtVerNeed) || tags.count(DtVerDef))
      for (uint64_t i = 0; i < symbolCount; ++i)
        if ((u16(offset + 2 * i) & 0x7fff) > std::max<uint64_t>(highest, 1))
          return fail("DT_VERSYM entry " + std::to_string(i) +
                      " names a version that is not defined or needed");
  }
  return true;
}

bool ElfChecker::checkRelocations(int64_t addressTag, int64_t sizeTag,
                                  const char *name) {
  if (!tags.count(addressTag))
    return true;
  uint64_t size = tags.count(sizeTag) ? tags[sizeTag] : 0, offset;
  if (size % kRelaBytes)
    return fail(std::string(name) + " size " + hex(size) +
                " is not a whole number of entries");
  if (!mapped(tags[addressTag], size, name, offset))
    return false;
  uint64_t count = size / kRelaBytes;
  uint64_t relative =
      addressTag == DtRela && tags.count(DtRelaCount) ? tags[DtRelaCount] : 0;
  if (x86() && relative > count)
    return fail("DT_RELACOUNT " + std::to_string(relative) + " exceeds the " +
                std::to_string(count) + " DT_RELA entries");
  for (uint64_t i = 0; i < count; ++i) {
    uint64_t at = offset + i * kRelaBytes;
    uint64_t target = u64(at), info = u64(at + 8), addend = u64(at + 16);
    uint32_t type = uint32_t(info);
    uint64_t symbol = info >> 32;
    std::string label = std::string(name) + " relocation " + std::to_string(i);
    if (symbol >= symbolCount)
      return fail(label + " names symbol " + std::to_string(symbol) + " of " +
                  std::to_string(symbolCount));
    if (!inWritable(target, 8))
      return fail(label + " writes address " + hex(target) +
                  ", outside every writable segment");
    if (!x86())
      continue;
    // glibc applies the first DT_RELACOUNT entries as relative ones
    // without looking at their type, and calls IRELATIVE resolvers.
    if (i < relative && type != kRX86_64Relative)
      return fail(label + " is counted by DT_RELACOUNT but is not "
                          "R_X86_64_RELATIVE");
    if (type == kRX86_64IRelative && !inExecutable(addend))
      return fail(label + ": IRELATIVE resolver " + hex(addend) +
                  " is not inside an executable segment");
    fixups[target] = {type, symbol, addend};
  }
  return true;
}

bool ElfChecker::checkRelr() {
  if (!tags.count(DtRelr))
    return true;
  uint64_t size = tags.count(DtRelrSz) ? tags[DtRelrSz] : 0, offset;
  if (size % 8 || !mapped(tags[DtRelr], size, "the DT_RELR table", offset))
    return fail(problem.empty() ? "DT_RELRSZ is not a multiple of 8" : problem);
  // An even entry is an address; an odd one a bitmap of the 63 words after
  // the last address.
  bool haveBase = false;
  uint64_t base = 0;
  auto relocate = [&](uint64_t target) {
    if (!inWritable(target, 8))
      return fail("a DT_RELR relocation writes address " + hex(target) +
                  ", outside every writable segment");
    // The addend is the word in place (zero in a segment's zero-filled
    // tail).
    uint64_t slot;
    fixups[target] = {kRX86_64Relative, 0,
                      translate(target, 8, slot) ? u64(slot) : 0};
    return true;
  };
  for (uint64_t i = 0; i < size / 8; ++i) {
    uint64_t entry = u64(offset + 8 * i);
    if (!(entry & 1)) {
      if (!relocate(entry))
        return false;
      base = entry + 8;
      haveBase = true;
      continue;
    }
    if (!haveBase)
      return fail("the DT_RELR table starts with a bitmap");
    for (int bit = 1; bit < 64; ++bit)
      if ((entry >> bit) & 1)
        if (!relocate(base + 8 * (bit - 1)))
          return false;
    base += 63 * 8;
  }
  return true;
}

bool ElfChecker::checkInitArrays() {
  struct Array {
    int64_t address, size;
    const char *name;
  };
  for (Array array :
       {Array{DtInitArray, DtInitArraySz, "DT_INIT_ARRAY"},
        Array{DtFiniArray, DtFiniArraySz, "DT_FINI_ARRAY"},
        Array{DtPreinitArray, DtPreinitArraySz, "DT_PREINIT_ARRAY"}}) {
    if (!tags.count(array.address))
      continue;
    uint64_t start = tags[array.address], offset;
    uint64_t size = tags.count(array.size) ? tags[array.size] : 0;
    if (size % 8 || !mapped(start, size, array.name, offset))
      return fail(problem.empty()
                      ? std::string(array.name) + " size is not a multiple of 8"
                      : problem);
    if (!x86())
      continue;
    // dlopen calls every slot: each must be relocated to code.
    for (uint64_t slot = start; slot < start + size; slot += 8) {
      auto fixup = fixups.find(slot);
      bool toCode = false;
      if (fixup != fixups.end()) {
        const Fixup &f = fixup->second;
        if (f.type == kRX86_64Relative)
          toCode = inExecutable(f.addend);
        else if (f.type == kRX86_64_64 || f.type == kRX86_64GlobDat ||
                 f.type == kRX86_64JumpSlot)
          toCode = f.addend == 0 &&
                   (uint8_t(file[symOffset + f.symbol * kSymbolBytes + 4]) &
                    15) == kSttFunc;
      }
      if (!toCode)
        return fail(std::string(array.name) + " entry at " + hex(slot) +
                    " is not relocated to a function");
    }
  }
  return true;
}

} // namespace ce::elf
