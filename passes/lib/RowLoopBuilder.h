//===- RowLoopBuilder.h - Row sweeps of the CE lowering ---------*- C++ -*-===//
//
// Builds the per-row pieces shared by every ce op lowering: the statistics
// sweep (online max and sum of exponentials), the gradient sweep, and the
// accurate scalar helpers (log1p, expm1) the target-class terms need.
//
//===----------------------------------------------------------------------===//

#ifndef CE_TRANSFORMS_ROWLOOPBUILDER_H
#define CE_TRANSFORMS_ROWLOOPBUILDER_H

#include "TargetInfo.h"

#include "mlir/Dialect/SCF/IR/SCF.h"
#include "mlir/IR/ImplicitLocOpBuilder.h"
#include "mlir/IR/Value.h"
#include "llvm/ADT/ScopeExit.h"
#include "llvm/ADT/SmallVector.h"

#include <utility>

namespace mlir::ce {

/// The statistics of one logits row. The sum of exponentials is
/// `S = 1 + rest` at scale `max` (the maximum's own term is implicit), which
/// keeps the small terms of a confident row from being rounded away. With a
/// logit scale `s` (RowLoopBuilder::setLogitScale) the exponentials are of
/// z = s x; `max` and the sums stay of x, exact.
struct RowStats {
  Value max;  ///< f32, max_j x_j (-FLT_MAX for an all -inf row, NaN with NaN)
  Value rest; ///< f32, S - 1 where S = sum_j exp(s (x_j - max)) (-1: no x > -inf)
  Value sum;  ///< f32, sum_j x_j, only when requested
  /// f32, mean_j x_j - max, with the sum (label smoothing's term): from
  /// the sum where it is finite and |max| < 2^24, else from the exact
  /// re-sweep's shifted sum, which no finite row overflows.
  Value meanShift;
  /// With the outputs (buildStatistics' `withOutputs`): f32, U = sum_j
  /// exp(s (x_j - max)) (x_j - max) fl(s log2 e) (the entropy is
  /// log1p(rest) - U ln 2 / (1 + rest)), i32, the lowest j with x_j == max
  /// (INT32_MAX for none), and i1, whether the row was swept again exactly
  /// (|s max| >= 2^24, NaN, inf, an overflowing sum): U and the index are
  /// then not of the row (buildOutputsSweep gives its outputs).
  Value entropySum;
  Value bestIndex;
  Value resweep;

  /// The fields a branch yields, in order: max, rest, then sum and
  /// meanShift `withSum`, then entropySum, bestIndex and resweep
  /// `withOutputs`; their types; and the statistics of such fields.
  SmallVector<Value> fields(bool withSum, bool withOutputs) const;
  static SmallVector<Type> fieldTypes(Builder &b, bool withSum,
                                      bool withOutputs);
  static RowStats fromFields(ArrayRef<Value> fields, bool withSum,
                             bool withOutputs);
};

/// The per-token outputs of one row (buildOutputsSweep).
struct RowOutputs {
  Value entropy; ///< f32, sum_j p_j (lse - z_j); NaN where lse is not finite
  Value argmax;  ///< i64, lowest j with x_j == max; -1 for a NaN row
};

/// Where one row lives: the logits memref and the indices in front of the
/// vocabulary index (`[n]` or `[s, b]`).
struct RowRef {
  Value memref;
  SmallVector<Value, 2> prefix;
};

/// Builds `scf.for` whose body `body` returns the values to yield (nothing
/// when `inits` is empty).
scf::ForOp
buildForLoop(ImplicitLocOpBuilder &b, Value lower, Value upper, Value step,
             ValueRange inits,
             function_ref<SmallVector<Value>(Value iv, ValueRange args)> body);

/// Builds a result-less `scf.if`; `elseBody` may be null.
void buildIf(ImplicitLocOpBuilder &b, Value condition,
             function_ref<void()> thenBody, function_ref<void()> elseBody = {});

/// How the sweeps of one row are split over the threads of a workgroup. On
/// the host there is one thread and this is empty.
struct RowThreads {
  Value threadId;            ///< index, in [0, numThreads)
  unsigned numThreads = 1;   ///< workgroup size (x)
  unsigned subgroupSize = 1; ///< warp (32) or wave (64) size
  /// f32 workgroup memory, at least 3 * numSubgroups() elements, used to
  /// combine per-subgroup results.
  Value scratch;
  /// Workgroup memory of the logits' element type (`memref<C x T>`) that
  /// keeps the first whole chunks of a row: the statistics sweep fills it
  /// and a gradient sweep right after it (`afterStatistics`) reads them back
  /// instead of reading the row again from global memory. Null: no cache.
  Value rowCache;
  /// Fill the row cache by asynchronous copies (NVIDIA cp.async), issued
  /// before the rest of the row is swept.
  bool asyncCopy = false;
  /// Workgroup memory of two chunks (`memref<2 chunk x T>`) through which
  /// the statistics sweep streams its chunks by asynchronous copies: the
  /// next chunk's copies are in flight while a chunk is reduced. Null: the
  /// chunks are loaded into registers.
  Value streamRing;
  /// Take a statistics step's maximum of bf16/f16 logits on the loaded
  /// (packed) vectors, before widening (NVIDIA: two per instruction).
  bool packedMax = false;
  /// The target's features (TargetInfo.h): what builds the asynchronous
  /// copies, their groups and waits, and the L2 prefetch. Set whenever
  /// `asyncCopy` is.
  const TargetInfo *target = nullptr;
  /// The share, in eighths of each vector, of the softcap's reciprocals
  /// built from FMAs (TargetInfo::getSoftcapFmaReciprocalEighths; on the
  /// host the NVIDIA share).
  unsigned softcapFmaReciprocalEighths = kSoftcapFmaReciprocalEighths;

