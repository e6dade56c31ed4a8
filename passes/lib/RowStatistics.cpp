//===- RowStatistics.cpp - The statistics sweep ---------------------------===//
//
// The online-softmax state algebra (per-step (max, rest) states with the
// FMA exponent, their merging) and the statistics sweep built on it,
// with the exact re-sweep of rows whose maximum is past 2^24, and the
// log-sum-exp.
//
//===----------------------------------------------------------------------===//

#include "RowLoopBuilder.h"
#include "RowLoopInternal.h"
#include "TargetInfo.h"

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/GPU/IR/GPUDialect.h"
#include "mlir/Dialect/Math/IR/Math.h"
#include "mlir/Dialect/MemRef/IR/MemRef.h"
#include "mlir/Dialect/SCF/IR/SCF.h"
#include "mlir/Dialect/Vector/IR/VectorOps.h"

using namespace mlir;
using namespace mlir::ce;
using namespace mlir::ce::detail;

/// The exponentials of `xs` at the maximum `max` (shaped like them), summed
/// twice: without the maximum's copies and with them. Per element one
/// select; the difference of the two sums (at most xs.size() apart, off by a
/// few ulps) rounds to the maxima's count.
///
/// With `negScaledMax` = -fl(max log2 e) (scalar or shaped like `xs`), each
/// exponent is one FMA, `x log2 e - fl(max log2 e)`, instead of a subtract
/// and a multiply; every term then carries the same factor 2^d, d = max log2
/// e - fl(max log2 e) (|d| <= half an ulp of the scaled maximum), which the
/// caller takes out of the small terms (the maximum's own terms are 2^d, not
/// exactly 1, which the count's rounding absorbs). Without it the exponent is
/// `(x - max) log2 e` and the maximum's terms are exactly 1.
///
/// `weighted` (with `negScaledMax`): also sum_k e_k a_k, a_k the exponent
/// (the entropy's sum before its residual is taken out). Only where `masked`
/// (a step with lanes past the row, which are -inf) is a_k clamped to at
/// least -256, so that those lanes add 0 * -256: elsewhere a -inf logit
/// makes the sum 0 * -inf = NaN, and its row takes the outputs' separate
/// sweep (buildStatistics). One FMA an element, no maximumf.
static std::pair<Value, Value> sumTerms(RowLoopBuilder &rows,
                                        ImplicitLocOpBuilder &b,
                                        ArrayRef<Value> xs, Value max,
                                        Value negScaledMax = {},
                                        Value *weighted = nullptr,
                                        bool masked = false) {
  Value zero = rows.f32(0.0f, max.getType());
  Value log2e = negScaledMax ? rows.scaledLog2E(max.getType()) : Value();
  Value smallTerms, allTerms;
  for (Value x : xs) {
    Value isMax = arith::CmpFOp::create(b, arith::CmpFPredicate::OEQ, x, max);
    Value exponent =
        negScaledMax ? math::FmaOp::create(b, x, log2e, negScaledMax).getResult()
                     : Value();
    Value e = negScaledMax
                  ? math::Exp2Op::create(b, exponent).getResult()
                  : rows.buildScaledExp(arith::SubFOp::create(b, x, max));
    if (weighted) {
      Value a = masked ? arith::MaximumFOp::create(
                             b, exponent, rows.f32(-256.0f, max.getType()))
                             .getResult()
                       : exponent;
      *weighted = *weighted ? math::FmaOp::create(b, e, a, *weighted).getResult()
                            : arith::MulFOp::create(b, e, a).getResult();
    }
    Value term = arith::SelectOp::create(b, isMax, zero, e);
    smallTerms = smallTerms ? arith::AddFOp::create(b, smallTerms, term)
                            : term;
    allTerms = allTerms ? arith::AddFOp::create(b, allTerms, e) : e;
  }
  return {smallTerms, allTerms};
}

