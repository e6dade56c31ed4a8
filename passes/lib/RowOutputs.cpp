//===- RowOutputs.cpp - The per-token outputs -----------------------------===//
//
// The entropy and argmax outputs of ce.forward, ce.fused and ce.shard_stats
// (flag bits 4 and 5). The statistics sweep accumulates them (its
// `withOutputs`): per lane the entropy's sum U = sum_j t_j (x_j - m) L, t_j
// = exp(s (x_j - m)), L = fl(s log2 e), moved with the running maximum like
// the sum of exponentials, and per thread the step where its maximum first
// occurs (scalar selects), read again for the index once the row's maximum
// is known, by the threads that hold it. The helpers for that live
// here, with the outputs built from them: H = log S - U ln 2 / S. A row the
// statistics sweep a second time (|s max| >= 2^24, NaN, inf) gets its
// outputs from a sweep of their own instead: each row's entropy of
// softmax(z), as sum_j p_j (lse - z_j), and the lowest index of its maximum
// (-1 where it has a NaN). With a softcap every element is z as the
// statistics sweep made it (the maximum is of z, and so are the argmax and
// its ties).
//
//===----------------------------------------------------------------------===//

#include "RowLoopBuilder.h"
#include "RowLoopInternal.h"

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/Math/IR/Math.h"
#include "mlir/Dialect/Vector/IR/VectorOps.h"

#include "llvm/ADT/ScopeExit.h"

#include <limits>

using namespace mlir;
using namespace mlir::ce;
using namespace mlir::ce::detail;

/// The i32 vectors (0, 1, .., W - 1) and (INT32_MAX, ..): a vector's lane
/// indices and its argmax candidates of no element.
static std::pair<Value, Value> laneIndices(ImplicitLocOpBuilder &b,
                                           VectorType indexType) {
  SmallVector<int32_t> lanes(indexType.getNumElements());
  for (auto [k, lane] : llvm::enumerate(lanes))
    lane = static_cast<int32_t>(k);
  Value iota = arith::ConstantOp::create(
      b, indexType, DenseElementsAttr::get(indexType, ArrayRef(lanes)));
  Value none = arith::ConstantOp::create(
      b, indexType, DenseElementsAttr::get(indexType, kNoIndex));
  return {iota, none};
}

/// The indices of the vector at `offset` (index type): offset + (0, 1, ..,
/// W - 1) as i32, `iota` from laneIndices.
static Value vectorIndices(ImplicitLocOpBuilder &b, Value offset, Value iota) {
  auto indexType = cast<VectorType>(iota.getType());
  Value first = arith::IndexCastOp::create(b, indexType.getElementType(), offset);
  return arith::AddIOp::create(
      b, vector::BroadcastOp::create(b, indexType, first), iota);
}

