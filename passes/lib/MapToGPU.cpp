//===- MapToGPU.cpp - Map ce ops onto GPU workgroups ----------------------===//
//
// One token per workgroup: the per-token lowering of TokenLowering.h with
// the row split over the workgroup's threads (RowThreads).
//
//===----------------------------------------------------------------------===//

#include "TargetInfo.h"
#include "TokenLowering.h"

#include "ce/Transforms/Passes.h"

#include "mlir/Dialect/GPU/IR/GPUDialect.h"
#include "mlir/Dialect/MemRef/IR/MemRef.h"
#include "llvm/ADT/TypeSwitch.h"

namespace mlir::ce {
#define GEN_PASS_DEF_CEMAPTOGPU
#include "ce/Transforms/Passes.h.inc"
} // namespace mlir::ce

using namespace mlir;
using namespace mlir::ce;
using namespace mlir::ce::detail;

namespace {

/// Lanes of one 16-byte load of `logits`' element type.
unsigned lanesPer16Bytes(Value logits) {
  Type element = cast<MemRefType>(logits.getType()).getElementType();
  return 128 / element.getIntOrFloatBitWidth();
}

struct CEMapToGPUPass : mlir::ce::impl::CEMapToGPUBase<CEMapToGPUPass> {
  using Base::Base;

  void runOnOperation() override {
    targetInfo = getTargetInfo(target);
    if (!targetInfo) {
      getOperation()->emitError("ce-map-to-gpu: unknown target '")
          << target << "' (nvvm or rocdl)";
      return signalPassFailure();
    }
    // The pass, not the tool, rejects a feature the target lacks.
    auto lacks = [&](bool requested, bool has, StringRef option) {
      if (!requested || has)
        return false;
      getOperation()->emitError("ce-map-to-gpu: ")
          << option << " needs a target that has it; " << target
          << " has none";
      return true;
    };
    if (lacks(asyncCopy, targetInfo->hasAsyncCopy(), "async-copy") ||
        lacks(packedMax, targetInfo->hasPackedMax(), "packed-max"))
      return signalPassFailure();
    SmallVector<Operation *> ceOps;
    getOperation().walk([&](Operation *op) {
      if (isa<ForwardOp, BackwardOp, FusedOp, ShardStatsOp, RescaleOp>(op))
        ceOps.push_back(op);
    });
    for (Operation *op : ceOps)
      if (failed(mapToWorkgroup(op)))
        return signalPassFailure();
  }

  /// The kernel's `ce.tuning`, else one made of the pass options (no row
  /// cache, no stream ring).
  TuningAttr tuningOf(gpu::GPUFuncOp kernel) {
    if (auto attr = kernel->getAttrOfType<TuningAttr>(TuningAttr::getAttrName()))
      return attr;
    return TuningAttr::get(&getContext(), blockSize, unroll,
                           /*row_cache_bytes=*/0, /*stream_stages=*/0,
                           /*flush_denormals=*/false, /*max_registers=*/0);
  }

  LogicalResult verifyTuning(Operation *op, unsigned blockSize,
                             unsigned unroll) {
    if (subgroupSize == 0 || !llvm::has_single_bit(subgroupSize.getValue()) ||
        blockSize == 0 || blockSize % subgroupSize != 0 || blockSize > 1024)
      return op->emitError("block-size (")
             << blockSize
             << ") must be a multiple of the power-of-two subgroup-size ("
             << subgroupSize.getValue() << ") and at most 1024";
    if (unroll == 0 || unroll > 16)
      return op->emitError("unroll (")
             << unroll << ") must be in [1, 16]";
    return success();
  }

  /// The fused kernel's row cache: `bytes` (the tuning's row_cache_bytes) of
  /// dynamic workgroup memory viewed as the logits' element type. The launch
  /// provides those bytes (the manifest's `lds_bytes`).
  static Value buildRowCache(ImplicitLocOpBuilder &b, unsigned bytes,
                             Value logits) {
    Type element = cast<MemRefType>(logits.getType()).getElementType();
    int64_t elements = bytes / (element.getIntOrFloatBitWidth() / 8);
    if (elements == 0)
      return {};
    return buildWorkgroupBuffer(b, logits, elements);
  }

