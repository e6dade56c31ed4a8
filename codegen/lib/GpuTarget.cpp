//===- GpuTarget.cpp - GPU chips and their tuning tables ------------------===//
//
// The chips' facts, the per-chip tuning table (measured in
// docs/PERFORMANCE.md; docs/gpu-mapping.md shows `ce-gen --print-tuning`),
// and the resolution of a variant's kernels from the table and the command
// line's overrides.
//
//===----------------------------------------------------------------------===//

#include "ce/Codegen/GpuTarget.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/Support/Format.h"

#include <algorithm>

using namespace mlir;
using namespace mlir::ce;
using ::ce::KernelOp;

static const GpuChip kChips[] = {
    {/*name=*/"sm_90", /*amd=*/false, /*subgroupSize=*/32,
     /*sharedBytesPerSM=*/228 * 1024, /*reservedBytesPerBlock=*/1024,
     /*asyncCopy=*/true, /*packedMax=*/true},
    // gfx9 has no packed bf16 maximum (v_pk_max_f16 is f16 only, with
    // maxNum semantics) and no asynchronous global-to-LDS copy we use.
    {/*name=*/"gfx942", /*amd=*/true, /*subgroupSize=*/64,
     /*sharedBytesPerSM=*/64 * 1024, /*reservedBytesPerBlock=*/0,
     /*asyncCopy=*/false, /*packedMax=*/false},
    {/*name=*/"gfx950", /*amd=*/true, /*subgroupSize=*/64,
     /*sharedBytesPerSM=*/160 * 1024, /*reservedBytesPerBlock=*/0,
     /*asyncCopy=*/false, /*packedMax=*/false},
    {/*name=*/"gfx90a", /*amd=*/true, /*subgroupSize=*/64,
     /*sharedBytesPerSM=*/64 * 1024, /*reservedBytesPerBlock=*/0,
     /*asyncCopy=*/false, /*packedMax=*/false},
};

const GpuChip *GpuChip::lookup(StringRef name) {
  for (const GpuChip &chip : kChips)
    if (name == chip.name)
      return &chip;
  return nullptr;
}

ArrayRef<GpuChip> GpuChip::all() { return kChips; }

unsigned GpuChip::ldsBytesFor(unsigned rowsPerSM) const {
  if (rowsPerSM == 0)
    return 0;
  // One more workgroup must not fit: (k + 1) (L + reserved) > per-SM bytes.
  return sharedBytesPerSM / (rowsPerSM + 1) - reservedBytesPerBlock + 1;
}

unsigned GpuChip::maxSharedBytesPerWorkgroup() const {
  // The driver's reserved bytes, and the workgroup's own static slots (at
  // most 384 bytes) with room to spare.
  return sharedBytesPerSM - reservedBytesPerBlock - 1024;
}

std::string GpuChip::triple() const {
  return amd ? "amdgcn-amd-amdhsa" : "nvptx64-nvidia-cuda";
}

std::string GpuChip::objectFile() const {
  return std::string(name) + (amd ? ".hsaco" : ".ptx");
}

const char *GpuChip::objectKind() const { return amd ? "hsaco" : "ptx"; }

GpuTuningTable GpuTuningTable::of(const GpuChip &chip) {
  if (!chip.amd) {
    // sm_90, from the H200 sweeps: the statistics kernels run a row per two
    // warps with 8 loads in flight per lane, the next chunk streamed into
    // shared memory while one is reduced (1-2 % more); the backward is
    // memory-bound and best at 512 threads; the fused kernel at 256 with a
    // 48 KB row cache (four rows per SM keep their first 48 KB on chip
    // between the two sweeps). Every kernel flushes f32 denormals
    // (one-instruction ex2: the forward 3-5 % faster, PERFORMANCE.md).
    GpuTuningTable table{
        /*statistics=*/{/*blockSize=*/64, /*unroll=*/8, /*rowsPerSM=*/0,
                        /*rowCacheBytes=*/0, /*streamStages=*/2,
                        /*flushDenormals=*/true},
        // The backward's register budgets keep ptxas at the allocation the
        // sweeps were measured with (40 and 56; its own choice, 32, issues
        // three loads ahead instead of four: 2.5-5 % slower, GPU-TESTS run
        // 12).
        /*gradient=*/{512, 4, 0, 0, 0, true, /*maxRegisters=*/40},
        /*fused=*/{256, 4, 0, 48 * 1024, 0, true},
        {},
        {}};
    // Backward: rows past 128 KB in 1024 threads (2-3 % faster than 512 at
    // V >= 128k, slower at V <= 50k).
    table.gradientLongerRows = {
        {128 * 1024, {1024, 4, 0, 0, 0, true, 56}, "_rows128k"}};
    // Fused: rows up to 128 KB in two workgroups per SM with 112 KB caches
    // (the whole row up to 112 KB); longer rows in one workgroup of 1024
    // threads per SM whose 192 KB cache holds most of the row, the rest
    // re-read from L2.
    table.fusedLongerRows = {
        {64 * 1024, {256, 4, 0, 112 * 1024, 0, true}, "_rows64k"},
        {128 * 1024, {1024, 4, 0, 192 * 1024, 0, true}, "_rows128k"}};
    return table;
  }
  // gfx9 is unmeasured (no device): 4 wave64 waves, no row cache.
  // gfx942, gfx950 and gfx90a, from the static table (docs/AMD-TESTS.md,
  // issue 19): f32 denormals flushed as on sm_90 (drops the exponential's
  // 5-instruction scaling: the gfx942 forward 16.8 -> 11.2 VALU per logit);
  // the statistics kernels then load 4 vectors per lane and step at 64 VGPRs,
  // 7 waves (128 VGPRs without the flush). The backward and fused kernels
  // keep unroll 2 (the fused kernel's unroll 4 takes 82 VGPRs, 5 waves).
  // Flushed, gfx90a's code uses v_mad_f32/v_mac_f32 (CDNA2's unfused
  // multiply-adds), which the emulator runs through test/amd's gfx90a layer.
  GpuTuning wave64{/*blockSize=*/256, /*unroll=*/2};
  wave64.flushDenormals = true;
  GpuTuning statistics = wave64;
  statistics.unroll = 4;
  return GpuTuningTable{statistics, wave64, wave64, {}, {}};
}

