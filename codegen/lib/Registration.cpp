//===- Registration.cpp - What ce-opt and ce-gen register -----------------===//

#include "ce/Codegen/Registration.h"
#include "ce/Codegen/Pipelines.h"
#include "ce/Dialect/CE/IR/CEDialect.h"
#include "ce/Transforms/Passes.h"

#include "mlir/Conversion/Passes.h"
#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/Arith/Transforms/Passes.h"
#include "mlir/Dialect/ControlFlow/IR/ControlFlow.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/Dialect/GPU/IR/GPUDialect.h"
#include "mlir/Dialect/LLVMIR/NVVMDialect.h"
#include "mlir/Dialect/LLVMIR/ROCDLDialect.h"
#include "mlir/Dialect/LLVMIR/LLVMDialect.h"
#include "mlir/Dialect/Math/IR/Math.h"
#include "mlir/Dialect/MemRef/IR/MemRef.h"
#include "mlir/Dialect/SCF/IR/SCF.h"
#include "mlir/Dialect/Vector/IR/VectorOps.h"
#include "mlir/IR/DialectRegistry.h"
#include "mlir/Target/LLVMIR/Dialect/Builtin/BuiltinToLLVMIRTranslation.h"
#include "mlir/Target/LLVMIR/Dialect/GPU/GPUToLLVMIRTranslation.h"
#include "mlir/Target/LLVMIR/Dialect/LLVMIR/LLVMToLLVMIRTranslation.h"
#include "mlir/Target/LLVMIR/Dialect/NVVM/NVVMToLLVMIRTranslation.h"
#include "mlir/Target/LLVMIR/Dialect/ROCDL/ROCDLToLLVMIRTranslation.h"
#include "mlir/Transforms/Passes.h"

using namespace mlir;

void mlir::ce::registerCEDialects(DialectRegistry &registry) {
  registry.insert<CEDialect, arith::ArithDialect, cf::ControlFlowDialect,
                  func::FuncDialect, gpu::GPUDialect, LLVM::LLVMDialect,
                  NVVM::NVVMDialect, ROCDL::ROCDLDialect, math::MathDialect,
                  memref::MemRefDialect, scf::SCFDialect,
                  vector::VectorDialect>();
  registerBuiltinDialectTranslation(registry);
  registerLLVMDialectTranslation(registry);
  registerGPUDialectTranslation(registry);
  registerNVVMDialectTranslation(registry);
  registerROCDLDialectTranslation(registry);
}

void mlir::ce::registerCEPassesAndPipelines() {
  registerCEPasses();
  // Upstream passes the pipelines use, so each stage can be replayed.
  registerCanonicalizerPass();
  registerCSEPass();
  registerLoopInvariantCodeMotionPass();
  arith::registerArithExpandOpsPass();
  registerSCFToControlFlowPass();
  registerConvertVectorToLLVMPass();
  registerConvertMathToLLVMPass();
  registerArithToLLVMConversionPass();
  registerFinalizeMemRefToLLVMConversionPass();
  registerConvertControlFlowToLLVMPass();
  registerConvertFuncToLLVMPass();
  registerReconcileUnrealizedCastsPass();
  registerConvertGpuOpsToNVVMOpsPass();
  registerConvertGpuOpsToROCDLOpsPass();
  registerCEPipelines();
}