  bool enabled() const { return static_cast<bool>(threadId); }
  unsigned numSubgroups() const { return numThreads / subgroupSize; }
};

/// The split of a row: scalar elements [0, head), whole chunks of
/// `unroll` vectors per thread [head, mainEnd), single vectors
/// [mainEnd, vectorEnd), scalar elements [vectorEnd, V).
struct RowRange {
  Value head;
  Value mainEnd;
  Value vectorEnd;
};

class RowLoopBuilder {
public:
  RowLoopBuilder(ImplicitLocOpBuilder &b, unsigned vectorWidth,
                 unsigned unroll, RowThreads threads = {})
      : b(b), vectorWidth(vectorWidth), unroll(unroll), threads(threads) {}

  const RowThreads &getThreads() const { return threads; }

  /// Every exponential of the sweeps is then of z = s x (an f32 value that
  /// dominates the sweeps; null: s = 1): `exp(s (x - m))`, the subtraction
  /// first (exact near the maximum), then one relative rounding, as
  /// `exp2((x - m) * fl(s log2 e))`.
  void setLogitScale(Value scale);
  /// The logit scale, or null for 1.
  Value getLogitScale() const { return logitScale; }

  /// Every loaded logit is then z = cap tanh(s x / cap) (f32 values that
  /// dominate the sweeps; `scale` null: s = 1): the statistics sweeps run on
  /// z, the gradient sweep takes exp of z and multiplies by dz/dx. Used
  /// instead of setLogitScale (the scale is inside z).
  void setLogitSoftcap(Value cap, Value scale);
  /// The softcap, or null.
  Value getLogitSoftcap() const { return softcap; }
  /// Whether the sweeps built next may build part of each vector's softcap
  /// reciprocals from FMAs (RowThreads::softcapFmaReciprocalEighths; on by
  /// default). The two ways round differently, so the same logit in two
  /// lanes can give z an ulp apart: off wherever an argmax is taken of z
  /// (its ties must go to the lowest index), on for the sweeps that only
  /// sum (the plain statistics, the gradient). Returns the previous value.
  bool setSoftcapSplit(bool split) { return std::exchange(softcapSplit, split); }
  /// setSoftcapSplit(false) until the returned guard is destroyed, which
  /// restores the previous value.
  [[nodiscard]] auto softcapSplitOff() {
    bool previous = setSoftcapSplit(false);
    return llvm::scope_exit([this, previous] { setSoftcapSplit(previous); });
  }
  /// z of `x` (scalar or vector): cap tanh(s x / cap) as cap - 2 cap r
  /// (softcapComplement), `x` itself without a softcap.
  Value softcapLogits(Value x);
  /// z and dz/dx = s (1 - t^2) = 4 s r (1 - r) of `x`, from the same r
  /// (needs a softcap).
  std::pair<Value, Value> softcapWithSlope(Value x);
  /// dz/dx of `x` (needs a softcap).
  Value softcapSlope(Value x);

  /// `diff * s` (scalar or vector), `diff` without a scale.
  Value scaleLogits(Value diff);
  /// `exp(s * diff)` (scalar or vector) as `exp2(diff * fl(s log2 e))`.
  Value buildScaledExp(Value diff);
  /// `fl(s log2 e)` (the constant log2 e without a scale), shaped like `like`.
  Value scaledLog2E(Type like = {});