RowOutputs RowLoopBuilder::buildOutputsSweep(const RowRef &row, Value vocab,
                                             Value rowMax, Value logSum) {
  // One vector per thread and step: the sweep's registers (loads, the Kahan
  // sums, the indices) count against the whole kernel's budget even where
  // its branch is not taken, and the fused kernel's occupancy depends on it.
  unsigned savedUnroll = unroll;
  unroll = 1;
  llvm::scope_exit restoreUnroll([&] { unroll = savedUnroll; });
  Type i32 = b.getI32Type();
  auto vectorType = VectorType::get({vectorWidth}, b.getF32Type());
  auto indexType = VectorType::get({vectorWidth}, i32);
  // log2 p_j = (x_j - m) fl(s log2 e) - L log2 e: the subtraction exact near
  // the maximum, as the fused gradient's exponent (with a softcap x_j is z_j
  // and s is 1: the scale is inside z). A term is p log2 p, 0 where p is (a
  // -inf logit's p = 0 would make it 0 * -inf).
  Value negLog2Sum = arith::MulFOp::create(b, logSum, f32(-kLog2E));
  auto terms = [&](Value x, Value indices, Type type,
                   Type idxType) -> std::pair<Value, Value> {
    auto splat = [&](Value s, Type t) -> Value {
      return isa<VectorType>(t) ? vector::BroadcastOp::create(b, t, s)
                                : s;
    };
    Value log2p = math::FmaOp::create(
        b, arith::SubFOp::create(b, x, splat(rowMax, type)), scaledLog2E(type),
        splat(negLog2Sum, type));
    Value p = math::Exp2Op::create(b, log2p);
    Value positive = arith::CmpFOp::create(b, arith::CmpFPredicate::OGT, p,
                                           f32(0.0f, type));
    Value term = arith::SelectOp::create(
        b, positive, arith::MulFOp::create(b, p, log2p), f32(0.0f, type));
    Value isMax = arith::CmpFOp::create(b, arith::CmpFPredicate::OEQ, x,
                                        splat(rowMax, type));
    Value none = arith::ConstantOp::create(
        b, idxType,
        isa<VectorType>(idxType)
            ? cast<TypedAttr>(DenseElementsAttr::get(
                  cast<ShapedType>(idxType), b.getI32IntegerAttr(kNoIndex)))
            : cast<TypedAttr>(b.getI32IntegerAttr(kNoIndex)));
    // A NaN element is -1, below every index: the row's argmax is then -1
    // whatever the statistics' maximum says (a vector maximum may drop NaNs).
    // Unordered against the maximum, not against x itself: LLVM narrows
    // `isnan(fpext bf16)` to a bf16 compare, which NVPTX prints with an
    // illegal .ftz (ptxas refuses setp.nan.ftz.bf16); a NaN maximum flags
    // every element, rightly.
    Value isNaN = arith::CmpFOp::create(b, arith::CmpFPredicate::UNO, x,
                                        splat(rowMax, type));
    Value minusOne = arith::ConstantOp::create(
        b, idxType,
        isa<VectorType>(idxType)
            ? cast<TypedAttr>(DenseElementsAttr::get(cast<ShapedType>(idxType),
                                                     b.getI32IntegerAttr(-1)))
            : cast<TypedAttr>(b.getI32IntegerAttr(-1)));
    Value candidate = arith::SelectOp::create(
        b, isNaN, minusOne, arith::SelectOp::create(b, isMax, indices, none));
    return {term, candidate};
  };
  auto toI32 = [&](Value offset) -> Value {
    return arith::IndexCastOp::create(b, i32, offset);
  };
  auto [iota, noneVector] = laneIndices(b, indexType);
  // The terms are summed with Kahan's compensation (sum, lost): a lane adds
  // V / (threads x width) terms one after another, whose plain f32 sum drifts
  // by ~1e-5 relative at V = 32000 on one thread.
  auto kahan = [&](Value sum, Value lost, Value term) -> std::pair<Value, Value> {
    Value y = arith::SubFOp::create(b, term, lost);
    Value total = arith::AddFOp::create(b, sum, y);
    Value newLost = arith::SubFOp::create(
        b, arith::SubFOp::create(b, total, sum), y);
    return {total, newLost};
  };
  RowRange range = rangeOf(row, vocab);
  SmallVector<Value> vectorState = buildVectorLoops(
      range, {f32(0.0f, vectorType), f32(0.0f, vectorType), noneVector},
      [&](ArrayRef<Value> offsets, ArrayRef<Value> valid,
          ValueRange state) -> SmallVector<Value> {
        // Load the whole step first so the loads are in flight together.
        SmallVector<Value, 8> xs;
        for (Value offset : offsets)
          xs.push_back(softcapLogits(widen(loadRawVector(row, offset))));
        Value sum = state[0], lost = state[1], best = state[2];
        for (auto [k, x] : llvm::enumerate(xs)) {
          Value indices = vectorIndices(b, offsets[k], iota);
          auto [term, candidate] = terms(x, indices, vectorType, indexType);
          if (!valid.empty()) {
            term = arith::SelectOp::create(b, valid[k], term,
                                           f32(0.0f, vectorType));
            candidate =
                arith::SelectOp::create(b, valid[k], candidate, noneVector);
          }
          std::tie(sum, lost) = kahan(sum, lost, term);
          best = arith::MinSIOp::create(b, best, candidate);
        }
        return {sum, lost, best};
      },
      /*lastFirst=*/threads.enabled());
  Value sum = vector::ReductionOp::create(
      b, vector::CombiningKind::ADD,
      arith::SubFOp::create(b, vectorState[0], vectorState[1]));
  Value best = vector::ReductionOp::create(b, vector::CombiningKind::MINSI,
                                           vectorState[2]);
  SmallVector<Value> scalarState = buildScalarLoops(
      range, vocab, {sum, f32(0.0f), best},
      [&](Value j, ValueRange state) -> SmallVector<Value> {
        Value x = loadLogit(row, j);
        auto [term, candidate] = terms(x, toI32(j), b.getF32Type(), i32);
        auto [total, lost] = kahan(state[0], state[1], term);
        return {total, lost, arith::MinSIOp::create(b, state[2], candidate)};
      });
  sum = allReduceSum(
      arith::SubFOp::create(b, scalarState[0], scalarState[1]));
  best = allReduceMinIndex(scalarState[2]);
  RowOutputs outputs;
  // H = -ln 2 sum_j p_j log2 p_j; NaN where lse is not finite (a NaN or
  // +inf logit, or no logit above -inf).
  Value lse = arith::AddFOp::create(b, scaleLogits(rowMax), logSum);
  Value finite = arith::CmpFOp::create(b, arith::CmpFPredicate::OLT,
                                       math::AbsFOp::create(b, lse), f32(kInf));
  outputs.entropy = arith::SelectOp::create(
      b, finite, arith::MulFOp::create(b, sum, f32(-kLn2)),
      f32(std::numeric_limits<float>::quiet_NaN()));
  // -1: the row has a NaN. No element equals the -FLT_MAX of a row with no
  // value above -inf (all tie: 0).
  outputs.argmax = argmaxOf(best);
  return outputs;
}

