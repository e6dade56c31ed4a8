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
    token.linear = rowIndex ? rowIndex
                            : arith::AddIOp::create(
                                  b, arith::MulIOp::create(b, s, dim1), bIdx)
                                  .getResult();
  }
  return token;
}

/// Builds the loops over all tokens of `logits` and calls `body` in the
/// innermost one. Token loops are ordered so the logits are walked in
/// memory order for packed [S, B, V] tensors.
void mlir::ce::detail::buildTokenLoops(ImplicitLocOpBuilder &b, Layout layout,
                                       Value logits,
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

Token mlir::ce::detail::tokenOfBlock(ImplicitLocOpBuilder &b, Layout layout,
                                     Value logits, Value blockId) {
  if (layout == Layout::flat)
    return Token{{blockId}, {blockId}, blockId};
  Value dim0 = memref::DimOp::create(b, logits, 0);
  Value dim1 = memref::DimOp::create(b, logits, 1);
  // One division per row: blocks walk [S, B] in memory order.
  Value s = arith::DivUIOp::create(b, blockId, dim1);
  Value bIdx = arith::RemUIOp::create(b, blockId, dim1);
  return tokenOfRow(b, layout, s, bIdx, dim0, dim1, blockId);
}

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

struct CELowerToLoopsPass
    : mlir::ce::impl::CELowerToLoopsBase<CELowerToLoopsPass> {
  using Base::Base;

  void runOnOperation() override {
    if (vectorWidth == 0 || !llvm::has_single_bit(vectorWidth.getValue())) {
      getOperation().emitError("vector-width must be a power of two, got ")
          << vectorWidth.getValue();
      return signalPassFailure();
    }
    if (unroll == 0) {
      getOperation().emitError("unroll must be at least 1");
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
                 TokenLoopLowering<FusedOp>, TokenLoopLowering<ShardStatsOp>>(
        context, vectorWidth, unroll);
    if (failed(applyPartialConversion(getOperation(), target,
                                      std::move(patterns))))
      signalPassFailure();
  }
};

} // namespace
