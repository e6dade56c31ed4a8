//===- GpuTarget.h - GPU chips and their tuning tables ----------*- C++ -*-===//
//
// Two things apart, as IREE's KnownTargets keeps them: the hardware facts of
// each chip ce-gen emits code for (GpuChip), and the tuning policy, a table
// of named per-op fields per chip (GpuTuningTable), measured in
// docs/PERFORMANCE.md. resolveTuning() turns the table and the command
// line's overrides into the kernels one variant gets; printTuningTable() is
// what `ce-gen --print-tuning` prints (and docs/gpu-mapping.md shows).
//
//===----------------------------------------------------------------------===//

#ifndef CE_CODEGEN_GPUTARGET_H
#define CE_CODEGEN_GPUTARGET_H

#include "ce/runtime/VariantKey.h"

#include "mlir/Support/LLVM.h"
#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/SmallVector.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/raw_ostream.h"

#include <optional>
#include <string>

namespace mlir::ce {

/// Hardware facts of a GPU chip: nothing here is a choice.
struct GpuChip {
  const char *name;              ///< sm_90, gfx942, gfx950, gfx90a
  bool amd;                      ///< AMDGPU (HSACO) rather than NVPTX (PTX)
  unsigned subgroupSize;         ///< 32 (warp) or 64 (wave64)
  unsigned sharedBytesPerSM;     ///< shared memory (LDS) per SM (CU)
  unsigned reservedBytesPerBlock; ///< shared memory the driver keeps per block
  bool asyncCopy;                ///< global-to-shared asynchronous copies
  bool packedMax;                ///< NaN-propagating max of packed bf16/f16

  /// The chip named `name`, or null for an unknown one.
  static const GpuChip *lookup(StringRef name);
  /// Every chip, in the order ce-gen lists them.
  static ArrayRef<GpuChip> all();
  /// Dynamic shared memory that lets at most `rowsPerSM` workgroups share
  /// an SM (0 for no cap).
  unsigned ldsBytesFor(unsigned rowsPerSM) const;
  /// The most dynamic shared memory one workgroup may use.
  unsigned maxSharedBytesPerWorkgroup() const;
  std::string triple() const;
  /// The code object's file name and kind in a bundle.
  std::string objectFile() const;
  const char *objectKind() const;
};

/// How one kernel is mapped: threads per workgroup (one row each) and
/// 16-byte loads per thread and step, and what the workgroup memory holds.
struct GpuTuning {
  unsigned blockSize;
  unsigned unroll;
  /// At most this many workgroups (rows) in flight per SM/CU, enforced by
  /// reserving dynamic shared memory at launch; 0: no cap.
  unsigned rowsPerSM = 0;
  /// Fused kernels: bytes of workgroup memory that keep a row's first
  /// chunks between its two sweeps (whole chunks); 0: none.
  unsigned rowCacheBytes = 0;
  /// Statistics kernels: stream the chunks through a ring of this many
  /// chunks of workgroup memory by asynchronous copies (0: off).
  unsigned streamStages = 0;
  /// Flush f32 denormals (NVIDIA's exponential is then one instruction,
  /// `ex2.approx.ftz.f32`, instead of four; AMD's drops its scaling).
  bool flushDenormals = false;
  /// Registers per thread the target's compiler may use (NVIDIA `.maxnreg`;
  /// 0: its own choice).
  unsigned maxRegisters = 0;

  /// Bytes one step of the workgroup covers: 16 bytes x unroll per thread.
  unsigned chunkBytes() const { return 16 * unroll * blockSize; }
};

/// A further kernel of one op for rows longer than `minRowBytes`, which
/// the runtime picks by the row's length.
struct GpuLongerRows {
  unsigned minRowBytes;
  GpuTuning tuning;
  const char *suffix; ///< of the kernel's symbol
};

/// The tuning policy of one chip: a tuning per op class, and the further
/// kernels for longer rows (increasing `minRowBytes`).
struct GpuTuningTable {
  GpuTuning statistics; ///< forward and shard_stats: one sweep, no writes
  GpuTuning gradient;   ///< backward: read and write
  GpuTuning fused;      ///< fused: two sweeps of a row
  SmallVector<GpuLongerRows, 2> gradientLongerRows;
  SmallVector<GpuLongerRows, 2> fusedLongerRows;

  /// The table of `chip`.
  static GpuTuningTable of(const GpuChip &chip);
  GpuTuning forOp(::ce::KernelOp op) const;
  ArrayRef<GpuLongerRows> longerRowsFor(::ce::KernelOp op) const;
};

/// Command-line settings that replace the table's (unset: the table's).
/// Setting the block size, unroll or row cache emits one kernel per
/// variant (no longer-row kernels).
struct TuningOverrides {
  std::optional<unsigned> blockSize, unroll, rowsPerSM, rowCacheBytes,
      streamStages;
  std::optional<bool> flushDenormals;
  bool asyncCopy = true; ///< where the chip has it

  bool replacesKernelShape() const {
    return blockSize || unroll || rowCacheBytes;
  }
};

/// One kernel a variant gets on a chip, with everything its launch needs.
struct KernelTuning {
  GpuTuning tuning;
  std::string suffix;   ///< of the symbol ("" or "_rows64k", ...)
  int64_t minVocab = 0; ///< the manifest's launch.min_vocab
  bool streamed = false; ///< tuning.streamStages applies to this op
  /// Dynamic shared memory the launch reserves (row cache, stream ring or
  /// the rows-per-SM cap, whichever is largest).
  unsigned ldsBytes = 0;
};

/// The kernels `key` gets on `chip`: the table's for its op with the
/// overrides applied, one per row-length range. Fails with a message that
/// names the setting when the workgroup memory they need exceeds the chip's.
FailureOr<SmallVector<KernelTuning, 3>>
resolveTuning(const GpuChip &chip, const ::ce::KernelVariantKey &key,
              const TuningOverrides &overrides, std::string &error);

/// Prints every chip's facts and tuning table (`ce-gen --print-tuning`).
void printTuningTable(llvm::raw_ostream &os);

} // namespace mlir::ce

#endif // CE_CODEGEN_GPUTARGET_H