Value RowLoopBuilder::argmaxOf(Value best) {
  Value found =
      arith::CmpIOp::create(b, arith::CmpIPredicate::ne, best, noIndex());
  return arith::SelectOp::create(
      b, found, arith::ExtSIOp::create(b, b.getI64Type(), best),
      arith::ConstantOp::create(b, b.getI64IntegerAttr(0)));
}

Value RowLoopBuilder::entropyShift(Value from, Value to) {
  return arith::MaximumFOp::create(
      b, arith::MulFOp::create(b, arith::SubFOp::create(b, from, to),
                               scaledLog2E()),
      f32(-0x1p20f));
}

Value RowLoopBuilder::moveEntropySum(Value sum, Value total, Value from,
                                     Value to) {
  // U' = r (U + delta S), r = 2^delta.
  Value delta = entropyShift(from, to);
  return arith::MulFOp::create(b, math::FmaOp::create(b, delta, total, sum),
                               math::Exp2Op::create(b, delta));
}

Value RowLoopBuilder::bestIndexAt(Value best, Value max, Value rowMax) {
  Value holds =
      arith::CmpFOp::create(b, arith::CmpFPredicate::OEQ, max, rowMax);
  return arith::SelectOp::create(b, holds, best, noIndex());
}

Value RowLoopBuilder::stepBestStep(Value bestFirst, Value oldMax,
                                   Value stepMax, Value first) {
  // Scalar selects, no branch: a step that raises the thread's maximum
  // becomes its best step, one that ties it keeps the lower of the two (the
  // vector loops may visit a thread's steps out of order; a step's vectors
  // all lie below the next step's).
  Value firstIndex = arith::IndexCastOp::create(b, b.getI32Type(), first);
  Value grew =
      arith::CmpFOp::create(b, arith::CmpFPredicate::OGT, stepMax, oldMax);
  Value ties =
      arith::CmpFOp::create(b, arith::CmpFPredicate::OEQ, stepMax, oldMax);
  Value kept = arith::SelectOp::create(
      b, ties, arith::MinSIOp::create(b, bestFirst, firstIndex), bestFirst);
  return arith::SelectOp::create(b, grew, firstIndex, kept);
}