GpuTuning GpuTuningTable::forOp(KernelOp op) const {
  switch (op) {
  case KernelOp::Forward:
  case KernelOp::ShardStats:
    return statistics;
  case KernelOp::Backward:
  case KernelOp::Rescale: // a sweep that reads and writes, as a backward's
    return gradient;
  case KernelOp::Fused:
    return fused;
  }
  return statistics;
}

ArrayRef<GpuLongerRows> GpuTuningTable::longerRowsFor(KernelOp op) const {
  switch (op) {
  case KernelOp::Fused:
    return fusedLongerRows;
  case KernelOp::Backward:
    return gradientLongerRows;
  case KernelOp::Forward:
  case KernelOp::ShardStats:
  case KernelOp::Rescale:
    return {};
  }
  return {};
}

/// The overrides checked against `chip`, with the allowed range in each
/// message.
static LogicalResult verifyOverrides(const GpuChip &chip,
                                     const TuningOverrides &overrides,
                                     std::string &error) {
  if (overrides.blockSize) {
    unsigned size = *overrides.blockSize;
    if (size < chip.subgroupSize || size > 1024 || size % chip.subgroupSize) {
      error = "--block-size=" + std::to_string(size) + " on " + chip.name +
              ": expected a multiple of " +
              std::to_string(chip.subgroupSize) + " in [" +
              std::to_string(chip.subgroupSize) + ", 1024]";
      return failure();
    }
  }
  if (overrides.unroll && (*overrides.unroll < 1 || *overrides.unroll > 16)) {
    error = "--unroll=" + std::to_string(*overrides.unroll) +
            ": expected 16-byte vectors per thread and step in [1, 16]";
    return failure();
  }
  if (overrides.streamStages &&
      (*overrides.streamStages == 1 || *overrides.streamStages > 8)) {
    error = "--stream-stages=" + std::to_string(*overrides.streamStages) +
            ": expected 0 (off) or a ring of [2, 8] chunks";
    return failure();
  }
  if (overrides.rowsPerSM && *overrides.rowsPerSM > 64) {
    error = "--rows-per-sm=" + std::to_string(*overrides.rowsPerSM) +
            ": expected [0, 64] (0: no cap)";
    return failure();
  }
  return success();
}

/// `tuning` with the overrides applied.
static GpuTuning applyOverrides(GpuTuning tuning,
                                const TuningOverrides &overrides) {
  tuning.blockSize = overrides.blockSize.value_or(tuning.blockSize);
  tuning.unroll = overrides.unroll.value_or(tuning.unroll);
  tuning.rowsPerSM = overrides.rowsPerSM.value_or(tuning.rowsPerSM);
  tuning.rowCacheBytes = overrides.rowCacheBytes.value_or(tuning.rowCacheBytes);
  tuning.streamStages = overrides.streamStages.value_or(tuning.streamStages);
  tuning.flushDenormals =
      overrides.flushDenormals.value_or(tuning.flushDenormals);
  // A register budget belongs to the shape it was measured for.
  if (overrides.replacesKernelShape())
    tuning.maxRegisters = 0;
  return tuning;
}

