//===- TestData.cpp - Buffers and number formats for numerics tests -------===//

#include "TestData.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sys/mman.h>
#include <unistd.h>

namespace ce::test {

namespace {

uint32_t bitsOf(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

float floatOf(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

/// Far enough that a wild label (say 12345 for V = 7) lands in the guard.
constexpr size_t kGuardBytes = size_t(1) << 20;

} // namespace

uint16_t floatToBf16(float value) {
  uint32_t bits = bitsOf(value);
  if (std::isnan(value))
    return static_cast<uint16_t>((bits >> 16) | 0x40);
  uint32_t roundingBias = 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>((bits + roundingBias) >> 16);
}

float bf16ToFloat(uint16_t bits) { return floatOf(uint32_t(bits) << 16); }

uint16_t floatToHalf(float value) {
  uint32_t bits = bitsOf(value);
  uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  uint32_t magnitude = bits & 0x7fffffff;
  if (magnitude > 0x7f800000)
    return sign | 0x7e00; // NaN
  if (magnitude >= 0x477ff000)
    return sign | 0x7c00; // >= 65520 rounds to infinity
  if (magnitude < 0x38800000) {
    // Below 2^-14: a multiple of 2^-24, rounded to nearest even by rint in
    // the default rounding mode. 1024 is the smallest normal, as it should.
    float scaled = floatOf(magnitude) * 16777216.0f; // exact
    return sign | static_cast<uint16_t>(std::nearbyint(scaled));
  }
  uint32_t exponent = (magnitude >> 23) - 127 + 15;
  uint32_t mantissa = magnitude & 0x7fffff;
  uint32_t half = (exponent << 10) | (mantissa >> 13);
  uint32_t rest = mantissa & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (half & 1)))
    ++half; // may carry into the exponent, which is right
  return sign | static_cast<uint16_t>(half);
}

float halfToFloat(uint16_t bits) {
  uint32_t sign = uint32_t(bits & 0x8000) << 16;
  uint32_t exponent = (bits >> 10) & 0x1f;
  uint32_t mantissa = bits & 0x3ff;
  if (exponent == 0) {
    float magnitude = static_cast<float>(mantissa) / 16777216.0f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31)
    return floatOf(sign | 0x7f800000 | (mantissa << 13));
  return floatOf(sign | ((exponent - 15 + 127) << 23) | (mantissa << 13));
}

double roundTo(ElemType type, double value) {
  float single = static_cast<float>(value);
  switch (type) {
  case ElemType::BF16:
    return bf16ToFloat(floatToBf16(single));
  case ElemType::F16:
    return halfToFloat(floatToHalf(single));
  default:
    return single;
  }
}

double ulpOf(ElemType type, double value) {
  int mantissaBits = 23, minExponent = -126;
  if (type == ElemType::BF16)
    mantissaBits = 7;
  else if (type == ElemType::F16)
    mantissaBits = 10, minExponent = -14;
  int exponent = minExponent;
  if (value != 0.0 && std::isfinite(value)) {
    std::frexp(value, &exponent); // value = m 2^exponent, m in [0.5, 1)
    exponent = std::max(exponent - 1, minExponent);
  }
  return std::ldexp(1.0, exponent - mantissaBits);
}

ce_dtype toDtype(ElemType type) {
  switch (type) {
  case ElemType::BF16:
    return CE_DTYPE_BF16;
  case ElemType::F16:
    return CE_DTYPE_F16;
  case ElemType::F32:
    return CE_DTYPE_F32;
  case ElemType::I32:
    return CE_DTYPE_I32;
  case ElemType::I64:
    return CE_DTYPE_I64;
  }
  return CE_DTYPE_F32;
}

GuardedBuffer::GuardedBuffer(size_t size, bool atStart) : length(size) {
  size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  size_t dataPages = (size + page - 1) / page * page;
  mappingSize = kGuardBytes + dataPages + kGuardBytes;
  mapping = ::mmap(nullptr, mappingSize, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mapping == MAP_FAILED) {
    std::perror("mmap");
    std::abort();
  }
  unsigned char *first = static_cast<unsigned char *>(mapping) + kGuardBytes;
  if (dataPages && ::mprotect(first, dataPages, PROT_READ | PROT_WRITE) != 0) {
    std::perror("mprotect");
    std::abort();
  }
  bytes = atStart ? first : first + (dataPages - size);
}

GuardedBuffer::GuardedBuffer(GuardedBuffer &&other) noexcept {
  *this = std::move(other);
}

GuardedBuffer &GuardedBuffer::operator=(GuardedBuffer &&other) noexcept {
  if (this != &other) {
    if (mapping)
      ::munmap(mapping, mappingSize);
    mapping = other.mapping;
    mappingSize = other.mappingSize;
    bytes = other.bytes;
    length = other.length;
    other.mapping = nullptr;
    other.bytes = nullptr;
    other.length = other.mappingSize = 0;
  }
  return *this;
}

GuardedBuffer::~GuardedBuffer() {
  if (mapping)
    ::munmap(mapping, mappingSize);
}

std::vector<int64_t> packedStrides(const std::vector<int64_t> &sizes) {
  std::vector<int64_t> strides(sizes.size());
  int64_t stride = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= sizes[i];
  }
  return strides;
}