/// One online-softmax step of a state (max, rest) over the values `xs`
/// (scalars or vectors of the state's shape): the new maximum rescales the
/// old sum once. The maximum's own exp(0) = 1 becomes the implicit term:
/// elements equal to the new maximum are counted as exact ones instead of
/// being summed with the small terms, which would round those away.
///
/// States start at (kNoMax, -1): a finite maximum that any real value
/// replaces, and no implicit 1 yet. So the per-element work is a compare,
/// `exp(x - max)` (subtract, scale, exp2: the subtraction is exact for the
/// values near the maximum that matter), two selects and two adds, with no
/// -inf special case (a -inf element is exp2(-inf) = 0).
static std::pair<Value, Value> stepState(RowLoopBuilder &rows,
                                         ImplicitLocOpBuilder &b, Value max,
                                         Value rest, ArrayRef<Value> xs) {
  Value tileMax = xs.front();
  for (Value x : xs.drop_front())
    tileMax = arith::MaximumFOp::create(b, tileMax, x);
  Value newMax = arith::MaximumFOp::create(b, max, tileMax);
  Value rescale = rows.buildScaledExp(arith::SubFOp::create(b, max, newMax));
  Type type = max.getType();
  Value zero = rows.f32(0.0f, type), one = rows.f32(1.0f, type);
  Value grew = arith::CmpFOp::create(b, arith::CmpFPredicate::OGT, newMax, max);
  auto [smallTerms, allTerms] = sumTerms(rows, b, xs, newMax);
  Value maxCount = math::RoundEvenOp::create(
      b, arith::SubFOp::create(b, allTerms, smallTerms));
  // When the maximum grew, one of its copies is the new implicit 1 and the
  // old implicit 1 joins the rescaled rest; both adjustments are exact.
  Value moved = arith::SelectOp::create(b, grew, one, zero);
  Value carried = arith::MulFOp::create(
      b, arith::AddFOp::create(b, rest, moved), rescale);
  Value extraOnes = arith::SubFOp::create(b, maxCount, moved);
  Value newRest = arith::AddFOp::create(
      b, carried, arith::AddFOp::create(b, smallTerms, extraOnes));
  return {newMax, newRest};
}

/// 2^-d for the residual d of a scaled maximum (|d| <= 64): 1 - d ln 2 when
/// |d| <= 2^-12 (exact to f32 precision, which exp2's approximations near 1
/// are not), else exp2(-d).
static Value unscaleOf(RowLoopBuilder &rows, ImplicitLocOpBuilder &b,
                       Value residual) {
  Value tiny = arith::CmpFOp::create(b, arith::CmpFPredicate::OLE,
                                     math::AbsFOp::create(b, residual),
                                     rows.f32(0x1p-12f));
  return arith::SelectOp::create(
      b, tiny,
      math::FmaOp::create(b, residual, rows.f32(-kLn2), rows.f32(1.0f)),
      math::Exp2Op::create(b, arith::NegFOp::create(b, residual)));
}

/// The maximum of the elements of the vectors `xs`, as a scalar of their
/// element type (NaN if any is NaN).
static Value maximumOf(ImplicitLocOpBuilder &b, ArrayRef<Value> xs) {
  Value tileMax = xs.front();
  for (Value x : xs.drop_front())
    tileMax = arith::MaximumFOp::create(b, tileMax, x);
  return vector::ReductionOp::create(b, vector::CombiningKind::MAXIMUMF,
                                     tileMax);
}

