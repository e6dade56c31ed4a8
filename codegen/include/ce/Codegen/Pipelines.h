//===- Pipelines.h - Named lowering pipelines -------------------*- C++ -*-===//

#ifndef CE_CODEGEN_PIPELINES_H
#define CE_CODEGEN_PIPELINES_H

#include "mlir/Pass/PassOptions.h"

namespace mlir {
class OpPassManager;
} // namespace mlir

namespace mlir::ce {

struct HostPipelineOptions : public PassPipelineOptions<HostPipelineOptions> {
  PassOptions::Option<bool> fuse{
      *this, "fuse", llvm::cl::desc("Fuse forward and backward where legal"),
      llvm::cl::init(true)};
  PassOptions::Option<unsigned> vectorWidth{
      *this, "vector-width", llvm::cl::desc("Lanes per vector"),
      llvm::cl::init(8)};
  PassOptions::Option<unsigned> unroll{
      *this, "unroll", llvm::cl::desc("Vectors per step"), llvm::cl::init(4)};
};

struct GpuPipelineOptions : public PassPipelineOptions<GpuPipelineOptions> {
  PassOptions::Option<std::string> target{
      *this, "target", llvm::cl::desc("nvvm or rocdl"), llvm::cl::init("nvvm")};
  PassOptions::Option<std::string> chipset{
      *this, "chipset", llvm::cl::desc("AMDGPU chipset (rocdl)"),
      llvm::cl::init("gfx942")};
  PassOptions::Option<unsigned> blockSize{
      *this, "block-size", llvm::cl::desc("Threads per workgroup"),
      llvm::cl::init(256)};
  PassOptions::Option<unsigned> subgroupSize{
      *this, "subgroup-size", llvm::cl::desc("Warp/wave size"),
      llvm::cl::init(32)};
  PassOptions::Option<unsigned> unroll{
      *this, "unroll", llvm::cl::desc("16-byte vectors per thread and step"),
      llvm::cl::init(2)};
  PassOptions::Option<bool> asyncCopy{
      *this, "async-copy",
      llvm::cl::desc("Fill row caches by asynchronous copies (nvvm)"),
      llvm::cl::init(false)};
  PassOptions::Option<bool> packedMax{
      *this, "packed-max",
      llvm::cl::desc("Statistics maxima on packed bf16/f16 values (nvvm)"),
      llvm::cl::init(false)};
};

/// ce ops in gpu.func kernels -> workgroup-mapped loops (`--emit=gpu`).
void buildGpuMappingPipeline(OpPassManager &pm,
                             const GpuPipelineOptions &options);

/// ce ops in gpu.func kernels -> LLVM dialect with NVVM or ROCDL
/// intrinsics: `ce-lower-to-gpu`.
void buildGpuPipeline(OpPassManager &pm, const GpuPipelineOptions &options);

/// ce ops -> row loops (`--emit=loops` stops here).
void buildHostLoopsPipeline(OpPassManager &pm,
                            const HostPipelineOptions &options);

/// ce ops -> LLVM dialect for the host: `ce-lower-to-host`.
void buildHostPipeline(OpPassManager &pm, const HostPipelineOptions &options);

/// Row loops -> LLVM dialect, the host half of `buildHostPipeline`.
void buildLoopsToLLVMPipeline(OpPassManager &pm);

void registerCEPipelines();

} // namespace mlir::ce

#endif // CE_CODEGEN_PIPELINES_H
