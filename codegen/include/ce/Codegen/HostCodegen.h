//===- HostCodegen.h - The host target machine and LLVM IR ------*- C++ -*-===//
//
// The x86-64 target machine for host kernels and the translation of the
// LLVM dialect to an optimized LLVM module.
//
//===----------------------------------------------------------------------===//

#ifndef CE_CODEGEN_HOSTCODEGEN_H
#define CE_CODEGEN_HOSTCODEGEN_H

#include "mlir/IR/BuiltinOps.h"
#include "llvm/IR/Module.h"
#include "llvm/Target/TargetMachine.h"

#include <memory>
#include <string>
#include <vector>

namespace mlir::ce {

/// The host CPU ce-gen builds for unless told otherwise.
inline constexpr const char *kDefaultHostCpu = "x86-64-v3";

struct HostTargetOptions {
  /// LLVM CPU name, or "native" for the machine ce-gen runs on. The
  /// default is a baseline every x86-64 training node of the last decade
  /// has (AVX2, FMA, F16C), so a bundle or cache on shared storage runs on
  /// all of them; "native" is an opt-in.
  std::string cpu = kDefaultHostCpu;
  unsigned optLevel = 3;
};

/// The features of ce/runtime/BundleAbi.h's kHostCpuFeatures that code of
/// `machine` may use (the manifest's `cpu_features` of a host object).
std::vector<std::string> requiredCpuFeatures(const llvm::TargetMachine &machine);

/// Creates the x86-64 target machine for `options`; fails with a message.
FailureOr<std::unique_ptr<llvm::TargetMachine>>
createHostTargetMachine(const HostTargetOptions &options, std::string &error);

/// Translates an LLVM-dialect module to LLVM IR for `machine` and optimizes
/// it at the machine's level.
std::unique_ptr<llvm::Module> translateAndOptimize(ModuleOp module,
                                                   llvm::LLVMContext &context,
                                                   llvm::TargetMachine &machine,
                                                   unsigned optLevel,
                                                   std::string &error);

} // namespace mlir::ce

#endif // CE_CODEGEN_HOSTCODEGEN_H
