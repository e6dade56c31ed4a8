//===- MemoryRange.cpp - Memory spanned by strided views ------------------===//
//
// Range tests are conservative: two views whose ranges interleave without
// sharing an element (say, loss and lse as the two columns of one [N,2]
// buffer) still count as overlapping. Exact tests need per-element work;
// a caller can always pass separate buffers.
//
//===----------------------------------------------------------------------===//

#include "MemoryRange.h"

#include <algorithm>
#include <cstdlib>
#include <utility>
#include <vector>

namespace ce {

int64_t elementCount(const ce_tensor &tensor) {
  int64_t count = 1;
  for (int i = 0; i < tensor.ndim; ++i)
    if (tensor.sizes[i] == 0)
      return 0;
  for (int i = 0; i < tensor.ndim; ++i)
    if (__builtin_mul_overflow(count, tensor.sizes[i], &count))
      return -1;
  return count;
}

bool byteRange(const ce_tensor &tensor, int64_t elementSize, ByteRange &range) {
  range = ByteRange();
  if (elementCount(tensor) == 0)
    return true;
  __int128 low = 0, high = 0;
  for (int i = 0; i < tensor.ndim; ++i) {
    __int128 extent =
        static_cast<__int128>(tensor.sizes[i] - 1) * tensor.strides[i];
    (extent < 0 ? low : high) += extent;
  }
  constexpr __int128 int64Max = INT64_MAX;
  if (low < -int64Max || high > int64Max)
    return false;
  __int128 base =
      static_cast<__int128>(reinterpret_cast<uintptr_t>(tensor.data));
  range.begin = base + low * elementSize;
  range.end = base + (high + 1) * elementSize;
  constexpr __int128 addressLimit = static_cast<__int128>(1) << 64;
  return range.begin >= 0 && range.end <= addressLimit;
}

bool mayWriteTwice(const ce_tensor &tensor) {
  if (elementCount(tensor) == 0)
    return false;
  std::vector<std::pair<__int128, int64_t>> dims; // (|stride|, size)
  for (int i = 0; i < tensor.ndim; ++i)
    if (tensor.sizes[i] > 1)
      dims.push_back({tensor.strides[i] < 0
                          ? -static_cast<__int128>(tensor.strides[i])
                          : static_cast<__int128>(tensor.strides[i]),
                      tensor.sizes[i]});
  std::sort(dims.begin(), dims.end());
  __int128 reach = 0; // Largest offset the smaller dimensions reach.
  for (auto [stride, size] : dims) {
    if (stride <= reach)
      return true;
    reach += stride * (size - 1);
  }
  return false;
}

} // namespace ce