/// One kernel's tuning as the mapping and the launch see it: the row cache
/// in whole chunks (fused only), the stream ring where it applies, and the
/// dynamic shared memory to reserve.
static FailureOr<KernelTuning>
finishTuning(const GpuChip &chip, const ::ce::KernelVariantKey &key,
             const TuningOverrides &overrides, GpuTuning tuning,
             std::string suffix, int64_t minVocab, std::string &error) {
  KernelTuning kernel{tuning, std::move(suffix), minVocab};
  unsigned chunk = tuning.chunkBytes();
  kernel.tuning.rowCacheBytes = key.op == KernelOp::Fused && chunk
                                    ? tuning.rowCacheBytes / chunk * chunk
                                    : 0;
  unsigned maxBytes = chip.maxSharedBytesPerWorkgroup();
  unsigned bytes = kernel.tuning.rowCacheBytes;
  if (bytes > maxBytes) {
    error = "--row-cache=" + std::to_string(bytes) +
            " exceeds the workgroup memory of " + chip.name + " (" +
            std::to_string(maxBytes) + " bytes)";
    return failure();
  }
  kernel.streamed = tuning.streamStages >= 2 && chip.asyncCopy &&
                    overrides.asyncCopy &&
                    (key.op == KernelOp::Forward ||
                     key.op == KernelOp::ShardStats);
  if (!kernel.streamed)
    kernel.tuning.streamStages = 0;
  if (kernel.streamed) {
    bytes = tuning.streamStages * chunk;
    if (bytes > maxBytes) {
      error = "--stream-stages=" + std::to_string(tuning.streamStages) +
              " needs " + std::to_string(bytes) +
              " bytes of workgroup memory, more than " + chip.name + " has (" +
              std::to_string(maxBytes) + ")";
      return failure();
    }
  }
  kernel.ldsBytes = std::max(bytes, chip.ldsBytesFor(tuning.rowsPerSM));
  return kernel;
}

FailureOr<SmallVector<KernelTuning, 3>>
mlir::ce::resolveTuning(const GpuChip &chip, const ::ce::KernelVariantKey &key,
                        const TuningOverrides &overrides, std::string &error) {
  if (failed(verifyOverrides(chip, overrides, error)))
    return failure();
  GpuTuningTable table = GpuTuningTable::of(chip);
  SmallVector<KernelTuning, 3> kernels;
  FailureOr<KernelTuning> first =
      finishTuning(chip, key, overrides,
                   applyOverrides(table.forOp(key.op), overrides), "", 0,
                   error);
  if (failed(first))
    return failure();
  kernels.push_back(std::move(*first));
  // Longer rows get kernels of their own: the table's, not when the command
  // line sets the kernel's shape.
  if (overrides.replacesKernelShape())
    return kernels;
  for (const GpuLongerRows &rows : table.longerRowsFor(key.op)) {
    FailureOr<KernelTuning> kernel = finishTuning(
        chip, key, overrides, applyOverrides(rows.tuning, overrides),
        rows.suffix, rows.minRowBytes / ::ce::elemSize(key.logits) + 1, error);
    if (failed(kernel))
      return failure();
    kernels.push_back(std::move(*kernel));
  }
  return kernels;
}

/// One row of the printed table.
static void printTuningRow(llvm::raw_ostream &os, StringRef op,
                           StringRef rows, const GpuTuning &tuning) {
  os << llvm::format("  %-12s %-11s %5u %6u %8u %10u %6u %4s %5u\n",
                     op.str().c_str(), rows.str().c_str(), tuning.blockSize,
                     tuning.unroll, tuning.rowsPerSM, tuning.rowCacheBytes,
                     tuning.streamStages, tuning.flushDenormals ? "yes" : "no",
                     tuning.maxRegisters);
}

void mlir::ce::printTuningTable(llvm::raw_ostream &os) {
  for (const GpuChip &chip : GpuChip::all()) {
    os << chip.name << ": " << (chip.amd ? "AMDGPU" : "NVPTX")
       << ", subgroup " << chip.subgroupSize << ", "
       << chip.sharedBytesPerSM / 1024 << " KB shared memory per "
       << (chip.amd ? "CU" : "SM") << ", async copy "
       << (chip.asyncCopy ? "yes" : "no") << ", packed bf16 max "
       << (chip.packedMax ? "yes" : "no") << "\n";
    os << "  op           rows        block unroll rows/SM  row cache "
          "stream  ftz  regs\n";
    GpuTuningTable table = GpuTuningTable::of(chip);
    auto printOp = [&](StringRef op, const GpuTuning &tuning,
                       ArrayRef<GpuLongerRows> longer) {
      std::string first =
          longer.empty() ? "all"
                         : "<= " + std::to_string(longer[0].minRowBytes / 1024) +
                               " KB";
      printTuningRow(os, op, first, tuning);
      for (auto [i, rows] : llvm::enumerate(longer)) {
        std::string range = std::to_string(rows.minRowBytes / 1024);
        range = i + 1 < longer.size()
                    ? range + "-" +
                          std::to_string(longer[i + 1].minRowBytes / 1024) +
                          " KB"
                    : "> " + range + " KB";
        printTuningRow(os, op, range, rows.tuning);
      }
    };
    printOp("forward", table.statistics, {});
    printOp("shard_stats", table.statistics, {});
    printOp("backward", table.gradient, table.gradientLongerRows);
    printOp("fused", table.fused, table.fusedLongerRows);
  }
}