/// The main sweep's step: one maximum per thread (a scalar) and the rest as
/// a vector of partial sums (`S = 1 + sum of its lanes`), so that the
/// bookkeeping of a step (new maximum, rescale, the maxima's count) is done
/// once per `unroll * width` elements instead of once per lane.
///
/// The exponents are one FMA each (sumTerms), at c = fl(m log2 e) capped
/// below at -2^25 (so c is finite for every state, the initial -FLT_MAX
/// included). Every term carries 2^d, d = m log2 e - c (exact by FMA;
/// |d| <= 1 for |m| < 2^24), which the step takes out of the small terms and
/// the count: by 1 - d ln 2 when |d| <= 2^-12 (every |m| < 2839), else by
/// exp2(-d). A state whose maximum is below -2^24 gets finite but meaningless
/// terms; it is either rescaled to 0 by a later, larger maximum or it is the
/// row's maximum, and buildStatistics sweeps a row whose maximum is not below
/// 2^24 in magnitude again with exact subtractions.
/// `stepMax`: the maximum of `xs` when the caller has it (f32), else null.
/// `rest` holds only the small terms, per lane; `extra` (a scalar, updated
/// in place) the rest of S = 1 + extra + sum of the lanes: the copies of the
/// maximum beyond the implicit 1 (an integer), or, once the maximum has
/// grown, the old state's rescaled total. Kept out of the lanes: on lane 0 a
/// count of 1 or more would take the bits of every small term added to it
/// after (terms of 2^-21 onto 2.0 kept two bits of their 24: lse off by
/// 1.4e-5 at V = 32000 with two tied maxima).
/// `entropySum` (a vector like `rest`, with the outputs): the per-lane
/// entropy sums U (RowStats), updated in place; `masked`: the step has lanes
/// past the row (sumTerms).
static std::pair<Value, Value> stepRowState(RowLoopBuilder &rows,
                                            ImplicitLocOpBuilder &b, Value max,
                                            Value rest, Value &extra,
                                            ArrayRef<Value> xs, Value stepMax,
                                            Value *entropySum = nullptr,
                                            bool masked = false) {
  auto type = cast<VectorType>(rest.getType());
  auto splat = [&](Value scalar) -> Value {
    return vector::BroadcastOp::create(b, type, scalar);
  };
  if (!stepMax)
    stepMax = maximumOf(b, xs);
  Value newMax = arith::MaximumFOp::create(b, max, stepMax);
  Value rescale = rows.buildScaledExp(arith::SubFOp::create(b, max, newMax));
  Value grew = arith::CmpFOp::create(b, arith::CmpFPredicate::OGT, newMax, max);
  // With a logit scale s, log2 e is fl(s log2 e) throughout: the terms are
  // exp2(x fl(s log2 e) - c), c = fl(m fl(s log2 e)), whose error is one
  // rounding of (x - m) s log2 e + d, never that of s x or s m.
  Value log2e = rows.scaledLog2E();
  Value negScaled = arith::MinimumFOp::create(
      b, arith::NegFOp::create(b, arith::MulFOp::create(b, newMax, log2e)),
      rows.f32(kMaxNegScaledMax));
  Value residual = arith::MaximumFOp::create(
      b, math::FmaOp::create(b, newMax, log2e, negScaled),
      rows.f32(-64.0f));
  Value unscale = unscaleOf(rows, b, residual);
  Value weighted;
  auto [smallTerms, allTerms] =
      sumTerms(rows, b, xs, splat(newMax), splat(negScaled),
               entropySum ? &weighted : nullptr, masked);
  if (entropySum) {
    // The terms are t 2^d with exponents a = (x - m) L + d (L = fl(s log2
    // e)): sum t (x - m) L = 2^-d (sum e a - d sum e). The old sums move to
    // the new maximum as U' = r (U + delta S), delta = (m_old - m) L <= 0
    // (at least -2^20: a first maximum from -FLT_MAX has r = 0 and S = 0),
    // r = exp2(delta), S the old total (1 + extra on lane 0).
    Value stepSum = arith::MulFOp::create(
        b,
        math::FmaOp::create(b, arith::NegFOp::create(b, splat(residual)),
                            allTerms, weighted),
        splat(unscale));
    Value delta = rows.entropyShift(max, newMax);
    Value moved = math::FmaOp::create(b, splat(delta), rest, *entropySum);
    Value lane = vector::ExtractOp::create(b, moved, ArrayRef<int64_t>{0});
    moved = vector::InsertOp::create(
        b,
        math::FmaOp::create(b, delta,
                            arith::AddFOp::create(b, extra, rows.f32(1.0f)),
                            lane),
        moved, ArrayRef<int64_t>{0});
    *entropySum = math::FmaOp::create(b, moved, splat(rescale), stepSum);
  }
  Value maxCount = math::RoundEvenOp::create(
      b, arith::MulFOp::create(
             b,
             vector::ReductionOp::create(
                 b, vector::CombiningKind::ADD,
                 arith::SubFOp::create(b, allTerms, smallTerms)),
             unscale));
  // rest' = rest rescale + small 2^-d per lane, and extra' = (extra +
  // moved) rescale + (count - moved); `moved` is the old implicit 1 when
  // the maximum grew (rescale is exactly 1 when it did not).
  Value moved = arith::SelectOp::create(b, grew, rows.f32(1.0f), rows.f32(0.0f));
  extra = math::FmaOp::create(b, arith::AddFOp::create(b, extra, moved),
                              rescale,
                              arith::SubFOp::create(b, maxCount, moved));
  Value newRest = math::FmaOp::create(
      b, rest, splat(rescale),
      arith::MulFOp::create(b, smallTerms, splat(unscale)));
  return {newMax, newRest};
}