  /// `elements` of the logits' element type in dynamic workgroup memory.
  static Value buildWorkgroupBuffer(ImplicitLocOpBuilder &b, Value logits,
                                    int64_t elements) {
    Type element = cast<MemRefType>(logits.getType()).getElementType();
    auto workgroupSpace = gpu::AddressSpaceAttr::get(
        b.getContext(), gpu::AddressSpace::Workgroup);
    auto raw = gpu::DynamicSharedMemoryOp::create(
        b, MemRefType::get({ShapedType::kDynamic}, b.getI8Type(),
                           MemRefLayoutAttrInterface(), workgroupSpace));
    return memref::ViewOp::create(
        b,
        MemRefType::get({elements}, element, MemRefLayoutAttrInterface(),
                        workgroupSpace),
        raw, arith::ConstantIndexOp::create(b, 0), ValueRange{});
  }

  /// The features of the `target` option's target.
  const TargetInfo *targetInfo = nullptr;

  LogicalResult mapToWorkgroup(Operation *op) {
    auto kernel = op->getParentOfType<gpu::GPUFuncOp>();
    if (!kernel || !kernel.isKernel())
      return op->emitError("ce ops in a gpu.module must be in a gpu.func "
                           "kernel");
    TuningAttr tuning = tuningOf(kernel);
    unsigned blockSize = tuning.getBlockSize();
    unsigned unroll = tuning.getUnroll();
    if (unsigned registers = tuning.getMaxRegisters()) {
      if (!targetInfo->hasRegisterBudget())
        return op->emitError("ce-map-to-gpu: max_registers needs a target "
                             "that has a register budget; ")
               << target << " has none";
      targetInfo->setRegisterBudget(kernel, registers);
    }
    if (failed(verifyTuning(op, blockSize, unroll)))
      return failure();
    unsigned numSubgroups = blockSize / subgroupSize;
    MLIRContext *context = &getContext();
    auto workgroupSpace = gpu::AddressSpaceAttr::get(
        context, gpu::AddressSpace::Workgroup);
    // Slots for the subgroups' partial states; a one-subgroup row needs none,
    // nor does a rescale, which reduces nothing.
    Value scratch;
    if (numSubgroups > 1 && !isa<RescaleOp>(op)) {
      auto scratchType = MemRefType::get(
          {3 * static_cast<int64_t>(numSubgroups)}, Float32Type::get(context),
          MemRefLayoutAttrInterface(), workgroupSpace);
      scratch = kernel.addWorkgroupAttribution(scratchType, op->getLoc());
    }
    kernel.setKnownBlockSizeAttr(DenseI32ArrayAttr::get(
        context, {static_cast<int32_t>(blockSize), 1, 1}));

    IRRewriter rewriter(context);
    rewriter.setInsertionPoint(op);
    ImplicitLocOpBuilder b(op->getLoc(), rewriter);
    RowThreads threads;
    threads.threadId = gpu::ThreadIdOp::create(b, gpu::Dimension::x);
    threads.numThreads = blockSize;
    threads.subgroupSize = subgroupSize;
    threads.scratch = scratch;
    if (isa<FusedOp>(op))
      threads.rowCache =
          buildRowCache(b, tuning.getRowCacheBytes(), op->getOperand(0));
    threads.asyncCopy = asyncCopy;
    threads.packedMax = packedMax;
    threads.target = targetInfo;
    threads.softcapFmaReciprocalEighths =
        targetInfo->getSoftcapFmaReciprocalEighths();
    unsigned stages = tuning.getStreamStages();
    if (isa<ForwardOp, ShardStatsOp>(op) && asyncCopy && stages >= 2)
      threads.streamRing = buildWorkgroupBuffer(
          b, op->getOperand(0),
          stages * static_cast<int64_t>(lanesPer16Bytes(op->getOperand(0))) *
              unroll * blockSize);
    Value blockId = gpu::BlockIdOp::create(b, gpu::Dimension::x);

    auto lower = [&](auto ceOp) {
      CrossEntropyLowering lowering(b, OpConfig::get(ceOp), ceOp.getLogits(),
                                    ceOp.getLabels(),
                                    lanesPer16Bytes(ceOp.getLogits()),
                                    unroll, threads);
      lowering.prepare(ceOp);
      lowering.lowerToken(
          ceOp, tokenOfBlock(b, ceOp.getLayout(), ceOp.getLogits(), blockId));
    };
    llvm::TypeSwitch<Operation *>(op)
        .Case<ForwardOp, BackwardOp, FusedOp, ShardStatsOp>(
            [&](auto ceOp) { lower(ceOp); })
        .Case<RescaleOp>([&](RescaleOp rescale) {
          RowLoopBuilder rows(b, lanesPer16Bytes(rescale.getGrad()), unroll,
                              threads);
          lowerRescaleToken(
              b, rows, rescale,
              tokenOfBlock(b, rescale.getLayout(), rescale.getGrad(), blockId));
        });
    rewriter.eraseOp(op);
    return success();
  }
};

} // namespace
