//===- LabelStatus.cpp - Reporting out-of-range labels --------------------===//
//
// Kernels cannot print, so a kernel that meets a bad label stores 1 + the
// token's linear index in a status word (docs/bundle-format.md). The runtime
// turns that into a message a user can act on: which token, where it is in
// the batch, what its label is, and what would have been valid.
//
//===----------------------------------------------------------------------===//

#include "ce/runtime/Launch.h"

#include <cstring>
#include <string>

namespace ce {

namespace {

/// Reads the label at token index (first, second) of the token shape.
int64_t readLabel(const ce_tensor &labels, int64_t first, int64_t second) {
  int64_t offset = first * labels.strides[0];
  if (labels.ndim == 2)
    offset += second * labels.strides[1];
  const char *base = static_cast<const char *>(labels.data);
  if (labels.dtype == CE_DTYPE_I32) {
    int32_t value;
    std::memcpy(&value, base + offset * 4, sizeof(value));
    return value;
  }
  int64_t value;
  std::memcpy(&value, base + offset * 8, sizeof(value));
  return value;
}

/// What the kernel wrote for the bad token, per the bundle contract.
const char *poisoned(KernelOp op) {
  switch (op) {
  case KernelOp::Forward:
    return "that token's loss is NaN";
  case KernelOp::Backward:
    return "that token's gradient row is NaN";
  case KernelOp::Fused:
    return "that token's loss and gradient row are NaN";
  }
  return "";
}

} // namespace

Status labelStatusError(int64_t status, const LaunchPlan &plan) {
  if (status < 1 || status > plan.numTokens)
    return Status::error(CE_ERROR_BACKEND,
                         "the kernel returned status " +
                             std::to_string(status) +
                             ", which names no token (expected 0 or 1.." +
                             std::to_string(plan.numTokens) + ")");
  int64_t token = status - 1;
  int64_t first = token, second = 0;
  std::string where;
  switch (plan.variant.layout) {
  case LabelLayout::Flat:
    where = "n=" + std::to_string(token);
    break;
  case LabelLayout::SbvBs:
    first = token / plan.tokenSizes[1];
    second = token % plan.tokenSizes[1];
    where = "b=" + std::to_string(first) + ", s=" + std::to_string(second);
    break;
  case LabelLayout::SbvSb:
    first = token / plan.tokenSizes[1];
    second = token % plan.tokenSizes[1];
    where = "s=" + std::to_string(first) + ", b=" + std::to_string(second);
    break;
  }
  const ce_tensor &labels = plan.tensor(ArgRole::Labels);
  int64_t label = readLabel(labels, first, second);
  std::string range = "[0, " + std::to_string(plan.vocabSize) + ")";
  std::string ignore = plan.variant.ignoreIndex
                           ? "is not the ignore_index " +
                                 std::to_string(*plan.variant.ignoreIndex)
                           : "no ignore_index is set";
  bool inRange = label >= 0 && label < plan.vocabSize;
  bool ignored = plan.variant.ignoreIndex && label == *plan.variant.ignoreIndex;
  if (inRange || ignored)
    return Status::error(
        CE_ERROR_BACKEND,
        "the kernel reported token " + std::to_string(token) + " (" + where +
            ") as having a bad label, but its "
            "label " +
            std::to_string(label) + " is valid (in " + range + " or ignored)");
  return Status::error(CE_ERROR_LABEL_OUT_OF_RANGE,
                       "label out of range at token " + std::to_string(token) +
                           " (" + where + "): label " + std::to_string(label) +
                           " is not in " + range + " and " + ignore + "; " +
                           poisoned(plan.variant.op));
}

} // namespace ce
