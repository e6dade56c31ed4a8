//===- RowSchedule.cpp - The row schedule ---------------------------------===//
//
// Loops and ifs, element and vector accesses, where a row's vector steps
// start and end, the chunk, remainder and scalar loops a sweep is made of,
// and the gradient and fill sweeps built on them.
//
//===----------------------------------------------------------------------===//

#include "RowLoopBuilder.h"
#include "RowLoopInternal.h"

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/GPU/IR/GPUDialect.h"
#include "mlir/Dialect/Math/IR/Math.h"
#include "mlir/Dialect/MemRef/IR/MemRef.h"
#include "mlir/Dialect/SCF/IR/SCF.h"
#include "mlir/Dialect/Vector/IR/VectorOps.h"

using namespace mlir;
using namespace mlir::ce;
using namespace mlir::ce::detail;

/// Builds `scf.if` yielding `types`: `thenBody` or `elseBody` gives them.
SmallVector<Value>
mlir::ce::detail::buildIfYield(ImplicitLocOpBuilder &b, Value condition, TypeRange types,
             function_ref<SmallVector<Value>()> thenBody,
             function_ref<SmallVector<Value>()> elseBody) {
  auto ifOp = scf::IfOp::create(b, types, condition, /*withElseRegion=*/true);
  OpBuilder::InsertionGuard guard(b);
  auto fill = [&](Block *block, function_ref<SmallVector<Value>()> body) {
    if (types.empty()) {
      b.setInsertionPoint(block->getTerminator());
      body();
      return;
    }
    b.setInsertionPointToEnd(block);
    scf::YieldOp::create(b, body());
  };
  fill(ifOp.thenBlock(), thenBody);
  fill(ifOp.elseBlock(), elseBody);
  return SmallVector<Value>(ifOp.getResults().begin(), ifOp.getResults().end());
}

scf::ForOp mlir::ce::buildForLoop(
    ImplicitLocOpBuilder &b, Value lower, Value upper, Value step,
    ValueRange inits,
    function_ref<SmallVector<Value>(Value iv, ValueRange args)> body) {
  auto loop = scf::ForOp::create(b, lower, upper, step, inits);
  OpBuilder::InsertionGuard guard(b);
  b.setInsertionPointToStart(loop.getBody());
  SmallVector<Value> results = body(loop.getInductionVar(),
                                    loop.getRegionIterArgs());
  if (inits.empty()) {
    // The builder already made the terminator; the body went in front of it.
    return loop;
  }
  scf::YieldOp::create(b, results);
  return loop;
}

void mlir::ce::buildIf(ImplicitLocOpBuilder &b, Value condition,
                       function_ref<void()> thenBody,
                       function_ref<void()> elseBody) {
  auto ifOp = scf::IfOp::create(b, condition, /*withElseRegion=*/!!elseBody);
  OpBuilder::InsertionGuard guard(b);
  b.setInsertionPoint(ifOp.thenBlock()->getTerminator());
  thenBody();
  if (elseBody) {
    b.setInsertionPoint(ifOp.elseBlock()->getTerminator());
    elseBody();
  }
}

Value RowLoopBuilder::loadElement(const RowRef &row, Value index) {
  SmallVector<Value, 3> indices = indicesOf(row, index);
  Value value = memref::LoadOp::create(b, row.memref, indices);
  if (value.getType() != b.getF32Type())
    value = arith::ExtFOp::create(b, b.getF32Type(), value);
  return value;
}

void RowLoopBuilder::storeElement(const RowRef &row, Value index,
                                  Value value) {
  SmallVector<Value, 3> indices = indicesOf(row, index);
  Type elementType = cast<MemRefType>(row.memref.getType()).getElementType();
  if (elementType != value.getType())
    value = arith::TruncFOp::create(b, elementType, value);
  memref::StoreOp::create(b, value, row.memref, indices);
}

