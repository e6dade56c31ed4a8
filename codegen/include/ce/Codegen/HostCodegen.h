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

namespace mlir::ce {

struct HostTargetOptions {
  /// LLVM CPU name, or "native" for the machine ce-gen runs on.
  std::string cpu = "native";
  unsigned optLevel = 3;
};

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
