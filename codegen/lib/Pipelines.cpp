//===- Pipelines.cpp - Named lowering pipelines ---------------------------===//

#include "ce/Codegen/Pipelines.h"
#include "ce/Transforms/Passes.h"

#include "mlir/Conversion/Passes.h"
#include "mlir/Dialect/Arith/Transforms/Passes.h"
#include "mlir/Pass/PassManager.h"
#include "mlir/Pass/PassRegistry.h"
#include "mlir/Transforms/Passes.h"

using namespace mlir;
using namespace mlir::ce;

void mlir::ce::buildHostLoopsPipeline(OpPassManager &pm,
                                      const HostPipelineOptions &options) {
  if (options.fuse)
    pm.addPass(createCEFuseForwardBackward());
  CELowerToLoopsOptions loopOptions;
  loopOptions.vectorWidth = options.vectorWidth;
  loopOptions.unroll = options.unroll;
  pm.addNestedPass<func::FuncOp>(createCELowerToLoops(loopOptions));
  pm.addPass(createLoopInvariantCodeMotionPass());
  pm.addPass(createCanonicalizerPass());
  pm.addPass(createCSEPass());
}

void mlir::ce::buildLoopsToLLVMPipeline(OpPassManager &pm) {
  // bf16 conversions become integer arithmetic (round to nearest even):
  // x86 has no bf16 instructions before AVX512-BF16, and the libcall LLVM
  // would emit (__truncsfbf2) is not in every libgcc.
  pm.addPass(createCEExpandExp2());
  arith::ArithExpandOpsPassOptions expandOptions;
  expandOptions.includeBf16 = true;
  pm.addPass(arith::createArithExpandOpsPass(expandOptions));
  pm.addPass(createSCFToControlFlowPass());
  pm.addPass(createConvertVectorToLLVMPass());
  pm.addPass(createConvertMathToLLVMPass());
  pm.addPass(createArithToLLVMConversionPass());
  pm.addPass(createFinalizeMemRefToLLVMConversionPass());
  pm.addPass(createConvertControlFlowToLLVMPass());
  pm.addPass(createConvertFuncToLLVMPass());
  pm.addPass(createReconcileUnrealizedCastsPass());
  pm.addPass(createCanonicalizerPass());
}

void mlir::ce::buildHostPipeline(OpPassManager &pm,
                                 const HostPipelineOptions &options) {
  buildHostLoopsPipeline(pm, options);
  buildLoopsToLLVMPipeline(pm);
}

void mlir::ce::buildGpuMappingPipeline(OpPassManager &pm,
                                       const GpuPipelineOptions &options) {
  OpPassManager &kernels = pm.nest<gpu::GPUModuleOp>();
  CEMapToGPUOptions mapOptions;
  mapOptions.target = options.target;
  mapOptions.blockSize = options.blockSize;
  mapOptions.subgroupSize = options.subgroupSize;
  mapOptions.unroll = options.unroll;
  mapOptions.asyncCopy = options.asyncCopy;
  mapOptions.packedMax = options.packedMax;
  kernels.addPass(createCEMapToGPU(mapOptions));
  kernels.addPass(createLoopInvariantCodeMotionPass());
  kernels.addPass(createCanonicalizerPass());
  kernels.addPass(createCSEPass());
}

void mlir::ce::buildGpuPipeline(OpPassManager &pm,
                                const GpuPipelineOptions &options) {
  buildGpuMappingPipeline(pm, options);
  OpPassManager &kernels = pm.nest<gpu::GPUModuleOp>();
  kernels.addPass(createSCFToControlFlowPass());
  CEConvertGPUToTargetOptions convertOptions;
  convertOptions.target = options.target;
  convertOptions.chipset = options.chipset;
  kernels.addPass(createCEConvertGPUToTarget(convertOptions));
  pm.addPass(createReconcileUnrealizedCastsPass());
  pm.nest<gpu::GPUModuleOp>().addPass(createCanonicalizerPass());
}

void mlir::ce::registerCEPipelines() {
  PassPipelineRegistration<GpuPipelineOptions>(
      "ce-lower-to-gpu",
      "Map ce ops in gpu.func kernels onto workgroups and lower them to the "
      "LLVM dialect with NVVM or ROCDL intrinsics (what ce-gen runs for GPU "
      "targets before translation)",
      buildGpuPipeline);
  PassPipelineRegistration<HostPipelineOptions>(
      "ce-lower-to-host-loops",
      "Lower ce ops to row loops (what ce-gen --emit=loops prints)",
      buildHostLoopsPipeline);
  PassPipelineRegistration<HostPipelineOptions>(
      "ce-lower-to-host",
      "Lower ce ops to the LLVM dialect for the host (what ce-gen runs "
      "before translation to LLVM IR)",
      buildHostPipeline);
}