Value RowLoopBuilder::searchBestStep(const RowRef &row, const RowRange &range,
                                     Value bestFirst, Value threadMax,
                                     Value rowMax) {
  // Only a thread that holds the row's maximum and saw it in its vectors
  // reads its best step again (`unroll` vectors, from global memory: the
  // row cache and the ring hold other chunks by now).
  Type i32 = b.getI32Type();
  Value holds = arith::AndIOp::create(
      b,
      arith::CmpFOp::create(b, arith::CmpFPredicate::OEQ, threadMax, rowMax),
      arith::CmpIOp::create(b, arith::CmpIPredicate::ne, bestFirst,
                            noIndex()));
  return buildIfYield(
      b, holds, TypeRange{i32},
      [&] {
        auto vectorType = VectorType::get({vectorWidth}, b.getF32Type());
        auto indexType = VectorType::get({vectorWidth}, i32);
        auto [iota, none] = laneIndices(b, indexType);
        Value first = arith::IndexCastOp::create(b, b.getIndexType(), bestFirst);
        Value splatMax = vector::BroadcastOp::create(b, vectorType, rowMax);
        Value candidates = none;
        // The step's vectors, as stepOffsets made them; those of a masked
        // step past the row are not read (the first one, always in the
        // row, is read in their place and not counted).
        for (Value offset : stepOffsets(first)) {
          Value inRow = arith::CmpIOp::create(b, arith::CmpIPredicate::ult,
                                              offset, range.vectorEnd);
          Value x = softcapLogits(widen(loadRawVector(
              row, arith::SelectOp::create(b, inRow, offset, first))));
          Value isMax = arith::AndIOp::create(
              b,
              arith::CmpFOp::create(b, arith::CmpFPredicate::OEQ, x, splatMax),
              vector::BroadcastOp::create(
                  b, VectorType::get({vectorWidth}, b.getI1Type()), inRow));
          candidates = arith::MinSIOp::create(
              b, candidates,
              arith::SelectOp::create(b, isMax, vectorIndices(b, offset, iota),
                                      none));
        }
        return SmallVector<Value>{vector::ReductionOp::create(
            b, vector::CombiningKind::MINSI, candidates)};
      },
      [&] { return SmallVector<Value>{noIndex()}; })[0];
}

RowOutputs RowLoopBuilder::buildOutputs(const RowRef &row, Value vocab,
                                        const RowStats &stats) {
  if (!stats.entropySum)
    return buildOutputsSweep(row, vocab, stats.max, buildLog1p(stats.rest));
  SmallVector<Value> values = buildIfYield(
      b, stats.resweep, TypeRange{b.getF32Type(), b.getI64Type()},
      [&] {
        RowOutputs swept = buildOutputsSweep(row, vocab, stats.max,
                                             buildLog1p(stats.rest));
        return SmallVector<Value>{swept.entropy, swept.argmax};
      },
      [&] {
        // H = log S - U ln 2 / S, S = 1 + rest (both terms >= 0: no
        // cancellation).
        Value total = arith::AddFOp::create(b, stats.rest, f32(1.0f));
        Value entropy = math::FmaOp::create(
            b, f32(-kLn2), arith::DivFOp::create(b, stats.entropySum, total),
            buildLog1p(stats.rest));
        return SmallVector<Value>{entropy, argmaxOf(stats.bestIndex)};
      });
  return {values[0], values[1]};
}
