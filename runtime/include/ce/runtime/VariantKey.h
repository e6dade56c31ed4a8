//===- VariantKey.h - Kernel variant keys shared by ce-gen and runtime ----===//
//
// Header-only and dependency-free: ce-gen writes these keys into a bundle's
// manifest and the runtime builds the same string from a request, so both
// sides must spell a variant identically. See docs/bundle-format.md.
//
//===----------------------------------------------------------------------===//

#ifndef CE_RUNTIME_VARIANTKEY_H
#define CE_RUNTIME_VARIANTKEY_H

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>

namespace ce {

/// Rescale is the fused gradient's correction: rows of a fused kernel's
/// gradient `w_t * dloss_t/dx` become `g_t * dloss_t/dx` in place, and rows
/// whose upstream gradient equals the weight are not touched.
enum class KernelOp { Forward, Backward, Fused, ShardStats, Rescale };
enum class ElemType { BF16, F16, F32, I32, I64 };
enum class LabelLayout { Flat, SbvBs, SbvSb };
/// A fused kernel's gradient weights are per-token (a scalar weight is a
/// per-token tensor of stride 0); the other ops take none.
enum class WeightsKind { None, Token };

inline const char *stringify(KernelOp op) {
  switch (op) {
  case KernelOp::Forward:
    return "forward";
  case KernelOp::Backward:
    return "backward";
  case KernelOp::Fused:
    return "fused";
  case KernelOp::ShardStats:
    return "shard_stats";
  case KernelOp::Rescale:
    return "rescale";
  }
  return "?";
}

inline const char *stringify(ElemType type) {
  switch (type) {
  case ElemType::BF16:
    return "bf16";
  case ElemType::F16:
    return "f16";
  case ElemType::F32:
    return "f32";
  case ElemType::I32:
    return "i32";
  case ElemType::I64:
    return "i64";
  }
  return "?";
}

inline const char *stringify(LabelLayout layout) {
  switch (layout) {
  case LabelLayout::Flat:
    return "flat";
  case LabelLayout::SbvBs:
    return "sbv_bs";
  case LabelLayout::SbvSb:
    return "sbv_sb";
  }
  return "?";
}

inline const char *stringify(WeightsKind kind) {
  switch (kind) {
  case WeightsKind::None:
    return "none";
  case WeightsKind::Token:
    return "token";
  }
  return "?";
}

/// Size in bytes of one element of `type`.
inline int64_t elemSize(ElemType type) {
  switch (type) {
  case ElemType::BF16:
  case ElemType::F16:
    return 2;
  case ElemType::F32:
  case ElemType::I32:
    return 4;
  case ElemType::I64:
    return 8;
  }
  return 0;
}

/// Prints an f32 so that it reads back to the same bits ("%.9g").
inline std::string formatF32(float value) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.9g", static_cast<double>(value));
  return buffer;
}

/// Bits of a kernel's run-time `flags` argument, the same values as the ce
/// ops' `flags` operand (mlir::ce::RuntimeFlag).
enum KernelFlag : int64_t {
  /// Labels outside [0, V) follow Megatron-Core's contract
  /// (CE_LABEL_POLICY_MEGATRON) instead of being reported.
  kFlagMegatronLabels = 1,
  /// The `ignore_index` argument is in force: tokens whose label equals it
  /// are ignored. Without the bit no token is ignored.
  kFlagIgnoreIndex = 2,
  /// A vocabulary slice smooths over the global vocabulary (`shard_vocab`).
  /// Without the bit it smooths over its own V_local, as Megatron-Core's
  /// vocab-parallel cross entropy does.
  kFlagGlobalSmoothing = 4,
  /// The `lse_low` argument is a real tensor: forward and fused kernels
  /// write lse's low part there, backward kernels read it. Without the bit
  /// the argument is a placeholder (the lse's own view) that is neither
  /// written nor used.
  kFlagLseLow = 8,
  /// The `entropy` argument is a real tensor that forward and fused kernels
  /// write (each row's entropy of softmax(z)); without the bit it is a
  /// placeholder (the lse's view) left alone.
  kFlagEntropy = 16,
  /// The `argmax` argument is a real tensor that forward and fused kernels
  /// write (each row's index of its largest z, -1 for a NaN row); without
  /// the bit it is a placeholder (the lse's view) left alone.
  kFlagArgmax = 32,
};

