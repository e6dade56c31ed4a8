//===- GpuStages.cpp - GPU kernels from variants to PTX and HSACO ---------===//
//
// The GPU half of the staged codegen API (Stages.h): one gpu.func per
// kernel with its resolved tuning (`ce.tuning`), the mapping onto
// workgroups, the NVVM/ROCDL conversion, LLVM's target machine, and for
// AMDGPU lld.
//
//===----------------------------------------------------------------------===//

#include "ce/Codegen/GpuCodegen.h"
#include "ce/Codegen/KernelBuilder.h"
#include "ce/Codegen/MachineCode.h"
#include "ce/Codegen/Pipelines.h"
#include "ce/Codegen/Stages.h"
#include "ce/Dialect/CE/IR/CEAttrs.h"
#include "StageSupport.h"

#include "ce/runtime/BundleAbi.h"

#include "mlir/IR/Verifier.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/raw_ostream.h"

using namespace mlir;
using namespace mlir::ce;

/// Adds the kernels of `key` (one per row-length range of the chip's
/// table) to `kernelModule` and describes them for the manifest.
static LogicalResult addKernels(gpu::GPUModuleOp kernelModule,
                                const ::ce::KernelVariantKey &key,
                                StringRef name, const GpuChip &chip,
                                const CodegenOptions &options,
                                std::vector<EmittedKernel> &kernels,
                                std::string &error) {
  FailureOr<SmallVector<KernelTuning, 3>> tunings =
      resolveTuning(chip, key, options.tuning, error);
  if (failed(tunings))
    return failure();
  MLIRContext *context = kernelModule.getContext();
  for (const KernelTuning &kernel : *tunings) {
    std::string symbol = (name + kernel.suffix).str();
    gpu::GPUFuncOp func = buildGpuKernel(kernelModule, symbol, key);
    const GpuTuning &tuning = kernel.tuning;
    func->setAttr(TuningAttr::getAttrName(),
                  TuningAttr::get(context, tuning.blockSize, tuning.unroll,
                                  tuning.rowCacheBytes, tuning.streamStages,
                                  tuning.flushDenormals, tuning.maxRegisters));
    FailureOr<EmittedKernel> info = describeKernel(func);
    if (failed(info))
      return failure();
    info->symbol = symbol;
    info->abi = ::ce::kMemrefDescriptorFieldsAbi;
    info->blockSize = tuning.blockSize;
    info->ldsBytes = kernel.ldsBytes;
    info->minVocab = kernel.minVocab;
    kernels.push_back(std::move(*info));
  }
  return success();
}

/// LLVM IR to the stage's output or the bundle's code object.
static StageStatus finishGpu(gpu::GPUModuleOp kernelModule,
                             std::vector<EmittedKernel> kernels,
                             const GpuChip &chip,
                             const CodegenOptions &options,
                             StageResult &result) {
  std::string &error = result.error;
  auto machine = createGpuTargetMachine(chip, error);
  if (failed(machine)) {
    error = std::string(chip.name) + ": " + error;
    return StageStatus::BadInput;
  }
  llvm::LLVMContext llvmContext;
  std::unique_ptr<llvm::Module> llvmModule =
      translateGpuModule(kernelModule, llvmContext, **machine, error);
  if (!llvmModule)
    return StageStatus::InternalError;
  if (options.stopAfter == Stage::Llvm) {
    result.output = printLLVMModule(*llvmModule);
    return StageStatus::Ok;
  }
  std::string assembly, object;
  if (failed(emitMachineCode(*llvmModule, **machine, false, assembly, error)))
    return StageStatus::InternalError;
  std::string chipName = chip.name;
  if (!options.dumpDir.empty() &&
      (failed(writeDump(options, chipName + ".opt.ll",
                        printLLVMModule(*llvmModule), error)) ||
       failed(writeDump(options, chipName + ".s", assembly, error))))
    return StageStatus::InternalError;
  // PTX is NVIDIA's code object: the driver compiles it for the device.
  if (options.stopAfter == Stage::Isa ||
      (!chip.amd && options.stopAfter == Stage::Obj)) {
    result.output = std::move(assembly);
    return StageStatus::Ok;
  }
  if (!chip.amd) {
    if (failed(writeFileIn(options.bundleDir, chip.objectFile(), assembly,
                           error)))
      return StageStatus::InternalError;
  } else {
    if (failed(emitMachineCode(*llvmModule, **machine, true, object, error)))
      return StageStatus::InternalError;
    if (options.stopAfter == Stage::Obj) {
      result.output = std::move(object);
      return StageStatus::Ok;
    }
    // HSACO: the relocatable object linked into a shared object by lld.
    if (failed(linkObjectBytes(object, options.bundleDir, chipName,
                               chip.objectFile(), /*hostLibraries=*/false,
                               error))) {
      error = "linking " + chipName + " code object: " + error;
      return StageStatus::InternalError;
    }
  }
  result.object = BundleObject{chip.objectFile(), chipName, chip.objectKind(),
                               std::move(kernels)};
  return StageStatus::Ok;
}

StageStatus mlir::ce::runGpuStages(MLIRContext &context,
                                   ArrayRef<::ce::KernelVariantKey> keys,
                                   const GpuChip &chip,
                                   const CodegenOptions &options,
                                   StageResult &result) {
  OwningOpRef<ModuleOp> module = ModuleOp::create(UnknownLoc::get(&context));
  (*module)->setAttr(gpu::GPUDialect::getContainerModuleAttrName(),
                     UnitAttr::get(&context));
  OpBuilder builder = OpBuilder::atBlockEnd(module->getBody());
  auto kernelModule =
      gpu::GPUModuleOp::create(builder, module->getLoc(), "ce_kernels");
  std::vector<EmittedKernel> kernels;
  for (auto [i, key] : llvm::enumerate(keys))
    if (failed(addKernels(kernelModule, key, kernelSymbol(key, i), chip,
                          options, kernels, result.error)))
      return StageStatus::BadInput;
  if (failed(verify(*module)))
    return StageStatus::InternalError;
  if (options.stopAfter == Stage::Mlir) {
    result.output = printStage(*module);
    return StageStatus::Ok;
  }

  GpuPipelineOptions pipeline;
  pipeline.target = chip.amd ? "rocdl" : "nvvm";
  pipeline.chipset = chip.name;
  pipeline.subgroupSize = chip.subgroupSize;
  pipeline.asyncCopy = options.tuning.asyncCopy && chip.asyncCopy;
  pipeline.packedMax = chip.packedMax;
  bool mappedOnly =
      options.stopAfter == Stage::Gpu || options.stopAfter == Stage::Loops;
  if (failed(runPasses(*module, options, [&](PassManager &pm) {
        if (mappedOnly)
          buildGpuMappingPipeline(pm, pipeline);
        else
          buildGpuPipeline(pm, pipeline);
      })))
    return StageStatus::BadInput;
  if (mappedOnly) {
    result.output = printStage(*module);
    return StageStatus::Ok;
  }
  return finishGpu(kernelModule, std::move(kernels), chip, options, result);
}
