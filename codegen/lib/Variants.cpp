//===- Variants.cpp - Kernel variants from ce-gen's options ---------------===//

#include "ce/Codegen/Variants.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/ADT/StringSwitch.h"

#include <functional>
#include <optional>
#include <set>

using namespace mlir;
using namespace mlir::ce;
using ::ce::ElemType;
using ::ce::KernelOp;
using ::ce::KernelVariantKey;
using ::ce::LabelLayout;
using ::ce::WeightsKind;

bool VariantOptions::any() const {
  if (all)
    return true;
  for (const std::vector<std::string> *list :
       {&ops, &logits, &labels, &layouts, &smoothings, &zLosses, &overwrites,
        &weights, &softcaps, &keys})
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

std::optional<KernelOp> parseOp(StringRef s) {
  return llvm::StringSwitch<std::optional<KernelOp>>(s)
      .Case("forward", KernelOp::Forward)
      .Case("backward", KernelOp::Backward)
      .Case("fused", KernelOp::Fused)
      .Case("shard_stats", KernelOp::ShardStats)
      .Case("rescale", KernelOp::Rescale)
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

std::optional<bool> parseOnOff(StringRef s) {
  if (s == "off")
    return false;
  if (s == "on")
    return true;
  return std::nullopt;
}

std::optional<bool> parseBool(StringRef s) {
  if (s == "0")
    return false;
  if (s == "1")
    return true;
  return std::nullopt;
}

/// `scalar` names the same kernel as `token`: a scalar weight is a
/// per-token weight of stride 0.
std::optional<WeightsKind> parseWeights(StringRef s) {
  return llvm::StringSwitch<std::optional<WeightsKind>>(s)
      .Case("scalar", WeightsKind::Token)
      .Case("token", WeightsKind::Token)
      .Default(std::nullopt);
}

/// Why `key` names no kernel, or an empty string. Shared by the lists (which
/// skip such combinations) and --variant (which reports them).
std::string whyNotAKernel(const KernelVariantKey &key) {
  if (key.op == KernelOp::Rescale)
    return key.isCanonical()
               ? ""
               : "op=rescale has labels=i64, label_smoothing=off, "
                 "z_loss=off, overwrite=1, weights=token and no softcap (it "
                 "reads no labels and rescales in place)";
  bool gradient = key.op == KernelOp::Backward || key.op == KernelOp::Fused;
  if (key.overwrite && !gradient)
    return "overwrite=1 needs op=backward or fused";
  if ((key.weights != WeightsKind::None) != (key.op == KernelOp::Fused))
    return "weights is token for op=fused, none otherwise";
  if (key.op == KernelOp::ShardStats && key.zLoss)
    return "shard_stats has z_loss=off (the z-loss applies after the "
           "shards' statistics are combined)";
  return "";
}

FailureOr<std::vector<KernelVariantKey>>
keysFromText(ArrayRef<std::string> texts, std::string &error) {
  std::vector<KernelVariantKey> keys;
  std::set<std::string> seen;
  for (const std::string &text : texts) {
    std::optional<KernelVariantKey> key = ::ce::parseKernelVariantKey(text);
    if (!key) {
      error = "--variant='" + text +
              "' is not a canonical variant key (docs/bundle-format.md, "
              "version 3: op=...,logits=...,labels=...,layout=...,"
              "label_smoothing=on|off,z_loss=on|off,overwrite=0|1,"
              "weights=none|token[,softcap=on], each value as ce-gen and the "
              "runtime print it)";
      return failure();
    }
    if (std::string why = whyNotAKernel(*key); !why.empty()) {
      error = "--variant='" + text + "': " + why;
      return failure();
    }
    if (seen.insert(text).second)
      keys.push_back(*key);
  }
  return keys;
}

} // namespace

FailureOr<std::vector<KernelVariantKey>>
mlir::ce::expandVariants(const VariantOptions &options, std::string &error) {
  if (!options.keys.empty() || options.all) {
    VariantOptions lists = options;
    lists.keys.clear();
    lists.all = false;
    if (lists.any() || (options.all && !options.keys.empty())) {
      error = "--variant and --all give whole sets of kernels; they cannot "
              "be combined with each other or with --op, --logits and the "
              "other variant lists";
      return failure();
    }
    if (!options.all)
      return keysFromText(options.keys, error);
  }
  // --all: every value of every list.
  auto pickList = [&](const std::vector<std::string> &given,
                      std::vector<std::string> every) {
    return options.all ? every : given;
  };
  std::vector<KernelOp> opList;
  std::vector<ElemType> logitsList, labelsList;
  std::vector<LabelLayout> layoutList;
  std::vector<bool> smoothingList, zList, overwriteList, softcapList;
  std::vector<WeightsKind> weightsList;
  if (failed(parseEach<KernelOp>(
          pickList(options.ops,
                   {"forward", "backward", "fused", "shard_stats", "rescale"}),
          {"forward"}, "op", "forward, backward, fused, shard_stats or rescale",
          parseOp, opList, error)) ||
      failed(parseEach<ElemType>(pickList(options.logits, {"bf16", "f16", "f32"}),
                                 {"bf16"}, "logits", "bf16, f16 or f32",
                                 parseLogits, logitsList, error)) ||
      failed(parseEach<ElemType>(pickList(options.labels, {"i32", "i64"}),
                                 {"i64"}, "labels", "i32 or i64", parseLabels,
                                 labelsList, error)) ||
      failed(parseEach<LabelLayout>(
          pickList(options.layouts, {"flat", "sbv_bs", "sbv_sb"}), {"sbv_bs"},
          "layout", "flat, sbv_bs or sbv_sb", parseLayout, layoutList,
          error)) ||
      failed(parseEach<bool>(pickList(options.smoothings, {"off", "on"}),
                             {"off"}, "label-smoothing", "off or on",
                             parseOnOff, smoothingList, error)) ||
      failed(parseEach<bool>(pickList(options.zLosses, {"off", "on"}), {"off"},
                             "z-loss", "off or on", parseOnOff, zList,
                             error)) ||
      failed(parseEach<bool>(pickList(options.softcaps, {"off", "on"}),
                             {"off"}, "softcap", "off or on", parseOnOff,
                             softcapList, error)) ||
      failed(parseEach<bool>(pickList(options.overwrites, {"0", "1"}), {"0"},
                             "overwrite", "0 or 1", parseBool, overwriteList,
                             error)) ||
      failed(parseEach<WeightsKind>(
          pickList(options.weights, {"token"}), {"token"}, "weights",
          "token or scalar (fused kernels; the same kernel, a scalar weight "
          "has stride 0)", parseWeights, weightsList, error)))
    return failure();

  // shard_stats kernels have no z-loss (it applies after the statistics
  // are combined): asking only for z-loss kernels is an error.
  if (!llvm::is_contained(zList, false) &&
      llvm::is_contained(opList, KernelOp::ShardStats)) {
    error = "--z-loss=on does not apply to --op=shard_stats (the z-loss is "
            "added after the shards' statistics are combined); emit "
            "shard_stats kernels with --z-loss=off";
    return failure();
  }

  std::vector<KernelVariantKey> keys;
  std::set<std::string> seen;
  for (KernelOp op : opList)
    for (ElemType logits : logitsList)
      for (ElemType labels : labelsList)
        for (LabelLayout layout : layoutList)
          for (bool smoothing : smoothingList)
            for (bool z : zList)
              for (bool overwrite : overwriteList)
                for (WeightsKind weights : weightsList)
                  for (bool softcap : softcapList) {
                    KernelVariantKey key;
                    key.op = op;
                    key.logits = logits;
                    key.labels = labels;
                    key.layout = layout;
                    key.smoothing = smoothing;
                    key.zLoss = z;
                    // Lists apply where they can: no overwrite for a
                    // forward, weights only for a fused kernel.
                    key.overwrite = (op == KernelOp::Backward ||
                                     op == KernelOp::Fused) &&
                                    overwrite;
                    key.weights =
                        op == KernelOp::Fused ? weights : WeightsKind::None;
                    key.softcap = softcap;
                    // --all: softcap kernels without smoothing and z-loss.
                    if (options.all && softcap && (smoothing || z))
                      continue;
                    // A rescale varies only in dtype and layout.
                    if (op == KernelOp::Rescale)
                      key.canonicalRescale();
                    if (!whyNotAKernel(key).empty())
                      continue;
                    if (seen.insert(key.str()).second)
                      keys.push_back(key);
                  }
  if (keys.empty()) {
    error = "the variant options select no kernel";
    return failure();
  }
  return keys;
}