std::pair<Value, Value> RowLoopBuilder::combineStates(Value maxA, Value restA,
                                                      Value maxB,
                                                      Value restB) {
  Type type = maxA.getType();
  Value aOnTop =
      arith::CmpFOp::create(b, arith::CmpFPredicate::OGE, maxA, maxB);
  Value topMax = arith::SelectOp::create(b, aOnTop, maxA, maxB);
  Value topRest = arith::SelectOp::create(b, aOnTop, restA, restB);
  Value lowMax = arith::SelectOp::create(b, aOnTop, maxB, maxA);
  Value lowRest = arith::SelectOp::create(b, aOnTop, restB, restA);
  // The lower state's sum, its implicit 1 included (0 for a state that saw
  // no value > -inf: its rest is -1).
  Value lowSum = arith::AddFOp::create(b, lowRest, f32(1.0f, type));
  Value scale = buildScaledExp(arith::SubFOp::create(b, lowMax, topMax));
  Value rest = arith::AddFOp::create(
      b, topRest, arith::MulFOp::create(b, lowSum, scale));
  return {topMax, rest};
}

SmallVector<Value> RowStats::fields(bool withSum, bool withOutputs) const {
  SmallVector<Value> values = {max, rest};
  if (withSum)
    values.append({sum, meanShift});
  if (withOutputs)
    values.append({entropySum, bestIndex, resweep});
  return values;
}

SmallVector<Type> RowStats::fieldTypes(Builder &b, bool withSum,
                                       bool withOutputs) {
  SmallVector<Type> types(withSum ? 4 : 2, b.getF32Type());
  if (withOutputs)
    types.append({b.getF32Type(), b.getI32Type(), b.getI1Type()});
  return types;
}

RowStats RowStats::fromFields(ArrayRef<Value> fields, bool withSum,
                              bool withOutputs) {
  RowStats stats{fields[0], fields[1]};
  size_t next = 2;
  if (withSum) {
    stats.sum = fields[2];
    stats.meanShift = fields[3];
    next = 4;
  }
  if (withOutputs) {
    stats.entropySum = fields[next];
    stats.bestIndex = fields[next + 1];
    stats.resweep = fields[next + 2];
  }
  return stats;
}

