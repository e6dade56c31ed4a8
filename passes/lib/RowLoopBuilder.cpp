//===- RowLoopBuilder.cpp - Row sweeps of the CE lowering -----------------===//

#include "RowLoopBuilder.h"

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/GPU/IR/GPUDialect.h"
#include "mlir/Dialect/LLVMIR/LLVMDialect.h"
#include "mlir/Dialect/LLVMIR/NVVMDialect.h"
#include "mlir/Dialect/Math/IR/Math.h"
#include "mlir/Dialect/MemRef/IR/MemRef.h"
#include "mlir/Dialect/NVGPU/IR/NVGPUDialect.h"
#include "mlir/Dialect/SCF/IR/SCF.h"
#include "mlir/Dialect/Vector/IR/VectorOps.h"

#include <limits>

using namespace mlir;
using namespace mlir::ce;

static constexpr float kLog2E = 1.44269504088896340736f;
static constexpr float kLn2 = 0.693147180559945309417f;
/// The main sweep subtracts the scaled maximum by FMA (stepRowState), capped
/// at -fl(max log2 e) <= 2^25.
static constexpr float kMaxNegScaledMax = 0x1p25f;
/// Rows whose maximum is not below this in magnitude (infinite, NaN, or the
/// -FLT_MAX of a row with no value > -inf included) are swept again with
/// exact subtractions (buildStatistics).
static constexpr float kFoldLimit = 0x1p24f;
static constexpr float kInf = std::numeric_limits<float>::infinity();
/// The maximum of a state that has seen no value > -inf: -FLT_MAX, finite
/// so that `x - max` is never -inf - -inf and no element but -FLT_MAX
/// itself compares equal to it. Such a state has no implicit 1 (rest = -1).
static constexpr float kNoMax = -std::numeric_limits<float>::max();

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

Value RowLoopBuilder::f32(float value, Type like) {
  Type f32Type = b.getF32Type();
  if (auto vectorType = dyn_cast_if_present<VectorType>(like))
    return arith::ConstantOp::create(
        b, vectorType, DenseElementsAttr::get(vectorType, value));
  return arith::ConstantOp::create(b, b.getFloatAttr(f32Type, value));
}

Value RowLoopBuilder::index(int64_t value) {
  return arith::ConstantIndexOp::create(b, value);
}

Value RowLoopBuilder::buildExp(Value x) {
  Value scaled = arith::MulFOp::create(b, x, f32(kLog2E, x.getType()));
  return math::Exp2Op::create(b, scaled);
}



Value RowLoopBuilder::buildLog1p(Value x) {
  // log(u) = k ln2 + 2 atanh(f / (2 + f)) with u = 1 + x = 2^k (1 + f),
  // 1 + f in [sqrt(1/2), sqrt(2)). Built from arithmetic alone, so it is as
  // accurate on GPUs (whose log2 instructions are absolute-error
  // approximations) as on the host. Near 0, f is x itself rather than
  // u - 1, which keeps the low bits of a small x.
  Type i32 = b.getI32Type();
  Value one = f32(1.0f);
  Value u = arith::AddFOp::create(b, one, x);
  Value bits = arith::BitcastOp::create(b, i32, u);
  auto i32c = [&](int32_t v) -> Value {
    return arith::ConstantOp::create(b, b.getI32IntegerAttr(v));
  };
  Value exponent = arith::SubIOp::create(
      b, arith::ShRUIOp::create(b, bits, i32c(23)), i32c(127));
  Value mantissa = arith::BitcastOp::create(
      b, b.getF32Type(),
      arith::OrIOp::create(b, arith::AndIOp::create(b, bits, i32c(0x007fffff)),
                           i32c(0x3f800000)));
  Value high = arith::CmpFOp::create(b, arith::CmpFPredicate::OGT, mantissa,
                                     f32(1.41421356f));
  mantissa = arith::SelectOp::create(
      b, high, arith::MulFOp::create(b, mantissa, f32(0.5f)), mantissa);
  exponent = arith::SelectOp::create(
      b, high, arith::AddIOp::create(b, exponent, i32c(1)), exponent);
  Value isZeroExponent =
      arith::CmpIOp::create(b, arith::CmpIPredicate::eq, exponent, i32c(0));
  Value f = arith::SelectOp::create(
      b, isZeroExponent, x, arith::SubFOp::create(b, mantissa, one));
  Value s = arith::DivFOp::create(b, f, arith::AddFOp::create(b, f32(2.0f), f));
  Value s2 = arith::MulFOp::create(b, s, s);
  // atanh(s) / s = 1 + s^2/3 + ... + s^10/11, |s| <= 0.1716.
  Value poly = f32(1.0f / 11.0f);
  for (float c : {1.0f / 9.0f, 1.0f / 7.0f, 1.0f / 5.0f, 1.0f / 3.0f, 1.0f})
    poly = math::FmaOp::create(b, poly, s2, f32(c));
  Value logM = arith::MulFOp::create(
      b, f32(2.0f), arith::MulFOp::create(b, s, poly));
  Value k = arith::SIToFPOp::create(b, b.getF32Type(), exponent);
  // ln 2 split so k * ln2Hi is exact.
  Value result = math::FmaOp::create(
      b, k, f32(0.693145752f),
      math::FmaOp::create(b, k, f32(1.42860677e-6f), logM));
  // u = 0 (x = -1): -inf; u = +inf: +inf; NaN stays NaN.
  Value isZero = arith::CmpFOp::create(b, arith::CmpFPredicate::OEQ, u,
                                       f32(0.0f));
  result = arith::SelectOp::create(b, isZero, f32(-kInf), result);
  Value isInf = arith::CmpFOp::create(b, arith::CmpFPredicate::OEQ, u,
                                      f32(kInf));
  result = arith::SelectOp::create(b, isInf, u, result);
  Value isNaN = arith::CmpFOp::create(b, arith::CmpFPredicate::UNO, x, x);
  return arith::SelectOp::create(b, isNaN, x, result);
}

