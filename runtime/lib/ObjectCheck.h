//===- ObjectCheck.h - Code objects are untrusted input ---------*- C++ -*-===//
//
// Internal to the runtime (not installed). A bundle on disk may be truncated
// (a half-finished copy), corrupt, or paired with another ce-gen run's
// manifest. The loaders (dlopen, cuModuleLoadData, hipModuleLoadData) trust
// their input: a truncated shared object makes dlopen fault on pages past
// the end of the file, and the GPU loaders take no size at all. So every code
// object is read whole and checked here, with the bytes in hand, before a
// loader sees it: its structure (ElfCheck.cpp for ELF objects, a text check
// for PTX) and the SHA-256 its manifest records.
//
//===----------------------------------------------------------------------===//

#ifndef CE_RUNTIME_OBJECTCHECK_H
#define CE_RUNTIME_OBJECTCHECK_H

#include "Manifest.h"
#include "Status.h"

#include <string>
#include <string_view>

namespace ce {

/// The ELF objects a bundle holds.
enum class ElfKind {
  HostSharedObject, ///< x86-64 ET_DYN, for dlopen
  Hsaco,            ///< AMDGPU ET_DYN, for hipModuleLoadData
  Cubin,            ///< CUDA ET_EXEC, for cuModuleLoadData
};

/// Checks that `file`, the whole contents of an object, is an ELF object of
/// `kind` whose headers, segments, sections and (for ET_DYN objects) dynamic
/// section, symbol, hash, version and relocation tables lie inside the file
/// and agree with each other, so that a loader never reads past the end of
/// the file or through a pointer the file does not back. Returns what is
/// wrong, or an empty string. (ElfCheck.cpp)
std::string checkElf(std::string_view file, ElfKind kind);

/// Checks that `text` is whole PTX: no NUL or other control bytes, a
/// `.version` directive first and a `.target` after it, at least one
/// `.entry`, braces balanced outside comments and strings, and nothing but
/// comments after the last closing brace. Returns what is wrong, or an empty
/// string.
std::string checkPtx(std::string_view text);

/// Checks `bytes`, the contents of the file at `path` that the manifest
/// lists as `objects[index]`: its structure by the object's kind (a host
/// object is always checked as a shared object, since it is dlopened), then
/// its SHA-256 against `object.sha256` when the manifest has one. Failures
/// are CE_ERROR_BUNDLE naming the file, the object and what is wrong.
Status checkCodeObject(std::string_view bytes, const ObjectInfo &object,
                       size_t index, const std::string &path);

/// Reads the object file at `path` whole (at most 1 GiB) and runs
/// checkCodeObject on it.
Status readCodeObject(const std::string &path, const ObjectInfo &object,
                      size_t index, std::string &bytes);

} // namespace ce

#endif // CE_RUNTIME_OBJECTCHECK_H
