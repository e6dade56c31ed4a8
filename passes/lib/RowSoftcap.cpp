//===- RowSoftcap.cpp - The logit softcap of the row lowering -------------===//
//
// The logit softcap z = cap tanh(s x / cap) applied to every loaded element
// of a softcap kernel, its chain-rule factor dz/dx = s (1 - t^2), and the
// f32 tanh they are built from (a rational approximation, arithmetic and
// one approximate division only: no tanh.approx, no libdevice/ocml call).
//
//===----------------------------------------------------------------------===//

#include "RowLoopBuilder.h"
#include "RowLoopInternal.h"

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/Math/IR/Math.h"
#include "mlir/Dialect/Vector/IR/VectorOps.h"

using namespace mlir;
using namespace mlir::ce;
using namespace mlir::ce::detail;

namespace {
/// tanh(y) = y P(y^2) / Q(y^2) for |y| <= kTanhClamp, fitted for this
/// project (iteratively reweighted least squares on the relative error over
/// [0, 9], coefficients rounded to f32). Evaluated in f32 with FMAs its
/// error is at most 5.2 ulps over a dense sweep of [-12, 12] and powers of 2
/// down to 2^-119 (relative accuracy near 0 included); |t| may exceed 1 by
/// one ulp, and t(+-9) = +-1 in f32, so the clamp is exact past it.
constexpr float kTanhClamp = 9.0f;
constexpr float kTanhP[] = {1.0f,
                            0.13084013760089874f,
                            0.003103959606960416f,
                            1.1154344065289479e-05f,
                            -2.0225375152449487e-08f,
                            5.2780238513072675e-11f,
                            -8.488912697779405e-14f};
constexpr float kTanhQ[] = {1.0f, 0.46417340636253357f, 0.024495191872119904f,
                            0.0002546150062698871f};
} // namespace

void RowLoopBuilder::setLogitSoftcap(Value cap, Value scale) {
  softcap = cap;
  softcapScale = scale;
  // y = x fl(s / cap): two roundings, a relative error tanh does not grow.
  softcapInner =
      cap ? arith::DivFOp::create(b, scale ? scale : f32(1.0f), cap).getResult()
          : Value();
}

/// `scalar` shaped like `like` (a broadcast for vectors).
static Value shapedLike(ImplicitLocOpBuilder &b, Value scalar, Type like) {
  if (auto vectorType = dyn_cast<VectorType>(like))
    return vector::BroadcastOp::create(b, vectorType, scalar);
  return scalar;
}

Value RowLoopBuilder::buildTanh(Value y) {
  Type type = y.getType();
  // NaN propagates through the clamp (minimumf/maximumf); +-inf clamps.
  Value clamped = arith::MaximumFOp::create(
      b, arith::MinimumFOp::create(b, y, f32(kTanhClamp, type)),
      f32(-kTanhClamp, type));
  Value u = arith::MulFOp::create(b, clamped, clamped);
  auto horner = [&](ArrayRef<float> coefficients) {
    Value acc = f32(coefficients.back(), type);
    for (float c : llvm::reverse(coefficients.drop_back()))
      acc = math::FmaOp::create(b, acc, u, f32(c, type));
    return acc;
  };
  Value numerator = arith::MulFOp::create(b, clamped, horner(kTanhP));
  // The division may be approximate (afn): on NVIDIA div.approx.f32 (a
  // reciprocal and a multiply, at most 2 ulps for Q in [1, 339]), on AMD
  // v_rcp_f32 and a multiply, instead of a correctly rounded division's
  // Newton steps and range checks, which cost as much as the polynomials;
  // the host's division stays exact. tanh is then within 7.2 ulps.
  return arith::DivFOp::create(
      b, numerator, horner(kTanhQ),
      arith::FastMathFlagsAttr::get(b.getContext(), arith::FastMathFlags::afn));
}

Value RowLoopBuilder::softcapTanh(Value x) {
  return buildTanh(
      arith::MulFOp::create(b, x, shapedLike(b, softcapInner, x.getType())));
}

Value RowLoopBuilder::softcapLogits(Value x) {
  if (!softcap)
    return x;
  return arith::MulFOp::create(b, softcapTanh(x),
                               shapedLike(b, softcap, x.getType()));
}

std::pair<Value, Value> RowLoopBuilder::softcapWithSlope(Value x) {
  Type type = x.getType();
  Value t = softcapTanh(x);
  Value z = arith::MulFOp::create(b, t, shapedLike(b, softcap, type));
  // 1 - t^2 in one rounding; at least 0 (|t| may pass 1 by an ulp).
  Value slope = arith::MaximumFOp::create(
      b,
      math::FmaOp::create(b, arith::NegFOp::create(b, t), t, f32(1.0f, type)),
      f32(0.0f, type));
  if (softcapScale)
    slope = arith::MulFOp::create(b, slope, shapedLike(b, softcapScale, type));
  return {z, slope};
}

Value RowLoopBuilder::softcapSlope(Value x) {
  return softcapWithSlope(x).second;
}