RowStats RowLoopBuilder::buildStatistics(const RowRef &row, Value vocab,
                                         bool withSum, bool shiftedSum,
                                         bool withOutputs) {
  RowStats stats =
      buildStatisticsSweep(row, vocab, withSum, shiftedSum, withOutputs);
  Value vocabF32 = arith::UIToFPOp::create(
      b, b.getF32Type(),
      arith::IndexCastUIOp::create(b, b.getI64Type(), vocab));
  // Outside |max| < 2^24 the folded exponents are unusable (stepRowState):
  // such a row (and an all -inf, infinite or NaN one) is swept again from
  // global memory with exact subtractions, one element per thread and step
  // (no real logits take this path; a scalar loop keeps its registers out of
  // the way of the main sweep's). So is a row whose plain sum overflowed
  // (|x| V past FLT_MAX). Every thread has the same max and sum, so the
  // branch is uniform.
  // With a logit scale the limit is on |s max|, the magnitude of the
  // folded exponents.
  Value unusual = arith::CmpFOp::create(
      b, arith::CmpFPredicate::UGE,
      math::AbsFOp::create(b, scaleLogits(stats.max)), f32(kFoldLimit));
  if (withSum)
    unusual = arith::OrIOp::create(
        b, unusual,
        arith::CmpFOp::create(b, arith::CmpFPredicate::UEQ,
                              math::AbsFOp::create(b, stats.sum), f32(kInf)));
  // The branch yields the statistics; the outputs' sums pass around it.
  SmallVector<Type> types = RowStats::fieldTypes(b, withSum, false);
  auto valuesOf = [&](const RowStats &s) { return s.fields(withSum, false); };
  if (withSum)
    unusual = arith::OrIOp::create(
        b, unusual,
        arith::CmpFOp::create(b, arith::CmpFPredicate::UEQ,
                              math::AbsFOp::create(b, stats.meanShift),
                              f32(kInf)));
  SmallVector<Value> values = buildIfYield(
      b, unusual, types,
      [&] {
        // With the sum, also sum_j (x_j - m) 2^-32 against the running
        // maximum m, rescaled by count (m_old - m_new) 2^-32 as m grows:
        // every term and partial sum is at most 2 FLT_MAX V 2^-32, finite
        // for V < 2^31, and a row of equal values sums exact zeros. The
        // sum is compensated (Kahan), so its error does not grow with V.
        SmallVector<Value> inits = {f32(kNoMax), f32(-1.0f)};
        if (withSum)
          inits.append({f32(0.0f), f32(0.0f), f32(0.0f), f32(0.0f)});
        Value scale = f32(0x1p-32f);
        scf::ForOp loop = buildTailLoop(
            index(0), vocab, inits,
            [&](Value j, ValueRange state) -> SmallVector<Value> {
              Value x = loadLogit(row, j);
              auto [max, rest] = stepState(*this, b, state[0], state[1], {x});
              SmallVector<Value> next = {max, rest};
              if (!withSum)
                return next;
              Value newScaled = arith::MulFOp::create(b, max, scale);
              Value regrown = arith::MulFOp::create(
                  b, state[4],
                  arith::SubFOp::create(
                      b, arith::MulFOp::create(b, state[0], scale),
                      newScaled));
              Value term = arith::SubFOp::create(
                  b, arith::MulFOp::create(b, x, scale), newScaled);
              next.push_back(arith::AddFOp::create(b, state[2], x));
              Value y = arith::SubFOp::create(
                  b, arith::AddFOp::create(b, regrown, term), state[5]);
              Value total = arith::AddFOp::create(b, state[3], y);
              next.push_back(total);
              next.push_back(arith::AddFOp::create(b, state[4], f32(1.0f)));
              // An infinite term (a -inf logit) makes the sum infinite and
              // the compensation NaN: the compensation is then dropped.
              Value lost = arith::SubFOp::create(
                  b, arith::SubFOp::create(b, total, state[3]), y);
              next.push_back(arith::SelectOp::create(
                  b,
                  arith::CmpFOp::create(b, arith::CmpFPredicate::OLT,
                                        math::AbsFOp::create(b, lost),
                                        f32(kInf)),
                  lost, f32(0.0f)));
              return next;
            });
        RowStats exact;
        std::tie(exact.max, exact.rest) =
            allReduceState(loop.getResult(0), loop.getResult(1));
        // A row here only for its overflowing sum keeps the main sweep's
        // (max, rest): the same maximum, summed by many lanes, where this
        // scalar loop sums one element after another (less accurate).
        Value foldable = arith::CmpFOp::create(
            b, arith::CmpFPredicate::OLT,
            math::AbsFOp::create(b, scaleLogits(stats.max)), f32(kFoldLimit));
        exact.rest =
            arith::SelectOp::create(b, foldable, stats.rest, exact.rest);
        if (withSum) {
          exact.sum = allReduceSum(loop.getResult(2));
          // Each thread's shifted sum moved to the row's maximum (a thread
          // that saw no element adds nothing), then summed.
          Value count = loop.getResult(4);
          Value moved = arith::MulFOp::create(
              b, count,
              arith::SubFOp::create(
                  b, arith::MulFOp::create(b, loop.getResult(0), scale),
                  arith::MulFOp::create(b, exact.max, scale)));
          moved = arith::SelectOp::create(
              b,
              arith::CmpFOp::create(b, arith::CmpFPredicate::OGT, count,
                                    f32(0.0f)),
              moved, f32(0.0f));
          Value shifted = allReduceSum(arith::AddFOp::create(
              b, arith::SubFOp::create(b, loop.getResult(3), loop.getResult(5)),
              moved));
          exact.meanShift = arith::MulFOp::create(
              b, shifted,
              arith::DivFOp::create(b, f32(0x1p32f), vocabF32));
        }
        return valuesOf(exact);
      },
      [&] { return valuesOf(stats); });
  RowStats result = RowStats::fromFields(values, withSum, false);
  if (withOutputs) {
    result.entropySum = stats.entropySum;
    result.bestIndex = stats.bestIndex;
    // A NaN logit need not reach the maximum (a merge of states may drop
    // it) but makes the sums NaN, as does a -inf logit the entropy sum (its
    // term 0 * -inf, unclamped to keep the sweep at one FMA an element):
    // such a row takes the outputs' own sweep too.
    result.resweep = arith::OrIOp::create(
        b, unusual,
        arith::CmpFOp::create(
            b, arith::CmpFPredicate::UNO, stats.rest,
            arith::AddFOp::create(b, stats.entropySum, stats.rest)));
  }
  return result;
}

