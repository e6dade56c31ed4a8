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
  std::vector<KernelInfo> kernels;
};

/// Writes manifest.json (version 1) for `objects` to `os`.
void writeManifest(llvm::raw_ostream &os, ArrayRef<BundleObject> objects);

} // namespace mlir::ce

#endif // CE_CODEGEN_BUNDLEWRITER_H
