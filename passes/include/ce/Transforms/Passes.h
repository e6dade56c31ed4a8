//===- Passes.h - Cross-entropy transformation passes -----------*- C++ -*-===//

#ifndef CE_TRANSFORMS_PASSES_H
#define CE_TRANSFORMS_PASSES_H

#include "ce/Dialect/CE/IR/CEDialect.h"
#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/Dialect/GPU/IR/GPUDialect.h"
#include "mlir/Dialect/LLVMIR/LLVMDialect.h"
#include "mlir/Dialect/LLVMIR/NVVMDialect.h"
#include "mlir/Dialect/LLVMIR/ROCDLDialect.h"
#include "mlir/Dialect/Math/IR/Math.h"
#include "mlir/Dialect/NVGPU/IR/NVGPUDialect.h"
#include "mlir/Dialect/MemRef/IR/MemRef.h"
#include "mlir/Dialect/SCF/IR/SCF.h"
#include "mlir/Dialect/Vector/IR/VectorOps.h"
#include "mlir/Pass/Pass.h"

namespace mlir::ce {

#define GEN_PASS_DECL
#include "ce/Transforms/Passes.h.inc"

#define GEN_PASS_REGISTRATION
#include "ce/Transforms/Passes.h.inc"

} // namespace mlir::ce

#endif // CE_TRANSFORMS_PASSES_H