Value RowLoopBuilder::buildExpm1(Value x) {
  // |x| < 1/2: Taylor to x^9 (relative error < 1e-9); otherwise
  // exp(x) - 1, where the cancellation costs at most a factor 2.6.
  Value taylor = f32(1.0f / 362880.0f);
  for (float c : {1.0f / 40320.0f, 1.0f / 5040.0f, 1.0f / 720.0f,
                  1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f})
    taylor = math::FmaOp::create(b, taylor, x, f32(c));
  taylor = arith::MulFOp::create(b, taylor, x);
  Value direct = arith::SubFOp::create(b, buildExp(x), f32(1.0f));
  Value small = arith::CmpFOp::create(b, arith::CmpFPredicate::OLT,
                                      math::AbsFOp::create(b, x), f32(0.5f));
  return arith::SelectOp::create(b, small, taylor, direct);
}

/// The indices of element `index` of `row`.
static SmallVector<Value, 3> indicesOf(const RowRef &row, Value index) {
  SmallVector<Value, 3> indices(row.prefix.begin(), row.prefix.end());
  indices.push_back(index);
  return indices;
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

Value RowLoopBuilder::widen(Value raw) {
  Type elementType = cast<VectorType>(raw.getType()).getElementType();
  if (elementType.isBF16() && threads.enabled() && vectorWidth % 2 == 0)
    return widenBF16Pairs(raw);
  if (!elementType.isF32())
    raw = arith::ExtFOp::create(
        b, VectorType::get({vectorWidth}, b.getF32Type()), raw);
  return raw;
}

/// Builds `scf.if` yielding `types`: `thenBody` or `elseBody` gives them.
static SmallVector<Value>
buildIfYield(ImplicitLocOpBuilder &b, Value condition, TypeRange types,
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

RowLoopBuilder::CacheSplit
RowLoopBuilder::cacheSplitOf(const RowRange &range) {
  if (!threads.rowCache)
    return {};
  int64_t capacity =
      cast<MemRefType>(threads.rowCache.getType()).getNumElements();
  int64_t chunks = capacity / chunkSize() * chunkSize();
  if (chunks == 0)
    return {};
  Value chunksEnd = arith::MinUIOp::create(
      b, range.mainEnd, arith::AddIOp::create(b, range.head, index(chunks)));
  Value remainder = arith::CmpIOp::create(
      b, arith::CmpIPredicate::ule,
      arith::SubIOp::create(b, range.vectorEnd, range.head), index(capacity));
  return {chunksEnd, remainder};
}

SmallVector<Value> RowLoopBuilder::buildSplitRemainder(
    const RowRange &range, const CacheSplit &split, ValueRange state,
    StepBody cached, StepBody uncached) {
  auto side = [&](StepBody body) {
    return [&, body]() -> SmallVector<Value> {
      if (!body)
        return SmallVector<Value>(state.begin(), state.end());
      return buildRemainder(range, state, body);
    };
  };
  return buildIfYield(b, split.remainder, state.getTypes(), side(cached),
                      side(uncached));
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

int64_t RowLoopBuilder::cacheChunks() const {
  return cast<MemRefType>(threads.rowCache.getType()).getNumElements() /
         chunkSize();
}

Value RowLoopBuilder::commitCopies() {
  return nvgpu::DeviceAsyncCreateGroupOp::create(
      b, nvgpu::DeviceAsyncTokenType::get(b.getContext()), ValueRange{});
}

int64_t RowLoopBuilder::elementBytes(const RowRef &row) {
  return cast<MemRefType>(row.memref.getType()).getElementTypeBitWidth() / 8;
}

Value RowLoopBuilder::addressOf(const RowRef &row, Value index) {
  auto metadata = memref::ExtractStridedMetadataOp::create(b, row.memref);
  Value start = arith::AddIOp::create(b, metadata.getOffset(), index);
  for (auto [i, prefix] : llvm::enumerate(row.prefix))
    start = arith::AddIOp::create(
        b, start, arith::MulIOp::create(b, prefix, metadata.getStrides()[i]));
  Value base = memref::ExtractAlignedPointerAsIndexOp::create(b, row.memref);
  return arith::AddIOp::create(
      b, base, arith::MulIOp::create(b, start, this->index(elementBytes(row))));
}

void RowLoopBuilder::buildCacheCopies(const RowRef &row, const RowRange &range,
                                      const CacheSplit &split) {
  auto copy = [&](ArrayRef<Value> offsets, ArrayRef<Value> valid, ValueRange) {
    for (auto [k, offset] : llvm::enumerate(offsets)) {
      buildIfValid(valid, k, [&] { copyToCache(row, range, offset); });
    }
    return SmallVector<Value>();
  };
  // One group per chunk of the cache (empty ones for chunks past the row),
  // then the remainder's: cacheChunks() + 1 groups in all, so the sweep can
  // wait for chunk i alone (buildStatisticsSweep).
  buildChunkLoop(range.head, split.chunksEnd, {},
                 [&](ArrayRef<Value> offsets, ArrayRef<Value> valid,
                     ValueRange state) {
                   copy(offsets, valid, state);
                   commitCopies();
                   return SmallVector<Value>();
                 },
                 false);
  Value copied = arith::DivUIOp::create(
      b, arith::SubIOp::create(b, split.chunksEnd, range.head),
      index(chunkSize()));
  buildForLoop(b, copied, index(cacheChunks()), index(1), {},
               [&](Value, ValueRange) {
                 commitCopies();
                 return SmallVector<Value>();
               });
  buildSplitRemainder(range, split, {}, copy, {});
  commitCopies();
}

void RowLoopBuilder::prefetchToL2(const RowRef &row, Value begin, Value end) {
  // One bulk prefetch of [begin, end) (16-byte aligned whole vectors) by
  // thread 0.
  assert(threads.enabled() && "a GPU-only prefetch");
  Value first = arith::CmpIOp::create(b, arith::CmpIPredicate::eq,
                                      threads.threadId, index(0));
  Value nonEmpty =
      arith::CmpIOp::create(b, arith::CmpIPredicate::ult, begin, end);
  buildIf(b, arith::AndIOp::create(b, first, nonEmpty), [&] {
    Value address = addressOf(row, begin);
    Value size = arith::IndexCastUIOp::create(
        b, b.getI32Type(),
        arith::MulIOp::create(b, arith::SubIOp::create(b, end, begin),
                              index(elementBytes(row))));
    Value pointer = LLVM::IntToPtrOp::create(
        b, LLVM::LLVMPointerType::get(b.getContext(), 1),
        arith::IndexCastUIOp::create(b, b.getI64Type(), address).getResult(),
        LLVM::DereferenceableAttr());
    NVVM::CpAsyncBulkPrefetchOp::create(b, pointer, size, Value());
  });
}

Value RowLoopBuilder::cacheSlot(const RowRange &range, Value index) {
  return arith::SubIOp::create(b, index, range.head);
}

Value RowLoopBuilder::loadRingVector(const RowRange &range, Value index) {
  // Offset `index` of chunk i sits in stage i mod S: (index - head) mod
  // (S chunks), the whole ring.
  auto ringType = cast<MemRefType>(threads.streamRing.getType());
  Type elementType = ringType.getElementType();
  Value slot = arith::RemUIOp::create(
      b, arith::SubIOp::create(b, index, range.head),
      this->index(ringType.getNumElements()));
  return vector::LoadOp::create(b, VectorType::get({vectorWidth}, elementType),
                                threads.streamRing, ValueRange{slot},
                                /*nontemporal=*/false, alignment());
}

Value RowLoopBuilder::loadCachedVector(const RowRange &range, Value index) {
  Type elementType =
      cast<MemRefType>(threads.rowCache.getType()).getElementType();
  return vector::LoadOp::create(b, VectorType::get({vectorWidth}, elementType),
                                threads.rowCache,
                                ValueRange{cacheSlot(range, index)},
                                /*nontemporal=*/false, alignment());
}

/// The offsets of a thread's `unroll` vectors in the step at `first`.
static SmallVector<Value, 8> stepOffsets(RowLoopBuilder &rows,
                                         ImplicitLocOpBuilder &b, Value first,
                                         unsigned unroll, int64_t stride);

void RowLoopBuilder::copyToCache(const RowRef &row, const RowRange &range,
                                 Value index) {
  copyToSlot(row, index, threads.rowCache, cacheSlot(range, index));
}

void RowLoopBuilder::copyToSlot(const RowRef &row, Value index, Value buffer,
                                Value slot) {
  nvgpu::DeviceAsyncCopyOp::create(
      b, nvgpu::DeviceAsyncTokenType::get(b.getContext()), buffer,
      ValueRange{slot}, row.memref, indicesOf(row, index),
      b.getIndexAttr(vectorWidth), /*srcElements=*/Value(),
      /*bypassL1=*/b.getUnitAttr());
}

SmallVector<Value> RowLoopBuilder::buildStreamedChunks(const RowRef &row,
                                                       const RowRange &range,
                                                       ValueRange inits,
                                                       StepBody body) {
  // Chunk i's vectors land in stage i mod S of the ring (S stages, S - 1
  // chunks in flight ahead of the one reduced): each thread's at the same
  // places as in the chunk, so it reads back only its own copies.
  int64_t chunk = chunkSize();
  int64_t stages =
      cast<MemRefType>(threads.streamRing.getType()).getNumElements() / chunk;
  int64_t threadStride = static_cast<int64_t>(vectorWidth) * threads.numThreads;
  Value threadOffset = threadOffsetOf();
  Value first = arith::AddIOp::create(b, range.head, threadOffset);
  Value numChunks = arith::DivUIOp::create(
      b, arith::SubIOp::create(b, range.mainEnd, range.head), index(chunk));
  auto tokenType = nvgpu::DeviceAsyncTokenType::get(b.getContext());
  auto copyChunk = [&](Value chunkIndex, Value j) {
    Value stage = arith::RemUIOp::create(b, chunkIndex, index(stages));
    Value base = arith::AddIOp::create(
        b, arith::MulIOp::create(b, stage, index(chunk)), threadOffset);
    for (auto [k, offset] :
         llvm::enumerate(stepOffsets(*this, b, j, unroll, threadStride)))
      copyToSlot(row, offset, threads.streamRing,
                 arith::AddIOp::create(b, base, index(k * threadStride)));
  };
  // Chunks 0 .. S-2 ahead, one group each (empty past the row's chunks).
  for (int64_t s = 0; s + 1 < stages; ++s) {
    Value exists = arith::CmpIOp::create(b, arith::CmpIPredicate::ult,
                                         index(s), numChunks);
    buildIf(b, exists, [&] {
      copyChunk(index(s), arith::AddIOp::create(b, first, index(s * chunk)));
    });
    nvgpu::DeviceAsyncCreateGroupOp::create(b, tokenType, ValueRange{});
  }
  scf::ForOp loop = buildForLoop(
      b, index(0), numChunks, index(1), inits,
      [&](Value i, ValueRange state) -> SmallVector<Value> {
        Value j = arith::AddIOp::create(
            b, first, arith::MulIOp::create(b, i, index(chunk)));
        Value next = arith::AddIOp::create(b, i, index(stages - 1));
        Value more =
            arith::CmpIOp::create(b, arith::CmpIPredicate::ult, next, numChunks);
        buildIf(b, more, [&] {
          copyChunk(next,
                    arith::AddIOp::create(b, j, index((stages - 1) * chunk)));
        });
        Value group =
            nvgpu::DeviceAsyncCreateGroupOp::create(b, tokenType, ValueRange{});
        // Chunk i's group is complete when at most the S - 1 newest are
        // pending.
        nvgpu::DeviceAsyncWaitOp::create(
            b, group, b.getI32IntegerAttr(static_cast<int32_t>(stages - 1)));
        return body(stepOffsets(*this, b, j, unroll, threadStride), {}, state);
      });
  return SmallVector<Value>(loop.getResults().begin(), loop.getResults().end());
}

void RowLoopBuilder::storeCachedVector(const RowRange &range, Value index,
                                       Value raw) {
  vector::StoreOp::create(b, raw, threads.rowCache,
                          ValueRange{cacheSlot(range, index)},
                          /*nontemporal=*/false, alignment());
}

Value RowLoopBuilder::widenBF16Pairs(Value value) {
  // A bf16 is the high half of an f32: with two per 32-bit word, the even
  // element is `word << 16` and the odd one `word & 0xffff0000`, one integer
  // operation each (a conversion plus an unpacking move otherwise).
  int64_t words = vectorWidth / 2;
  auto wordType = VectorType::get({words}, b.getI32Type());
  auto halfType = VectorType::get({words}, b.getF32Type());
  Value packed = vector::BitCastOp::create(b, wordType, value);
  auto splat = [&](int32_t bits) -> Value {
    return arith::ConstantOp::create(
        b, DenseElementsAttr::get(wordType, b.getI32IntegerAttr(bits)));
  };
  Value even = vector::BitCastOp::create(
      b, halfType, arith::ShLIOp::create(b, packed, splat(16)));
  Value odd = vector::BitCastOp::create(
      b, halfType,
      arith::AndIOp::create(b, packed, splat(static_cast<int32_t>(0xffff0000u))));
  SmallVector<int64_t, 16> interleave;
  for (int64_t i = 0; i < words; ++i)
    interleave.append({i, words + i});
  return vector::ShuffleOp::create(b, even, odd, interleave);
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

int64_t RowLoopBuilder::chunkSize() const {
  return static_cast<int64_t>(vectorWidth) * unroll * threads.numThreads;
}

static SmallVector<Value, 8> stepOffsets(RowLoopBuilder &rows,
                                         ImplicitLocOpBuilder &b, Value first,
                                         unsigned unroll, int64_t stride) {
  SmallVector<Value, 8> offsets = {first};
  for (unsigned k = 1; k < unroll; ++k)
    offsets.push_back(arith::AddIOp::create(b, first, rows.index(k * stride)));
  return offsets;
}

SmallVector<Value> RowLoopBuilder::buildChunkLoop(Value begin, Value end,
                                                  ValueRange inits,
                                                  StepBody body,
                                                  bool lastFirst) {
  // Thread t's k-th vector of a chunk starts at (k * threads + t) * width:
  // consecutive threads read consecutive 16-byte vectors, so every load
  // instruction of a warp covers one contiguous span.
  int64_t threadStride = static_cast<int64_t>(vectorWidth) * threads.numThreads;
  Value first = begin;
  if (threads.enabled())
    first = arith::AddIOp::create(b, begin, threadOffsetOf());
  auto chunkBody = [&](Value j, ValueRange state) {
    return body(stepOffsets(*this, b, j, unroll, threadStride), {}, state);
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
  int64_t threadStride = static_cast<int64_t>(vectorWidth) * threads.numThreads;
  if (!threads.enabled()) {
    scf::ForOp loop = buildForLoop(
        b, range.mainEnd, range.vectorEnd, index(threadStride), state,
        [&](Value j, ValueRange state) { return body({j}, {}, state); });
    return SmallVector<Value>(loop.getResults().begin(),
                              loop.getResults().end());
  }
  // Fewer than a chunk's vectors are left: at most `unroll` per thread, all
  // loaded at once rather than one round trip each.
  Value any = arith::CmpIOp::create(b, arith::CmpIPredicate::ult,
                                    range.mainEnd, range.vectorEnd);
  return buildIfYield(
      b, any, state.getTypes(),
      [&] {
        Value first = arith::AddIOp::create(b, range.mainEnd, threadOffsetOf());
        Value lastVector =
            arith::SubIOp::create(b, range.vectorEnd, index(vectorWidth));
        SmallVector<Value, 8> offsets, valid;
        for (Value offset :
             stepOffsets(*this, b, first, unroll, threadStride)) {
          valid.push_back(arith::CmpIOp::create(
              b, arith::CmpIPredicate::ult, offset, range.vectorEnd));
          offsets.push_back(arith::MinUIOp::create(b, offset, lastVector));
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

std::pair<Value, Value> RowLoopBuilder::butterflyState(Value max, Value rest,
                                                      unsigned width) {
  for (unsigned offset = width / 2; offset >= 1; offset /= 2) {
    auto other = [&](Value v) -> Value {
      return gpu::ShuffleOp::create(b, v, offset, threads.subgroupSize,
                                    gpu::ShuffleMode::XOR)
          .getShuffleResult();
    };
    Value otherMax = other(max), otherRest = other(rest);
    std::tie(max, rest) = combineStates(max, rest, otherMax, otherRest);
  }
  return {max, rest};
}

/// Butterfly over a subgroup, then one slot per subgroup in workgroup
/// memory, combined by every thread in the same order (deterministic).
std::pair<Value, Value> RowLoopBuilder::allReduceState(Value max, Value rest) {
  if (!threads.enabled())
    return {max, rest};
  std::tie(max, rest) = butterflyState(max, rest, threads.subgroupSize);
  unsigned numSubgroups = threads.numSubgroups();
  if (numSubgroups <= 1)
    return {max, rest};
  Value subgroupSize = index(threads.subgroupSize);
  Value lane = arith::RemUIOp::create(b, threads.threadId, subgroupSize);
  Value subgroup = arith::DivUIOp::create(b, threads.threadId, subgroupSize);
  Value isFirstLane =
      arith::CmpIOp::create(b, arith::CmpIPredicate::eq, lane, index(0));
  buildIf(b, isFirstLane, [&] {
    memref::StoreOp::create(b, max, threads.scratch, ValueRange{subgroup});
    Value restSlot =
        arith::AddIOp::create(b, subgroup, index(numSubgroups));
    memref::StoreOp::create(b, rest, threads.scratch, ValueRange{restSlot});
  });
  gpu::BarrierOp::create(b);
  if (llvm::has_single_bit(numSubgroups)) {
    // Lane l of every subgroup takes slot l mod numSubgroups, and a
    // butterfly over numSubgroups lanes combines the slots in
    // log2(numSubgroups) steps rather than one after another.
    Value slot = arith::RemUIOp::create(b, lane, index(numSubgroups));
    max = memref::LoadOp::create(b, threads.scratch, ValueRange{slot});
    rest = memref::LoadOp::create(
        b, threads.scratch,
        ValueRange{arith::AddIOp::create(b, slot, index(numSubgroups))});
    std::tie(max, rest) = butterflyState(max, rest, numSubgroups);
  } else {
    max = memref::LoadOp::create(b, threads.scratch, ValueRange{index(0)});
    rest = memref::LoadOp::create(b, threads.scratch,
                                  ValueRange{index(numSubgroups)});
    for (unsigned i = 1; i < numSubgroups; ++i) {
      Value otherMax =
          memref::LoadOp::create(b, threads.scratch, ValueRange{index(i)});
      Value otherRest = memref::LoadOp::create(
          b, threads.scratch, ValueRange{index(numSubgroups + i)});
      std::tie(max, rest) = combineStates(max, rest, otherMax, otherRest);
    }
  }
  // The slots are reused by the next reduction.
  gpu::BarrierOp::create(b);
  return {max, rest};
}

Value RowLoopBuilder::allReduceSum(Value sum) {
  if (!threads.enabled())
    return sum;
  for (unsigned offset = threads.subgroupSize / 2; offset >= 1; offset /= 2) {
    Value other = gpu::ShuffleOp::create(b, sum, offset, threads.subgroupSize,
                                         gpu::ShuffleMode::XOR)
                      .getShuffleResult();
    sum = arith::AddFOp::create(b, sum, other);
  }
  unsigned numSubgroups = threads.numSubgroups();
  if (numSubgroups <= 1)
    return sum;
  Value subgroupSize = index(threads.subgroupSize);
  Value lane = arith::RemUIOp::create(b, threads.threadId, subgroupSize);
  Value subgroup = arith::DivUIOp::create(b, threads.threadId, subgroupSize);
  Value slot =
      arith::AddIOp::create(b, subgroup, index(2 * numSubgroups));
  buildIf(b, arith::CmpIOp::create(b, arith::CmpIPredicate::eq, lane, index(0)),
          [&] {
            memref::StoreOp::create(b, sum, threads.scratch, ValueRange{slot});
          });
  gpu::BarrierOp::create(b);
  sum = memref::LoadOp::create(b, threads.scratch,
                               ValueRange{index(2 * numSubgroups)});
  for (unsigned i = 1; i < numSubgroups; ++i)
    sum = arith::AddFOp::create(
        b, sum,
        memref::LoadOp::create(b, threads.scratch,
                               ValueRange{index(2 * numSubgroups + i)}));
  gpu::BarrierOp::create(b);
  return sum;
}

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
static std::pair<Value, Value> sumTerms(RowLoopBuilder &rows,
                                        ImplicitLocOpBuilder &b,
                                        ArrayRef<Value> xs, Value max,
                                        Value negScaledMax = {}) {
  Value zero = rows.f32(0.0f, max.getType());
  Value log2e = negScaledMax ? rows.f32(kLog2E, max.getType()) : Value();
  Value smallTerms, allTerms;
  for (Value x : xs) {
    Value isMax = arith::CmpFOp::create(b, arith::CmpFPredicate::OEQ, x, max);
    Value e = negScaledMax
                  ? math::Exp2Op::create(
                        b, math::FmaOp::create(b, x, log2e, negScaledMax))
                  : rows.buildExp(arith::SubFOp::create(b, x, max));
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
  Value rescale = rows.buildExp(arith::SubFOp::create(b, max, newMax));
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
static std::pair<Value, Value> stepRowState(RowLoopBuilder &rows,
                                            ImplicitLocOpBuilder &b, Value max,
                                            Value rest, ArrayRef<Value> xs,
                                            Value stepMax) {
  auto type = cast<VectorType>(rest.getType());
  auto splat = [&](Value scalar) -> Value {
    return vector::BroadcastOp::create(b, type, scalar);
  };
  if (!stepMax)
    stepMax = maximumOf(b, xs);
  Value newMax = arith::MaximumFOp::create(b, max, stepMax);
  Value rescale = rows.buildExp(arith::SubFOp::create(b, max, newMax));
  Value grew = arith::CmpFOp::create(b, arith::CmpFPredicate::OGT, newMax, max);
  Value negScaled = arith::MinimumFOp::create(
      b, arith::MulFOp::create(b, newMax, rows.f32(-kLog2E)),
      rows.f32(kMaxNegScaledMax));
  Value residual = arith::MaximumFOp::create(
      b, math::FmaOp::create(b, newMax, rows.f32(kLog2E), negScaled),
      rows.f32(-64.0f));
  Value unscale = unscaleOf(rows, b, residual);
  auto [smallTerms, allTerms] =
      sumTerms(rows, b, xs, splat(newMax), splat(negScaled));
  Value maxCount = math::RoundEvenOp::create(
      b, arith::MulFOp::create(
             b,
             vector::ReductionOp::create(
                 b, vector::CombiningKind::ADD,
                 arith::SubFOp::create(b, allTerms, smallTerms)),
             unscale));
  // rest' = (rest + moved) rescale + small 2^-d + (count - moved), the
  // scalar parts on lane 0; `moved` is the old implicit 1 when the maximum
  // grew.
  Value moved = arith::SelectOp::create(b, grew, rows.f32(1.0f), rows.f32(0.0f));
  Value adjust = arith::AddFOp::create(
      b, arith::MulFOp::create(b, moved, rescale),
      arith::SubFOp::create(b, maxCount, moved));
  Value newRest = math::FmaOp::create(
      b, rest, splat(rescale),
      arith::MulFOp::create(b, smallTerms, splat(unscale)));
  Value lane0 = vector::ExtractOp::create(b, newRest, ArrayRef<int64_t>{0});
  newRest = vector::InsertOp::create(
      b, arith::AddFOp::create(b, lane0, adjust), newRest,
      ArrayRef<int64_t>{0});
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
  Value scale = buildExp(arith::SubFOp::create(b, lowMax, topMax));
  Value rest = arith::AddFOp::create(
      b, topRest, arith::MulFOp::create(b, lowSum, scale));
  return {topMax, rest};
}

RowStats RowLoopBuilder::buildStatistics(const RowRef &row, Value vocab,
                                         bool withSum) {
  RowStats stats = buildStatisticsSweep(row, vocab, withSum);
  // Outside |max| < 2^24 the folded exponents are unusable (stepRowState):
  // such a row (and an all -inf, infinite or NaN one) is swept again from
  // global memory with exact subtractions, one element per thread and step
  // (no real logits take this path; a scalar loop keeps its registers out of
  // the way of the main sweep's). Every thread has the same max, so the
  // branch is uniform.
  Value unusual = arith::CmpFOp::create(b, arith::CmpFPredicate::UGE,
                                        math::AbsFOp::create(b, stats.max),
                                        f32(kFoldLimit));
  SmallVector<Type, 3> types(withSum ? 3 : 2, b.getF32Type());
  auto valuesOf = [&](const RowStats &s) {
    SmallVector<Value> values = {s.max, s.rest};
    if (withSum)
      values.push_back(s.sum);
    return values;
  };
  SmallVector<Value> values = buildIfYield(
      b, unusual, types,
      [&] {
        SmallVector<Value> inits = {f32(kNoMax), f32(-1.0f)};
        if (withSum)
          inits.push_back(f32(0.0f));
        scf::ForOp loop = buildTailLoop(
            index(0), vocab, inits,
            [&](Value j, ValueRange state) -> SmallVector<Value> {
              Value x = loadElement(row, j);
              auto [max, rest] = stepState(*this, b, state[0], state[1], {x});
              SmallVector<Value> next = {max, rest};
              if (withSum)
                next.push_back(arith::AddFOp::create(b, state[2], x));
              return next;
            });
        RowStats exact;
        std::tie(exact.max, exact.rest) =
            allReduceState(loop.getResult(0), loop.getResult(1));
        if (withSum)
          exact.sum = allReduceSum(loop.getResult(2));
        return valuesOf(exact);
      },
      [&] { return valuesOf(stats); });
  return {values[0], values[1], withSum ? values[2] : Value()};
}

RowStats RowLoopBuilder::buildStatisticsSweep(const RowRef &row, Value vocab,
                                              bool withSum) {
  auto vectorType = VectorType::get({vectorWidth}, b.getF32Type());

  // Main sweep: `unroll` vectors per step; one maximum per thread, the rest
  // as partial sums per lane (-1 on lane 0: no implicit 1 yet).
  RowRange range = rangeOf(row, vocab);
  SmallVector<float> noRest(vectorWidth, 0.0f);
  noRest[0] = -1.0f;
  Value initialRest = arith::ConstantOp::create(
      b, DenseElementsAttr::get(vectorType, ArrayRef<float>(noRest)));
  SmallVector<Value> inits = {f32(kNoMax), initialRest};
  if (withSum)
    inits.push_back(f32(0.0f, vectorType));
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
    if (threads.packedMax &&
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
      Value x = widen(raw);
      sumXs.push_back(x);
      if (!valid.empty()) {
        // A vector past the row: -inf adds nothing to (max, rest), 0
        // nothing to the sum.
        x = arith::SelectOp::create(b, valid[k], x, f32(-kInf, vectorType));
        sumXs.back() = arith::SelectOp::create(b, valid[k], sumXs.back(),
                                               f32(0.0f, vectorType));
      }
      xs.push_back(x);
    }
    auto [max, rest] =
        stepRowState(*this, b, state[0], state[1], xs, stepMax);
    SmallVector<Value> next = {max, rest};
    if (withSum) {
      Value tileSum = sumXs.front();
      for (Value x : ArrayRef<Value>(sumXs).drop_front())
        tileSum = arith::AddFOp::create(b, tileSum, x);
      next.push_back(arith::AddFOp::create(b, state[2], tileSum));
    }
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
          nvgpu::DeviceAsyncWaitOp::create(b, commitCopies(),
                                           b.getI32IntegerAttr(behind));
          return fromCache(offsets, valid, state);
        },
        false);
    nvgpu::DeviceAsyncWaitOp::create(b, commitCopies(), IntegerAttr());
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
  Value rest =
      vector::ReductionOp::create(b, vector::CombiningKind::ADD, lanes[1]);
  Value sum;
  if (withSum)
    sum = vector::ReductionOp::create(b, vector::CombiningKind::ADD,
                                      lanes[2]);

  // Scalar head and tail: a state of their own, merged last.
  SmallVector<Value> tailInits = {f32(kNoMax), f32(-1.0f)};
  if (withSum)
    tailInits.push_back(f32(0.0f));
  SmallVector<Value> tailState = buildScalarLoops(
      range, vocab, tailInits,
      [&](Value j, ValueRange state) -> SmallVector<Value> {
        Value x = loadElement(row, j);
        auto [tailMax, tailRest] =
            stepState(*this, b, state[0], state[1], {x});
        SmallVector<Value> next = {tailMax, tailRest};
        if (withSum)
          next.push_back(arith::AddFOp::create(b, state[2], x));
        return next;
      });
  std::tie(max, rest) =
      combineStates(max, rest, tailState[0], tailState[1]);
  if (withSum)
    sum = arith::AddFOp::create(b, sum, tailState[2]);
  std::tie(max, rest) = allReduceState(max, rest);
  if (withSum)
    sum = allReduceSum(sum);
  return {max, rest, sum};
}

Value RowLoopBuilder::buildLogSumExp(const RowStats &stats) {
  return arith::AddFOp::create(b, stats.max, buildLog1p(stats.rest));
}

void RowLoopBuilder::buildGradientSweep(const RowRef &row, const RowRef &grad,
                                        Value vocab, Value lse, Value scale,
                                        Value c, Value u,
                                        bool afterStatistics) {
  auto vectorType = VectorType::get({vectorWidth}, b.getF32Type());
  Value scaleC = arith::MulFOp::create(b, scale, c);
  Value negScaleU = arith::NegFOp::create(b, arith::MulFOp::create(b, scale, u));
  auto gradient = [&](Value x, Type type) -> Value {
    auto splat = [&](Value s) -> Value {
      if (isa<VectorType>(type))
        return vector::BroadcastOp::create(b, type, s);
      return s;
    };
    // scale (p c - u) = p (scale c) - scale u: one FMA after the exp.
    Value p = buildExp(arith::SubFOp::create(b, x, splat(lse)));
    return math::FmaOp::create(b, p, splat(scaleC), splat(negScaleU));
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
