//===- TokenLowering.h - Per-token lowering of ce ops -----------*- C++ -*-===//
//
// What one token of a ce op computes, shared by the host loop lowering
// (ce-lower-to-loops: a loop over tokens) and the GPU mapping
// (ce-map-to-gpu: one token per workgroup): labels, ignore_index,
// smoothing, z-loss, the loss and the target-class gradient term. The
// bodies are in TokenLowering.cpp.
//
//===----------------------------------------------------------------------===//

#ifndef CE_TRANSFORMS_TOKENLOWERING_H
#define CE_TRANSFORMS_TOKENLOWERING_H

#include "RowLoopBuilder.h"

#include "ce/Dialect/CE/IR/CEOps.h"

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/GPU/IR/GPUDialect.h"
#include "mlir/Dialect/MemRef/IR/MemRef.h"

#include <limits>
#include <optional>

namespace mlir::ce::detail {

inline constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

/// The configuration of one op, as the lowering needs it. Each option is
/// an attribute (a constant) or a run-time operand (a Value), not both.
struct OpConfig {
  Layout layout;
  std::optional<int64_t> ignoreIndex;
  float labelSmoothing;
  float zLoss;
  ShardAttr shard; ///< null unless the logits are a vocabulary slice
  Value status;
  Value flags; ///< i64 run-time flags (RuntimeFlag), or null for none
  Value ignoreIndexValue;     ///< i64, or null
  Value labelSmoothingValue;  ///< f32, or null
  Value zLossValue;           ///< f32, or null
  Value shardStart, shardVocab; ///< i64 run-time bounds, or null
  Value logitScale;             ///< f32 s (z = s x), or null for 1
  /// f32 cap (z = cap tanh(s x / cap)), or null. The lowering then folds
  /// the scale into z and clears logitScale (CrossEntropyLowering).
  Value logitSoftcap;

  bool hasSmoothing() const {
    return labelSmoothingValue || labelSmoothing != 0.0f;
  }
  bool hasZLoss() const { return zLossValue || zLoss != 0.0f; }

  template <typename OpT>
  static OpConfig get(OpT op) {
    OpConfig config;
    config.layout = op.getLayout();
    if (IntegerAttr attr = op.getIgnoreIndexAttr())
      config.ignoreIndex = attr.getInt();
    config.labelSmoothing = op.getLabelSmoothing().convertToFloat();
    config.zLoss = op.getZLoss().convertToFloat();
    config.shard = op.getShardAttr();
    config.status = op.getStatus();
    config.flags = op.getFlags();
    config.ignoreIndexValue = op.getIgnoreIndexValue();
    config.labelSmoothingValue = op.getLabelSmoothingValue();
    config.zLossValue = op.getZLossValue();
    config.shardStart = op.getShardStart();
    config.shardVocab = op.getShardVocab();
    config.logitScale = op.getLogitScale();
    config.logitSoftcap = op.getLogitSoftcap();
    return config;
  }
};

/// One token: where its logits row starts, where its per-token values live,
/// and its linear index in the token shape (for the status report).
struct Token {
  SmallVector<Value, 2> rowPrefix;
  SmallVector<Value, 2> indices;
  Value linear;
};

/// What the label of one token says.
struct LabelInfo {
  Value label;   ///< i64, a global id when sharded
  Value valid;   ///< i1: 0 <= label < V (the global vocabulary when sharded)
  Value accepted; ///< i1: valid, or out of range under Megatron's contract
  Value ignored; ///< i1: label == ignore_index (false without one)
  Value column;  ///< i64: the label's column in the local row
  Value inRow;   ///< i1: 0 <= column < V_local (== valid unless sharded)
  Value target; ///< f32: z[column] when inRow, else 0 (z = x without a softcap)
  /// f32 dz/dx at the target (a softcap's chain-rule factor), or null.
  Value targetSlope;
};

/// Shared lowering state of one op.
class CrossEntropyLowering {
public:
  CrossEntropyLowering(ImplicitLocOpBuilder &b, const OpConfig &config,
                       Value logits, Value labels, unsigned vectorWidth,
                       unsigned unroll, RowThreads threads = {});

  bool hasThreads() const { return rows.getThreads().enabled(); }

  /// Runs `body` on one thread of the workgroup (always on the host): for
  /// the per-token stores that every thread could make.
  void leaderOnly(function_ref<void()> body);

  /// Makes every thread's writes to the row visible to the others.
  void rowBarrier();

  bool hasSmoothing() const { return config.hasSmoothing(); }
  bool hasZLoss() const { return config.hasZLoss(); }

  RowRef rowOf(Value memref, const Token &token) {
    return RowRef{memref, token.rowPrefix};
  }

  /// `0 <= value < bound` for i64 values.
  Value inRange(Value value, Value bound);

  /// Reads the label, classifies it, and gathers the target logit with a
  /// single guarded load. Reports a bad label through `status`. A shard's
  /// labels are global ids: the target is in this row only when the label
  /// falls in the slice.
  LabelInfo readLabel(const Token &token);

  /// i1: whether run-time flag `flag` (RuntimeFlag) is set; needs flags.
  Value flagSet(int64_t flag);

  /// `plain` where `coefficient` is 0, else `withTerm` (constant-folded
  /// when the coefficient is a constant).
  Value selectUnlessZero(Value coefficient, Value plain, Value withTerm);

  /// The per-token loss from the row statistics and `logProb` = log p_y.
  Value buildLoss(const LabelInfo &label, const RowStats &stats, Value lse,
                  Value logProb);

