//===- GpuCodegen.cpp - GPU kernels to PTX and HSACO ----------------------===//

#include "ce/Codegen/GpuCodegen.h"

#include "mlir/ExecutionEngine/OptUtils.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/IRMapping.h"
#include "mlir/Target/LLVMIR/Export.h"
#include "llvm/MC/TargetRegistry.h"
#include "llvm/Support/TargetSelect.h"
#include "llvm/TargetParser/Triple.h"

using namespace mlir;
using namespace mlir::ce;

std::optional<GpuTarget> GpuTarget::lookup(StringRef chip) {
  // The tuning table (docs/gpu-mapping.md, measured in
  // docs/PERFORMANCE.md). sm_90, from the H200 sweeps: the statistics
  // kernels run a row per warp with 8 loads in flight per lane (no barrier:
  // 0.62 vs 0.70 ms at 8192x128256), the next chunk streamed into shared
  // memory while one is reduced (1-2 % more); the backward
  // is memory-bound and best at 512 threads; the fused kernel at 256 with
  // a 64 KB row cache (three rows per SM keep their first 64 KB on chip
  // between the two sweeps). gfx9 is unmeasured (no device): 4 wave64
  // waves with unroll 2, since unroll 4 reaches 128 VGPRs, the
  // 4-waves-per-SIMD limit, and no row cache.
  // Every sm_90 kernel flushes f32 denormals (one-instruction ex2: the
  // forward 3-5 % faster, PERFORMANCE.md run 7).
  if (chip == "sm_90") {
    GpuTarget target{chip.str(),
                     false,
                     32,
                     228 * 1024,
                     {64, 8, 0, 0, 2, true},
                     {512, 4, 0, 0, 0, true},
                     {256, 4, 0, 48 * 1024, 0, true}};
    // Fused: rows up to 64 KB in four workgroups per SM with 48 KB caches;
    // up to 128 KB in two with 112 KB (the whole row up to 112 KB); longer
    // rows in one workgroup of 1024 threads per SM whose 192 KB cache holds
    // most of the row, the rest re-read from L2.
    target.fusedLongerRows = {
        {64 * 1024, {256, 4, 0, 112 * 1024, 0, true}, "_rows64k"},
        {128 * 1024, {1024, 4, 0, 192 * 1024, 0, true}, "_rows128k"}};
    // Backward: rows past 128 KB in 1024 threads (2-3 % faster than 512 at
    // V >= 128k, slower at V <= 50k; PERFORMANCE.md run 7).
    target.gradientLongerRows = {
        {128 * 1024, {1024, 4, 0, 0, 0, true}, "_rows128k"}};
    return target;
  }
  if (chip == "gfx942" || chip == "gfx90a")
    return GpuTarget{chip.str(), true, 64, 64 * 1024,
                     {256, 2}, {256, 2}, {256, 2}};
  if (chip == "gfx950")
    return GpuTarget{chip.str(), true, 64, 160 * 1024,
                     {256, 2}, {256, 2}, {256, 2}};
  return std::nullopt;
}

unsigned GpuTarget::ldsBytesFor(unsigned rowsPerSM) const {
  if (rowsPerSM == 0)
    return 0;
  // One more workgroup must not fit: (k + 1) (L + reserved) > per-SM bytes,
  // with the 1 KB the CUDA driver reserves per block (none on AMD).
  unsigned reserved = amd ? 0 : 1024;
  return sharedBytesPerSM / (rowsPerSM + 1) - reserved + 1;
}

unsigned GpuTarget::rowCacheBytesFor(const GpuTuning &tuning,
                                     unsigned requested) {
  unsigned chunk = tuning.chunkBytes();
  return chunk ? requested / chunk * chunk : 0;
}

unsigned GpuTarget::maxSharedBytesPerWorkgroup() const {
  // The CUDA driver keeps 1 KB of each SM's shared memory per block; the
  // workgroup's own static slots (at most 384 bytes) come on top.
  return sharedBytesPerSM - (amd ? 1024 : 2048);
}

ArrayRef<GpuTarget::LongerRows>
GpuTarget::longerRowsFor(::ce::KernelOp op) const {
  switch (op) {
  case ::ce::KernelOp::Fused:
    return fusedLongerRows;
  case ::ce::KernelOp::Backward:
    return gradientLongerRows;
  case ::ce::KernelOp::Forward:
  case ::ce::KernelOp::ShardStats:
    return {};
  }
  return {};
}

GpuTuning GpuTarget::tuningFor(::ce::KernelOp op) const {
  switch (op) {
  case ::ce::KernelOp::Forward:
  case ::ce::KernelOp::ShardStats:
    return statistics;
  case ::ce::KernelOp::Backward:
    return gradient;
  case ::ce::KernelOp::Fused:
    return fused;
  }
  return statistics;
}

std::string GpuTarget::triple() const {
  return amd ? "amdgcn-amd-amdhsa" : "nvptx64-nvidia-cuda";
}

std::string GpuTarget::objectFile() const {
  return chip + (amd ? ".hsaco" : ".ptx");
}

FailureOr<std::unique_ptr<llvm::TargetMachine>>
mlir::ce::createGpuTargetMachine(const GpuTarget &target, std::string &error) {
  if (target.amd) {
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
  llvm::Triple triple(target.triple());
  const llvm::Target *llvmTarget =
      llvm::TargetRegistry::lookupTarget(triple, error);
  if (!llvmTarget)
    return failure();
  // PTX ISA 8.0 is what LLVM 22 needs for sm_90 and what CUDA 12+ drivers
  // load.
  std::string features = target.amd ? "" : "+ptx80";
  llvm::TargetOptions options;
  std::unique_ptr<llvm::TargetMachine> machine(
      llvmTarget->createTargetMachine(triple, target.chip, features, options,
                                      llvm::Reloc::PIC_, std::nullopt,
                                      llvm::CodeGenOptLevel::Aggressive));
  if (!machine) {
    error = "cannot create a target machine for " + target.chip;
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
  // Kernels marked `ce.flush_denormals` flush f32 denormals: NVPTX then
  // selects `ex2.approx.ftz.f32`, AMDGPU a bare `v_exp_f32`.
  for (Operation &op : module.getBody()->without_terminator())
    if (op.hasAttr("ce.flush_denormals"))
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