Value RowLoopBuilder::loadRawVector(const RowRef &row, Value index) {
  SmallVector<Value, 3> indices = indicesOf(row, index);
  Type elementType = cast<MemRefType>(row.memref.getType()).getElementType();
  auto loadType = VectorType::get({vectorWidth}, elementType);
  return vector::LoadOp::create(b, loadType, row.memref, indices,
                                /*nontemporal=*/false, alignment());
}

void RowLoopBuilder::buildIfValid(ArrayRef<Value> valid, size_t k,
                                  function_ref<void()> body) {
  if (valid.empty())
    body();
  else
    buildIf(b, valid[k], body);
}

Value RowLoopBuilder::threadOffsetOf() {
  return arith::MulIOp::create(b, threads.threadId, index(vectorWidth));
}

void RowLoopBuilder::storeVector(const RowRef &row, Value index, Value value) {
  SmallVector<Value, 3> indices = indicesOf(row, index);
  Type elementType = cast<MemRefType>(row.memref.getType()).getElementType();
  if (!elementType.isF32())
    value = arith::TruncFOp::create(
        b, VectorType::get({vectorWidth}, elementType), value);
  vector::StoreOp::create(b, value, row.memref, indices,
                          /*nontemporal=*/false, alignment());
}

llvm::MaybeAlign RowLoopBuilder::alignment() const {
  // GPU sweeps start their vectors at a 16-byte boundary (see rangeOf).
  if (threads.enabled())
    return llvm::Align(16);
  return llvm::MaybeAlign();
}

RowRange RowLoopBuilder::rangeOf(const RowRef &row, Value vocab) {
  Value head = index(0);
  if (threads.enabled()) {
    // Elements before the row's first 16-byte boundary go to the scalar
    // loops, so every vector access is aligned (rows of odd V, views).
    int64_t bytes = elementBytes(row);
    Value address = addressOf(row, index(0));
    Value misaligned = arith::DivUIOp::create(
        b, arith::RemUIOp::create(b, address, index(16)), index(bytes));
    Value lanes = index(16 / bytes);
    head = arith::RemUIOp::create(
        b, arith::SubIOp::create(b, lanes, misaligned), lanes);
    head = arith::MinUIOp::create(b, head, vocab);
  }
  Value body = arith::SubIOp::create(b, vocab, head);
  auto roundDown = [&](int64_t multiple) -> Value {
    return arith::AddIOp::create(
        b, head,
        arith::SubIOp::create(
            b, body, arith::RemUIOp::create(b, body, index(multiple))));
  };
  return {head, roundDown(chunkSize()), roundDown(vectorWidth)};
}

int64_t RowLoopBuilder::threadStride() const {
  return static_cast<int64_t>(vectorWidth) * threads.numThreads;
}

int64_t RowLoopBuilder::chunkSize() const { return threadStride() * unroll; }

SmallVector<Value, 8> RowLoopBuilder::stepOffsets(Value first) {
  SmallVector<Value, 8> offsets = {first};
  for (unsigned k = 1; k < unroll; ++k)
    offsets.push_back(
        arith::AddIOp::create(b, first, index(k * threadStride())));
  return offsets;
}

SmallVector<Value> RowLoopBuilder::buildChunkLoop(Value begin, Value end,
                                                  ValueRange inits,
                                                  StepBody body,
                                                  bool lastFirst) {
  // Thread t's k-th vector of a chunk starts at (k * threads + t) * width:
  // consecutive threads read consecutive 16-byte vectors, so every load
  // instruction of a warp covers one contiguous span.
  Value first = begin;
  if (threads.enabled())
    first = arith::AddIOp::create(b, begin, threadOffsetOf());
  auto chunkBody = [&](Value j, ValueRange state) {
    return body(stepOffsets(j), {}, state);
  };
  scf::ForOp loop;
  if (!lastFirst) {
    loop = buildForLoop(b, first, end, index(chunkSize()), inits, chunkBody);
  } else {
    Value numChunks = arith::DivUIOp::create(
        b, arith::SubIOp::create(b, end, begin), index(chunkSize()));
    Value lastChunk = arith::AddIOp::create(
        b, first,
        arith::MulIOp::create(b, arith::SubIOp::create(b, numChunks, index(1)),
                              index(chunkSize())));
    loop = buildForLoop(
        b, index(0), numChunks, index(1), inits,
        [&](Value i, ValueRange state) {
          Value j = arith::SubIOp::create(
              b, lastChunk, arith::MulIOp::create(b, i, index(chunkSize())));
          return chunkBody(j, state);
        });
  }
  return SmallVector<Value>(loop.getResults().begin(), loop.getResults().end());
}

