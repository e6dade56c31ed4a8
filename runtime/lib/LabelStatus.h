//===- LabelStatus.h - Out-of-range labels reported by kernels --*- C++ -*-===//
//
// Internal to the runtime (not installed). A kernel that meets a label
// outside [0, V) that is not the ignore_index stores 1 + the token's linear
// index in its status word (docs/bundle-format.md). Host launches read the
// word right after the call; GPU launches leave it to ce_check_label_status
// (LabelStatusTracker.h). Either way the word is turned into an error here.
//
//===----------------------------------------------------------------------===//

#ifndef CE_RUNTIME_LABELSTATUS_H
#define CE_RUNTIME_LABELSTATUS_H

#include "Status.h"
#include "Validation.h"
#include "ce/runtime/VariantKey.h"
#include "ce/runtime/ce_runtime.h"

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace ce {

/// What a status word is interpreted against: the launch's variant, token
/// shape and labels.
struct LabelContext {
  KernelVariantKey variant;
  std::optional<int64_t> ignoreIndex;
  int64_t numTokens = 0;
  int64_t vocabSize = 0;
  int tokenRank = 1;
  int64_t tokenSizes[2] = {0, 0};
  ce_tensor labels{};
};

/// The context of a validated launch.
LabelContext labelContext(const LaunchPlan &plan);

/// Reads the label `elementOffset` elements past `labels.data`. Returns false
/// with a reason when it cannot be read.
using LabelReader =
    std::function<bool(const ce_tensor &labels, int64_t elementOffset,
                       int64_t &label, std::string &reason)>;

/// Reads labels in host memory.
bool readHostLabel(const ce_tensor &labels, int64_t elementOffset,
                   int64_t &label, std::string &reason);

/// The error for a non-zero status word `status`: "token 7 (b=2, s=1):
/// label 12345 is not in [0, 32000) and ...", CE_ERROR_LABEL_OUT_OF_RANGE.
/// A word that names no token is CE_ERROR_BACKEND. `deferred` says the
/// labels are read after the fact (GPU launches): a label that now reads as
/// valid was changed since, and is reported as such rather than as a kernel
/// error.
Status labelStatusError(int64_t status, const LabelContext &context,
                        const LabelReader &read, bool deferred);

} // namespace ce

#endif // CE_RUNTIME_LABELSTATUS_H
