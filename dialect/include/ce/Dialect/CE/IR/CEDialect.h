//===- CEDialect.h - Cross-entropy dialect ----------------------*- C++ -*-===//

#ifndef CE_DIALECT_CE_IR_CEDIALECT_H
#define CE_DIALECT_CE_IR_CEDIALECT_H

#include "mlir/IR/Dialect.h"

#include "ce/Dialect/CE/IR/CEDialect.h.inc"

#include <cstdint>

namespace mlir::ce {

/// Bits of the ce ops' run-time `flags` operand (CEOps.td); the bundle ABI
/// passes the same word as the kernels' `flags` argument
/// (docs/bundle-format.md).
enum RuntimeFlag : int64_t {
  /// Labels outside [0, V) follow Megatron-Core's contract instead of being
  /// reported.
  kFlagMegatronLabels = 1,
  /// The `ignore_index` operand is in force.
  kFlagIgnoreIndex = 2,
  /// A shard smooths over its global vocabulary (as `global_smoothing`).
  kFlagGlobalSmoothing = 4,
  /// The `lse_low` operand is in force (written by forward and fused, read by
  /// backward); without the bit it is a placeholder left alone.
  kFlagLseLow = 8,
  /// The `entropy` operand is in force (forward and fused write it).
  kFlagEntropy = 16,
  /// The `argmax` operand is in force (forward and fused write it).
  kFlagArgmax = 32,
};

} // namespace mlir::ce

#endif // CE_DIALECT_CE_IR_CEDIALECT_H
