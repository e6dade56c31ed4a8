//===- Manifest.h - The parsed manifest.json of a bundle --------*- C++ -*-===//
//
// Internal to the runtime (not installed). Turns manifest.json text into
// checked structures per docs/bundle-format.md, version 3 (the
// names, roles and argument list are those of ce/runtime/BundleAbi.h).
// Everything a launch relies on is validated here, once, when the bundle is
// opened.
//
//===----------------------------------------------------------------------===//

#ifndef CE_RUNTIME_MANIFEST_H
#define CE_RUNTIME_MANIFEST_H

#include "Status.h"
#include "ce/runtime/BundleAbi.h"

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace ce {

/// Whether `target` names an NVIDIA GPU ("sm_90", "sm_90a").
bool isCudaTarget(std::string_view target);
/// Whether `target` names an AMD GPU ("gfx942", "gfx90a").
bool isHipTarget(std::string_view target);

/// One entry of a kernel's `args`.
struct KernelArg {
  ArgRole role = ArgRole::Logits;
  int rank = 0;
  ElemType dtype = ElemType::F32;
};

/// The `launch` object (zeros on the host).
struct LaunchShape {
  int64_t blockSize = 0;
  int64_t rowsPerBlock = 0;
  int64_t ldsBytes = 0;
  /// The kernel serves rows of at least this many elements; a bundle may
  /// hold one kernel per (target, key) and minimum, and a launch takes the
  /// one with the largest minimum at most its vocabulary size.
  int64_t minVocab = 0;
};

/// One entry of `objects`.
struct ObjectInfo {
  std::string file; ///< Relative to the bundle directory.
  std::string target;
  std::string kind;
  /// The SHA-256 of the file, 64 lowercase hex digits (required).
  std::string sha256;
  /// Host objects: the x86-64 features the code needs (kHostCpuFeatures'
  /// names; optional, empty for objects of older writers).
  std::vector<std::string> cpuFeatures;
};

/// One entry of `kernels`.
struct KernelInfo {
  std::string key;
  KernelVariantKey variant; ///< `key`, parsed.
  std::string target;
  std::string object; ///< An ObjectInfo::file of the same target.
  std::string symbol;
  std::string abi;
  std::vector<KernelArg> args; ///< In call order.
  LaunchShape launch;
};

/// A whole manifest.
struct Manifest {
  int64_t version = 0;
  std::string generator; ///< Informational; may be empty.
  std::vector<ObjectInfo> objects;
  std::vector<KernelInfo> kernels;
};

/// Parses and validates manifest text. `path` names the file in messages.
/// Failures are CE_ERROR_BUNDLE with the path and, where it helps, the byte
/// offset of the offending JSON.
Status parseManifest(std::string_view text, const std::string &path,
                     Manifest &manifest);

} // namespace ce

#endif // CE_RUNTIME_MANIFEST_H
