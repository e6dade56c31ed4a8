//===- WorkgroupReduce.cpp - Reductions across a workgroup ----------------===//
//
// The (max, rest) states, the sums and the smallest indices of all threads
// of a row: xor-shuffle
// butterflies within a subgroup, then a slot per subgroup in workgroup
// memory.
//
//===----------------------------------------------------------------------===//

#include "RowLoopBuilder.h"
#include "RowLoopInternal.h"

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/GPU/IR/GPUDialect.h"
#include "mlir/Dialect/MemRef/IR/MemRef.h"
#include "mlir/Dialect/SCF/IR/SCF.h"

using namespace mlir;
using namespace mlir::ce;
using namespace mlir::ce::detail;

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
  return allReduceWith(sum, [&](Value x, Value y) -> Value {
    return arith::AddFOp::create(b, x, y);
  });
}

Value RowLoopBuilder::allReduceMinIndex(Value index) {
  return allReduceWith(index, [&](Value x, Value y) -> Value {
    return arith::MinSIOp::create(b, x, y);
  });
}

Value RowLoopBuilder::allReduceWith(
    Value value, function_ref<Value(Value, Value)> combine) {
  if (!threads.enabled())
    return value;
  for (unsigned offset = threads.subgroupSize / 2; offset >= 1; offset /= 2) {
    Value other = gpu::ShuffleOp::create(b, value, offset,
                                         threads.subgroupSize,
                                         gpu::ShuffleMode::XOR)
                      .getShuffleResult();
    value = combine(value, other);
  }
  unsigned numSubgroups = threads.numSubgroups();
  if (numSubgroups <= 1)
    return value;
  // The f32 scratch slots [2n, 3n) hold one value per subgroup (an i32 by
  // its bits).
  Type type = value.getType();
  bool isFloat = type.isF32();
  auto toSlot = [&](Value v) -> Value {
    return isFloat ? v : arith::BitcastOp::create(b, b.getF32Type(), v);
  };
  auto fromSlot = [&](Value v) -> Value {
    return isFloat ? v : arith::BitcastOp::create(b, type, v);
  };
  Value subgroupSize = index(threads.subgroupSize);
  Value lane = arith::RemUIOp::create(b, threads.threadId, subgroupSize);
  Value subgroup = arith::DivUIOp::create(b, threads.threadId, subgroupSize);
  Value slot =
      arith::AddIOp::create(b, subgroup, index(2 * numSubgroups));
  buildIf(b, arith::CmpIOp::create(b, arith::CmpIPredicate::eq, lane, index(0)),
          [&] {
            memref::StoreOp::create(b, toSlot(value), threads.scratch,
                                    ValueRange{slot});
          });
  gpu::BarrierOp::create(b);
  value = fromSlot(memref::LoadOp::create(b, threads.scratch,
                                          ValueRange{index(2 * numSubgroups)}));
  for (unsigned i = 1; i < numSubgroups; ++i)
    value = combine(
        value, fromSlot(memref::LoadOp::create(
                   b, threads.scratch,
                   ValueRange{index(2 * numSubgroups + i)})));
  gpu::BarrierOp::create(b);
  return value;
}
