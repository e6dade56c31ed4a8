//===- HostCodegen.cpp - LLVM IR to a host shared object ------------------===//

#include "ce/Codegen/HostCodegen.h"

#include "mlir/ExecutionEngine/OptUtils.h"
#include "mlir/Target/LLVMIR/Export.h"
#include "llvm/IR/LegacyPassManager.h"
#include "llvm/MC/MCSubtargetInfo.h"
#include "llvm/MC/TargetRegistry.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Program.h"
#include "llvm/Support/TargetSelect.h"
#include "llvm/Support/raw_ostream.h"
#include "llvm/TargetParser/Host.h"
#include "llvm/TargetParser/Triple.h"
#include "llvm/Transforms/Utils/Cloning.h"

using namespace mlir;
using namespace mlir::ce;

FailureOr<std::unique_ptr<llvm::TargetMachine>>
mlir::ce::createHostTargetMachine(const HostTargetOptions &options,
                                  std::string &error) {
  LLVMInitializeX86TargetInfo();
  LLVMInitializeX86Target();
  LLVMInitializeX86TargetMC();
  LLVMInitializeX86AsmPrinter();
  llvm::Triple triple("x86_64-unknown-linux-gnu");
  const llvm::Target *target =
      llvm::TargetRegistry::lookupTarget(triple, error);
  if (!target)
    return failure();
  std::string cpu = options.cpu;
  std::string features;
  if (cpu == "native") {
    cpu = llvm::sys::getHostCPUName().str();
    for (const auto &feature : llvm::sys::getHostCPUFeatures())
      features += (feature.second ? "+" : "-") + feature.first().str() + ",";
  }
  std::unique_ptr<llvm::MCSubtargetInfo> subtarget(
      target->createMCSubtargetInfo(triple, "", ""));
  if (!subtarget || !subtarget->isCPUStringValid(cpu)) {
    error = "unknown CPU '" + cpu + "' for x86-64";
    return failure();
  }
  llvm::TargetOptions targetOptions;
  std::unique_ptr<llvm::TargetMachine> machine(target->createTargetMachine(
      triple, cpu, features, targetOptions, llvm::Reloc::PIC_, std::nullopt,
      options.optLevel >= 3 ? llvm::CodeGenOptLevel::Aggressive
                            : llvm::CodeGenOptLevel::Default));
  if (!machine) {
    error = "cannot create a target machine for CPU '" + cpu + "'";
    return failure();
  }
  return machine;
}

std::unique_ptr<llvm::Module>
mlir::ce::translateAndOptimize(ModuleOp module, llvm::LLVMContext &context,
                               llvm::TargetMachine &machine, unsigned optLevel,
                               std::string &error) {
  std::unique_ptr<llvm::Module> llvmModule =
      translateModuleToLLVMIR(module, context, "cegen");
  if (!llvmModule) {
    error = "translation to LLVM IR failed";
    return nullptr;
  }
  llvmModule->setTargetTriple(machine.getTargetTriple());
  llvmModule->setDataLayout(machine.createDataLayout());
  auto optimize = makeOptimizingTransformer(optLevel, 0, &machine);
  if (llvm::Error err = optimize(llvmModule.get())) {
    error = llvm::toString(std::move(err));
    return nullptr;
  }
  return llvmModule;
}

LogicalResult mlir::ce::emitMachineCode(llvm::Module &module,
                                        llvm::TargetMachine &machine,
                                        bool asObject, std::string &out,
                                        std::string &error) {
  llvm::SmallString<0> buffer;
  llvm::raw_svector_ostream stream(buffer);
  // Codegen rewrites the IR it runs on (AMDGPU's structurizer inserts
  // llvm.amdgcn.if, for one), so each emission gets its own copy.
  std::unique_ptr<llvm::Module> copy = llvm::CloneModule(module);
  llvm::legacy::PassManager passes;
  if (machine.addPassesToEmitFile(passes, stream, nullptr,
                                  asObject ? llvm::CodeGenFileType::ObjectFile
                                           : llvm::CodeGenFileType::AssemblyFile)) {
    error = "the target machine cannot emit this file type";
    return failure();
  }
  passes.run(*copy);
  out.assign(buffer.begin(), buffer.end());
  return success();
}

LogicalResult mlir::ce::linkSharedObject(StringRef ldLld, StringRef objectPath,
                                         StringRef outputPath,
                                         std::string &error,
                                         bool hostLibraries) {
  SmallVector<StringRef> args = {ldLld, "-shared", "-o", outputPath,
                                 objectPath};
  // libm for the transcendental calls LLVM may leave; the dependency is
  // recorded so dlopen resolves it in any process.
  if (hostLibraries)
    args.append({"--as-needed", "-L/lib/x86_64-linux-gnu",
                 "-L/usr/lib/x86_64-linux-gnu", "-lm"});
  int status = llvm::sys::ExecuteAndWait(ldLld, args, std::nullopt, {}, 0, 0,
                                         &error);
  if (status != 0) {
    if (error.empty())
      error = "ld.lld exited with status " + std::to_string(status);
    return failure();
  }
  return success();
}
