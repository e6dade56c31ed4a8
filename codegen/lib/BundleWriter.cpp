//===- BundleWriter.cpp - Write a bundle manifest -------------------------===//
//
// The manifest ties itself to its code objects: every object carries the
// SHA-256 of its file, and the manifest the SHA-256 of its own text (with
// that hash's digits as zeros), which the runtime checks before it trusts
// either (docs/bundle-format.md, "Integrity").
//
//===----------------------------------------------------------------------===//

#include "ce/Codegen/BundleWriter.h"
#include "ce/runtime/BundleAbi.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/JSON.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/SHA256.h"

using namespace mlir;
using namespace mlir::ce;

/// The manifest's `launch` object of `kernel` (zeros on the host).
static llvm::json::Object launchOf(const EmittedKernel &kernel) {
  llvm::json::Object launch{{"block_size", kernel.blockSize},
                            {"rows_per_block", kernel.blockSize ? 1 : 0},
                            {"lds_bytes", kernel.ldsBytes}};
  if (kernel.minVocab)
    launch["min_vocab"] = kernel.minVocab;
  return launch;
}

static std::string sha256Hex(StringRef bytes) {
  return llvm::toHex(llvm::SHA256::hash(llvm::arrayRefFromStringRef(bytes)),
                     /*LowerCase=*/true);
}

LogicalResult mlir::ce::hashObjectFiles(StringRef directory,
                                        MutableArrayRef<BundleObject> objects,
                                        std::string &error) {
  for (BundleObject &object : objects) {
    std::string path = (directory + "/" + object.file).str();
    auto buffer = llvm::MemoryBuffer::getFile(path, /*IsText=*/false,
                                              /*RequiresNullTerminator=*/false);
    if (!buffer) {
      error = "cannot read '" + path + "': " + buffer.getError().message();
      return failure();
    }
    object.sha256 = sha256Hex((*buffer)->getBuffer());
  }
  return success();
}

void mlir::ce::writeManifest(llvm::raw_ostream &os,
                             ArrayRef<BundleObject> objects) {
  llvm::json::Array objectList;
  llvm::json::Array kernelList;
  for (const BundleObject &object : objects) {
    assert(object.sha256.size() == 64 && "hashObjectFiles fills sha256");
    llvm::json::Object entry{{"file", object.file},
                             {"target", object.target},
                             {"kind", object.kind},
                             {"sha256", object.sha256}};
    if (object.target == "host") {
      llvm::json::Array features;
      for (const std::string &feature : object.cpuFeatures)
        features.push_back(feature);
      entry["cpu_features"] = std::move(features);
    }
    objectList.push_back(std::move(entry));
    for (const EmittedKernel &kernel : object.kernels) {
      llvm::json::Array args;
      for (const EmittedArg &arg : kernel.args)
        args.push_back(llvm::json::Object{{"role", ::ce::stringify(arg.role)},
                                          {"rank", arg.rank},
                                          {"dtype", ::ce::stringify(arg.dtype)}});
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
  // The seal is written as zeros, the text hashed, and the zeros replaced
  // by the hash: the runtime hashes the text with them zeroed again.
  std::string zeros(64, '0');
  llvm::StringRef sealKey = ::ce::kManifestSealKey;
  llvm::json::Object manifest{{"format", ::ce::kBundleFormatName},
                              {"version", ::ce::kBundleFormatVersion},
                              {"generator", "ce-gen 0.1.0"},
                              {"objects", std::move(objectList)},
                              {"kernels", std::move(kernelList)},
                              {sealKey, zeros}};
  std::string text =
      llvm::formatv("{0:2}", llvm::json::Value(std::move(manifest))).str() +
      "\n";
  std::string placeholder = ("\"" + sealKey + "\": \"" + zeros + "\"").str();
  size_t at = text.find(placeholder);
  assert(at != std::string::npos && "the seal is written as a plain string");
  text.replace(at + placeholder.size() - 65, 64, sha256Hex(text));
  os << text;
}
