//===- MachineCode.h - LLVM modules to assembly, objects, links -*- C++ -*-===//
//
// The last stages every target shares: LLVM's target machine emits assembly
// or an object file from an optimized module, and lld links an object into
// the shared object a bundle holds (host kernels, HSACO).
//
//===----------------------------------------------------------------------===//

#ifndef CE_CODEGEN_MACHINECODE_H
#define CE_CODEGEN_MACHINECODE_H

#include "mlir/Support/LLVM.h"
#include "llvm/IR/Module.h"
#include "llvm/Target/TargetMachine.h"

#include <string>

namespace mlir::ce {

/// Emits assembly (`asObject == false`) or an object file.
LogicalResult emitMachineCode(llvm::Module &module,
                              llvm::TargetMachine &machine, bool asObject,
                              std::string &out, std::string &error);

/// Links an object file into a shared object with lld; `hostLibraries`
/// adds libm for host kernels (not for GPU code objects).
LogicalResult linkSharedObject(StringRef ldLld, StringRef objectPath,
                               StringRef outputPath, std::string &error,
                               bool hostLibraries = true);

/// Writes `bytes` to the file `dir/name`.
LogicalResult writeFileIn(StringRef dir, StringRef name, StringRef bytes,
                          std::string &error);

/// Writes `bytes` to `objectDir/stem.o`, links it into `objectDir/file`
/// with lld and removes the `.o`.
LogicalResult linkObjectBytes(StringRef bytes, StringRef objectDir,
                              StringRef stem, StringRef file,
                              bool hostLibraries, std::string &error);

} // namespace mlir::ce

#endif // CE_CODEGEN_MACHINECODE_H
