//===- HostCodegen.cpp - The host target machine and LLVM IR --------------===//
//
// The x86-64 target machine for host kernels and the translation of the
// LLVM dialect to an optimized LLVM module (MachineCode.cpp emits and
// links it).
//
//===----------------------------------------------------------------------===//

#include "ce/Codegen/HostCodegen.h"
#include "ce/runtime/BundleAbi.h"

#include "mlir/ExecutionEngine/OptUtils.h"
#include "mlir/Target/LLVMIR/Export.h"
#include "llvm/MC/MCSubtargetInfo.h"
#include "llvm/MC/TargetRegistry.h"
#include "llvm/Support/TargetSelect.h"
#include "llvm/Support/raw_ostream.h"
#include "llvm/TargetParser/Host.h"
#include "llvm/TargetParser/Triple.h"

using namespace mlir;
using namespace mlir::ce;

std::vector<std::string>
mlir::ce::requiredCpuFeatures(const llvm::TargetMachine &machine) {
  const llvm::MCSubtargetInfo *subtarget = machine.getMCSubtargetInfo();
  std::vector<std::string> features;
  for (const char *feature : ::ce::kHostCpuFeatures)
    if (subtarget->checkFeatures(std::string("+") + feature))
      features.push_back(feature);
  return features;
}

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