  /// Sweeps `row[0, vocab)` once; `withSum` also accumulates sum_j x_j, as
  /// sum_j (x_j - c) with c the row's first finite element when
  /// `shiftedSum` (an exact mean - max for logits with a common offset; the
  /// raw sum is then sum_j (x_j - c) + V c, which loses digits where it is
  /// small: shard_stats, which stores the raw sum, passes false).
  /// `withOutputs` also accumulates the entropy's sum and the argmax
  /// (RowStats), in the same sweep.
  RowStats buildStatistics(const RowRef &row, Value vocab, bool withSum,
                           bool shiftedSum = true, bool withOutputs = false);

  /// `lse = s max + log1p(rest)`.
  Value buildLogSumExp(const RowStats &stats);

  /// Writes `grad[j] = scale * (exp(z_j - lse) * c - u)` for every j of the
  /// row, z = s x (setLogitScale), reading `x` from `row` and writing into
  /// `grad` (may be the same buffer: each element is read before it is
  /// written). The exponent is `fma(s, x_j, -lse)` (one rounding), minus
  /// `lseLow` when given. With `fromRowMax` (the fused op) `lse` is instead
  /// the row maximum m of x and `lseLow` the log of the sum at that scale,
  /// and the exponent `(x_j - m) s - lseLow` (the subtraction exact near the
  /// maximum), so that its error does not grow with |x| (a rounded f32 lse
  /// costs |lse| * 2^-24 in every exponent).
  /// `afterStatistics`: the statistics sweep of this row just ran in this
  /// workgroup, so a GPU sweep reads the cached chunks from the row cache
  /// and walks the others from the row's end (the most recently read bytes
  /// are the likeliest still in L2).
  void buildGradientSweep(const RowRef &row, const RowRef &grad, Value vocab,
                          Value lse, Value scale, Value c, Value u,
                          bool afterStatistics = false, Value lseLow = {},
                          bool fromRowMax = false);

  /// Sweeps `row` once more after its statistics (the row maximum `rowMax`
  /// of x and `logSum` = log(sum_j exp(s (x_j - rowMax)))) for the
  /// entropy of softmax(z) and the lowest index of the maximum. Every
  /// thread gets both.
  RowOutputs buildOutputsSweep(const RowRef &row, Value vocab, Value rowMax,
                               Value logSum);
  /// The outputs of statistics built `withOutputs`: from their sums where
  /// the main sweep's values hold, else (and for statistics built without)
  /// from buildOutputsSweep.
  RowOutputs buildOutputs(const RowRef &row, Value vocab,
                          const RowStats &stats);

  /// Writes `value` (f32) into every element of the row.
  void buildFill(const RowRef &grad, Value vocab, Value value);

  /// Multiplies every element of the row by `scale` (f32) in place, each
  /// element rounded once to the row's type.
  void buildScaleSweep(const RowRef &row, Value vocab, Value scale);

  /// Loads `row[index]` widened to f32.
  Value loadElement(const RowRef &row, Value index);
  /// Rounds `value` to the row's element type once and stores it.
  void storeElement(const RowRef &row, Value index, Value value);

  /// Accurate `log(1 + x)` (arithmetic only) and `exp(x) - 1` (exp2 and a
  /// Taylor polynomial near 0).
  Value buildLog1p(Value x);
  Value buildExpm1(Value x);

  /// `exp(x)` for f32 x via exp2.
  Value buildExp(Value x);