RowStats RowLoopBuilder::buildStatisticsSweep(const RowRef &row, Value vocab,
                                              bool withSum, bool shiftedSum,
                                              bool withOutputs) {
  auto vectorType = VectorType::get({vectorWidth}, b.getF32Type());

  // Main sweep: `unroll` vectors per step; one maximum per thread, the rest
  // as partial sums per lane and the maxima's count apart (`extra`, last in
  // the state: -1, no implicit 1 yet; stepRowState).
  RowRange range = rangeOf(row, vocab);
  SmallVector<Value> inits = {f32(kNoMax), f32(0.0f, vectorType)};
  if (withSum)
    inits.push_back(f32(0.0f, vectorType));
  // With the outputs, the per-lane entropy sums and the thread's best step
  // (where its maximum first occurs; searched once the row's is known).
  Type i32 = b.getI32Type();
  size_t outputsAt = inits.size();
  if (withOutputs)
    inits.append({f32(0.0f, vectorType), noIndex()});
  size_t extraAt = inits.size();
  inits.push_back(f32(-1.0f));
  // The row sum is taken of x - c, c the row's first element (0 where that
  // is not finite, or for an empty row): a common offset of the logits (all
  // near 100, say) then costs no digits of mean - max, which the smoothing
  // term scales by the logit scale.
  Value sumShift;
  if (withSum && shiftedSum) {
    Value nonEmpty = arith::CmpIOp::create(b, arith::CmpIPredicate::ugt, vocab,
                                           index(0));
    Value first = buildIfYield(
        b, nonEmpty, TypeRange{b.getF32Type()},
        [&] { return SmallVector<Value>{loadLogit(row, index(0))}; },
        [&] { return SmallVector<Value>{f32(0.0f)}; })[0];
    Value finite = arith::CmpFOp::create(b, arith::CmpFPredicate::OLT,
                                         math::AbsFOp::create(b, first),
                                         f32(kInf));
    sumShift = arith::SelectOp::create(b, finite, first, f32(0.0f));
  }
  // Where a step's vectors come from: global memory, global memory with a
  // copy kept in the row cache, or the row cache.
  enum class Source { Global, GlobalToCache, Cache, Ring };
  auto step = [&](ArrayRef<Value> offsets, ArrayRef<Value> valid,
                  ValueRange state, Source source) -> SmallVector<Value> {
    SmallVector<Value, 8> raws, xs, sumXs;
    for (Value offset : offsets)
      raws.push_back(source == Source::Cache  ? loadCachedVector(range, offset)
                     : source == Source::Ring ? loadRingVector(range, offset)
                                              : loadRawVector(row, offset));
    // The step's maximum on the packed values (exact: it is one of them).
    Value stepMax;
    auto rawType = cast<VectorType>(raws.front().getType());
    // Not with a softcap: the maximum is taken of z, as computed.
    if (threads.packedMax && !softcap &&
        rawType.getElementType().getIntOrFloatBitWidth() == 16) {
      SmallVector<Value, 8> maskedRaws(raws);
      if (!valid.empty()) {
        Value noValue = arith::ConstantOp::create(
            b, DenseElementsAttr::get(
                   rawType, b.getFloatAttr(rawType.getElementType(), -kInf)));
        for (size_t k = 0; k < maskedRaws.size(); ++k)
          maskedRaws[k] =
              arith::SelectOp::create(b, valid[k], maskedRaws[k], noValue);
      }
      stepMax = arith::ExtFOp::create(b, b.getF32Type(),
                                      maximumOf(b, maskedRaws));
    }
    for (auto [k, raw] : llvm::enumerate(raws)) {
      if (source == Source::GlobalToCache)
        buildIfValid(valid, k,
                     [&] { storeCachedVector(range, offsets[k], raw); });
      Value x = softcapLogits(widen(raw));
      sumXs.push_back(
          sumShift ? arith::SubFOp::create(
                         b, x, vector::BroadcastOp::create(b, vectorType,
                                                           sumShift))
                         .getResult()
                   : x);
      if (!valid.empty()) {
        // A vector past the row: -inf adds nothing to (max, rest), 0
        // nothing to the sum.
        x = arith::SelectOp::create(b, valid[k], x, f32(-kInf, vectorType));
        sumXs.back() = arith::SelectOp::create(b, valid[k], sumXs.back(),
                                               f32(0.0f, vectorType));
      }
      xs.push_back(x);
    }
    Value entropySum, bestIndex;
    if (withOutputs) {
      if (!stepMax)
        stepMax = maximumOf(b, xs);
      entropySum = state[outputsAt];
      bestIndex = stepBestStep(state[outputsAt + 1], state[0], stepMax,
                               offsets.front());
    }
    Value extra = state[extraAt];
    auto [max, rest] = stepRowState(*this, b, state[0], state[1], extra, xs,
                                    stepMax, withOutputs ? &entropySum : nullptr,
                                    /*masked=*/!valid.empty());
    SmallVector<Value> next = {max, rest};
    if (withSum) {
      Value tileSum = sumXs.front();
      for (Value x : ArrayRef<Value>(sumXs).drop_front())
        tileSum = arith::AddFOp::create(b, tileSum, x);
      next.push_back(arith::AddFOp::create(b, state[2], tileSum));
    }
    if (withOutputs)
      next.append({entropySum, bestIndex});
    next.push_back(extra);
    return next;
  };
  auto stepFrom = [&](Source source) {
    return [&step, source](ArrayRef<Value> offsets, ArrayRef<Value> valid,
                           ValueRange state) {
      return step(offsets, valid, state, source);
    };
  };
  auto fromGlobal = stepFrom(Source::Global);
  auto toCache = stepFrom(Source::GlobalToCache);
  auto fromCache = stepFrom(Source::Cache);
  CacheSplit split = cacheSplitOf(range);
  SmallVector<Value> lanes;
  if (threads.streamRing && !split) {
    lanes = buildStreamedChunks(row, range, inits, stepFrom(Source::Ring));
    lanes = buildRemainder(range, lanes, fromGlobal);
  } else if (!split) {
    lanes = buildVectorLoops(range, inits, fromGlobal);
  } else if (threads.asyncCopy) {
    // Every cached vector is requested up front, a group per chunk, and
    // the rest of the row is prefetched into L2; each cached chunk is
    // reduced as soon as its own group has landed (the later ones still in
    // flight), then the rest of the row, from L2.
    buildCacheCopies(row, range, split);
    Value uncachedEnd = arith::SelectOp::create(b, split.remainder,
                                                range.mainEnd, range.vectorEnd);
    prefetchToL2(row, split.chunksEnd, uncachedEnd);
    // Chunk i's group is complete once at most cacheChunks() + 1 groups are
    // pending after one more (empty) group is committed: the groups of
    // chunks i + 1.., the remainder's, and the i + 1 empty ones.
    int32_t behind = static_cast<int32_t>(cacheChunks()) + 1;
    lanes = buildChunkLoop(
        range.head, split.chunksEnd, inits,
        [&](ArrayRef<Value> offsets, ArrayRef<Value> valid, ValueRange state) {
          threads.target->buildWaitGroups(b, commitCopies(), behind);
          return fromCache(offsets, valid, state);
        },
        false);
    threads.target->buildWaitGroups(b, commitCopies(), std::nullopt);
    lanes = buildSplitRemainder(range, split, lanes, fromCache, {});
    lanes = buildChunkLoop(split.chunksEnd, range.mainEnd, lanes, fromGlobal,
                           false);
    lanes = buildSplitRemainder(range, split, lanes, {}, fromGlobal);
  } else {
    lanes = buildChunkLoop(range.head, split.chunksEnd, inits, toCache, false);
    lanes = buildChunkLoop(split.chunksEnd, range.mainEnd, lanes, fromGlobal,
                           false);
    lanes = buildSplitRemainder(range, split, lanes, toCache, fromGlobal);
  }

  // The lanes share the maximum: their partial sums simply add.
  Value max = lanes[0];
  Value vectorMax = max;
  Value rest = arith::AddFOp::create(
      b, vector::ReductionOp::create(b, vector::CombiningKind::ADD, lanes[1]),
      lanes[extraAt]);
  Value sum;
  if (withSum)
    sum = vector::ReductionOp::create(b, vector::CombiningKind::ADD,
                                      lanes[2]);

  Value entropySum, bestIndex;
  if (withOutputs) {
    entropySum = vector::ReductionOp::create(b, vector::CombiningKind::ADD,
                                             lanes[outputsAt]);
  }

  // Scalar head and tail: a state of their own, merged last.
  SmallVector<Value> tailInits = {f32(kNoMax), f32(-1.0f)};
  if (withSum)
    tailInits.push_back(f32(0.0f));
  if (withOutputs)
    tailInits.append({f32(0.0f), noIndex()});
  SmallVector<Value> tailState = buildScalarLoops(
      range, vocab, tailInits,
      [&](Value j, ValueRange state) -> SmallVector<Value> {
        Value x = loadLogit(row, j);
        auto [tailMax, tailRest] =
            stepState(*this, b, state[0], state[1], {x});
        SmallVector<Value> next = {tailMax, tailRest};
        if (withSum)
          next.push_back(arith::AddFOp::create(
              b, state[2],
              sumShift ? arith::SubFOp::create(b, x, sumShift).getResult() : x));
        if (withOutputs) {
          // U' = r (U + delta S) + t a, a = (x - m') L, t = exp2(a).
          Value total = arith::AddFOp::create(b, state[1], f32(1.0f));
          Value moved = moveEntropySum(state[outputsAt], total, state[0],
                                       tailMax);
          Value a = arith::MulFOp::create(
              b, arith::SubFOp::create(b, x, tailMax), scaledLog2E());
          Value term = arith::MulFOp::create(
              b, math::Exp2Op::create(b, a),
              arith::MaximumFOp::create(b, a, f32(-256.0f)));
          next.push_back(arith::AddFOp::create(b, moved, term));
          Value index = arith::IndexCastOp::create(b, i32, j);
          next.push_back(arith::MinSIOp::create(
              b, bestIndexAt(state[outputsAt + 1], state[0], tailMax),
              bestIndexAt(index, x, tailMax)));
        }
        return next;
      });
  if (withOutputs) {
    // This thread's vector and scalar parts at their common maximum.
    Value top = arith::MaximumFOp::create(b, max, tailState[0]);
    entropySum = arith::AddFOp::create(
        b,
        moveEntropySum(entropySum, arith::AddFOp::create(b, rest, f32(1.0f)),
                       max, top),
        moveEntropySum(tailState[outputsAt],
                       arith::AddFOp::create(b, tailState[1], f32(1.0f)),
                       tailState[0], top));
  }
  std::tie(max, rest) =
      combineStates(max, rest, tailState[0], tailState[1]);
  if (withSum)
    sum = arith::AddFOp::create(b, sum, tailState[2]);
  Value threadMax = max, threadRest = rest;
  std::tie(max, rest) = allReduceState(max, rest);
  if (withOutputs) {
    // Every thread's sums moved to the row's maximum, then added.
    entropySum = allReduceSum(moveEntropySum(
        entropySum, arith::AddFOp::create(b, threadRest, f32(1.0f)),
        threadMax, max));
    // The lowest index among the threads that hold the row's maximum: in
    // the scalar head and tail, or in the best step of the vectors.
    bestIndex = allReduceMinIndex(arith::MinSIOp::create(
        b,
        searchBestStep(row, range, lanes[outputsAt + 1], vectorMax, max),
        bestIndexAt(tailState[outputsAt + 1], tailState[0], max)));
  }
  if (!withSum)
    return {max, rest, Value(), Value(), entropySum, bestIndex};
  // sum = sum_j (x_j - c) + V c; mean - max = sum_j (x_j - c) / V + (c - max).
  Value reducedSum = allReduceSum(sum);
  Value vocabF32 = arith::UIToFPOp::create(
      b, b.getF32Type(),
      arith::IndexCastUIOp::create(b, b.getI64Type(), vocab));
  RowStats stats{max, rest};
  stats.entropySum = entropySum;
  stats.bestIndex = bestIndex;
  Value mean = arith::DivFOp::create(b, reducedSum, vocabF32);
  if (!sumShift) {
    stats.sum = reducedSum;
    stats.meanShift = arith::SubFOp::create(b, mean, max);
    return stats;
  }
  stats.sum = math::FmaOp::create(b, sumShift, vocabF32, reducedSum);
  stats.meanShift =
      arith::AddFOp::create(b, mean, arith::SubFOp::create(b, sumShift, max));
  return stats;
}

Value RowLoopBuilder::buildLogSumExp(const RowStats &stats) {
  return arith::AddFOp::create(b, scaleLogits(stats.max),
                               buildLog1p(stats.rest));
}
