//===- Variants.cpp - Kernel variants from ce-gen's options ---------------===//

#include "ce/Codegen/Variants.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/ADT/StringSwitch.h"

#include <cmath>
#include <functional>
#include <optional>
#include <set>

using namespace mlir;
using namespace mlir::ce;
using ::ce::ElemType;
using ::ce::KernelOp;
using ::ce::KernelVariantKey;
using ::ce::LabelLayout;
using ::ce::VocabShard;
using ::ce::WeightsKind;

bool VariantOptions::any() const {
  for (const std::vector<std::string> *list :
       {&ops, &logits, &labels, &layouts, &ignoreIndices, &smoothings,
        &zLosses, &overwrites, &weights, &shards, &keys})
    if (!list->empty())
      return true;
  return false;
}

namespace {

/// Parses each value of `values` (or of `defaults` when it is empty) with
/// `parse`; a failure names the option, the value and what it accepts.
template <typename T>
LogicalResult
parseEach(const std::vector<std::string> &values,
          std::vector<std::string> defaults, StringRef option,
          StringRef accepted,
          const std::function<std::optional<T>(StringRef)> &parse,
          std::vector<T> &out, std::string &error) {
  const std::vector<std::string> &list = values.empty() ? defaults : values;
  for (const std::string &text : list) {
    std::optional<T> value = parse(text);
    if (!value) {
      error = "invalid --" + option.str() + " value '" + text +
              "': expected " + accepted.str();
      return failure();
    }
    out.push_back(*value);
  }
  return success();
}

std::optional<float> parseFloat(StringRef text) {
  double value;
  if (text.trim() != text || text.getAsDouble(value))
    return std::nullopt;
  return static_cast<float>(value);
}

std::optional<KernelOp> parseOp(StringRef s) {
  return llvm::StringSwitch<std::optional<KernelOp>>(s)
      .Case("forward", KernelOp::Forward)
      .Case("backward", KernelOp::Backward)
      .Case("fused", KernelOp::Fused)
      .Case("shard_stats", KernelOp::ShardStats)
      .Default(std::nullopt);
}

std::optional<ElemType> parseLogits(StringRef s) {
  return llvm::StringSwitch<std::optional<ElemType>>(s)
      .Case("bf16", ElemType::BF16)
      .Case("f16", ElemType::F16)
      .Case("f32", ElemType::F32)
      .Default(std::nullopt);
}

std::optional<ElemType> parseLabels(StringRef s) {
  return llvm::StringSwitch<std::optional<ElemType>>(s)
      .Case("i32", ElemType::I32)
      .Case("i64", ElemType::I64)
      .Default(std::nullopt);
}

std::optional<LabelLayout> parseLayout(StringRef s) {
  return llvm::StringSwitch<std::optional<LabelLayout>>(s)
      .Case("flat", LabelLayout::Flat)
      .Case("sbv_bs", LabelLayout::SbvBs)
      .Case("sbv_sb", LabelLayout::SbvSb)
      .Default(std::nullopt);
}

std::optional<std::optional<int64_t>> parseIgnore(StringRef s) {
  if (s == "none")
    return std::optional<int64_t>();
  int64_t value;
  if (s.getAsInteger(10, value))
    return std::nullopt;
  return std::optional<int64_t>(value);
}

std::optional<float> parseSmoothing(StringRef s) {
  std::optional<float> value = parseFloat(s);
  if (!value || !(*value >= 0.0f && *value < 1.0f))
    return std::nullopt;
  return value;
}

std::optional<float> parseZLoss(StringRef s) {
  std::optional<float> value = parseFloat(s);
  if (!value || !(*value >= 0.0f) || std::isinf(*value))
    return std::nullopt;
  return value;
}

std::optional<bool> parseBool(StringRef s) {
  if (s == "0")
    return false;
  if (s == "1")
    return true;
  return std::nullopt;
}

std::optional<WeightsKind> parseWeights(StringRef s) {
  return llvm::StringSwitch<std::optional<WeightsKind>>(s)
      .Case("scalar", WeightsKind::Scalar)
      .Case("token", WeightsKind::Token)
      .Default(std::nullopt);
}

std::optional<std::optional<VocabShard>> parseShard(StringRef s) {
  if (s == "none")
    return std::optional<VocabShard>();
  std::optional<VocabShard> shard = ::ce::parseVocabShard(s);
  if (!shard || shard->vocab <= 0 || shard->start < 0 ||
      shard->start >= shard->vocab)
    return std::nullopt;
  return shard;
}

/// Checks a key given with --variant: the same rules as the lists.
LogicalResult checkKey(const KernelVariantKey &key, StringRef text,
                       std::string &error) {
  auto fail = [&](StringRef why) {
    error = "--variant='" + text.str() + "': " + why.str();
    return failure();
  };
  if (!(key.labelSmoothing >= 0.0f && key.labelSmoothing < 1.0f))
    return fail("label_smoothing must be in [0, 1)");
  if (!(key.zLoss >= 0.0f) || std::isinf(key.zLoss))
    return fail("z_loss must be finite and >= 0");
  bool gradient = key.op == KernelOp::Backward || key.op == KernelOp::Fused;
  if (key.overwrite && !gradient)
    return fail("overwrite=1 needs op=backward or fused");
  if ((key.weights != WeightsKind::None) != (key.op == KernelOp::Fused))
    return fail("weights is scalar or token for op=fused, none otherwise");
  if (key.shard.has_value() !=
      (key.op == KernelOp::ShardStats) && key.op != KernelOp::Backward)
    return fail("a shard is for op=shard_stats (always) or backward");
  if (key.shard && (key.shard->vocab <= 0 || key.shard->start < 0 ||
                    key.shard->start >= key.shard->vocab))
    return fail("the shard's START must be in [0, VOCAB)");
  if (key.op == KernelOp::ShardStats && (key.zLoss != 0.0f || key.overwrite))
    return fail("shard_stats has z_loss=0 and overwrite=0 (the z-loss "
                "applies after the shards are combined)");
  return success();
}

FailureOr<std::vector<KernelVariantKey>>
keysFromText(ArrayRef<std::string> texts, std::string &error) {
  std::vector<KernelVariantKey> keys;
  std::set<std::string> seen;
  for (const std::string &text : texts) {
    std::optional<KernelVariantKey> key = ::ce::parseKernelVariantKey(text);
    if (!key) {
      error = "--variant='" + text +
              "' is not a canonical variant key (docs/bundle-format.md: "
              "op=...,logits=...,labels=...,layout=...,ignore_index=...,"
              "label_smoothing=...,z_loss=...,overwrite=...,weights=...[,"
              "shard=...], each value as ce-gen and the runtime print it)";
      return failure();
    }
    if (failed(checkKey(*key, text, error)))
      return failure();
    if (seen.insert(text).second)
      keys.push_back(*key);
  }
  return keys;
}

} // namespace

