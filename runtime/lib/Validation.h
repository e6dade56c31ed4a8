//===- Validation.h - Checking a launch request before any launch -*- C++
//-*-===//
//
// Internal to the runtime (not installed). Every launch is validated in full
// before a kernel is looked up or called: options, presence, ranks, shapes,
// dtypes, strides, devices and memory overlap. A request that passes is
// turned into a LaunchPlan: the variant key to look up and the tensors, by
// role, as the kernel will see them.
//
//===----------------------------------------------------------------------===//

#ifndef CE_RUNTIME_VALIDATION_H
#define CE_RUNTIME_VALIDATION_H

#include "Manifest.h"
#include "Status.h"
#include "ce/runtime/VariantKey.h"
#include "ce/runtime/ce_runtime.h"

#include <array>
#include <cstdint>

namespace ce {

/// The longest logits row (vocabulary, or vocabulary slice) a launch takes:
/// past it the f32 row sums lose the numerics contract's 1e-5 accuracy.
inline constexpr int64_t kMaxVocab = int64_t(1) << 27;

/// The arguments of one ce_forward/ce_backward/ce_fused/ce_shard_stats call. Tensors an op
/// does not take are null.
struct LaunchRequest {
  KernelOp op = KernelOp::Forward;
  const ce_options *options = nullptr; ///< Null means the defaults.
  const ce_tensor *logits = nullptr;
  const ce_tensor *labels = nullptr;
  const ce_tensor *loss = nullptr;
  const ce_tensor *lse = nullptr;
  const ce_tensor *gradLoss = nullptr;
  const ce_tensor *weights = nullptr;
  const ce_tensor *grad = nullptr;
  const ce_tensor *stats = nullptr;
  /// The caller's stream (CUstream / hipStream_t); ignored on the host.
  void *stream = nullptr;
};

/// A validated request.
struct LaunchPlan {
  /// The variant to look up.
  KernelVariantKey variant;
  /// The options in effect (the defaults when the request had none).
  ce_options options;
  ce_device_type device = CE_DEVICE_HOST;
  int32_t deviceIndex = 0;
  /// Number of tokens (N, or S*B) and vocabulary size (V).
  int64_t numTokens = 0;
  int64_t vocabSize = 0;
  /// The token shape T: [N], [B,S] or [S,B].
  int tokenRank = 1;
  int64_t tokenSizes[2] = {0, 0};
  /// Tensors by ArgRole, as the kernel sees them (the vocab stride of a
  /// vocabulary of one is normalized to 1). Absent roles have null data and
  /// `present` false.
  std::array<ce_tensor, kNumArgRoles> tensors{};
  std::array<bool, kNumArgRoles> present{};

  const ce_tensor &tensor(ArgRole role) const {
    return tensors[static_cast<int>(role)];
  }
  bool has(ArgRole role) const { return present[static_cast<int>(role)]; }

  /// Whether a kernel argument of `role` gets a tensor, and which: its own,
  /// or for an absent lse_low, entropy or argmax a token-shaped placeholder,
  /// the lse view (the labels' for shard_stats, which has no lse), that the
  /// kernel neither writes nor uses (its flag bit unset).
  bool provides(ArgRole role) const {
    return has(role) || (isOptional(role) && has(placeholderRole()));
  }
  const ce_tensor &argument(ArgRole role) const {
    return isOptional(role) && !has(role) ? tensor(placeholderRole())
                                          : tensor(role);
  }
  ArgRole placeholderRole() const {
    return has(ArgRole::Lse) ? ArgRole::Lse : ArgRole::Labels;
  }
  static bool isOptional(ArgRole role) {
    return role == ArgRole::LseLow || role == ArgRole::Entropy ||
           role == ArgRole::Argmax;
  }

  /// The kernel's value arguments (docs/bundle-format.md).
  KernelValues values() const {
    KernelValues values;
    if (options.label_policy == CE_LABEL_POLICY_MEGATRON)
      values.flags |= kFlagMegatronLabels;
    if (options.has_ignore_index) {
      values.flags |= kFlagIgnoreIndex;
      values.ignoreIndex = options.ignore_index;
    }
    if (has(ArgRole::LseLow))
      values.flags |= kFlagLseLow;
    if (has(ArgRole::Entropy))
      values.flags |= kFlagEntropy;
    if (has(ArgRole::Argmax))
      values.flags |= kFlagArgmax;
    values.labelSmoothing = options.label_smoothing;
    values.zLoss = options.z_loss;
    values.logitScale = options.logit_scale;
    values.logitSoftcap = options.logit_softcap;
    // Backward and shard_stats kernels take a slice; unsharded, [0, V) of V.
    if (options.shard_vocab > 0) {
      values.shardStart = options.shard_start;
      values.shardVocab = options.shard_vocab;
      if (options.shard_global_smoothing)
        values.flags |= kFlagGlobalSmoothing;
    } else {
      values.shardVocab = vocabSize;
    }
    return values;
  }
};

/// Checks `request` and fills `plan`. Failures are
/// CE_ERROR_INVALID_ARGUMENT with a message that names the tensor or option
/// and the problem.
Status validateLaunch(const LaunchRequest &request, LaunchPlan &plan);

/// Size in bytes of one element of `dtype` (0 for an invalid value).
int64_t dtypeSize(ce_dtype dtype);

/// The name of `dtype` ("bf16", ...), or "invalid dtype N".
std::string dtypeName(ce_dtype dtype);

} // namespace ce

#endif // CE_RUNTIME_VALIDATION_H