  /// Scalar or splat f32 constant shaped like `like`.
  Value f32(float value, Type like = {});
  /// The i32 argmax candidate of no element, INT32_MAX (RowStats).
  Value noIndex();
  /// The entropy sums' shift from maximum `from` to `to` >= `from`:
  /// (from - to) fl(s log2 e), at least -2^20 (so that a state that saw
  /// nothing, S = 0, moves to 0, not 0 * -inf).
  Value entropyShift(Value from, Value to);
  Value index(int64_t value);

private:
  /// buildStatistics' main sweep, each exponent one FMA (valid for rows
  /// whose maximum is below 2^24 in magnitude).
  RowStats buildStatisticsSweep(const RowRef &row, Value vocab, bool withSum,
                                bool shiftedSum, bool withOutputs);
  /// The entropy sum `sum` of a state with maximum `from` and total
  /// `total` (1 + rest) moved to the maximum `to` >= `from` (scalars).
  Value moveEntropySum(Value sum, Value total, Value from, Value to);
  /// The thread's best step (i32, the first vector's offset; INT32_MAX for
  /// none) after a statistics step at `first` whose maximum is `stepMax`,
  /// `bestFirst` that of the state whose maximum was `oldMax`: the lowest
  /// step where the thread's maximum occurs.
  Value stepBestStep(Value bestFirst, Value oldMax, Value stepMax,
                     Value first);
  /// The lowest index in the step at `bestFirst` (stepBestStep) of an
  /// element equal to `rowMax`, read again from global memory where the
  /// thread's maximum `threadMax` is the row's; else INT32_MAX.
  Value searchBestStep(const RowRef &row, const RowRange &range,
                       Value bestFirst, Value threadMax, Value rowMax);
  /// `best` (i32, of a state with maximum `max`) where `max` is the row's
  /// `rowMax`, else INT32_MAX.
  Value bestIndexAt(Value best, Value max, Value rowMax);
  /// The i64 argmax of the row's lowest index `best` (i32): 0 where no
  /// element equals the maximum (a row with no value above -inf: all tie).
  Value argmaxOf(Value best);
  /// Merges two (max, rest) states elementwise (scalars or vectors).
  std::pair<Value, Value> combineStates(Value maxA, Value restA, Value maxB,
                                        Value restB);
  /// Runs `body` for vector `k` of a step: directly, or under `valid[k]` in
  /// a masked step.
  void buildIfValid(ArrayRef<Value> valid, size_t k,
                    function_ref<void()> body);
  /// Where this thread's first vector of a step sits past the step's start
  /// (GPUs): thread id x vector width.
  Value threadOffsetOf();
  /// One step of a sweep: the element offsets of its vectors; for the
  /// masked last step of a GPU row, whether each offset is in the row
  /// (empty: all are); the loop state. Returns the next state.
  using StepBody = function_ref<SmallVector<Value>(
      ArrayRef<Value> offsets, ArrayRef<Value> valid, ValueRange state)>;

