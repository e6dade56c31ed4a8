//===- HostCodegen.h - LLVM IR to a host shared object ----------*- C++ -*-===//

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

/// Emits assembly (`asObject == false`) or an object file.
LogicalResult emitMachineCode(llvm::Module &module,
                              llvm::TargetMachine &machine, bool asObject,
                              std::string &out, std::string &error);

/// Links an object file into a shared object with lld; `hostLibraries`
/// adds libm for host kernels (not for GPU code objects).
LogicalResult linkSharedObject(StringRef ldLld, StringRef objectPath,
                               StringRef outputPath, std::string &error,
                               bool hostLibraries = true);

} // namespace mlir::ce

#endif // CE_CODEGEN_HOSTCODEGEN_H
