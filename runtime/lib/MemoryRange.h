//===- MemoryRange.h - Memory spanned by strided views ----------*- C++ -*-===//
//
// Internal to the runtime (not installed). The arithmetic behind the overlap
// rules: which bytes a strided view can touch, whether two views may alias,
// and whether a view may write one element twice. All of it is done in
// 128-bit integers so that hostile sizes and strides cannot overflow it.
//
//===----------------------------------------------------------------------===//

#ifndef CE_RUNTIME_MEMORYRANGE_H
#define CE_RUNTIME_MEMORYRANGE_H

#include "ce/runtime/ce_runtime.h"

#include <cstdint>
#include <string>

namespace ce {

/// The bytes [begin, end) a view can touch; empty for a view of no elements.
struct ByteRange {
  __int128 begin = 0;
  __int128 end = 0;
  bool empty() const { return begin >= end; }
  bool overlaps(const ByteRange &other) const {
    return !empty() && !other.empty() && begin < other.end && other.begin < end;
  }
};

/// The number of elements of `tensor`, or -1 if it does not fit in int64.
int64_t elementCount(const ce_tensor &tensor);

/// The bytes `tensor` spans given its element size. Fails (returns false)
/// when the view reaches outside the 64-bit address space or its element
/// offsets do not fit in int64, which the kernels use for addressing.
bool byteRange(const ce_tensor &tensor, int64_t elementSize, ByteRange &range);

/// Whether two distinct indices of `tensor` may address the same element
/// (a sufficient test: dimensions sorted by stride must each step past
/// everything the smaller ones reach). Dimensions of size 1 are ignored.
bool mayWriteTwice(const ce_tensor &tensor);

} // namespace ce

#endif // CE_RUNTIME_MEMORYRANGE_H
