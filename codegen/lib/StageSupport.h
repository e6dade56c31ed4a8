//===- StageSupport.h - What the host and GPU stages share ------*- C++ -*-===//
//
// Internal to the codegen library: running a pass pipeline with the
// driver's pass-manager settings, printing a stage, writing dumps.
//
//===----------------------------------------------------------------------===//

#ifndef CE_CODEGEN_STAGESUPPORT_H
#define CE_CODEGEN_STAGESUPPORT_H

#include "ce/Codegen/Stages.h"

#include "mlir/Pass/PassManager.h"
#include "llvm/IR/Module.h"

#include <string>

namespace mlir::ce {

/// The printed form of `op` (the --emit=mlir/loops/gpu stages).
std::string printStage(Operation *op);

/// The text of an LLVM module.
std::string printLLVMModule(const llvm::Module &module);

/// Runs the passes `build` adds on `op`, with the driver's settings.
LogicalResult runPasses(Operation *op, const CodegenOptions &options,
                        function_ref<void(PassManager &)> build);

/// Writes `text` to `options.dumpDir/name`.
LogicalResult writeDump(const CodegenOptions &options, StringRef name,
                        StringRef text, std::string &error);

} // namespace mlir::ce

#endif // CE_CODEGEN_STAGESUPPORT_H
