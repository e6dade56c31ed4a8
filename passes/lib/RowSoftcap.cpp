//===- RowSoftcap.cpp - The logit softcap of the row lowering -------------===//
//
// The logit softcap z = cap tanh(s x / cap) applied to every loaded element
// of a softcap kernel, and its chain-rule factor dz/dx = s (1 - t^2), both
// from r = 1 / (1 + e^(2 s x / cap)): z = cap - 2 cap r, dz/dx = 4 s r (1 - r).
// One exp2 and one approximate reciprocal an element (no tanh.approx, no
// libdevice/ocml call); z is within a few 2^-24 of the cap of z in float64.
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

void RowLoopBuilder::setLogitSoftcap(Value cap, Value scale) {
  softcap = cap;
  softcapScale = scale;
  if (!cap) {
    softcapInner = softcapNegTwoCap = softcapFourScale = Value();
    return;
  }
  Value s = scale ? scale : f32(1.0f);
  // k = fl(fl(s / cap) fl(2 log2 e)): 2^(x k) = e^(2 s x / cap) to three
  // roundings of the exponent.
  softcapInner = arith::MulFOp::create(b, arith::DivFOp::create(b, s, cap),
                                       f32(2.0f * kLog2E));
  softcapNegTwoCap = arith::MulFOp::create(b, cap, f32(-2.0f));
  softcapFourScale = arith::MulFOp::create(b, s, f32(4.0f));
}

/// `scalar` shaped like `like` (a broadcast for vectors).
static Value shapedLike(ImplicitLocOpBuilder &b, Value scalar, Type like) {
  if (auto vectorType = dyn_cast<VectorType>(like))
    return vector::BroadcastOp::create(b, vectorType, scalar);
  return scalar;
}

Value RowLoopBuilder::softcapComplement(Value x) {
  Type type = x.getType();
  // E = 2^(x k): +inf past 2^128 (r = 0, z = cap), 0 below 2^-126 (r = 1,
  // z = -cap); NaN stays NaN. The reciprocal may be approximate (afn): on
  // NVIDIA rcp.approx.f32, on AMD v_rcp_f32 (one ulp), where a correctly
  // rounded division's Newton steps and range checks would cost as much as
  // the rest of the softcap; the host's stays exact. Where E is near 1 the
  // sum 1 + E rounds to half an ulp of 1, so r, and z - cap, are accurate
  // to a few 2^-24 absolute, not relative: z is within about 6 ulps of the
  // cap (2^-24 cap) of z in float64 everywhere, which is what the softmax,
  // the loss and the gradient see (an absolute error of z is a relative one
  // of exp(z)).
  Value e = math::Exp2Op::create(
      b, arith::MulFOp::create(b, x, shapedLike(b, softcapInner, type)));
  Value one = f32(1.0f, type);
  return arith::DivFOp::create(
      b, one, arith::AddFOp::create(b, e, one),
      arith::FastMathFlagsAttr::get(b.getContext(), arith::FastMathFlags::afn));
}

Value RowLoopBuilder::softcapLogits(Value x) {
  if (!softcap)
    return x;
  return softcapFromComplement(softcapComplement(x));
}

Value RowLoopBuilder::softcapFromComplement(Value r) {
  Type type = r.getType();
  // z = cap (1 - 2 r) = cap - 2 cap r in one rounding.
  return math::FmaOp::create(b, r, shapedLike(b, softcapNegTwoCap, type),
                             shapedLike(b, softcap, type));
}

std::pair<Value, Value> RowLoopBuilder::softcapWithSlope(Value x) {
  Type type = x.getType();
  Value r = softcapComplement(x);
  // 1 - t^2 = (1 - t)(1 + t) = 2 r 2 (1 - r): r - r^2 in one rounding, in
  // [0, 1/4] for r in [0, 1] (no clamp needed), then times 4 s.
  Value product = math::FmaOp::create(b, arith::NegFOp::create(b, r), r, r);
  Value slope = arith::MulFOp::create(
      b, product, shapedLike(b, softcapFourScale, type));
  return {softcapFromComplement(r), slope};
}

Value RowLoopBuilder::softcapSlope(Value x) {
  return softcapWithSlope(x).second;
}
