//===- ExpandExp2.cpp - Polynomial exp2 for hosts without one -------------===//

#include "ce/Transforms/Passes.h"

#include "mlir/IR/ImplicitLocOpBuilder.h"
#include "mlir/IR/PatternMatch.h"
#include "mlir/Transforms/GreedyPatternRewriteDriver.h"

namespace mlir::ce {
#define GEN_PASS_DEF_CEEXPANDEXP2
#include "ce/Transforms/Passes.h.inc"
} // namespace mlir::ce

using namespace mlir;
using namespace mlir::ce;

namespace {

/// math.exp2 (f32) -> 2^n * p(f) with n = roundeven(x), f = x - n.
struct Exp2Expansion : OpRewritePattern<math::Exp2Op> {
  using OpRewritePattern::OpRewritePattern;

  LogicalResult matchAndRewrite(math::Exp2Op op,
                                PatternRewriter &rewriter) const override {
    Type type = op.getType();
    if (!getElementTypeOrSelf(type).isF32())
      return rewriter.notifyMatchFailure(op, "only f32 is expanded");
    ImplicitLocOpBuilder b(op.getLoc(), rewriter);
    Type intType = b.getI32Type();
    if (auto vectorType = dyn_cast<VectorType>(type))
      intType = vectorType.clone(intType);
    auto f32 = [&](float value) -> Value {
      if (auto vectorType = dyn_cast<VectorType>(type))
        return arith::ConstantOp::create(
            b, vectorType, DenseElementsAttr::get(vectorType, value));
      return arith::ConstantOp::create(b, b.getF32FloatAttr(value));
    };
    auto i32 = [&](int32_t value) -> Value {
      if (auto vectorType = dyn_cast<VectorType>(intType))
        return arith::ConstantOp::create(
            b, vectorType, DenseElementsAttr::get(vectorType, value));
      return arith::ConstantOp::create(b, b.getI32IntegerAttr(value));
    };

    Value x = op.getOperand();
    // Clamp so 2^n has a normal exponent field (or +inf at 128); the
    // IEEE min/max keep NaN, which is restored explicitly at the end.
    Value clamped = arith::MaximumFOp::create(
        b, arith::MinimumFOp::create(b, x, f32(128.0f)), f32(-127.0f));
    Value n = math::RoundEvenOp::create(b, clamped);
    Value f = arith::SubFOp::create(b, clamped, n);
    // Cephes exp2f: 2^f = 1 + f * P(f) on |f| <= 1/2.
    static constexpr float coefficients[] = {
        1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
        5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f};
    Value poly = f32(coefficients[0]);
    for (float c : ArrayRef<float>(coefficients).drop_front())
      poly = math::FmaOp::create(b, poly, f, f32(c));
    Value mantissa = math::FmaOp::create(b, poly, f, f32(1.0f));
    Value exponent = arith::AddIOp::create(
        b, arith::FPToSIOp::create(b, intType, n), i32(127));
    Value scale = arith::BitcastOp::create(
        b, type, arith::ShLIOp::create(b, exponent, i32(23)));
    Value result = arith::MulFOp::create(b, mantissa, scale);
    Value isNaN =
        arith::CmpFOp::create(b, arith::CmpFPredicate::UNO, x, x);
    rewriter.replaceOp(op, arith::SelectOp::create(b, isNaN, x, result));
    return success();
  }
};

struct CEExpandExp2Pass
    : mlir::ce::impl::CEExpandExp2Base<CEExpandExp2Pass> {
  void runOnOperation() override {
    RewritePatternSet patterns(&getContext());
    patterns.add<Exp2Expansion>(&getContext());
    if (failed(applyPatternsGreedily(getOperation(), std::move(patterns))))
      signalPassFailure();
  }
};

} // namespace
