//===- GpuCodegen.h - GPU kernels to PTX and HSACO --------------*- C++ -*-===//

#ifndef CE_CODEGEN_GPUCODEGEN_H
#define CE_CODEGEN_GPUCODEGEN_H

#include "ce/runtime/VariantKey.h"

#include "mlir/Dialect/GPU/IR/GPUDialect.h"
#include "llvm/IR/Module.h"
#include "llvm/Target/TargetMachine.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace mlir::ce {

/// How one kernel is mapped: threads per workgroup (one row each) and
/// 16-byte loads per thread and step.
struct GpuTuning {
  unsigned blockSize;
  unsigned unroll;
  /// At most this many workgroups (rows) in flight per SM/CU, enforced by
  /// reserving dynamic shared memory at launch; 0: no cap.
  unsigned rowsPerSM = 0;
  /// Fused kernels: bytes of workgroup memory that keep a row's first
  /// chunks between its two sweeps (a multiple of the chunk, 16 x unroll x
  /// blockSize bytes; see rowCacheBytesFor); 0: none.
  unsigned rowCacheBytes = 0;
  /// Statistics kernels: stream the chunks through a ring of this many
  /// chunks of workgroup memory by asynchronous copies (NVIDIA; 0: off).
  unsigned streamStages = 0;
  /// Flush f32 denormals (NVIDIA's exponential is then one instruction,
  /// `ex2.approx.ftz.f32`, instead of four; AMD's drops its scaling).
  bool flushDenormals = false;

  /// Bytes one step of the workgroup covers: 16 bytes x unroll per thread.
  unsigned chunkBytes() const { return 16 * unroll * blockSize; }
};

/// A GPU chip ce-gen can emit code objects for, with its per-chip, per-op
/// defaults (the tuning table of docs/gpu-mapping.md).
struct GpuTarget {
  std::string chip; ///< sm_90, gfx942, gfx950, gfx90a
  bool amd;
  unsigned subgroupSize; ///< 32 (warp) or 64 (wave64)
  unsigned sharedBytesPerSM; ///< shared memory (LDS) per SM (CU)
  GpuTuning statistics;  ///< forward and shard_stats: one sweep, no writes
  GpuTuning gradient;    ///< backward: read and write
  GpuTuning fused;       ///< fused: two sweeps of a row
  /// Further kernels per variant, each for rows of more than `minRowBytes`
  /// (increasing), which the runtime picks by the row's length; the op's
  /// tuning serves the rows shorter than the first.
  struct LongerRows {
    unsigned minRowBytes;
    GpuTuning tuning;
    const char *suffix; ///< of the kernel's symbol
  };
  std::vector<LongerRows> fusedLongerRows;
  std::vector<LongerRows> gradientLongerRows; ///< backward

  /// The target named `chip`, or nothing for an unknown chip.
  static std::optional<GpuTarget> lookup(StringRef chip);
  /// The default tuning of kernels of `op` on this chip.
  GpuTuning tuningFor(::ce::KernelOp op) const;
  /// The further kernels of `op` for longer rows (none for most ops).
  ArrayRef<LongerRows> longerRowsFor(::ce::KernelOp op) const;
  /// Dynamic shared memory that lets at most `rowsPerSM` workgroups share
  /// an SM (0 for no cap).
  unsigned ldsBytesFor(unsigned rowsPerSM) const;
  /// `requested` row-cache bytes rounded down to whole chunks of `tuning`.
  static unsigned rowCacheBytesFor(const GpuTuning &tuning,
                                   unsigned requested);
  /// The most dynamic shared memory one workgroup may use.
  unsigned maxSharedBytesPerWorkgroup() const;
  std::string triple() const;
  /// The code object's file name in a bundle.
  std::string objectFile() const;
};

FailureOr<std::unique_ptr<llvm::TargetMachine>>
createGpuTargetMachine(const GpuTarget &target, std::string &error);

/// Translates the LLVM-dialect contents of `module` to an optimized LLVM
/// module for `machine`.
std::unique_ptr<llvm::Module>
translateGpuModule(gpu::GPUModuleOp module, llvm::LLVMContext &context,
                   llvm::TargetMachine &machine, std::string &error);

} // namespace mlir::ce

#endif // CE_CODEGEN_GPUCODEGEN_H
