//===- RowMath.cpp - Scalar math of the row lowering ----------------------===//
//
// Constants, exp via exp2, accurate log1p and expm1 (arithmetic only),
// and the widening of bf16/f16 vectors to f32.
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

Value RowLoopBuilder::f32(float value, Type like) {
  Type f32Type = b.getF32Type();
  if (auto vectorType = dyn_cast_if_present<VectorType>(like))
    return arith::ConstantOp::create(
        b, vectorType, DenseElementsAttr::get(vectorType, value));
  return arith::ConstantOp::create(b, b.getFloatAttr(f32Type, value));
}

Value RowLoopBuilder::noIndex() {
  return arith::ConstantOp::create(b, b.getI32IntegerAttr(kNoIndex));
}

Value RowLoopBuilder::index(int64_t value) {
  return arith::ConstantIndexOp::create(b, value);
}

Value RowLoopBuilder::buildExp(Value x) {
  Value scaled = arith::MulFOp::create(b, x, f32(kLog2E, x.getType()));
  return math::Exp2Op::create(b, scaled);
}

void RowLoopBuilder::setLogitScale(Value scale) {
  logitScale = scale;
  logitScaleLog2E =
      scale ? arith::MulFOp::create(b, scale, f32(kLog2E)).getResult() : Value();
}

Value RowLoopBuilder::scaledLog2E(Type like) {
  if (!logitScaleLog2E)
    return f32(kLog2E, like);
  if (auto vectorType = dyn_cast_if_present<VectorType>(like))
    return vector::BroadcastOp::create(b, vectorType, logitScaleLog2E);
  return logitScaleLog2E;
}

Value RowLoopBuilder::scaleLogits(Value diff) {
  if (!logitScale)
    return diff;
  Value scale = logitScale;
  if (auto vectorType = dyn_cast<VectorType>(diff.getType()))
    scale = vector::BroadcastOp::create(b, vectorType, scale);
  return arith::MulFOp::create(b, diff, scale);
}

Value RowLoopBuilder::buildScaledExp(Value diff) {
  return math::Exp2Op::create(
      b, arith::MulFOp::create(b, diff, scaledLog2E(diff.getType())));
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

Value RowLoopBuilder::widen(Value raw) {
  Type elementType = cast<VectorType>(raw.getType()).getElementType();
  if (elementType.isBF16() && threads.enabled() && vectorWidth % 2 == 0)
    return widenBF16Pairs(raw);
  if (!elementType.isF32())
    raw = arith::ExtFOp::create(
        b, VectorType::get({vectorWidth}, b.getF32Type()), raw);
  return raw;
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
