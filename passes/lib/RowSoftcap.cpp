//===- RowSoftcap.cpp - The logit softcap of the row lowering -------------===//
//
// The logit softcap z = cap tanh(s x / cap) applied to every loaded element
// of a softcap kernel, and its chain-rule factor dz/dx = s (1 - t^2), both
// from r = 1 / (1 + e^(2 s x / cap)): z = cap - 2 cap r, dz/dx = 4 s r (1 - r).
// One exp2 and one approximate reciprocal an element (no tanh.approx, no
// libdevice/ocml call), the reciprocal of some lanes built from FMAs to
// unload the transcendental unit; z is within a few 2^-24 of the cap of z
// in float64.
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
  // z = -cap); NaN stays NaN. The reciprocal is approximate
  // (softcapReciprocal: part from FMAs, part by the target's approximate
  // reciprocal, within 1.28 ulps either way). Where E is near 1 the
  // sum 1 + E rounds to half an ulp of 1, so r, and z - cap, are accurate
  // to a few 2^-24 absolute, not relative: z is within about 6 ulps of the
  // cap (2^-24 cap) of z in float64 everywhere, which is what the softmax,
  // the loss and the gradient see (an absolute error of z is a relative one
  // of exp(z)).
  Value e = math::Exp2Op::create(
      b, arith::MulFOp::create(b, x, shapedLike(b, softcapInner, type)));
  return softcapReciprocal(arith::AddFOp::create(b, e, f32(1.0f, type)));
}

/// 1 / a of f32 a >= 1 (or NaN) from FMAs and one integer subtraction:
/// a clamp to 2^64 (past it the bit trick below leaves the float range;
/// 1 / 2^64 is 0 next to the 1 that z and dz/dx add it to), the initial
/// guess 0x7EF311C3 - bits(a) (within 5.1 %), one Newton step
/// (y + y e, e = 1 - a y: error 2.6e-3) and one third-order step
/// (y + y (e + e^2): error e^3 plus rounding). At most 1.28 ulps of 1 / a
/// over a dense sweep of [1, 2] and 4 million a in [1, 2^64]; NaN stays NaN
/// (the clamp is minimumf). Seven FMA-pipe instructions, no transcendental.
static Value fmaReciprocal(ImplicitLocOpBuilder &b, Value a,
                           function_ref<Value(float)> f32Like) {
  Type type = a.getType();
  Value clamped = arith::MinimumFOp::create(b, a, f32Like(0x1p64f));
  Type intType = b.getI32Type();
  if (auto vectorType = dyn_cast<VectorType>(type))
    intType = vectorType.clone(intType);
  Value magic = arith::ConstantOp::create(
      b, intType,
      isa<VectorType>(intType)
          ? TypedAttr(DenseElementsAttr::get(cast<ShapedType>(intType),
                                             b.getI32IntegerAttr(0x7EF311C3)))
          : TypedAttr(b.getI32IntegerAttr(0x7EF311C3)));
  Value y = arith::BitcastOp::create(
      b, type,
      arith::SubIOp::create(b, magic,
                            arith::BitcastOp::create(b, intType, clamped)));
  Value negA = arith::NegFOp::create(b, clamped);
  Value one = f32Like(1.0f);
  Value e = math::FmaOp::create(b, negA, y, one);
  y = math::FmaOp::create(b, y, e, y);
  e = math::FmaOp::create(b, negA, y, one);
  return math::FmaOp::create(b, y, math::FmaOp::create(b, e, e, e), y);
}

Value RowLoopBuilder::softcapReciprocal(Value a) {
  Type type = a.getType();
  auto vectorType = dyn_cast<VectorType>(type);
  int64_t width = vectorType ? vectorType.getNumElements() : 1;
  int64_t fmaLanes =
      softcapSplit ? (width * threads.softcapFmaReciprocalEighths + 4) / 8
                   : 0;
  // The reciprocal may be approximate (afn): on NVIDIA rcp.approx.f32, on
  // AMD v_rcp_f32 (one ulp), where a correctly rounded division's Newton
  // steps and range checks would cost as much as the rest of the softcap.
  auto approximate = [&](Value v) -> Value {
    return arith::DivFOp::create(
        b, f32(1.0f, v.getType()), v,
        arith::FastMathFlagsAttr::get(b.getContext(),
                                      arith::FastMathFlags::afn));
  };
  auto fromFmas = [&](Value v) {
    return fmaReciprocal(b, v, [&](float c) { return f32(c, v.getType()); });
  };
  if (fmaLanes == 0)
    return approximate(a);
  if (fmaLanes == width)
    return fromFmas(a);
  // Lanes [0, fmaLanes) from FMAs, the rest approximate, joined again
  // (shuffles: llvm shufflevector, on NVIDIA only register renaming).
  auto lanes = [](int64_t begin, int64_t end) {
    return llvm::to_vector(llvm::seq<int64_t>(begin, end));
  };
  Value head = vector::ShuffleOp::create(b, a, a, lanes(0, fmaLanes));
  Value tail = vector::ShuffleOp::create(b, a, a, lanes(fmaLanes, width));
  return vector::ShuffleOp::create(b, fromFmas(head), approximate(tail),
                                   lanes(0, width));
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
