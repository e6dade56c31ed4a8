//===- HostStages.cpp - Host kernels from ce ops to a shared object -------===//
//
// The host half of the staged codegen API (Stages.h): fusion, the row loop
// nests, the LLVM dialect, LLVM's x86-64 target machine and lld.
//
//===----------------------------------------------------------------------===//

#include "ce/Codegen/HostCodegen.h"
#include "ce/Codegen/KernelBuilder.h"
#include "ce/Codegen/MachineCode.h"
#include "ce/Codegen/Pipelines.h"
#include "ce/Codegen/Stages.h"
#include "StageSupport.h"
#include "ce/Transforms/Passes.h"

#include "ce/runtime/BundleAbi.h"

#include "mlir/IR/Verifier.h"
#include "mlir/Parser/Parser.h"
#include "mlir/Support/FileUtilities.h"
#include "llvm/Support/SourceMgr.h"
#include "mlir/Pass/PassManager.h"

using namespace mlir;
using namespace mlir::ce;

OwningOpRef<ModuleOp>
mlir::ce::buildHostKernels(MLIRContext &context,
                           ArrayRef<::ce::KernelVariantKey> keys) {
  OwningOpRef<ModuleOp> module = ModuleOp::create(UnknownLoc::get(&context));
  for (auto [i, key] : llvm::enumerate(keys))
    buildKernel(*module, kernelSymbol(key, i), key);
  return module;
}

OwningOpRef<ModuleOp> mlir::ce::readKernelFile(MLIRContext &context,
                                               StringRef path,
                                               std::string &error) {
  auto file = openInputFile(path, &error);
  if (!file)
    return nullptr;
  llvm::SourceMgr sourceMgr;
  sourceMgr.AddNewSourceBuffer(std::move(file), llvm::SMLoc());
  OwningOpRef<ModuleOp> module = parseSourceFile<ModuleOp>(sourceMgr, &context);
  if (!module)
    error = "cannot parse '" + path.str() + "' (see the diagnostics above)";
  return module;
}

/// LLVM IR to the stage's output or the bundle's shared object.
static StageStatus finishHost(ModuleOp module,
                              std::vector<EmittedKernel> kernels,
                              const CodegenOptions &options,
                              StageResult &result) {
  HostTargetOptions hostOptions;
  hostOptions.cpu = options.hostCpu;
  std::string &error = result.error;
  auto machine = createHostTargetMachine(hostOptions, error);
  if (failed(machine)) {
    error = "host target: " + error;
    return StageStatus::BadInput;
  }
  llvm::LLVMContext llvmContext;
  std::unique_ptr<llvm::Module> llvmModule = translateAndOptimize(
      module, llvmContext, **machine, hostOptions.optLevel, error);
  if (!llvmModule)
    return StageStatus::InternalError;
  if (options.stopAfter == Stage::Llvm) {
    result.output = printLLVMModule(*llvmModule);
    return StageStatus::Ok;
  }
  std::string assembly, object;
  if (!options.dumpDir.empty() || options.stopAfter == Stage::Isa) {
    if (failed(emitMachineCode(*llvmModule, **machine, false, assembly,
                               error)))
      return StageStatus::InternalError;
  }
  if (!options.dumpDir.empty() &&
      (failed(writeDump(options, "kernel.opt.ll",
                        printLLVMModule(*llvmModule), error)) ||
       failed(writeDump(options, "kernel.s", assembly, error))))
    return StageStatus::InternalError;
  if (options.stopAfter == Stage::Isa) {
    result.output = std::move(assembly);
    return StageStatus::Ok;
  }
  if (failed(emitMachineCode(*llvmModule, **machine, true, object, error)))
    return StageStatus::InternalError;
  if (options.stopAfter == Stage::Obj) {
    result.output = std::move(object);
    return StageStatus::Ok;
  }
  // Bundle: the object linked into a shared object beside the manifest.
  std::string file = "host-x86_64.so";
  if (failed(linkObjectBytes(object, options.bundleDir, "host-x86_64", file,
                             /*hostLibraries=*/true, error))) {
    error = "linking host kernels: " + error;
    return StageStatus::InternalError;
  }
  BundleObject hostObject{file, "host", ::ce::kObjectKindSharedObject,
                          std::move(kernels)};
  hostObject.cpuFeatures = requiredCpuFeatures(**machine);
  result.objects.push_back(std::move(hostObject));
  return StageStatus::Ok;
}

StageStatus mlir::ce::runHostStages(ModuleOp module,
                                    const CodegenOptions &options,
                                    StageResult &result) {
  if (failed(verify(module)))
    return StageStatus::BadInput;
  if (options.stopAfter == Stage::Mlir) {
    result.output = printStage(module);
    return StageStatus::Ok;
  }
  if (options.stopAfter == Stage::Gpu) {
    result.error = "--emit=gpu applies to GPU targets";
    return StageStatus::BadInput;
  }
  // Fuse before describing: fusion changes which kernels exist.
  if (failed(runPasses(module, options, [&](PassManager &pm) {
        if (options.fuse)
          pm.addPass(createCEFuseForwardBackward());
      })))
    return StageStatus::BadInput;
  std::vector<EmittedKernel> kernels;
  for (auto func : module.getOps<func::FuncOp>()) {
    FailureOr<EmittedKernel> kernel = describeKernel(func);
    if (failed(kernel))
      return StageStatus::BadInput;
    func->setAttr("llvm.emit_c_interface", UnitAttr::get(module.getContext()));
    kernels.push_back(std::move(*kernel));
  }
  HostPipelineOptions pipeline;
  pipeline.fuse = false;
  pipeline.vectorWidth = options.vectorWidth;
  pipeline.unroll = options.hostUnroll;
  bool loops = options.stopAfter == Stage::Loops;
  if (failed(runPasses(module, options, [&](PassManager &pm) {
        if (loops)
          buildHostLoopsPipeline(pm, pipeline);
        else
          buildHostPipeline(pm, pipeline);
      })))
    return StageStatus::BadInput;
  if (loops) {
    result.output = printStage(module);
    return StageStatus::Ok;
  }
  return finishHost(module, std::move(kernels), options, result);
}
