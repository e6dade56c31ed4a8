//===- TokenLowering.cpp - Per-token lowering of ce ops -------------------===//
//
// What one token of a ce op computes (labels, ignore_index, smoothing,
// z-loss, the loss and the target-class gradient term) and the two token
// mappings: a loop nest over tokens on the host (ce-lower-to-loops) and one
// token per workgroup on GPUs (ce-map-to-gpu). Shared by both passes.
//
//===----------------------------------------------------------------------===//

#include "TokenLowering.h"
#include "RowLoopInternal.h"

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/GPU/IR/GPUDialect.h"
#include "mlir/Dialect/Math/IR/Math.h"
#include "mlir/Dialect/MemRef/IR/MemRef.h"
#include "mlir/Dialect/SCF/IR/SCF.h"

namespace mlir::ce::detail {

CrossEntropyLowering::CrossEntropyLowering(ImplicitLocOpBuilder &b,
                                           const OpConfig &config, Value logits,
                                           Value labels, unsigned vectorWidth,
                                           unsigned unroll, RowThreads threads)
    : b(b), rows(b, vectorWidth, unroll, threads), config(config),
      logits(logits), labels(labels) {
  if (threads.enabled())
    isLeader = arith::CmpIOp::create(b, arith::CmpIPredicate::eq,
                                     threads.threadId, rows.index(0));
  // z = s x: every exponential of the sweeps is of z. With a softcap every
  // loaded element becomes z = cap tanh(s x / cap) and the sweeps run on z
  // with no further scale.
  if (this->config.logitSoftcap) {
    rows.setLogitSoftcap(this->config.logitSoftcap, this->config.logitScale);
    this->config.logitScale = Value();
  } else {
    rows.setLogitScale(this->config.logitScale);
  }
  auto type = cast<MemRefType>(logits.getType());
  vocab = memref::DimOp::create(b, logits, type.getRank() - 1);
  vocabF32 = arith::UIToFPOp::create(
      b, b.getF32Type(),
      arith::IndexCastUIOp::create(b, b.getI64Type(), vocab));
  // Megatron's smoothing: s = alpha * V / (V - 1), and 0 for V == 1 where
  // every value of s gives the same (zero) loss. A shard smooths over its
  // own slice (Megatron's vocab-parallel V) unless told to use the
  // global vocabulary.
  auto i64 = [&](int64_t value) {
    return arith::ConstantIntOp::create(b, b.getI64Type(), value).getResult();
  };
  if (config.shard) {
    shardStart = config.shardStart ? config.shardStart
                                   : i64(config.shard.getStart());
    shardVocab = config.shardVocab ? config.shardVocab
                                   : i64(config.shard.getVocab());
  }
  if (hasZLoss())
    zLoss = config.zLossValue ? config.zLossValue : rows.f32(config.zLoss);
  if (hasSmoothing()) {
    Value smoothVocab = vocabF32;
    Value manyClasses = arith::CmpIOp::create(b, arith::CmpIPredicate::ugt,
                                              vocab, rows.index(1));
    if (config.shard) {
      // Over the global vocabulary with the attribute's global_smoothing or
      // the run-time flag, else over the slice.
      Value global = arith::ConstantIntOp::create(
          b, b.getI1Type(), config.shard.getGlobalSmoothing());
      if (config.flags && !config.shard.getGlobalSmoothing())
        global = flagSet(kFlagGlobalSmoothing);
      smoothVocab = arith::SelectOp::create(
          b, global, arith::SIToFPOp::create(b, b.getF32Type(), shardVocab),
          smoothVocab);
      manyClasses = arith::SelectOp::create(
          b, global,
          arith::CmpIOp::create(b, arith::CmpIPredicate::sgt, shardVocab,
                                i64(1)),
          manyClasses);
    }
    Value alpha = config.labelSmoothingValue
                      ? config.labelSmoothingValue
                      : rows.f32(config.labelSmoothing);
    Value vMinusOne = arith::SubFOp::create(b, smoothVocab, rows.f32(1.0f));
    Value s = arith::DivFOp::create(
        b, arith::MulFOp::create(b, alpha, smoothVocab), vMinusOne);
    smoothing = arith::SelectOp::create(b, manyClasses, s, rows.f32(0.0f));
    uniform = arith::DivFOp::create(b, smoothing, smoothVocab);
  }
}

void CrossEntropyLowering::leaderOnly(function_ref<void()> body) {
  if (isLeader)
    buildIf(b, isLeader, body);
  else
    body();
}

void CrossEntropyLowering::rowBarrier() {
  if (hasThreads())
    gpu::BarrierOp::create(b);
}

Value CrossEntropyLowering::inRange(Value value, Value bound) {
  Value zero = arith::ConstantIntOp::create(b, b.getI64Type(), 0);
  return arith::AndIOp::create(
      b, arith::CmpIOp::create(b, arith::CmpIPredicate::sge, value, zero),
      arith::CmpIOp::create(b, arith::CmpIPredicate::slt, value, bound));
}

LabelInfo CrossEntropyLowering::readLabel(const Token &token) {
  LabelInfo info;
  Value label = memref::LoadOp::create(b, labels, token.indices);
  if (!label.getType().isInteger(64))
    label = arith::ExtSIOp::create(b, b.getI64Type(), label);
  info.label = label;
  Value vocabI64 = arith::IndexCastUIOp::create(b, b.getI64Type(), vocab);
  if (config.shard) {
    info.valid = inRange(label, shardVocab);
    info.column = arith::SubIOp::create(b, label, shardStart);
    info.inRow =
        arith::AndIOp::create(b, info.valid, inRange(info.column, vocabI64));
  } else {
    info.valid = inRange(label, vocabI64);
    info.column = label;
    info.inRow = info.valid;
  }
  info.accepted = info.valid;
  if (config.flags)
    info.accepted =
        arith::OrIOp::create(b, info.valid, flagSet(kFlagMegatronLabels));
  if (config.ignoreIndex) {
    Value ignore =
        arith::ConstantIntOp::create(b, b.getI64Type(), *config.ignoreIndex);
    info.ignored =
        arith::CmpIOp::create(b, arith::CmpIPredicate::eq, label, ignore);
  } else if (config.ignoreIndexValue && config.flags) {
    // The operand is in force only with its flag (CEOps.td).
    info.ignored = arith::AndIOp::create(
        b, flagSet(kFlagIgnoreIndex),
        arith::CmpIOp::create(b, arith::CmpIPredicate::eq, label,
                              config.ignoreIndexValue));
  } else {
    info.ignored = arith::ConstantIntOp::create(b, b.getI1Type(), 0);
  }
  auto ifOp = scf::IfOp::create(b, TypeRange{b.getF32Type()}, info.inRow,
                                /*withElseRegion=*/true);
  {
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPointToStart(ifOp.thenBlock());
    Value column = arith::IndexCastOp::create(b, b.getIndexType(), info.column);
    scf::YieldOp::create(b, rows.loadElement(rowOf(logits, token), column));
    b.setInsertionPointToStart(ifOp.elseBlock());
    scf::YieldOp::create(b, rows.f32(0.0f));
  }
  info.target = ifOp.getResult(0);
  if (rows.getLogitSoftcap()) {
    // z_y and its slope from the raw x_y, read before any overwrite.
    std::tie(info.target, info.targetSlope) =
        rows.softcapWithSlope(info.target);
  }
  if (config.status) {
    Value notIgnored = arith::XOrIOp::create(
        b, info.ignored, arith::ConstantIntOp::create(b, b.getI1Type(), 1));
    Value notAccepted = arith::XOrIOp::create(
        b, info.accepted, arith::ConstantIntOp::create(b, b.getI1Type(), 1));
    Value bad = arith::AndIOp::create(b, notIgnored, notAccepted);
    leaderOnly([&] {
      buildIf(b, bad, [&] {
        Value linear =
            arith::IndexCastUIOp::create(b, b.getI64Type(), token.linear);
        Value code = arith::AddIOp::create(
            b, linear, arith::ConstantIntOp::create(b, b.getI64Type(), 1));
        memref::StoreOp::create(b, code, config.status,
                                ValueRange{rows.index(0)});
      });
    });
  }
  return info;
}

Value CrossEntropyLowering::flagSet(int64_t flag) {
  Value bit = arith::ConstantIntOp::create(b, b.getI64Type(), flag);
  return arith::CmpIOp::create(
      b, arith::CmpIPredicate::ne, arith::AndIOp::create(b, config.flags, bit),
      arith::ConstantIntOp::create(b, b.getI64Type(), 0));
}

Value CrossEntropyLowering::selectUnlessZero(Value coefficient, Value plain,
                                             Value withTerm) {
  Value zero = arith::CmpFOp::create(b, arith::CmpFPredicate::OEQ, coefficient,
                                     rows.f32(0.0f));
  return arith::SelectOp::create(b, zero, plain, withTerm);
}

Value CrossEntropyLowering::buildLoss(const LabelInfo &label,
                                      const RowStats &stats, Value lse,
                                      Value logProb) {
  Value loss = arith::NegFOp::create(b, logProb);
  if (hasSmoothing()) {
    // lse - mean as log1p(rest) - (mean - max): the rounding of lse (half
    // an ulp of a large max) stays out of the difference, and mean - max
    // comes from a sum that cannot overflow (RowStats::meanShift).
    // Of z: mean_j z_j - max_j z_j = s (mean - max). With a logit scale
    // the term is s_a log1p(rest) - (s_a s)(mean - max), s_a the smoothing
    // factor: its two parts are >= 0 (no cancellation), and (s_a s) is
    // formed first, so that a finite smoothed loss of a row near -FLT_MAX
    // does not overflow in s (mean - max).
    Value keep = arith::SubFOp::create(b, rows.f32(1.0f), smoothing);
    Value smoothPart;
    if (Value logitScale = config.logitScale)
      smoothPart = arith::SubFOp::create(
          b, arith::MulFOp::create(b, smoothing, rows.buildLog1p(stats.rest)),
          arith::MulFOp::create(
              b, arith::MulFOp::create(b, smoothing, logitScale),
              stats.meanShift));
    else
      smoothPart = arith::MulFOp::create(
          b, smoothing,
          arith::SubFOp::create(b, rows.buildLog1p(stats.rest),
                                stats.meanShift));
    Value smoothed = arith::AddFOp::create(
        b, arith::MulFOp::create(b, keep, loss), smoothPart);
    // A coefficient of 0 (a run-time value) gives the plain loss exactly,
    // also on rows whose smoothing term is infinite (0 * inf is NaN).
    loss = selectUnlessZero(smoothing, loss, smoothed);
  }
  if (hasZLoss()) {
    Value square = arith::MulFOp::create(b, lse, lse);
    loss = selectUnlessZero(
        zLoss, loss,
        arith::AddFOp::create(b, loss, arith::MulFOp::create(b, zLoss, square)));
  }
  loss = arith::SelectOp::create(b, label.accepted, loss, rows.f32(kNaN));
  return arith::SelectOp::create(b, label.ignored, rows.f32(0.0f), loss);
}

void CrossEntropyLowering::buildGradient(const Token &token, Value grad,
                                         const LabelInfo &label, Value lse,
                                         Value logProb, Value weight,
                                         bool afterStatistics, Value rowMax,
                                         Value logSum, Value lseLow) {
  RowRef gradRow = rowOf(grad, token);
  buildIf(
      b, label.ignored, [&] { rows.buildFill(gradRow, vocab, rows.f32(0)); },
      [&] {
        // dL/dx = s dL/dz: the logit scale joins the per-row weight.
        Value scale = arith::SelectOp::create(
            b, label.accepted, rows.scaleLogits(weight), rows.f32(kNaN));
        // c = 1 + 2 z lse; its excess over 1 is kept unrounded for the
        // target term, where it may nearly cancel p_y - 1.
        Value zTerm = rows.f32(0.0f);
        Value c = rows.f32(1.0f);
        if (hasZLoss()) {
          zTerm = arith::MulFOp::create(
              b, arith::MulFOp::create(b, rows.f32(2.0f), zLoss), lse);
          c = arith::AddFOp::create(b, c, zTerm);
        }
        Value u = hasSmoothing() ? uniform : rows.f32(0.0f);
        rows.buildGradientSweep(rowOf(logits, token), gradRow, vocab,
                                rowMax ? rowMax : lse, scale, c, u,
                                afterStatistics, rowMax ? logSum : lseLow,
                                /*fromRowMax=*/static_cast<bool>(rowMax));
        // The target element is rewritten after every thread's sweep.
        rowBarrier();
        leaderOnly([&] {
          buildIf(b, label.inRow, [&] {
            Value term = arith::MulFOp::create(b, rows.buildExpm1(logProb), c);
            term = arith::AddFOp::create(b, term, zTerm);
            if (hasSmoothing())
              term = arith::AddFOp::create(
                  b, term, arith::SubFOp::create(b, smoothing, uniform));
            Value column =
                arith::IndexCastOp::create(b, b.getIndexType(), label.column);
            Value value = arith::MulFOp::create(b, scale, term);
            if (label.targetSlope)
              value = arith::MulFOp::create(b, value, label.targetSlope);
            rows.storeElement(gradRow, column, value);
          });
        });
      });
}

void CrossEntropyLowering::prepare(FusedOp op) {
  if (op.getWeights().getType().getRank() == 0)
    sharedWeight = memref::LoadOp::create(b, op.getWeights(), ValueRange{});
}

void CrossEntropyLowering::lowerToken(ForwardOp op, const Token &t) {
  buildLossAndLse(t, op.getLoss(), op.getLse(), op.getLseLow(),
                  op.getEntropy(), op.getArgmax());
}

Value CrossEntropyLowering::inForce(int64_t flag) {
  if (config.flags)
    return flagSet(flag);
  return arith::ConstantIntOp::create(b, b.getI1Type(), 1);
}

Value CrossEntropyLowering::lseLowInForce() { return inForce(kFlagLseLow); }

void CrossEntropyLowering::lowerToken(BackwardOp op, const Token &t) {
  LabelInfo label = readLabel(t);
  // Under overwrite_input another thread's sweep may overwrite x[y].
  if (op.getOverwriteInput())
    rowBarrier();
  Value lse = memref::LoadOp::create(b, op.getLse(), t.indices);
  Value weight = memref::LoadOp::create(b, op.getGradLoss(), t.indices);
  // s x_y - lse is one rounding (an FMA; a subtraction without a scale),
  // exact when p_y is near 1. With lse's low part the exponents are
  // (s x - lse) - lse_low: their error no longer grows with |lse|. Without
  // the flag the operand is a placeholder (the runtime passes the lse view):
  // read, then replaced by 0.
  Value low;
  if (Value lseLow = op.getLseLow()) {
    low = memref::LoadOp::create(b, lseLow, t.indices);
    low = arith::SelectOp::create(b, lseLowInForce(), low, rows.f32(0.0f));
  }
  Value logProb =
      config.logitScale
          ? math::FmaOp::create(b, config.logitScale, label.target,
                                arith::NegFOp::create(b, lse))
                .getResult()
          : arith::SubFOp::create(b, label.target, lse).getResult();
  if (low)
    logProb = arith::SubFOp::create(b, logProb, low);
  buildGradient(t, op.getGrad(), label, lse, logProb, weight,
                /*afterStatistics=*/false, Value(), Value(), low);
}

void CrossEntropyLowering::lowerToken(ShardStatsOp op, const Token &t) {
  LabelInfo label = readLabel(t);
  // The raw row sum is stored: no shift (buildStatistics).
  RowStats stats = statisticsOf(t, hasSmoothing(), /*shiftedSum=*/false,
                                op.getEntropy(), op.getArgmax());
  Value target =
      arith::SelectOp::create(b, label.accepted, label.target, rows.f32(kNaN));
  target = arith::SelectOp::create(b, label.ignored, rows.f32(0.0f), target);
  Value sum = hasSmoothing() ? stats.sum : rows.f32(0.0f);
  leaderOnly([&] {
    Value values[] = {stats.max, stats.rest, target, sum};
    for (auto [i, value] : llvm::enumerate(values)) {
      SmallVector<Value, 3> indices(t.indices.begin(), t.indices.end());
      indices.push_back(rows.index(i));
      memref::StoreOp::create(b, value, op.getStats(), indices);
    }
  });
  // The slice's entropy and argmax (a global id) for the combine.
  buildOutputs(t, stats, op.getEntropy(), op.getArgmax(), shardStart);
}

void CrossEntropyLowering::lowerToken(FusedOp op, const Token &t) {
  // The outputs by a sweep of their own: a second copy of the statistics
  // sweep costs the fused kernel's plain path its occupancy (16384x32000
  // fused_ow 0.591 ms against 0.521 ms on the H200, 2026-12-02; with the
  // best-step argmax still up to 4 %, 2026-12-03, branch fused-outputs).
  TokenForward forward =
      buildLossAndLse(t, op.getLoss(), op.getLse(), op.getLseLow(),
                      op.getEntropy(), op.getArgmax(),
                      /*accumulateOutputs=*/false);
  Value weight =
      sharedWeight
          ? sharedWeight
          : memref::LoadOp::create(b, op.getWeights(), t.indices).getResult();
  buildGradient(t, op.getGrad(), forward.label, forward.lse, forward.logProb,
                weight, /*afterStatistics=*/true, forward.rowMax,
                forward.logSum);
}

CrossEntropyLowering::TokenForward
CrossEntropyLowering::buildLossAndLse(const Token &t, Value lossOut,
                                      Value lseOut, Value lseLowOut,
                                      Value entropyOut, Value argmaxOut,
                                      bool accumulateOutputs) {
  LabelInfo label = readLabel(t);
  RowStats stats = statisticsOf(t, hasSmoothing(), /*shiftedSum=*/true,
                                entropyOut, argmaxOut, accumulateOutputs);
  // z = s x: lse = s max + log1p(rest) with s max rounded once (its error
  // goes into lse_low), and log p_y = (x_y - max) s - log1p(rest), the
  // subtraction first.
  Value scaledMax = rows.scaleLogits(stats.max);
  Value logSum = rows.buildLog1p(stats.rest);
  Value lse = arith::AddFOp::create(b, scaledMax, logSum);
  Value shifted =
      rows.scaleLogits(arith::SubFOp::create(b, label.target, stats.max));
  // Megatron's out-of-range label: predicted logit 0 after the max shift.
  if (config.flags)
    shifted = arith::SelectOp::create(b, label.inRow, shifted, rows.f32(0.0f));
  Value logProb = arith::SubFOp::create(b, shifted, logSum);
  Value loss = buildLoss(label, stats, lse, logProb);
  // lse's low part: lse + low = s max + logSum exactly (TwoSum of the
  // rounded product and logSum, plus the product's own error by FMA), 0
  // where lse is not finite (an all -inf, infinite or NaN row keeps the lse
  // it had).
  Value low;
  if (lseLowOut) {
    Value bv = arith::SubFOp::create(b, lse, scaledMax);
    Value av = arith::SubFOp::create(b, lse, bv);
    low = arith::AddFOp::create(
        b, arith::SubFOp::create(b, scaledMax, av),
        arith::SubFOp::create(b, logSum, bv));
    if (config.logitScale)
      low = arith::AddFOp::create(
          b, low,
          math::FmaOp::create(b, config.logitScale, stats.max,
                              arith::NegFOp::create(b, scaledMax)));
    Value finite = arith::CmpFOp::create(
        b, arith::CmpFPredicate::OLT, math::AbsFOp::create(b, lse),
        rows.f32(std::numeric_limits<float>::infinity()));
    low = arith::SelectOp::create(b, finite, low, rows.f32(0.0f));
  }
  leaderOnly([&] {
    memref::StoreOp::create(b, loss, lossOut, t.indices);
    memref::StoreOp::create(b, lse, lseOut, t.indices);
    if (low)
      buildIf(b, lseLowInForce(),
              [&] { memref::StoreOp::create(b, low, lseLowOut, t.indices); });
  });
  buildOutputs(t, stats, entropyOut, argmaxOut);
  return {label, lse, logProb, stats.max, logSum};
}

Value CrossEntropyLowering::outputsWanted(Value entropyOut, Value argmaxOut) {
  Value wanted = arith::ConstantIntOp::create(b, b.getI1Type(), 0);
  if (entropyOut)
    wanted = arith::OrIOp::create(b, wanted, inForce(kFlagEntropy));
  if (argmaxOut)
    wanted = arith::OrIOp::create(b, wanted, inForce(kFlagArgmax));
  return wanted;
}

RowStats CrossEntropyLowering::statisticsOf(const Token &t, bool withSum,
                                            bool shiftedSum, Value entropyOut,
                                            Value argmaxOut,
                                            bool accumulateOutputs) {
  RowRef row = rowOf(logits, t);
  if (!entropyOut && !argmaxOut)
    return rows.buildStatistics(row, vocab, withSum, shiftedSum);
  // Where an argmax may be taken of z (the outputs' sweeps, and the maximum
  // that the separate outputs sweep looks for), every element's z is built
  // the same way (RowLoopBuilder::softcapSplitOff); the plain sweep of the
  // accumulating kernels keeps the split.
  if (!accumulateOutputs) {
    auto splitOff = rows.softcapSplitOff();
    return rows.buildStatistics(row, vocab, withSum, shiftedSum);
  }
  // The flags are uniform over the workgroup, so is the branch.
  SmallVector<Value> fields = buildIfYield(
      b, outputsWanted(entropyOut, argmaxOut),
      RowStats::fieldTypes(b, withSum, true),
      [&] {
        auto splitOff = rows.softcapSplitOff();
        return rows
            .buildStatistics(row, vocab, withSum, shiftedSum,
                             /*withOutputs=*/true)
            .fields(withSum, true);
      },
      [&] {
        RowStats plain = rows.buildStatistics(row, vocab, withSum, shiftedSum);
        plain.entropySum = rows.f32(0.0f);
        plain.bestIndex = rows.noIndex();
        plain.resweep = arith::ConstantIntOp::create(b, b.getI1Type(), 0);
        return plain.fields(withSum, true);
      });
  return RowStats::fromFields(fields, withSum, true);
}

void CrossEntropyLowering::buildOutputs(const Token &t, const RowStats &stats,
                                        Value entropyOut, Value argmaxOut,
                                        Value indexOffset) {
  if (!entropyOut && !argmaxOut)
    return;
  buildIf(b, outputsWanted(entropyOut, argmaxOut), [&] {
    RowOutputs outputs = [&] {
      auto splitOff = rows.softcapSplitOff();
      return rows.buildOutputs(rowOf(logits, t), vocab, stats);
    }();
    leaderOnly([&] {
      if (entropyOut)
        buildIf(b, inForce(kFlagEntropy), [&] {
          memref::StoreOp::create(b, outputs.entropy, entropyOut, t.indices);
        });
      if (argmaxOut)
        buildIf(b, inForce(kFlagArgmax), [&] {
          Value index = outputs.argmax;
          if (indexOffset) {
            // A slice's index is a global id; -1 (a NaN) stays.
            Value found = arith::CmpIOp::create(
                b, arith::CmpIPredicate::sge, index,
                arith::ConstantIntOp::create(b, b.getI64Type(), 0));
            index = arith::SelectOp::create(
                b, found, arith::AddIOp::create(b, index, indexOffset), index);
          }
          memref::StoreOp::create(b, index, argmaxOut, t.indices);
        });
    });
  });
}

void lowerRescaleToken(ImplicitLocOpBuilder &b, RowLoopBuilder &rows,
                       RescaleOp op, const Token &t) {
  Value g = memref::LoadOp::create(b, op.getGradLoss(), t.indices);
  Value w = memref::LoadOp::create(b, op.getWeights(), t.indices);
  // Unordered inequality: a NaN g rescales (the row becomes NaN).
  Value differs = arith::CmpFOp::create(b, arith::CmpFPredicate::UNE, g, w);
  Value masked = arith::CmpFOp::create(b, arith::CmpFPredicate::OEQ, g,
                                       rows.f32(0.0f));
  Value ratio = arith::SelectOp::create(
      b, masked, rows.f32(0.0f), arith::DivFOp::create(b, g, w));
  auto type = cast<MemRefType>(op.getGrad().getType());
  Value vocab = memref::DimOp::create(b, op.getGrad(), type.getRank() - 1);
  buildIf(b, differs, [&] {
    rows.buildScaleSweep(RowRef{op.getGrad(), t.rowPrefix}, vocab, ratio);
  });
}

/// The token of [S, B, V] row (s, b): its indices and linear index in the
/// layout's token shape. `rowIndex` is s * B + b when the caller has it.
static Token tokenOfRow(ImplicitLocOpBuilder &b, Layout layout, Value s,
                        Value bIdx, Value dim0, Value dim1,
                        Value rowIndex = {}) {
  Token token;
  token.rowPrefix = {s, bIdx};
  if (layout == Layout::sbv_bs) {
    token.indices = {bIdx, s};
    token.linear =
        arith::AddIOp::create(b, arith::MulIOp::create(b, bIdx, dim0), s);
  } else {
    token.indices = {s, bIdx};
    token.linear =
        rowIndex
            ? rowIndex
            : arith::AddIOp::create(b, arith::MulIOp::create(b, s, dim1), bIdx)
                  .getResult();
  }
  return token;
}

/// Builds the loops over all tokens of `logits` and calls `body` in the
/// innermost one. Token loops are ordered so the logits are walked in
/// memory order for packed [S, B, V] tensors.
void buildTokenLoops(ImplicitLocOpBuilder &b, Layout layout, Value logits,
                     function_ref<void(const Token &)> body) {
  Value c0 = arith::ConstantIndexOp::create(b, 0);
  Value c1 = arith::ConstantIndexOp::create(b, 1);
  Value dim0 = memref::DimOp::create(b, logits, 0);
  if (layout == Layout::flat) {
    buildForLoop(b, c0, dim0, c1, {},
                 [&](Value n, ValueRange) -> SmallVector<Value> {
                   body(Token{{n}, {n}, n});
                   return {};
                 });
    return;
  }
  Value dim1 = memref::DimOp::create(b, logits, 1);
  buildForLoop(b, c0, dim0, c1, {}, [&](Value s, ValueRange) {
    buildForLoop(b, c0, dim1, c1, {},
                 [&](Value bIdx, ValueRange) -> SmallVector<Value> {
                   body(tokenOfRow(b, layout, s, bIdx, dim0, dim1));
                   return {};
                 });
    return SmallVector<Value>{};
  });
}

Token tokenOfBlock(ImplicitLocOpBuilder &b, Layout layout, Value logits,
                   Value blockId) {
  if (layout == Layout::flat)
    return Token{{blockId}, {blockId}, blockId};
  Value dim0 = memref::DimOp::create(b, logits, 0);
  Value dim1 = memref::DimOp::create(b, logits, 1);
  // One division per row: blocks walk [S, B] in memory order.
  Value s = arith::DivUIOp::create(b, blockId, dim1);
  Value bIdx = arith::RemUIOp::create(b, blockId, dim1);
  return tokenOfRow(b, layout, s, bIdx, dim0, dim1, blockId);
}

} // namespace mlir::ce::detail
