//===- GpuStages.cpp - GPU kernels from variants to PTX and HSACO ---------===//
//
// The GPU half of the staged codegen API (Stages.h): one gpu.func per
// kernel with its resolved tuning (`ce.tuning`), the mapping onto
// workgroups, the NVVM/ROCDL conversion, LLVM's target machine, and for
// AMDGPU lld. An AMDGPU bundle has one code object per chip; an NVPTX one
// has one PTX file per kernel, because the driver compiles a whole module
// when it loads it (2.7 s per MB on the H200: a first launch from one
// module of every kernel took two minutes).
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
/// table; only the `only`-th when given) to `kernelModule` and describes
/// them for the manifest.
static LogicalResult addKernels(gpu::GPUModuleOp kernelModule,
                                const ::ce::KernelVariantKey &key,
                                StringRef name, const GpuChip &chip,
                                const CodegenOptions &options,
                                std::vector<EmittedKernel> &kernels,
                                std::string &error,
                                std::optional<size_t> only = std::nullopt) {
  FailureOr<SmallVector<KernelTuning, 3>> tunings =
      resolveTuning(chip, key, options.tuning, error);
  if (failed(tunings))
    return failure();
  MLIRContext *context = kernelModule.getContext();
  for (auto [index, kernel] : llvm::enumerate(*tunings)) {
    if (only && index != *only)
      continue;
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
                             const std::string &objectFile,
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
    if (failed(writeFileIn(options.bundleDir, objectFile, assembly, error)))
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
                               objectFile, /*hostLibraries=*/false, error))) {
      error = "linking " + chipName + " code object: " + error;
      return StageStatus::InternalError;
    }
  }
  result.objects.push_back(BundleObject{objectFile, chipName,
                                       chip.objectKind(), std::move(kernels)});
  return StageStatus::Ok;
}

/// One code object: the kernels `addAll` puts into a fresh module, through
/// the pipeline up to `options.stopAfter`, written as `objectFile`.
static StageStatus
compileUnit(MLIRContext &context, const GpuChip &chip,
            const CodegenOptions &options, const std::string &objectFile,
            function_ref<LogicalResult(gpu::GPUModuleOp,
                                       std::vector<EmittedKernel> &)>
                addAll,
            StageResult &result) {
  OwningOpRef<ModuleOp> module = ModuleOp::create(UnknownLoc::get(&context));
  (*module)->setAttr(gpu::GPUDialect::getContainerModuleAttrName(),
                     UnitAttr::get(&context));
  OpBuilder builder = OpBuilder::atBlockEnd(module->getBody());
  auto kernelModule =
      gpu::GPUModuleOp::create(builder, module->getLoc(), "ce_kernels");
  std::vector<EmittedKernel> kernels;
  if (failed(addAll(kernelModule, kernels)))
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
  return finishGpu(kernelModule, std::move(kernels), chip, options,
                   objectFile, result);
}

StageStatus mlir::ce::runGpuStages(MLIRContext &context,
                                   ArrayRef<::ce::KernelVariantKey> keys,
                                   const GpuChip &chip,
                                   const CodegenOptions &options,
                                   StageResult &result) {
  // A bundle's PTX: one file per kernel ("sm_90-ce_fused_3_rows64k.ptx").
  if (!chip.amd && options.stopAfter == Stage::Bundle) {
    for (auto [i, key] : llvm::enumerate(keys)) {
      std::string name = kernelSymbol(key, i);
      FailureOr<SmallVector<KernelTuning, 3>> tunings =
          resolveTuning(chip, key, options.tuning, result.error);
      if (failed(tunings))
        return StageStatus::BadInput;
      for (size_t t = 0; t < tunings->size(); ++t) {
        std::string file = std::string(chip.name) + "-" + name +
                           (*tunings)[t].suffix + ".ptx";
        StageStatus status = compileUnit(
            context, chip, options, file,
            [&](gpu::GPUModuleOp module, std::vector<EmittedKernel> &kernels) {
              return addKernels(module, key, name, chip, options, kernels,
                                result.error, t);
            },
            result);
        if (status != StageStatus::Ok)
          return status;
      }
    }
    return StageStatus::Ok;
  }
  return compileUnit(
      context, chip, options, chip.objectFile(),
      [&](gpu::GPUModuleOp module, std::vector<EmittedKernel> &kernels) {
        for (auto [i, key] : llvm::enumerate(keys))
          if (failed(addKernels(module, key, kernelSymbol(key, i), chip,
                                options, kernels, result.error)))
            return failure();
        return success();
      },
      result);
}
