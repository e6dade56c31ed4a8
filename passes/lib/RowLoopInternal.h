//===- RowLoopInternal.h - Shared pieces of the row lowering ----*- C++ -*-===//
//
// Internal to the RowLoopBuilder files (RowMath, RowSchedule, RowStaging,
// RowStatistics, WorkgroupReduce): the numeric constants of the statistics
// sweep and the small helpers more than one of them uses.
//
//===----------------------------------------------------------------------===//

#ifndef CE_TRANSFORMS_ROWLOOPINTERNAL_H
#define CE_TRANSFORMS_ROWLOOPINTERNAL_H

#include "RowLoopBuilder.h"

#include <limits>

namespace mlir::ce::detail {

inline constexpr float kLog2E = 1.44269504088896340736f;
inline constexpr float kLn2 = 0.693147180559945309417f;
/// The main sweep subtracts the scaled maximum by FMA (stepRowState), capped
/// at -fl(max log2 e) <= 2^25.
inline constexpr float kMaxNegScaledMax = 0x1p25f;
/// Rows whose maximum is not below this in magnitude (infinite, NaN, or the
/// -FLT_MAX of a row with no value > -inf included) are swept again with
/// exact subtractions (buildStatistics).
inline constexpr float kFoldLimit = 0x1p24f;
inline constexpr float kInf = std::numeric_limits<float>::infinity();
/// The maximum of a state that has seen no value > -inf: -FLT_MAX, finite
/// so that `x - max` is never -inf - -inf and no element but -FLT_MAX
/// itself compares equal to it. Such a state has no implicit 1 (rest = -1).
inline constexpr float kNoMax = -std::numeric_limits<float>::max();
/// The argmax candidate of no element (every index is below it).
inline constexpr int32_t kNoIndex = std::numeric_limits<int32_t>::max();

/// The indices of element `index` of `row`.
inline SmallVector<Value, 3> indicesOf(const RowRef &row, Value index) {
  SmallVector<Value, 3> indices(row.prefix.begin(), row.prefix.end());
  indices.push_back(index);
  return indices;
}

/// Builds `scf.if` yielding `types`: `thenBody` or `elseBody` gives them.
SmallVector<Value> buildIfYield(ImplicitLocOpBuilder &b, Value condition,
                                TypeRange types,
                                function_ref<SmallVector<Value>()> thenBody,
                                function_ref<SmallVector<Value>()> elseBody);

} // namespace mlir::ce::detail

#endif // CE_TRANSFORMS_ROWLOOPINTERNAL_H