TestTensor makeTensor(ElemType type, const std::vector<int64_t> &sizes,
                      const std::vector<int64_t> &strides, bool atStart) {
  TestTensor result;
  result.type = type;
  int64_t count = 1, span = 1;
  for (size_t i = 0; i < sizes.size(); ++i) {
    count *= sizes[i];
    span += (sizes[i] - 1) * strides[i];
  }
  if (count == 0)
    span = 0;
  int64_t elementSize = elemSize(type);
  result.buffer =
      GuardedBuffer(static_cast<size_t>(span * elementSize), atStart);
  std::memset(result.buffer.data(), kPaddingFill, result.buffer.size());
  result.covered.assign(span, false);
  result.elementOffsets.reserve(count);
  for (int64_t index = 0; index < count; ++index) {
    int64_t rest = index, offset = 0;
    for (size_t i = sizes.size(); i-- > 0;) {
      offset += (rest % sizes[i]) * strides[i];
      rest /= sizes[i];
    }
    result.elementOffsets.push_back(offset);
    result.covered[offset] = true;
    std::memset(result.buffer.data() + offset * elementSize, 0xff, elementSize);
  }
  ce_tensor &tensor = result.tensor;
  tensor.data = result.buffer.data();
  tensor.dtype = toDtype(type);
  tensor.ndim = static_cast<int32_t>(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    tensor.sizes[i] = sizes[i];
    tensor.strides[i] = strides[i];
  }
  tensor.device = CE_DEVICE_HOST;
  return result;
}

double TestTensor::get(int64_t index) const {
  const unsigned char *at =
      buffer.data() + elementOffsets[index] * elemSize(type);
  switch (type) {
  case ElemType::BF16:
  case ElemType::F16: {
    uint16_t bits;
    std::memcpy(&bits, at, 2);
    return type == ElemType::BF16 ? bf16ToFloat(bits) : halfToFloat(bits);
  }
  case ElemType::F32: {
    float value;
    std::memcpy(&value, at, 4);
    return value;
  }
  default:
    return static_cast<double>(getInt(index));
  }
}

void TestTensor::set(int64_t index, double value) {
  unsigned char *at = buffer.data() + elementOffsets[index] * elemSize(type);
  float single = static_cast<float>(value);
  switch (type) {
  case ElemType::BF16:
  case ElemType::F16: {
    uint16_t bits =
        type == ElemType::BF16 ? floatToBf16(single) : floatToHalf(single);
    std::memcpy(at, &bits, 2);
    return;
  }
  case ElemType::F32:
    std::memcpy(at, &single, 4);
    return;
  default:
    setInt(index, static_cast<int64_t>(value));
  }
}

int64_t TestTensor::getInt(int64_t index) const {
  const unsigned char *at =
      buffer.data() + elementOffsets[index] * elemSize(type);
  if (type == ElemType::I32) {
    int32_t value;
    std::memcpy(&value, at, 4);
    return value;
  }
  int64_t value;
  std::memcpy(&value, at, 8);
  return value;
}

void TestTensor::setInt(int64_t index, int64_t value) {
  unsigned char *at = buffer.data() + elementOffsets[index] * elemSize(type);
  if (type == ElemType::I32) {
    int32_t narrow = static_cast<int32_t>(value);
    std::memcpy(at, &narrow, 4);
  } else {
    std::memcpy(at, &value, 8);
  }
}

std::vector<unsigned char> TestTensor::snapshot() const {
  return std::vector<unsigned char>(buffer.data(),
                                    buffer.data() + buffer.size());
}

bool TestTensor::paddingIntact(unsigned char fill) const {
  int64_t elementSize = elemSize(type);
  for (size_t slot = 0; slot < covered.size(); ++slot) {
    if (covered[slot])
      continue;
    for (int64_t byte = 0; byte < elementSize; ++byte)
      if (buffer.data()[slot * elementSize + byte] != fill)
        return false;
  }
  return true;
}

} // namespace ce::test
