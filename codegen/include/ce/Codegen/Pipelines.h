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
