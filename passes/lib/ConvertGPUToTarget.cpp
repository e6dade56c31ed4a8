//===- ConvertGPUToTarget.cpp - gpu.module to NVVM / ROCDL LLVM -----------===//

#include "ce/Transforms/Passes.h"

#include "mlir/Conversion/ArithToLLVM/ArithToLLVM.h"
#include "mlir/Conversion/ControlFlowToLLVM/ControlFlowToLLVM.h"
#include "mlir/Conversion/GPUCommon/GPUCommonPass.h"
#include "mlir/Conversion/GPUToNVVM/GPUToNVVMPass.h"
#include "mlir/Conversion/GPUToROCDL/GPUToROCDLPass.h"
#include "mlir/Conversion/LLVMCommon/ConversionTarget.h"
#include "mlir/Conversion/LLVMCommon/TypeConverter.h"
#include "mlir/Conversion/MathToLLVM/MathToLLVM.h"
#include "mlir/Conversion/MemRefToLLVM/MemRefToLLVM.h"
#include "mlir/Conversion/NVGPUToNVVM/NVGPUToNVVM.h"
#include "mlir/Conversion/VectorToLLVM/ConvertVectorToLLVM.h"
#include "mlir/Dialect/AMDGPU/Utils/Chipset.h"
#include "mlir/Dialect/Math/IR/Math.h"
#include "mlir/Transforms/DialectConversion.h"

namespace mlir::ce {
#define GEN_PASS_DEF_CECONVERTGPUTOTARGET
#include "ce/Transforms/Passes.h.inc"
} // namespace mlir::ce

using namespace mlir;

namespace {

unsigned llvmAddressSpace(gpu::AddressSpace space, bool amd) {
  switch (space) {
  case gpu::AddressSpace::Global:
    return 1;
  case gpu::AddressSpace::Workgroup:
    return 3;
  case gpu::AddressSpace::Private:
    return amd ? 5 : 0;
  }
  return 0;
}

struct CEConvertGPUToTargetPass
    : mlir::ce::impl::CEConvertGPUToTargetBase<CEConvertGPUToTargetPass> {
  using Base::Base;

  void runOnOperation() override {
    gpu::GPUModuleOp module = getOperation();
    MLIRContext *context = &getContext();
    bool amd = target == "rocdl";
    if (!amd && target != "nvvm") {
      module.emitError("target must be nvvm or rocdl, got '") << target << "'";
      return signalPassFailure();
    }
    FailureOr<amdgpu::Chipset> chip = amdgpu::Chipset::parse(chipset);
    if (amd && failed(chip)) {
      module.emitError("unknown AMDGPU chipset '") << chipset << "'";
      return signalPassFailure();
    }

    LowerToLLVMOptions options(context, DataLayout(module));
    options.overrideIndexBitwidth(64);
    LLVMTypeConverter converter(context, options);
    populateGpuMemorySpaceAttributeConversions(
        converter,
        [amd](gpu::AddressSpace space) { return llvmAddressSpace(space, amd); });

    // First math -> LLVM intrinsics on its own: the GPU pattern sets would
    // otherwise turn math.exp2 or math.fma into __nv_* / __ocml_* calls.
    {
      RewritePatternSet mathPatterns(context);
      populateMathToLLVMConversionPatterns(converter, mathPatterns);
      ConversionTarget mathTarget(*context);
      mathTarget.addIllegalDialect<math::MathDialect>();
      mathTarget.markUnknownOpDynamicallyLegal([](Operation *) { return true; });
      if (failed(applyPartialConversion(module, mathTarget,
                                        std::move(mathPatterns))))
        return signalPassFailure();
    }

    RewritePatternSet patterns(context);
    arith::populateArithToLLVMConversionPatterns(converter, patterns);
    cf::populateControlFlowToLLVMConversionPatterns(converter, patterns);
    populateFinalizeMemRefToLLVMConversionPatterns(converter, patterns);
    populateVectorToLLVMConversionPatterns(converter, patterns);
    if (amd)
      populateGpuToROCDLConversionPatterns(converter, patterns,
                                           gpu::amd::Runtime::HIP, *chip);
    else {
      populateGpuToNVVMConversionPatterns(converter, patterns);
      // Asynchronous copies (the row cache's cp.async) and their tokens.
      converter.addConversion([&](nvgpu::DeviceAsyncTokenType type) -> Type {
        return converter.convertType(IntegerType::get(type.getContext(), 32));
      });
      populateNVGPUToNVVMConversionPatterns(converter, patterns);
    }

    LLVMConversionTarget conversionTarget(*context);
    conversionTarget.addIllegalDialect<gpu::GPUDialect, nvgpu::NVGPUDialect>();
    conversionTarget.addLegalOp<gpu::GPUModuleOp>();
    conversionTarget.addLegalDialect<NVVM::NVVMDialect, ROCDL::ROCDLDialect>();
    if (failed(applyPartialConversion(module, conversionTarget,
                                      std::move(patterns))))
      return signalPassFailure();

    // gpu.dynamic_shared_memory becomes an internal zero-sized array, which
    // NVPTX emits as a one-byte static `.shared` variable that may overlap
    // the static slots. The memory provided at launch is an external
    // zero-sized array (`.extern .shared ... []`, AMDGPU's dynamic LDS).
    module.walk([](LLVM::GlobalOp global) {
      auto array = dyn_cast<LLVM::LLVMArrayType>(global.getGlobalType());
      if (global.getAddrSpace() != llvmAddressSpace(
                                       gpu::AddressSpace::Workgroup, false) ||
          !array || array.getNumElements() != 0)
        return;
      global.setLinkage(LLVM::Linkage::External);
      global.removeValueAttr();
      global.setUnnamedAddr(std::nullopt);
    });
  }
};

} // namespace
