//===- VariantKey.h - Kernel variant keys shared by ce-gen and runtime ----===//
//
// Header-only and dependency-free: ce-gen writes these keys into a bundle's
// manifest and the runtime builds the same string from a request, so both
// sides must spell a variant identically. See docs/bundle-format.md.
//
//===----------------------------------------------------------------------===//

#ifndef CE_RUNTIME_VARIANTKEY_H
#define CE_RUNTIME_VARIANTKEY_H

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>

namespace ce {

enum class KernelOp { Forward, Backward, Fused, ShardStats };
enum class ElemType { BF16, F16, F32, I32, I64 };
enum class LabelLayout { Flat, SbvBs, SbvSb };
enum class WeightsKind { None, Scalar, Token };

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
  case WeightsKind::Scalar:
    return "scalar";
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

/// Bits of a kernel's run-time `flags` argument (bundle format version 2),
/// the same values as the ce ops' `flags` operand (mlir::ce::RuntimeFlag).
/// Run-time values are not part of the variant key.
enum KernelFlag : int64_t {
  /// Labels outside [0, V) follow Megatron-Core's contract
  /// (CE_LABEL_POLICY_MEGATRON) instead of being reported.
  kFlagMegatronLabels = 1,
};

/// A tensor-parallel vocabulary slice: global ids [start, start + V_local)
/// of `vocab`; `globalSmoothing` smooths over `vocab` instead of V_local.
struct VocabShard {
  int64_t start = 0;
  int64_t vocab = 0;
  bool globalSmoothing = false;

  bool operator==(const VocabShard &other) const {
    return start == other.start && vocab == other.vocab &&
           globalSmoothing == other.globalSmoothing;
  }

  /// `start/vocab/local` or `start/vocab/global`.
  std::string str() const {
    return std::to_string(start) + "/" + std::to_string(vocab) +
           (globalSmoothing ? "/global" : "/local");
  }
};

/// Everything that selects one compiled kernel. Shapes and strides are
/// runtime values and are not part of the key.
struct KernelVariantKey {
  KernelOp op = KernelOp::Forward;
  ElemType logits = ElemType::BF16;
  ElemType labels = ElemType::I64;
  LabelLayout layout = LabelLayout::Flat;
  std::optional<int64_t> ignoreIndex;
  float labelSmoothing = 0.0f;
  float zLoss = 0.0f;
  bool overwrite = false;
  WeightsKind weights = WeightsKind::None;
  std::optional<VocabShard> shard;

  std::string str() const {
    std::string key = "op=";
    key += stringify(op);
    key += ",logits=";
    key += stringify(logits);
    key += ",labels=";
    key += stringify(labels);
    key += ",layout=";
    key += stringify(layout);
    key += ",ignore_index=";
    key += ignoreIndex ? std::to_string(*ignoreIndex) : std::string("none");
    key += ",label_smoothing=" + formatF32(labelSmoothing);
    key += ",z_loss=" + formatF32(zLoss);
    key += ",overwrite=";
    key += overwrite ? "1" : "0";
    key += ",weights=";
    key += stringify(weights);
    // Only sharded keys carry the field, so unsharded keys stay as they were.
    if (shard)
      key += ",shard=" + shard->str();
    return key;
  }
};

/// Parses the `start/vocab/local|global` value of a key's shard field.
inline std::optional<VocabShard> parseVocabShard(std::string_view text) {
  VocabShard shard;
  for (int64_t *out : {&shard.start, &shard.vocab}) {
    size_t slash = text.find('/');
    if (slash == std::string_view::npos || slash == 0)
      return std::nullopt;
    std::string digits(text.substr(0, slash));
    char *end = nullptr;
    errno = 0;
    long long value = std::strtoll(digits.c_str(), &end, 10);
    if (errno != 0 || *end != '\0')
      return std::nullopt;
    *out = static_cast<int64_t>(value);
    text = text.substr(slash + 1);
  }
  if (text != "local" && text != "global")
    return std::nullopt;
  shard.globalSmoothing = text == "global";
  return shard;
}

/// Parses a variant key written by KernelVariantKey::str(). Only the
/// canonical spelling is accepted: every field present, in order, with the
/// exact value spelling str() produces (so `parse(k)->str() == k`); the
/// trailing `shard` field is present exactly for sharded kernels. Returns
/// std::nullopt for anything else.
inline std::optional<KernelVariantKey>
parseKernelVariantKey(std::string_view text) {
  KernelVariantKey key;
  static constexpr std::string_view shardField = ",shard=";
  if (size_t at = text.rfind(shardField); at != std::string_view::npos) {
    key.shard = parseVocabShard(text.substr(at + shardField.size()));
    if (!key.shard)
      return std::nullopt;
    text = text.substr(0, at);
  }
  static constexpr const char *fieldNames[] = {
      "op",     "logits",       "labels",
      "layout", "ignore_index", "label_smoothing",
      "z_loss", "overwrite",    "weights"};
  constexpr size_t numFields = sizeof(fieldNames) / sizeof(fieldNames[0]);
  std::string_view values[numFields];
  std::string_view rest = text;
  for (size_t i = 0; i < numFields; ++i) {
    size_t comma = rest.find(',');
    std::string_view field = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view()
                                           : rest.substr(comma + 1);
    if ((comma == std::string_view::npos) != (i + 1 == numFields))
      return std::nullopt;
    size_t eq = field.find('=');
    if (eq == std::string_view::npos || field.substr(0, eq) != fieldNames[i])
      return std::nullopt;
    values[i] = field.substr(eq + 1);
  }

  auto pick = [](std::string_view value, auto &out, auto... candidates) {
    for (auto candidate : {candidates...})
      if (value == stringify(candidate)) {
        out = candidate;
        return true;
      }
    return false;
  };
  if (!pick(values[0], key.op, KernelOp::Forward, KernelOp::Backward,
            KernelOp::Fused, KernelOp::ShardStats) ||
      !pick(values[1], key.logits, ElemType::BF16, ElemType::F16,
            ElemType::F32) ||
      !pick(values[2], key.labels, ElemType::I32, ElemType::I64) ||
      !pick(values[3], key.layout, LabelLayout::Flat, LabelLayout::SbvBs,
            LabelLayout::SbvSb) ||
      !pick(values[8], key.weights, WeightsKind::None, WeightsKind::Scalar,
            WeightsKind::Token))
    return std::nullopt;

  if (values[4] != "none") {
    std::string digits(values[4]);
    char *end = nullptr;
    errno = 0;
    long long ignoreIndex = std::strtoll(digits.c_str(), &end, 10);
    if (digits.empty() || errno != 0 || *end != '\0')
      return std::nullopt;
    key.ignoreIndex = static_cast<int64_t>(ignoreIndex);
  }
  for (int i : {5, 6}) {
    std::string number(values[i]);
    char *end = nullptr;
    float value = std::strtof(number.c_str(), &end);
    if (number.empty() || *end != '\0')
      return std::nullopt;
    (i == 5 ? key.labelSmoothing : key.zLoss) = value;
  }
  if (values[7] != "0" && values[7] != "1")
    return std::nullopt;
  key.overwrite = values[7] == "1";

  // Reject non-canonical spellings ("1e-1", "+5", "0.10") so that one
  // variant has exactly one key.
  std::string canonical = key.str();
  if (key.shard)
    canonical.resize(canonical.rfind(shardField));
  if (canonical != text)
    return std::nullopt;
  return key;
}

} // namespace ce

#endif // CE_RUNTIME_VARIANTKEY_H