  /// Writes the gradient row: zeros for an ignored token, NaN for a bad
  /// label, and otherwise `g * (p * c - s/V)` with the target element
  /// replaced by `g * (expm1(log p_y) * c + 2 z lse + s - s/V)`, computed
  /// from the exact log-probability rather than from a rounded p_y - 1;
  /// with a logit scale the whole row times it (the gradient is of x).
  /// `afterStatistics`: the row was just swept (the fused op), so the GPU
  /// sweep starts from the row's end, whose bytes are likeliest in L2.
  /// `rowMax` and `logSum` (the fused op, which has the unrounded
  /// statistics): the sweep's exponent is `(x - rowMax) s - logSum` instead
  /// of `s x - lse`, so its error does not grow with the logits' magnitude.
  /// `lseLow` (a backward given lse's low part): `(s x - lse) - lseLow`.
  void buildGradient(const Token &token, Value grad, const LabelInfo &label,
                     Value lse, Value logProb, Value weight,
                     bool afterStatistics = false, Value rowMax = {},
                     Value logSum = {}, Value lseLow = {});

  /// Work done once per op, before any token: the fused op's scalar weight
  /// is loaded once.
  void prepare(ForwardOp) {}
  void prepare(BackwardOp) {}
  void prepare(ShardStatsOp) {}
  void prepare(FusedOp op);

  /// ce.forward for one token: statistics sweep, loss and lse stores.
  void lowerToken(ForwardOp op, const Token &t);

  /// ce.backward for one token: one gradient sweep from the stored lse.
  void lowerToken(BackwardOp op, const Token &t);

  /// ce.shard_stats for one token: the statistics sweep of the slice and
  /// the four partial statistics (max, rest, target logit, row sum).
  void lowerToken(ShardStatsOp op, const Token &t);

  /// ce.fused for one token: statistics, loss and lse, gradient sweep.
  void lowerToken(FusedOp op, const Token &t);

  /// What the forward part of a token leaves for a gradient.
  struct TokenForward {
    LabelInfo label;
    Value lse;
    Value logProb; ///< log p_y from the unrounded statistics
    Value rowMax;  ///< max_j x_j
    Value logSum;  ///< log(sum_j exp(s (x_j - rowMax))), lse's unrounded part
  };

  /// Statistics sweep, loss, and the loss and lse stores of one token; with
  /// `lseLowOut`, also lse's low part (where flag bit 3 is set, or always
  /// without flags); with `entropyOut` / `argmaxOut` the outputs
  /// (buildOutputs), accumulated in the statistics sweep when
  /// `accumulateOutputs` (statisticsOf), else by a sweep of their own.
  TokenForward buildLossAndLse(const Token &t, Value lossOut, Value lseOut,
                               Value lseLowOut = {}, Value entropyOut = {},
                               Value argmaxOut = {},
                               bool accumulateOutputs = true);

  /// The row's statistics (RowLoopBuilder::buildStatistics); with an
  /// `entropyOut` or `argmaxOut` and `accumulateOutputs`, two sweeps in one
  /// branch on the flags: with the outputs' sums where one is in force,
  /// else without (so the plain call pays nothing for them). Without
  /// `accumulateOutputs` the outputs take their own sweep (buildOutputs).
  RowStats statisticsOf(const Token &t, bool withSum, bool shiftedSum,
                        Value entropyOut, Value argmaxOut,
                        bool accumulateOutputs = true);

  /// Where one of the outputs is in force (flags), stores the entropy and
  /// argmax of the row (either output may be null) from `stats`
  /// (statisticsOf); a found argmax plus `indexOffset` (i64, a slice's
  /// start) when given.
  void buildOutputs(const Token &t, const RowStats &stats, Value entropyOut,
                    Value argmaxOut, Value indexOffset = {});

  /// i1: whether the entropy or argmax output is in force.
  Value outputsWanted(Value entropyOut, Value argmaxOut);

  /// i1: whether run-time flag `flag` is in force (always without flags).
  Value inForce(int64_t flag);

  /// i1: whether an lse_low operand is in force (flag bit 3; true without
  /// flags).
  Value lseLowInForce();

  ImplicitLocOpBuilder &b;
  RowLoopBuilder rows;
  Value sharedWeight; ///< f32, the fused op's scalar weight, or null
  Value isLeader; ///< i1, thread 0 of the workgroup; null on the host
  OpConfig config;
  Value logits;
  Value labels;
  Value vocab;
  Value vocabF32;
  Value smoothing; ///< f32 s, only with label smoothing
  Value uniform;   ///< f32 s / V, only with label smoothing
  Value zLoss;     ///< f32 z, only with a z-loss
  Value shardStart, shardVocab; ///< i64 bounds, only for a shard
};


/// ce.rescale for one token: the row is scaled by g/w (0 where g == 0)
/// unless its upstream gradient g equals its weight w. Uniform per row, so
/// a workgroup takes the branch together.
void lowerRescaleToken(ImplicitLocOpBuilder &b, RowLoopBuilder &rows,
                       RescaleOp op, const Token &t);

/// Builds the loops over all tokens of `logits` and calls `body` in the
/// innermost one (the host's token mapping).
void buildTokenLoops(ImplicitLocOpBuilder &b, Layout layout, Value logits,
                     function_ref<void(const Token &)> body);

/// The token of workgroup `blockId` (the GPU's token mapping).
Token tokenOfBlock(ImplicitLocOpBuilder &b, Layout layout, Value logits,
                   Value blockId);

} // namespace mlir::ce::detail

#endif // CE_TRANSFORMS_TOKENLOWERING_H