  /// The vector at `index` in the row's element type, not widened.
  Value loadRawVector(const RowRef &row, Value index);
  /// A raw vector widened to f32.
  Value widen(Value raw);
  /// `vector<W x bf16>` widened to f32 by integer shifts and masks.
  Value widenBF16Pairs(Value value);
  /// The row cache slot of the vector at row offset `index`.
  Value cacheSlot(const RowRange &range, Value index);
  /// The row cache's copy of the vector at row offset `index`.
  Value loadCachedVector(const RowRange &range, Value index);
  /// The stream ring's copy of the vector at row offset `index`.
  Value loadRingVector(const RowRange &range, Value index);
  void storeCachedVector(const RowRange &range, Value index, Value raw);
  /// Starts an asynchronous copy of the vector at `index` into its slot of
  /// the row cache.
  void copyToCache(const RowRef &row, const RowRange &range, Value index);
  /// Starts an asynchronous copy of the vector at `index` into `slot` of
  /// the workgroup memory `buffer`.
  void copyToSlot(const RowRef &row, Value index, Value buffer, Value slot);
  /// The chunks of `range` streamed through `threads.streamRing`.
  SmallVector<Value> buildStreamedChunks(const RowRef &row,
                                         const RowRange &range,
                                         ValueRange inits, StepBody body);
  /// What of a row the row cache holds: the chunks in [head, chunksEnd)
  /// and, when `remainder` (i1) holds, also the vectors in
  /// [mainEnd, vectorEnd) (then chunksEnd = mainEnd). Null without a cache.
  struct CacheSplit {
    Value chunksEnd;
    Value remainder;
    explicit operator bool() const { return static_cast<bool>(chunksEnd); }
  };
  CacheSplit cacheSplitOf(const RowRange &range);
  /// Asynchronous copies of the row's cached vectors into the row cache, a
  /// group per chunk of the cache (cacheChunks(), empty past the row), then
  /// one for the remainder.
  void buildCacheCopies(const RowRef &row, const RowRange &range,
                        const CacheSplit &split);
  /// Whole chunks the row cache holds.
  int64_t cacheChunks() const;
  /// Closes the asynchronous copies issued so far into a group (an empty
  /// one if there are none); returns its token.
  Value commitCopies();
  /// Bytes per element of `row`'s logits.
  static int64_t elementBytes(const RowRef &row);
  /// The byte address of element `index` of `row` (from the buffer's
  /// aligned pointer, offset and strides).
  Value addressOf(const RowRef &row, Value index);
  /// Thread 0 starts a bulk prefetch of the vectors [begin, end) of `row`
  /// into L2 (NVIDIA sm_90).
  void prefetchToL2(const RowRef &row, Value begin, Value end);
  /// The vectors left after the chunks: `cached` when the split's
  /// remainder is in the cache, else `uncached` (either may be null: that
  /// case passes `state` through).
  SmallVector<Value> buildSplitRemainder(const RowRange &range,
                                         const CacheSplit &split,
                                         ValueRange state, StepBody cached,
                                         StepBody uncached);
  void storeVector(const RowRef &row, Value index, Value value);
  /// Where the vector steps of `row` start and end: at 0 on the host, at
  /// the first 16-byte boundary on GPUs (aligned vector accesses).
  RowRange rangeOf(const RowRef &row, Value vocab);
  llvm::MaybeAlign alignment() const;
  /// Elements one chunk of the vector loop covers: the workgroup's threads
  /// times `unroll` vectors.
  int64_t chunkSize() const;
  /// Elements between a thread's consecutive vectors of a step: vector width
  /// times the workgroup size (a chunk is `unroll` of them).
  int64_t threadStride() const;
  /// The offsets of a thread's `unroll` vectors in the step at `first`.
  SmallVector<Value, 8> stepOffsets(Value first);
  /// Builds this thread's share of the vector part of a sweep: chunks of
  /// `unroll` vectors, then the vectors left. `lastFirst` (GPUs): the
  /// vectors left, then the chunks from last to first.
  SmallVector<Value> buildVectorLoops(const RowRange &range, ValueRange inits,
                                      StepBody body, bool lastFirst = false);
  /// The chunks of [begin, end) (whole chunks from the row's head), from
  /// last to first with `lastFirst`.
  SmallVector<Value> buildChunkLoop(Value begin, Value end, ValueRange inits,
                                    StepBody body, bool lastFirst);
  /// The vectors in [mainEnd, vectorEnd): on GPUs one masked step (at most
  /// `unroll` vectors per thread, loads issued together) for the threads
  /// whose first vector is in the row; their offsets past the row are
  /// clamped to that first vector (so each thread reads only what it owns)
  /// and reported invalid. On the host a loop of single vectors.
  SmallVector<Value> buildRemainder(const RowRange &range, ValueRange state,
                                    StepBody body);
  /// Builds this thread's share of scalar elements in [begin, end).
  scf::ForOp buildTailLoop(
      Value begin, Value end, ValueRange inits,
      function_ref<SmallVector<Value>(Value, ValueRange)> body);
  /// The scalar head, then the scalar tail, carrying `inits` through both.
  SmallVector<Value> buildScalarLoops(
      const RowRange &range, Value vocab, ValueRange inits,
      function_ref<SmallVector<Value>(Value, ValueRange)> body);
  /// Combines the (max, rest) states, or the sums, of all threads; every
  /// thread gets the result. Identity on the host.
  std::pair<Value, Value> allReduceState(Value max, Value rest);
  /// Combines the states of each group of `width` (a power of two) lanes
  /// by xor shuffles; every lane of a group gets the group's state.
  std::pair<Value, Value> butterflyState(Value max, Value rest,
                                         unsigned width);
  Value allReduceSum(Value sum);
  /// The smallest i32 of all threads; every thread gets it.
  Value allReduceMinIndex(Value index);
  /// Combines one f32 or i32 value of all threads by `combine`, in the same
  /// order on every thread (deterministic).
  Value allReduceWith(Value value,
                      function_ref<Value(Value, Value)> combine);

  ImplicitLocOpBuilder &b;
  unsigned vectorWidth;
  unsigned unroll;
  RowThreads threads;
  Value logitScale;    ///< f32 s, or null for 1
  Value logitScaleLog2E; ///< f32 fl(s log2 e), with logitScale
  Value softcap;         ///< f32 cap, or null
  Value softcapScale;    ///< f32 s of a softcap, or null for 1
  Value softcapInner;    ///< f32 k = fl(s / cap) 2 log2 e, with softcap
  Value softcapNegTwoCap; ///< f32 -2 cap, with softcap
  Value softcapFourScale; ///< f32 4 s, with softcap
  bool softcapSplit = true; ///< setSoftcapSplit
  /// r = 1 / (1 + 2^(x k)) = (1 - tanh(s x / cap)) / 2, in [0, 1].
  Value softcapComplement(Value x);
  /// 1 / a of f32 a >= 1 (a vector or a scalar): the first
  /// softcapFmaReciprocalEighths of each vector's lanes from FMAs, the
  /// others by the target's approximate reciprocal.
  Value softcapReciprocal(Value a);
  /// z = cap - 2 cap r of r = softcapComplement(x).
  Value softcapFromComplement(Value r);
  /// loadElement, then softcapLogits.
  Value loadLogit(const RowRef &row, Value index) {
    return softcapLogits(loadElement(row, index));
  }
};

} // namespace mlir::ce

#endif // CE_TRANSFORMS_ROWLOOPBUILDER_H
