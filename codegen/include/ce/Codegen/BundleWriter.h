//===- BundleWriter.h - Write a bundle manifest -----------------*- C++ -*-===//

#ifndef CE_CODEGEN_BUNDLEWRITER_H
#define CE_CODEGEN_BUNDLEWRITER_H

#include "ce/Codegen/KernelBuilder.h"

#include "llvm/Support/raw_ostream.h"

namespace mlir::ce {

/// A code object file of the bundle and the kernels it holds.
struct BundleObject {
  std::string file;
  std::string target;
  std::string kind;
  std::vector<EmittedKernel> kernels;
  /// The SHA-256 of the file as written, 64 lowercase hex digits
  /// (hashObjectFiles fills it).
  std::string sha256;
  /// Host objects: the x86-64 features the code needs (`cpu_features`).
  std::vector<std::string> cpuFeatures;
};

/// Fills every object's `sha256` from its file in `directory`, as the files
/// were written (lld writes the shared objects itself).
LogicalResult hashObjectFiles(StringRef directory,
                              MutableArrayRef<BundleObject> objects,
                              std::string &error);

/// Writes manifest.json (docs/bundle-format.md, version
/// ::ce::kBundleFormatVersion) for `objects` to `os`: each object with its
/// SHA-256, and the manifest sealed with its own (`manifest_sha256`).
void writeManifest(llvm::raw_ostream &os, ArrayRef<BundleObject> objects);

} // namespace mlir::ce

#endif // CE_CODEGEN_BUNDLEWRITER_H