FailureOr<std::vector<KernelVariantKey>>
mlir::ce::expandVariants(const VariantOptions &options, std::string &error) {
  if (!options.keys.empty()) {
    VariantOptions lists = options;
    lists.keys.clear();
    if (lists.any()) {
      error = "--variant gives whole keys; it cannot be combined with --op, "
              "--logits and the other variant lists";
      return failure();
    }
    return keysFromText(options.keys, error);
  }
  std::vector<KernelOp> opList;
  std::vector<ElemType> logitsList, labelsList;
  std::vector<LabelLayout> layoutList;
  std::vector<std::optional<int64_t>> ignoreList;
  std::vector<float> smoothingList, zList;
  std::vector<bool> overwriteList;
  std::vector<WeightsKind> weightsList;
  std::vector<std::optional<VocabShard>> shardList;
  if (failed(parseEach<KernelOp>(options.ops, {"forward"}, "op",
                                 "forward, backward, fused or shard_stats",
                                 parseOp, opList, error)) ||
      failed(parseEach<ElemType>(options.logits, {"bf16"}, "logits",
                                 "bf16, f16 or f32", parseLogits, logitsList,
                                 error)) ||
      failed(parseEach<ElemType>(options.labels, {"i64"}, "labels",
                                 "i32 or i64", parseLabels, labelsList,
                                 error)) ||
      failed(parseEach<LabelLayout>(options.layouts, {"sbv_bs"}, "layout",
                                    "flat, sbv_bs or sbv_sb", parseLayout,
                                    layoutList, error)) ||
      failed(parseEach<std::optional<int64_t>>(
          options.ignoreIndices, {"none"}, "ignore-index",
          "none or a decimal integer in [-2^63, 2^63)", parseIgnore,
          ignoreList, error)) ||
      failed(parseEach<float>(options.smoothings, {"0"}, "label-smoothing",
                              "a number in [0, 1)", parseSmoothing,
                              smoothingList, error)) ||
      failed(parseEach<float>(options.zLosses, {"0"}, "z-loss",
                              "a finite number >= 0", parseZLoss, zList,
                              error)) ||
      failed(parseEach<bool>(options.overwrites, {"0"}, "overwrite", "0 or 1",
                             parseBool, overwriteList, error)) ||
      failed(parseEach<WeightsKind>(options.weights, {"scalar"}, "weights",
                                    "scalar or token (fused kernels)",
                                    parseWeights, weightsList, error)) ||
      failed(parseEach<std::optional<VocabShard>>(
          options.shards, {"none"}, "shard",
          "none or START/VOCAB/local|global with 0 <= START < VOCAB",
          parseShard, shardList, error)))
    return failure();

  // shard_stats kernels have no z-loss (it applies after the statistics
  // are combined): asking for one is an error, not a silent z_loss=0.
  bool anyZ = llvm::any_of(zList, [](float z) { return z != 0.0f; });
  if (anyZ && llvm::is_contained(opList, KernelOp::ShardStats)) {
    error = "--z-loss does not apply to --op=shard_stats (the z-loss is "
            "added after the shards' statistics are combined); emit "
            "shard_stats kernels with --z-loss=0";
    return failure();
  }

  std::vector<KernelVariantKey> keys;
  std::set<std::string> seen;
  for (KernelOp op : opList)
    for (ElemType logits : logitsList)
      for (ElemType labels : labelsList)
        for (LabelLayout layout : layoutList)
          for (const std::optional<int64_t> &ignore : ignoreList)
            for (float smoothing : smoothingList)
              for (float z : zList)
                for (bool overwrite : overwriteList)
                  for (WeightsKind weights : weightsList)
                    for (const std::optional<VocabShard> &shard : shardList) {
                      // Shards have partial statistics and a backward.
                      bool sharded = shard.has_value();
                      if (sharded != (op == KernelOp::ShardStats) &&
                          op != KernelOp::Backward)
                        continue;
                      KernelVariantKey key;
                      key.op = op;
                      key.logits = logits;
                      key.labels = labels;
                      key.layout = layout;
                      key.ignoreIndex = ignore;
                      key.labelSmoothing = smoothing;
                      key.zLoss = op == KernelOp::ShardStats ? 0.0f : z;
                      key.overwrite = (op == KernelOp::Backward ||
                                       op == KernelOp::Fused) &&
                                      overwrite;
                      key.weights =
                          op == KernelOp::Fused ? weights : WeightsKind::None;
                      key.shard = shard;
                      if (seen.insert(key.str()).second)
                        keys.push_back(key);
                    }
  if (keys.empty()) {
    error = "the variant options select no kernel: --shard takes "
            "--op=shard_stats or backward, and --op=shard_stats needs a "
            "--shard";
    return failure();
  }
  return keys;
}
