//===- GpuCodegen.cpp - GPU kernels to PTX and HSACO ----------------------===//
//
// The target machines and the translation to LLVM IR; the chips and their
// tuning are in GpuTarget.cpp, the stages in GpuStages.cpp.
//
//===----------------------------------------------------------------------===//

#include "ce/Codegen/GpuCodegen.h"
#include "ce/Dialect/CE/IR/CEAttrs.h"

#include "mlir/ExecutionEngine/OptUtils.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/IRMapping.h"
#include "mlir/Target/LLVMIR/Export.h"
#include "llvm/MC/TargetRegistry.h"
#include "llvm/Support/TargetSelect.h"
#include "llvm/TargetParser/Triple.h"

using namespace mlir;
using namespace mlir::ce;

FailureOr<std::unique_ptr<llvm::TargetMachine>>
mlir::ce::createGpuTargetMachine(const GpuChip &chip, std::string &error) {
  if (chip.amd) {
    LLVMInitializeAMDGPUTargetInfo();
    LLVMInitializeAMDGPUTarget();
    LLVMInitializeAMDGPUTargetMC();
    LLVMInitializeAMDGPUAsmPrinter();
  } else {
    LLVMInitializeNVPTXTargetInfo();
    LLVMInitializeNVPTXTarget();
    LLVMInitializeNVPTXTargetMC();
    LLVMInitializeNVPTXAsmPrinter();
  }
  llvm::Triple triple(chip.triple());
  const llvm::Target *llvmTarget =
      llvm::TargetRegistry::lookupTarget(triple, error);
  if (!llvmTarget)
    return failure();
  // PTX ISA 8.0 is what LLVM 22 needs for sm_90 and what CUDA 12+ drivers
  // load.
  std::string features = chip.amd ? "" : "+ptx80";
  llvm::TargetOptions options;
  std::unique_ptr<llvm::TargetMachine> machine(
      llvmTarget->createTargetMachine(triple, chip.name, features, options,
                                      llvm::Reloc::PIC_, std::nullopt,
                                      llvm::CodeGenOptLevel::Aggressive));
  if (!machine) {
    error = std::string("cannot create a target machine for ") + chip.name;
    return failure();
  }
  return machine;
}

std::unique_ptr<llvm::Module>
mlir::ce::translateGpuModule(gpu::GPUModuleOp module,
                             llvm::LLVMContext &context,
                             llvm::TargetMachine &machine, std::string &error) {
  // The translation works on a builtin.module: clone the kernels into one.
  OpBuilder builder(module.getContext());
  OwningOpRef<ModuleOp> holder = ModuleOp::create(module.getLoc());
  builder.setInsertionPointToStart(holder->getBody());
  for (Operation &op : module.getBody()->without_terminator())
    builder.clone(op);
  std::unique_ptr<llvm::Module> llvmModule =
      translateModuleToLLVMIR(*holder, context, module.getName());
  if (!llvmModule) {
    error = "translation of the GPU kernels to LLVM IR failed";
    return nullptr;
  }
  llvmModule->setTargetTriple(machine.getTargetTriple());
  llvmModule->setDataLayout(machine.createDataLayout());
  // Kernels whose tuning flushes f32 denormals: NVPTX then selects
  // `ex2.approx.ftz.f32`, AMDGPU a bare `v_exp_f32`.
  for (Operation &op : module.getBody()->without_terminator())
    if (auto tuning =
            op.getAttrOfType<TuningAttr>(TuningAttr::getAttrName());
        tuning && tuning.getFlushDenormals())
      if (auto name = op.getAttrOfType<StringAttr>(
              SymbolTable::getSymbolAttrName()))
        if (llvm::Function *fn = llvmModule->getFunction(name.getValue()))
          fn->addFnAttr("denormal-fp-math-f32", "preserve-sign,preserve-sign");
  auto optimize = makeOptimizingTransformer(3, 0, &machine);
  if (llvm::Error err = optimize(llvmModule.get())) {
    error = llvm::toString(std::move(err));
    return nullptr;
  }
  return llvmModule;
}
