//===- TestData.h - Buffers and number formats for numerics tests -*- C++
//-*-===//
//
// Half-precision conversions (round to nearest even), ulps, guarded buffers
// that fault on out-of-bounds access, and strided views over them.
//
//===----------------------------------------------------------------------===//

#ifndef CE_TEST_RUNTIME_TESTDATA_H
#define CE_TEST_RUNTIME_TESTDATA_H

#include "ce/runtime/VariantKey.h"
#include "ce/runtime/ce_runtime.h"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ce::test {

/// float -> bfloat16 bits, rounding to nearest even; NaN stays NaN.
uint16_t floatToBf16(float value);
float bf16ToFloat(uint16_t bits);
/// float -> IEEE binary16 bits, rounding to nearest even, with subnormals
/// and overflow to infinity; NaN stays NaN.
uint16_t floatToHalf(float value);
float halfToFloat(uint16_t bits);

/// `value` rounded to the nearest value of `type` (bf16, f16 or f32).
double roundTo(ElemType type, double value);

/// One unit in the last place of `type` at the magnitude of `value`
/// (subnormal spacing below the normal range).
double ulpOf(ElemType type, double value);

ce_dtype toDtype(ElemType type);

/// Memory between two inaccessible regions, so that a kernel reading or
/// writing past either end faults instead of silently touching other data.
/// The bytes sit flush against the trailing guard, or (`atStart`) against
/// the leading one.
class GuardedBuffer {
public:
  GuardedBuffer() = default;
  GuardedBuffer(size_t bytes, bool atStart = false);
  GuardedBuffer(GuardedBuffer &&other) noexcept;
  GuardedBuffer &operator=(GuardedBuffer &&other) noexcept;
  GuardedBuffer(const GuardedBuffer &) = delete;
  GuardedBuffer &operator=(const GuardedBuffer &) = delete;
  ~GuardedBuffer();

  unsigned char *data() const { return bytes; }
  size_t size() const { return length; }

private:
  void *mapping = nullptr;
  size_t mappingSize = 0;
  unsigned char *bytes = nullptr;
  size_t length = 0;
};

/// A tensor in a guarded buffer: the view, and which bytes of the buffer the
/// view covers (the rest is padding that must keep its fill pattern).
struct TestTensor {
  GuardedBuffer buffer;
  ce_tensor tensor{};
  ElemType type = ElemType::F32;
  std::vector<int64_t> elementOffsets; ///< Row-major over the view's sizes.
  std::vector<bool> covered;           ///< Per element slot of the buffer.

  /// Element `index` (row-major over the view's sizes) as a double.
  double get(int64_t index) const;
  /// Stores `value` rounded to the tensor's type.
  void set(int64_t index, double value);
  int64_t getInt(int64_t index) const;
  void setInt(int64_t index, int64_t value);
  /// Bytes of the whole buffer, for before/after comparisons.
  std::vector<unsigned char> snapshot() const;
  /// True if every byte outside the view still holds `fill`.
  bool paddingIntact(unsigned char fill) const;
};

/// The byte every buffer is filled with before its elements are written; it
/// must survive in padding.
constexpr unsigned char kPaddingFill = 0x5a;

/// A view of `type` with `sizes` and non-negative `strides` in a fresh
/// guarded buffer just large enough for it, padding filled with
/// kPaddingFill and elements with 0xff bytes (NaN for float types).
TestTensor makeTensor(ElemType type, const std::vector<int64_t> &sizes,
                      const std::vector<int64_t> &strides,
                      bool atStart = false);

/// Packed row-major strides for `sizes`.
std::vector<int64_t> packedStrides(const std::vector<int64_t> &sizes);

} // namespace ce::test

#endif // CE_TEST_RUNTIME_TESTDATA_H
