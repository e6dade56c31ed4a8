//===- GpuCodegen.h - GPU kernels to PTX and HSACO --------------*- C++ -*-===//
//
// LLVM's AMDGPU and NVPTX target machines for a chip, and the translation
// of a lowered gpu.module to an optimized LLVM module for one of them.
//
//===----------------------------------------------------------------------===//

#ifndef CE_CODEGEN_GPUCODEGEN_H
#define CE_CODEGEN_GPUCODEGEN_H

#include "ce/Codegen/GpuTarget.h"

#include "mlir/Dialect/GPU/IR/GPUDialect.h"
#include "llvm/IR/Module.h"
#include "llvm/Target/TargetMachine.h"

#include <memory>
#include <string>

namespace mlir::ce {

FailureOr<std::unique_ptr<llvm::TargetMachine>>
createGpuTargetMachine(const GpuChip &chip, std::string &error);

/// Translates the LLVM-dialect contents of `module` to an optimized LLVM
/// module for `machine`.
std::unique_ptr<llvm::Module>
translateGpuModule(gpu::GPUModuleOp module, llvm::LLVMContext &context,
                   llvm::TargetMachine &machine, std::string &error);

} // namespace mlir::ce

#endif // CE_CODEGEN_GPUCODEGEN_H
