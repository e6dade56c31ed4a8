//===- BundleAbi.h - The bundle contract between ce-gen and the runtime ---===//
//
// Header-only and dependency-free (installed, like VariantKey.h): the names,
// the version and the kernel argument list of a bundle, written once. ce-gen
// builds every kernel's arguments from expectedRoles()/expectedArg() and
// writes the manifest with these names; the runtime checks a manifest
// against the same functions. docs/bundle-format.md describes this header.
//
//===----------------------------------------------------------------------===//

#ifndef CE_RUNTIME_BUNDLEABI_H
#define CE_RUNTIME_BUNDLEABI_H

#include "ce/runtime/VariantKey.h"

#include <cstdint>
#include <iterator>
#include <vector>

namespace ce {

/// The `format` string every manifest carries.
inline constexpr const char *kBundleFormatName = "cegen-bundle";
/// The format version ce-gen writes and the newest one the runtime reads
/// (the same value as ce_runtime.h's CE_RUNTIME_BUNDLE_VERSION).
inline constexpr int64_t kBundleFormatVersion = 5;
/// The manifest's name in a bundle directory.
inline constexpr const char *kManifestFile = "manifest.json";
/// The top-level key of the manifest's own SHA-256, taken over
/// the manifest's text with this key's 64 digits written as zeros.
inline constexpr const char *kManifestSealKey = "manifest_sha256";

/// The host kernels' ABI: one pointer to a memref descriptor per argument.
inline constexpr const char *kMemrefDescriptorAbi =
    "memref-descriptor-pointers";
/// The GPU kernels' ABI: every descriptor field is a kernel parameter.
inline constexpr const char *kMemrefDescriptorFieldsAbi =
    "memref-descriptor-fields";

/// The `kind` of an entry of `objects`.
inline constexpr const char *kObjectKindSharedObject = "shared-object";
inline constexpr const char *kObjectKindHsaco = "hsaco";
inline constexpr const char *kObjectKindPtx = "ptx";
inline constexpr const char *kObjectKindCubin = "cubin";

/// The x86-64 features a host object may require (`objects[i].cpu_features`),
/// spelled as LLVM's x86 target features. ce-gen lists those of its target
/// CPU among these; the runtime checks each against the CPU (cpuid and the
/// OS's register state) before it loads the object, and refuses a name it
/// does not know. They cover the vector ISA LLVM's x86 backend selects.
inline constexpr const char *kHostCpuFeatures[] = {
    "sse4.1",   "sse4.2",   "popcnt",     "avx",         "avx2",
    "fma",      "f16c",     "bmi",        "bmi2",        "lzcnt",
    "movbe",    "avx512f",  "avx512dq",   "avx512cd",    "avx512bw",
    "avx512vl", "avx512vnni", "avx512bf16", "avx512fp16", "avx512vbmi",
    "avx512vbmi2", "avx512bitalg", "avx512vpopcntdq", "avx512ifma", "gfni",
    "vpclmulqdq", "vaes", "avxvnni"};

/// What a kernel argument holds (the `role` of an `args` entry).
enum class ArgRole {
  Logits,
  Labels,
  Loss,
  Lse,
  GradLoss,
  Weights,
  Grad,
  Stats,
  Status,
  LseLow, ///< f32 per token: lse's low part (forward, fused out; backward in)
  Entropy, ///< f32 per token: entropy of softmax(z) (forward, fused,
           ///< shard_stats out)
  Argmax,  ///< i64 per token: index of the largest z (forward, fused,
           ///< shard_stats out: a global id)
  // The run-time option values, passed by value after the tensors
  // (KernelValues):
  Flags,          ///< i64, KernelFlag bits
  IgnoreIndex,    ///< i64, in force with kFlagIgnoreIndex
  LabelSmoothing, ///< f32 alpha of Megatron's formula (smoothing kernels)
  ZLoss,          ///< f32 z-loss coefficient (z-loss kernels)
  ShardStart,     ///< i64 first global id of the slice (backward, shard_stats)
  ShardVocab,     ///< i64 global vocabulary (backward, shard_stats)
  LogitScale,     ///< f32 s: every logit x is z = s x before the softmax
  /// f32 cap: z = cap tanh(s x / cap) (softcap kernels; 0 elsewhere)
  LogitSoftcap
};
inline constexpr int kNumArgRoles = static_cast<int>(ArgRole::LogitSoftcap) + 1;

/// The value arguments every kernel takes after its tensors, in this order
/// (a kernel ignores those its variant does not use).
inline constexpr ArgRole kValueRoles[] = {
    ArgRole::Flags,      ArgRole::IgnoreIndex, ArgRole::LabelSmoothing,
    ArgRole::ZLoss,      ArgRole::ShardStart,  ArgRole::ShardVocab,
    ArgRole::LogitScale, ArgRole::LogitSoftcap};

/// Whether `role` is passed by value (one of kValueRoles).
inline bool isValueRole(ArgRole role) {
  return static_cast<int>(role) >= static_cast<int>(ArgRole::Flags);
}

/// The run-time option values of one launch, in kValueRoles' terms.
struct KernelValues {
  int64_t flags = 0;
  int64_t ignoreIndex = 0;
  float labelSmoothing = 0.0f;
  float zLoss = 0.0f;
  int64_t shardStart = 0;
  int64_t shardVocab = 0;
  float logitScale = 1.0f;
  float logitSoftcap = 0.0f; ///< 0: no softcap
};

/// The manifest spelling of `role` ("grad_loss", ...).
inline const char *stringify(ArgRole role) {
  switch (role) {
  case ArgRole::Logits:
    return "logits";
  case ArgRole::Labels:
    return "labels";
  case ArgRole::Loss:
    return "loss";
  case ArgRole::Lse:
    return "lse";
  case ArgRole::GradLoss:
    return "grad_loss";
  case ArgRole::Weights:
    return "weights";
  case ArgRole::Grad:
    return "grad";
  case ArgRole::Stats:
    return "stats";
  case ArgRole::Status:
    return "status";
  case ArgRole::LseLow:
    return "lse_low";
  case ArgRole::Entropy:
    return "entropy";
  case ArgRole::Argmax:
    return "argmax";
  case ArgRole::Flags:
    return "flags";
  case ArgRole::IgnoreIndex:
    return "ignore_index";
  case ArgRole::LabelSmoothing:
    return "label_smoothing";
  case ArgRole::ZLoss:
    return "z_loss";
  case ArgRole::ShardStart:
    return "shard_start";
  case ArgRole::ShardVocab:
    return "shard_vocab";
  case ArgRole::LogitScale:
    return "logit_scale";
  case ArgRole::LogitSoftcap:
    return "logit_softcap";
  }
  return "?";
}

/// The tensor argument roles of a kernel of `variant`, in call order. With
/// overwrite-input the gradient is written into the logits: no `grad`.
inline std::vector<ArgRole> tensorRoles(const KernelVariantKey &variant) {
  switch (variant.op) {
  case KernelOp::Forward:
    return {ArgRole::Logits,  ArgRole::Labels, ArgRole::Loss,
            ArgRole::Lse,     ArgRole::LseLow, ArgRole::Entropy,
            ArgRole::Argmax,  ArgRole::Status};
  case KernelOp::ShardStats:
    return {ArgRole::Logits,  ArgRole::Labels, ArgRole::Stats,
            ArgRole::Entropy, ArgRole::Argmax, ArgRole::Status};
  case KernelOp::Backward:
    if (variant.overwrite)
      return {ArgRole::Logits, ArgRole::Labels,   ArgRole::Lse,
              ArgRole::LseLow, ArgRole::GradLoss, ArgRole::Status};
    return {ArgRole::Logits,   ArgRole::Labels, ArgRole::Lse, ArgRole::LseLow,
            ArgRole::GradLoss, ArgRole::Grad,   ArgRole::Status};
  case KernelOp::Fused:
    if (variant.overwrite)
      return {ArgRole::Logits,  ArgRole::Labels, ArgRole::Weights,
              ArgRole::Loss,    ArgRole::Lse,    ArgRole::LseLow,
              ArgRole::Entropy, ArgRole::Argmax, ArgRole::Status};
    return {ArgRole::Logits,  ArgRole::Labels, ArgRole::Weights,
            ArgRole::Loss,    ArgRole::Lse,    ArgRole::LseLow,
            ArgRole::Entropy, ArgRole::Argmax, ArgRole::Grad,
            ArgRole::Status};
  case KernelOp::Rescale:
    // The gradient is read and written in place; no labels, no status.
    return {ArgRole::Grad, ArgRole::Weights, ArgRole::GradLoss};
  }
  return {};
}

/// Every argument role of a kernel of `variant`, in call order: its
/// tensors, then kValueRoles.
inline std::vector<ArgRole> expectedRoles(const KernelVariantKey &variant) {
  std::vector<ArgRole> roles = tensorRoles(variant);
  roles.insert(roles.end(), std::begin(kValueRoles), std::end(kValueRoles));
  return roles;
}

/// An argument's rank and element type. The value roles have rank 0 and are
/// passed by value.
struct ArgShape {
  int rank = 0;
  ElemType dtype = ElemType::F32;
};

/// The rank and element type `role` has in a kernel of `variant`.
inline ArgShape expectedArg(const KernelVariantKey &variant, ArgRole role) {
  int logitsRank = variant.layout == LabelLayout::Flat ? 2 : 3;
  int tokenRank = logitsRank - 1;
  switch (role) {
  case ArgRole::Logits:
  case ArgRole::Grad:
    return {logitsRank, variant.logits};
  case ArgRole::Labels:
    return {tokenRank, variant.labels};
  case ArgRole::Loss:
  case ArgRole::Lse:
  case ArgRole::LseLow:
  case ArgRole::Entropy:
  case ArgRole::GradLoss:
    return {tokenRank, ElemType::F32};
  case ArgRole::Argmax:
    return {tokenRank, ElemType::I64};
  case ArgRole::Weights:
    return {tokenRank, ElemType::F32};
  case ArgRole::Stats:
    return {tokenRank + 1, ElemType::F32};
  case ArgRole::Status:
    return {1, ElemType::I64};
  case ArgRole::Flags:
  case ArgRole::IgnoreIndex:
  case ArgRole::ShardStart:
  case ArgRole::ShardVocab:
    return {0, ElemType::I64};
  case ArgRole::LabelSmoothing:
  case ArgRole::ZLoss:
  case ArgRole::LogitScale:
  case ArgRole::LogitSoftcap:
    return {0, ElemType::F32};
  }
  return {};
}

} // namespace ce

#endif // CE_RUNTIME_BUNDLEABI_H
