//===- LabelStatus.cpp - Reporting out-of-range labels --------------------===//
//
// Kernels cannot print, so a kernel that meets a bad label stores 1 + the
// token's linear index in a status word (docs/bundle-format.md). The runtime
// turns that into a message a user can act on: which token, where it is in
// the batch, what its label is, and what would have been valid.
//
//===----------------------------------------------------------------------===//

#include "LabelStatus.h"

#include <cstring>
#include <string>

namespace ce {

namespace {

/// What the kernel wrote for the bad token, per the bundle contract.
const char *poisoned(KernelOp op) {
  switch (op) {
  case KernelOp::Forward:
    return "that token's loss is NaN";
  case KernelOp::Backward:
    return "that token's gradient row is NaN";
  case KernelOp::Fused:
    return "that token's loss and gradient row are NaN";
  case KernelOp::ShardStats:
    return "that token's target statistic (so its combined loss) is NaN";
  case KernelOp::Rescale:
    return ""; // reads no labels
  }
  return "";
}

} // namespace

LabelContext labelContext(const LaunchPlan &plan) {
  LabelContext context;
  context.variant = plan.variant;
  if (plan.options.has_ignore_index)
    context.ignoreIndex = plan.options.ignore_index;
  context.numTokens = plan.numTokens;
  // A shard's labels are global ids: the range is the whole vocabulary's.
  context.vocabSize =
      plan.options.shard_vocab > 0 ? plan.options.shard_vocab : plan.vocabSize;
  context.tokenRank = plan.tokenRank;
  context.tokenSizes[0] = plan.tokenSizes[0];
  context.tokenSizes[1] = plan.tokenSizes[1];
  context.labels = plan.tensor(ArgRole::Labels);
  return context;
}

bool readHostLabel(const ce_tensor &labels, int64_t elementOffset,
                   int64_t &label, std::string &reason) {
  (void)reason;
  const char *base = static_cast<const char *>(labels.data);
  if (labels.dtype == CE_DTYPE_I32) {
    int32_t value;
    std::memcpy(&value, base + elementOffset * 4, sizeof(value));
    label = value;
    return true;
  }
  std::memcpy(&label, base + elementOffset * 8, sizeof(label));
  return true;
}

Status labelStatusError(int64_t status, const LabelContext &context,
                        const LabelReader &read, bool deferred) {
  if (status < 1 || status > context.numTokens)
    return Status::error(CE_ERROR_BACKEND,
                         "the kernel returned status " +
                             std::to_string(status) +
                             ", which names no token (expected 0 or 1.." +
                             std::to_string(context.numTokens) + ")");
  int64_t token = status - 1;
  int64_t first = token, second = 0;
  std::string where;
  switch (context.variant.layout) {
  case LabelLayout::Flat:
    where = "n=" + std::to_string(token);
    break;
  case LabelLayout::SbvBs:
    first = token / context.tokenSizes[1];
    second = token % context.tokenSizes[1];
    where = "b=" + std::to_string(first) + ", s=" + std::to_string(second);
    break;
  case LabelLayout::SbvSb:
    first = token / context.tokenSizes[1];
    second = token % context.tokenSizes[1];
    where = "s=" + std::to_string(first) + ", b=" + std::to_string(second);
    break;
  }
  const ce_tensor &labels = context.labels;
  int64_t offset = first * labels.strides[0];
  if (labels.ndim == 2)
    offset += second * labels.strides[1];
  std::string range = "[0, " + std::to_string(context.vocabSize) + ")";
  std::string ignore = context.ignoreIndex
                           ? "is not the ignore_index " +
                                 std::to_string(*context.ignoreIndex)
                           : "no ignore_index is set";
  std::string at = "token " + std::to_string(token) + " (" + where + ")";
  int64_t label = 0;
  std::string reason;
  if (!read(labels, offset, label, reason))
    return Status::error(
        CE_ERROR_LABEL_OUT_OF_RANGE,
        "label out of range at " + at + ": its label is not in " + range +
            " and " + ignore + " (the label can no longer be read: " + reason +
            "); " + poisoned(context.variant.op));
  bool inRange = label >= 0 && label < context.vocabSize;
  bool ignored =
      context.ignoreIndex && label == *context.ignoreIndex;
  if (inRange || ignored) {
    if (deferred)
      return Status::error(CE_ERROR_LABEL_OUT_OF_RANGE,
                           "label out of range at " + at +
                               ": its label was not in " + range + " and " +
                               ignore + " when the kernel ran (it now reads " +
                               std::to_string(label) +
                               ": the labels changed after the launch); " +
                               poisoned(context.variant.op));
    return Status::error(CE_ERROR_BACKEND,
                         "the kernel reported " + at +
                             " as having a bad label, but its "
                             "label " +
                             std::to_string(label) + " is valid (in " + range +
                             " or ignored)");
  }
  return Status::error(CE_ERROR_LABEL_OUT_OF_RANGE,
                       "label out of range at " + at + ": label " +
                           std::to_string(label) + " is not in " + range +
                           " and " + ignore + "; " +
                           poisoned(context.variant.op));
}

} // namespace ce
