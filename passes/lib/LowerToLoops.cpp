//===- LowerToLoops.cpp - Lower ce ops to row-wise loop nests -------------===//
//
// Each ce op becomes a loop over tokens; each token's row is swept by the
// RowLoopBuilder. This file holds the per-op logic: labels, ignore_index,
// smoothing, z-loss, the loss and the target-class gradient term.
//
//===----------------------------------------------------------------------===//

#include "TokenLowering.h"

#include "ce/Dialect/CE/IR/CEOps.h"
#include "ce/Transforms/Passes.h"

#include "mlir/Transforms/DialectConversion.h"
#include "llvm/ADT/bit.h"

#include <limits>

namespace mlir::ce {
#define GEN_PASS_DEF_CELOWERTOLOOPS
#include "ce/Transforms/Passes.h.inc"
} // namespace mlir::ce

using namespace mlir;
using namespace mlir::ce;
using namespace mlir::ce::detail;

namespace {

/// A ce op -> a loop nest over tokens whose
/// body is the op's per-token code (TokenLowering.h).
template <typename OpT>
struct TokenLoopLowering : OpConversionPattern<OpT> {
  TokenLoopLowering(MLIRContext *context, unsigned vectorWidth,
                    unsigned unroll)
      : OpConversionPattern<OpT>(context), vectorWidth(vectorWidth),
        unroll(unroll) {}

  LogicalResult
  matchAndRewrite(OpT op, typename OpT::Adaptor adaptor,
                  ConversionPatternRewriter &rewriter) const override {
    ImplicitLocOpBuilder b(op.getLoc(), rewriter);
    CrossEntropyLowering lowering(b, OpConfig::get(op), op.getLogits(),
                                  op.getLabels(), vectorWidth, unroll);
    lowering.prepare(op);
    buildTokenLoops(b, op.getLayout(), op.getLogits(),
                    [&](const Token &t) { lowering.lowerToken(op, t); });
    rewriter.eraseOp(op);
    return success();
  }

  unsigned vectorWidth;
  unsigned unroll;
};

/// ce.rescale -> a loop nest over tokens, each row scaled in place.
struct RescaleLoopLowering : OpConversionPattern<RescaleOp> {
  RescaleLoopLowering(MLIRContext *context, unsigned vectorWidth,
                      unsigned unroll)
      : OpConversionPattern<RescaleOp>(context), vectorWidth(vectorWidth),
        unroll(unroll) {}

  LogicalResult
  matchAndRewrite(RescaleOp op, OpAdaptor,
                  ConversionPatternRewriter &rewriter) const override {
    ImplicitLocOpBuilder b(op.getLoc(), rewriter);
    RowLoopBuilder rows(b, vectorWidth, unroll);
    buildTokenLoops(b, op.getLayout(), op.getGrad(), [&](const Token &t) {
      lowerRescaleToken(b, rows, op, t);
    });
    rewriter.eraseOp(op);
    return success();
  }

  unsigned vectorWidth;
  unsigned unroll;
};

struct CELowerToLoopsPass
    : mlir::ce::impl::CELowerToLoopsBase<CELowerToLoopsPass> {
  using Base::Base;

  void runOnOperation() override {
    // Bounded: the loop nest grows with both, and no target needs more.
    if (vectorWidth == 0 || !llvm::has_single_bit(vectorWidth.getValue()) ||
        vectorWidth > 64) {
      getOperation().emitError(
          "vector-width must be a power of two in [1, 64], got ")
          << vectorWidth.getValue();
      return signalPassFailure();
    }
    if (unroll == 0 || unroll > 16) {
      getOperation().emitError("unroll must be in [1, 16], got ")
          << unroll.getValue();
      return signalPassFailure();
    }
    MLIRContext *context = &getContext();
    ConversionTarget target(*context);
    target.addIllegalDialect<CEDialect>();
    target.addLegalDialect<arith::ArithDialect, math::MathDialect,
                           memref::MemRefDialect, scf::SCFDialect,
                           vector::VectorDialect>();
    RewritePatternSet patterns(context);
    patterns.add<TokenLoopLowering<ForwardOp>, TokenLoopLowering<BackwardOp>,
                 TokenLoopLowering<FusedOp>, TokenLoopLowering<ShardStatsOp>,
                 RescaleLoopLowering>(context, vectorWidth, unroll);
    if (failed(applyPartialConversion(getOperation(), target,
                                      std::move(patterns))))
      signalPassFailure();
  }
};

} // namespace
