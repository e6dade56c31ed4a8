//===- RowStaging.cpp - Workgroup-memory staging of a row -----------------===//
//
// The fused kernels' row cache and the statistics sweep's stream ring,
// filled by asynchronous copies, and the L2 prefetch of the uncached rest
// of a row.
//
//===----------------------------------------------------------------------===//

#include "RowLoopBuilder.h"
#include "RowLoopInternal.h"
#include "TargetInfo.h"

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/GPU/IR/GPUDialect.h"
#include "mlir/Dialect/LLVMIR/LLVMDialect.h"
#include "mlir/Dialect/MemRef/IR/MemRef.h"
#include "mlir/Dialect/SCF/IR/SCF.h"
#include "mlir/Dialect/Vector/IR/VectorOps.h"

using namespace mlir;
using namespace mlir::ce;
using namespace mlir::ce::detail;

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

int64_t RowLoopBuilder::cacheChunks() const {
  return cast<MemRefType>(threads.rowCache.getType()).getNumElements() /
         chunkSize();
}

Value RowLoopBuilder::commitCopies() {
  assert(threads.target && threads.target->hasAsyncCopy());
  return threads.target->buildCommitGroup(b);
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
  assert(threads.enabled() && threads.target &&
         threads.target->hasL2Prefetch() && "a prefetch the target has");
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
    threads.target->buildL2Prefetch(b, pointer, size);
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

void RowLoopBuilder::copyToCache(const RowRef &row, const RowRange &range,
                                 Value index) {
  copyToSlot(row, index, threads.rowCache, cacheSlot(range, index));
}

void RowLoopBuilder::copyToSlot(const RowRef &row, Value index, Value buffer,
                                Value slot) {
  assert(threads.target && threads.target->hasAsyncCopy());
  threads.target->buildAsyncCopy(b, buffer, ValueRange{slot}, row.memref,
                                 indicesOf(row, index), vectorWidth);
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
  Value threadOffset = threadOffsetOf();
  Value first = arith::AddIOp::create(b, range.head, threadOffset);
  Value numChunks = arith::DivUIOp::create(
      b, arith::SubIOp::create(b, range.mainEnd, range.head), index(chunk));
  auto copyChunk = [&](Value chunkIndex, Value j) {
    Value stage = arith::RemUIOp::create(b, chunkIndex, index(stages));
    Value base = arith::AddIOp::create(
        b, arith::MulIOp::create(b, stage, index(chunk)), threadOffset);
    for (auto [k, offset] : llvm::enumerate(stepOffsets(j)))
      copyToSlot(row, offset, threads.streamRing,
                 arith::AddIOp::create(b, base, index(k * threadStride())));
  };
  // Chunks 0 .. S-2 ahead, one group each (empty past the row's chunks).
  for (int64_t s = 0; s + 1 < stages; ++s) {
    Value exists = arith::CmpIOp::create(b, arith::CmpIPredicate::ult,
                                         index(s), numChunks);
    buildIf(b, exists, [&] {
      copyChunk(index(s), arith::AddIOp::create(b, first, index(s * chunk)));
    });
    commitCopies();
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
        Value group = commitCopies();
        // Chunk i's group is complete when at most the S - 1 newest are
        // pending.
        threads.target->buildWaitGroups(b, group,
                                        static_cast<int32_t>(stages - 1));
        return body(stepOffsets(j), {}, state);
      });
  return SmallVector<Value>(loop.getResults().begin(), loop.getResults().end());
}

void RowLoopBuilder::storeCachedVector(const RowRange &range, Value index,
                                       Value raw) {
  vector::StoreOp::create(b, raw, threads.rowCache,
                          ValueRange{cacheSlot(range, index)},
                          /*nontemporal=*/false, alignment());
}