/// Everything that selects one compiled kernel (bundle format version 3).
/// A rescale kernel reads no labels and computes no loss: only its logits
/// (the gradient's) dtype and layout vary, and its other fields have one
/// canonical value (canonicalRescale()).
/// Shapes, strides and option values (ignore_index, the smoothing and z-loss
/// coefficients, a shard's bounds and how it smooths) are run-time
/// arguments, not part of the key; the key says only whether smoothing and
/// z-loss are computed at all, so that the common kernel does no work for
/// them. Every backward and shard_stats kernel takes a vocabulary slice (an
/// unsharded backward is the slice [0, V) of V).
struct KernelVariantKey {
  KernelOp op = KernelOp::Forward;
  ElemType logits = ElemType::BF16;
  ElemType labels = ElemType::I64;
  LabelLayout layout = LabelLayout::Flat;
  bool smoothing = false;
  bool zLoss = false;
  bool overwrite = false;
  WeightsKind weights = WeightsKind::None;
  /// Logit softcap kernels (z = cap tanh(s x / cap)): a compile-time
  /// variant, so that the kernels without one pay nothing for the tanh.
  /// Spelled `,softcap=on` after `weights` when set and left out when not,
  /// so every key without a softcap reads as before.
  bool softcap = false;

  /// The fields a rescale key does not vary, at their one value: labels i64,
  /// no smoothing or z-loss, in place (overwrite 1), per-token weights.
  KernelVariantKey &canonicalRescale() {
    labels = ElemType::I64;
    smoothing = false;
    zLoss = false;
    overwrite = true;
    weights = WeightsKind::Token;
    softcap = false;
    return *this;
  }
  bool isCanonical() const {
    if (op != KernelOp::Rescale)
      return true;
    KernelVariantKey canonical = *this;
    return canonical.canonicalRescale().str() == str();
  }

  std::string str() const {
    std::string key = "op=";
    key += stringify(op);
    key += ",logits=";
    key += stringify(logits);
    key += ",labels=";
    key += stringify(labels);
    key += ",layout=";
    key += stringify(layout);
    key += ",label_smoothing=";
    key += smoothing ? "on" : "off";
    key += ",z_loss=";
    key += zLoss ? "on" : "off";
    key += ",overwrite=";
    key += overwrite ? "1" : "0";
    key += ",weights=";
    key += stringify(weights);
    if (softcap)
      key += ",softcap=on";
    return key;
  }
};

/// Parses a variant key written by KernelVariantKey::str(). Only the
/// canonical spelling is accepted: every field present, in order, with the
/// exact value spelling str() produces (so `parse(k)->str() == k`). Returns
/// std::nullopt for anything else, including version 2 keys (whose
/// option fields held values). The optional last field is `softcap=on`
/// (`softcap=off` is not canonical: it is spelled by leaving it out).
inline std::optional<KernelVariantKey>
parseKernelVariantKey(std::string_view text) {
  static constexpr const char *fieldNames[] = {
      "op",     "logits",    "labels",  "layout", "label_smoothing",
      "z_loss", "overwrite", "weights", "softcap"};
  constexpr size_t numFields = sizeof(fieldNames) / sizeof(fieldNames[0]);
  std::string_view values[numFields];
  size_t present = 0;
  std::string_view rest = text;
  while (!rest.empty() || present == 0) {
    if (present == numFields)
      return std::nullopt;
    size_t comma = rest.find(',');
    std::string_view field = rest.substr(0, comma);
    if (comma != std::string_view::npos && comma + 1 == rest.size())
      return std::nullopt; // a trailing comma
    rest = comma == std::string_view::npos ? std::string_view()
                                           : rest.substr(comma + 1);
    size_t eq = field.find('=');
    if (eq == std::string_view::npos ||
        field.substr(0, eq) != fieldNames[present])
      return std::nullopt;
    values[present++] = field.substr(eq + 1);
  }
  if (present < numFields - 1 ||
      (present == numFields && values[numFields - 1] != "on"))
    return std::nullopt;

  KernelVariantKey key;
  auto pick = [](std::string_view value, auto &out, auto... candidates) {
    for (auto candidate : {candidates...})
      if (value == stringify(candidate)) {
        out = candidate;
        return true;
      }
    return false;
  };
  auto onOff = [](std::string_view value, bool &out, const char *on,
                  const char *off) {
    out = value == on;
    return value == on || value == off;
  };
  if (!pick(values[0], key.op, KernelOp::Forward, KernelOp::Backward,
            KernelOp::Fused, KernelOp::ShardStats, KernelOp::Rescale) ||
      !pick(values[1], key.logits, ElemType::BF16, ElemType::F16,
            ElemType::F32) ||
      !pick(values[2], key.labels, ElemType::I32, ElemType::I64) ||
      !pick(values[3], key.layout, LabelLayout::Flat, LabelLayout::SbvBs,
            LabelLayout::SbvSb) ||
      !onOff(values[4], key.smoothing, "on", "off") ||
      !onOff(values[5], key.zLoss, "on", "off") ||
      !onOff(values[6], key.overwrite, "1", "0") ||
      !pick(values[7], key.weights, WeightsKind::None, WeightsKind::Token) ||
      !key.isCanonical())
    return std::nullopt;
  key.softcap = present == numFields;
  if (key.op == KernelOp::Rescale && key.softcap)
    return std::nullopt;
  return key;
}

} // namespace ce

#endif // CE_RUNTIME_VARIANTKEY_H