SmallVector<Value> RowLoopBuilder::buildRemainder(const RowRange &range,
                                                  ValueRange state,
                                                  StepBody body) {
  if (!threads.enabled()) {
    scf::ForOp loop = buildForLoop(
        b, range.mainEnd, range.vectorEnd, index(threadStride()), state,
        [&](Value j, ValueRange state) { return body({j}, {}, state); });
    return SmallVector<Value>(loop.getResults().begin(),
                              loop.getResults().end());
  }
  // Fewer than a chunk's vectors are left: at most `unroll` per thread, all
  // loaded at once rather than one round trip each. Only a thread whose
  // first vector is in the row takes part, and its vectors past the row are
  // clamped to that first vector: every load of the step reads a vector
  // (or row-cache slot) of this thread's own, never one that another
  // thread writes. A lane clamped to the row's last vector would read the
  // cache slot that another thread's asynchronous copy fills, with no
  // barrier between (compute-sanitizer's racecheck reported it), or, under
  // overwrite, a logit that another thread overwrites with its gradient;
  // the value was discarded, but the access was a race (issue 23, item 13).
  Value first = arith::AddIOp::create(b, range.mainEnd, threadOffsetOf());
  Value owns = arith::CmpIOp::create(b, arith::CmpIPredicate::ult, first,
                                     range.vectorEnd);
  return buildIfYield(
      b, owns, state.getTypes(),
      [&] {
        SmallVector<Value, 8> steps = stepOffsets(first);
        SmallVector<Value, 8> offsets = {first};
        SmallVector<Value, 8> valid = {
            arith::ConstantIntOp::create(b, b.getI1Type(), 1)};
        for (Value offset : ArrayRef<Value>(steps).drop_front()) {
          Value inRow = arith::CmpIOp::create(b, arith::CmpIPredicate::ult,
                                              offset, range.vectorEnd);
          valid.push_back(inRow);
          offsets.push_back(arith::SelectOp::create(b, inRow, offset, first));
        }
        return body(offsets, valid, state);
      },
      [&] { return SmallVector<Value>(state.begin(), state.end()); });
}

SmallVector<Value> RowLoopBuilder::buildVectorLoops(const RowRange &range,
                                                    ValueRange inits,
                                                    StepBody body,
                                                    bool lastFirst) {
  if (!lastFirst || !threads.enabled()) {
    SmallVector<Value> state =
        buildChunkLoop(range.head, range.mainEnd, inits, body, false);
    return buildRemainder(range, state, body);
  }
  SmallVector<Value> state = buildRemainder(range, inits, body);
  return buildChunkLoop(range.head, range.mainEnd, state, body, true);
}

scf::ForOp RowLoopBuilder::buildTailLoop(
    Value begin, Value end, ValueRange inits,
    function_ref<SmallVector<Value>(Value, ValueRange)> body) {
  if (!threads.enabled())
    return buildForLoop(b, begin, end, index(1), inits, body);
  Value first = arith::AddIOp::create(b, begin, threads.threadId);
  return buildForLoop(b, first, end, index(threads.numThreads), inits, body);
}

