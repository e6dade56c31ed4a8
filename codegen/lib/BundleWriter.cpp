//===- BundleWriter.cpp - Write a bundle manifest -------------------------===//

#include "ce/Codegen/BundleWriter.h"

#include "llvm/Support/JSON.h"

using namespace mlir;
using namespace mlir::ce;

/// The manifest's `launch` object of `kernel` (zeros on the host).
static llvm::json::Object launchOf(const KernelInfo &kernel) {
  llvm::json::Object launch{{"block_size", kernel.blockSize},
                            {"rows_per_block", kernel.blockSize ? 1 : 0},
                            {"lds_bytes", kernel.ldsBytes}};
  if (kernel.minVocab)
    launch["min_vocab"] = kernel.minVocab;
  return launch;
}

void mlir::ce::writeManifest(llvm::raw_ostream &os,
                             ArrayRef<BundleObject> objects) {
  llvm::json::Array objectList;
  llvm::json::Array kernelList;
  for (const BundleObject &object : objects) {
    objectList.push_back(llvm::json::Object{{"file", object.file},
                                            {"target", object.target},
                                            {"kind", object.kind}});
    for (const KernelInfo &kernel : object.kernels) {
      llvm::json::Array args;
      for (const KernelArg &arg : kernel.args)
        args.push_back(llvm::json::Object{
            {"role", arg.role}, {"rank", arg.rank}, {"dtype", arg.dtype}});
      kernelList.push_back(llvm::json::Object{
          {"key", kernel.key.str()},
          {"target", object.target},
          {"object", object.file},
          {"symbol", kernel.symbol},
          {"abi", kernel.abi},
          {"args", std::move(args)},
          {"launch", launchOf(kernel)}});
    }
  }
  llvm::json::Object manifest{{"format", "cegen-bundle"},
                              {"version", 2},
                              {"generator", "ce-gen 0.1.0"},
                              {"objects", std::move(objectList)},
                              {"kernels", std::move(kernelList)}};
  os << llvm::formatv("{0:2}", llvm::json::Value(std::move(manifest))) << "\n";
}
