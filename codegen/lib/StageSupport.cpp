//===- StageSupport.cpp - What the host and GPU stages share --------------===//

#include "StageSupport.h"
#include "ce/Codegen/MachineCode.h"

#include "ce/runtime/BundleAbi.h"

#include "llvm/ADT/StringSwitch.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/raw_ostream.h"

#include <set>

using namespace mlir;
using namespace mlir::ce;

std::string mlir::ce::printStage(Operation *op) {
  std::string text;
  llvm::raw_string_ostream os(text);
  op->print(os);
  return text;
}

std::string mlir::ce::printLLVMModule(const llvm::Module &module) {
  std::string ir;
  llvm::raw_string_ostream os(ir);
  module.print(os, nullptr);
  return ir;
}

LogicalResult mlir::ce::runPasses(Operation *op, const CodegenOptions &options,
                                  function_ref<void(PassManager &)> build) {
  PassManager pm(op->getContext());
  if (options.configurePassManager &&
      failed(options.configurePassManager(pm)))
    return failure();
  build(pm);
  return pm.run(op);
}

LogicalResult mlir::ce::writeDump(const CodegenOptions &options,
                                  StringRef name, StringRef text,
                                  std::string &error) {
  return writeFileIn(options.dumpDir, name, text, error);
}

LogicalResult mlir::ce::writeBundleManifest(StringRef bundleDir,
                                            MutableArrayRef<BundleObject> objects,
                                            std::string &error) {
  // The manifest records each object's SHA-256, so the objects are hashed
  // as they lie on disk, after lld has written them.
  if (failed(hashObjectFiles(bundleDir, objects, error)))
    return failure();
  std::string manifest;
  llvm::raw_string_ostream os(manifest);
  writeManifest(os, objects);
  return writeFileIn(bundleDir, ::ce::kManifestFile, manifest, error);
}

LogicalResult mlir::ce::verifyCodegenOptions(const CodegenOptions &options,
                                             ArrayRef<std::string> targets,
                                             std::string &error) {
  std::set<std::string> seen;
  for (const std::string &target : targets) {
    if (target != "host" && !GpuChip::lookup(target)) {
      error = "unknown target '" + target +
              "'; expected one of: host, sm_90, gfx942, gfx950, gfx90a";
      return failure();
    }
    if (!seen.insert(target).second) {
      error = "target '" + target + "' is given twice";
      return failure();
    }
  }
  unsigned width = options.vectorWidth;
  if (width == 0 || (width & (width - 1)) != 0 || width > 64) {
    error = "--vector-width=" + std::to_string(width) +
            ": expected a power of two in [1, 64]";
    return failure();
  }
  if (options.hostUnroll < 1 || options.hostUnroll > 16) {
    error = "--unroll=" + std::to_string(options.hostUnroll) +
            ": expected vectors per step in [1, 16]";
    return failure();
  }
  // The GPU tuning overrides are checked per chip, by resolveTuning.
  return success();
}

std::optional<Stage> mlir::ce::parseStage(StringRef name) {
  return llvm::StringSwitch<std::optional<Stage>>(name)
      .Case("mlir", Stage::Mlir)
      .Case("loops", Stage::Loops)
      .Case("gpu", Stage::Gpu)
      .Case("llvm", Stage::Llvm)
      .Case("isa", Stage::Isa)
      .Case("obj", Stage::Obj)
      .Case("bundle", Stage::Bundle)
      .Default(std::nullopt);
}