SmallVector<Value> RowLoopBuilder::buildScalarLoops(
    const RowRange &range, Value vocab, ValueRange inits,
    function_ref<SmallVector<Value>(Value, ValueRange)> body) {
  scf::ForOp head = buildTailLoop(index(0), range.head, inits, body);
  scf::ForOp tail =
      buildTailLoop(range.vectorEnd, vocab, head.getResults(), body);
  return SmallVector<Value>(tail.getResults().begin(), tail.getResults().end());
}

void RowLoopBuilder::buildGradientSweep(const RowRef &row, const RowRef &grad,
                                        Value vocab, Value lse, Value scale,
                                        Value c, Value u,
                                        bool afterStatistics, Value lseLow,
                                        bool fromRowMax) {
  auto vectorType = VectorType::get({vectorWidth}, b.getF32Type());
  Value scaleC = arith::MulFOp::create(b, scale, c);
  Value negScaleU = arith::NegFOp::create(b, arith::MulFOp::create(b, scale, u));
  // From the row maximum (fromRowMax): exp(s (x - m) - L) =
  // exp2((x - m) fl(s log2 e) - L log2 e), one FMA after the exact
  // subtraction, as many instructions as exp(x - lse)'s subtraction and
  // scaling; L log2 e (below log2 V) is rounded once per row. From lse:
  // exp(fma(s, x, -lse) - lseLow), s x exact inside the FMA (a subtraction
  // without a scale), then the same FMA with log2 e.
  Value negLowScaled =
      lseLow ? arith::MulFOp::create(b, lseLow, f32(-kLog2E)).getResult()
             : Value();
  Value logitScaleValue = getLogitScale();
  Value negLse = logitScaleValue && !fromRowMax
                     ? arith::NegFOp::create(b, lse).getResult()
                     : Value();
  auto gradient = [&](Value x, Type type) -> Value {
    auto splat = [&](Value s) -> Value {
      if (isa<VectorType>(type))
        return vector::BroadcastOp::create(b, type, s);
      return s;
    };
    // A softcap: the exponent is of z, and the result times dz/dx (both
    // from the same tanh).
    Value slope;
    if (softcap)
      std::tie(x, slope) = softcapWithSlope(x);
    // scale (p c - u) = p (scale c) - scale u: one FMA after the exp.
    Value p;
    if (fromRowMax) {
      Value shifted = arith::SubFOp::create(b, x, splat(lse));
      p = math::Exp2Op::create(
          b, math::FmaOp::create(b, shifted, scaledLog2E(type),
                                 splat(negLowScaled)));
    } else {
      Value shifted =
          logitScaleValue ? math::FmaOp::create(b, splat(logitScaleValue), x,
                                            splat(negLse))
                            .getResult()
                 : arith::SubFOp::create(b, x, splat(lse)).getResult();
      p = lseLow ? math::Exp2Op::create(
                       b, math::FmaOp::create(b, shifted, splat(f32(kLog2E)),
                                              splat(negLowScaled)))
                       .getResult()
                 : buildExp(shifted);
    }
    Value g = math::FmaOp::create(b, p, splat(scaleC), splat(negScaleU));
    return slope ? arith::MulFOp::create(b, g, slope).getResult() : g;
  };
  auto scalarStep = [&](Value j, ValueRange) -> SmallVector<Value> {
    Value x = loadElement(row, j);
    storeElement(grad, j, gradient(x, b.getF32Type()));
    return {};
  };
  auto sweep = [&](const RowRange &range) {
    // Load the whole step first so the loads are in flight together.
    auto step = [&](ArrayRef<Value> offsets, ArrayRef<Value> valid,
                    bool fromCache) {
      SmallVector<Value, 8> xs;
      for (Value offset : offsets)
        xs.push_back(widen(fromCache ? loadCachedVector(range, offset)
                                     : loadRawVector(row, offset)));
      for (auto [k, x] : llvm::enumerate(xs))
        buildIfValid(valid, k, [&] {
          storeVector(grad, offsets[k], gradient(x, vectorType));
        });
    };
    auto fromGlobal = [&](ArrayRef<Value> offsets, ArrayRef<Value> valid,
                          ValueRange) {
      step(offsets, valid, /*fromCache=*/false);
      return SmallVector<Value>();
    };
    auto fromCache = [&](ArrayRef<Value> offsets, ArrayRef<Value> valid,
                         ValueRange) {
      step(offsets, valid, /*fromCache=*/true);
      return SmallVector<Value>();
    };
    bool lastFirst = afterStatistics && threads.enabled();
    CacheSplit split = lastFirst ? cacheSplitOf(range) : CacheSplit();
    if (!split) {
      buildVectorLoops(range, {}, fromGlobal, lastFirst);
    } else {
      // The row's end first (the bytes likeliest in L2), the cached part
      // last.
      buildSplitRemainder(range, split, {}, fromCache, fromGlobal);
      buildChunkLoop(split.chunksEnd, range.mainEnd, {}, fromGlobal,
                     /*lastFirst=*/true);
      buildChunkLoop(range.head, split.chunksEnd, {}, fromCache, false);
    }
    buildScalarLoops(range, vocab, {}, scalarStep);
  };
  RowRange range = rangeOf(row, vocab);
  if (!threads.enabled() || grad.memref == row.memref) {
    sweep(range);
    return;
  }
  // A separate gradient buffer whose rows sit differently against 16-byte
  // boundaries than the logits' cannot share their vector steps: such rows
  // take the scalar path.
  RowRange gradRange = rangeOf(grad, vocab);
  Value sameHead = arith::CmpIOp::create(b, arith::CmpIPredicate::eq,
                                         range.head, gradRange.head);
  buildIf(
      b, sameHead, [&] { sweep(range); },
      [&] { buildTailLoop(index(0), vocab, {}, scalarStep); });
}

void RowLoopBuilder::buildFill(const RowRef &grad, Value vocab, Value value) {
  auto vectorType = VectorType::get({vectorWidth}, b.getF32Type());
  Value splat = vector::BroadcastOp::create(b, vectorType, value);
  RowRange range = rangeOf(grad, vocab);
  buildVectorLoops(
      range, {},
      [&](ArrayRef<Value> offsets, ArrayRef<Value> valid,
          ValueRange) -> SmallVector<Value> {
        for (auto [k, offset] : llvm::enumerate(offsets))
          buildIfValid(valid, k, [&] { storeVector(grad, offset, splat); });
        return {};
      });
  buildScalarLoops(range, vocab, {},
                   [&](Value j, ValueRange) -> SmallVector<Value> {
                     storeElement(grad, j, value);
                     return {};
                   });
}

void RowLoopBuilder::buildScaleSweep(const RowRef &row, Value vocab,
                                     Value scale) {
  auto vectorType = VectorType::get({vectorWidth}, b.getF32Type());
  Value splat = vector::BroadcastOp::create(b, vectorType, scale);
  RowRange range = rangeOf(row, vocab);
  buildVectorLoops(
      range, {},
      [&](ArrayRef<Value> offsets, ArrayRef<Value> valid,
          ValueRange) -> SmallVector<Value> {
        // Load the whole step first so the loads are in flight together.
        SmallVector<Value, 8> xs;
        for (Value offset : offsets)
          xs.push_back(widen(loadRawVector(row, offset)));
        for (auto [k, x] : llvm::enumerate(xs))
          buildIfValid(valid, k, [&] {
            storeVector(row, offsets[k], arith::MulFOp::create(b, x, splat));
          });
        return {};
      });
  buildScalarLoops(range, vocab, {},
                   [&](Value j, ValueRange) -> SmallVector<Value> {
                     Value x = loadElement(row, j);
                     storeElement(row, j, arith::MulFOp::create(b, x, scale));
                     return {};
                   });
}
