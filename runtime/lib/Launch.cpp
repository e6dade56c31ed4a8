//===- Launch.cpp - From a C API call to a kernel launch ------------------===//
//
// The order matters: everything about the request is checked before the
// device, the device (and its target: "host", "sm_90", "gfx942") before the
// variant, and all of it before a launch, so that a bad call never reaches a
// kernel and a missing variant is reported even for an empty batch.
//
//===----------------------------------------------------------------------===//

#include "Launch.h"
#include "HostBackend.h"
#include "KernelCache.h"
#include "LabelStatus.h"

#include <algorithm>
#include <set>
#include <string>
#include <vector>

namespace ce {

namespace {

/// The `--name=value` options that make ce-gen emit exactly `variant`.
/// Number of comma-separated fields in which two keys differ.
int keyDistance(const std::string &a, const std::string &b) {
  auto split = [](const std::string &key) {
    std::vector<std::string> fields;
    size_t start = 0;
    while (true) {
      size_t comma = key.find(',', start);
      fields.push_back(key.substr(start, comma - start));
      if (comma == std::string::npos)
        return fields;
      start = comma + 1;
    }
  };
  std::vector<std::string> fieldsA = split(a), fieldsB = split(b);
  int distance = 0;
  for (size_t i = 0; i < std::max(fieldsA.size(), fieldsB.size()); ++i)
    if (i >= fieldsA.size() || i >= fieldsB.size() || fieldsA[i] != fieldsB[i])
      ++distance;
  return distance;
}

} // namespace

const KernelInfo *findServingKernel(const Bundle &bundle,
                                    const std::string &target,
                                    const LaunchPlan &plan) {
  // The request's own variant first; then, for a coefficient of 0, a kernel
  // that computes smoothing or a z-loss anyway (the same numbers for a
  // little more work), so that a bundle of "on" kernels serves every value.
  KernelVariantKey variant = plan.variant;
  for (int extra : {0, 1, 2, 3}) {
    if (((extra & 1) && variant.smoothing) || ((extra & 2) && variant.zLoss))
      continue;
    KernelVariantKey candidate = variant;
    candidate.smoothing |= (extra & 1) != 0;
    candidate.zLoss |= (extra & 2) != 0;
    if ((candidate.zLoss && candidate.op == KernelOp::ShardStats) ||
        (extra != 0 && candidate.op == KernelOp::Rescale))
      continue;
    if (const KernelInfo *info =
            bundle.findKernel(target, candidate.str(), plan.vocabSize))
      return info;
  }
  return nullptr;
}

Status variantNotFoundError(const Bundle &bundle, const std::string &target,
                            const LaunchPlan &plan,
                            const std::string &deviceDescription) {
  std::string key = plan.variant.str();
  std::string message =
      "kernel variant not found in bundle '" + bundle.directory() +
      "' for target " + target +
      (deviceDescription.empty() ? std::string()
                                 : " (" + deviceDescription + ")") +
      ": \"" + key + "\"; generate it with `ce-gen --target=" + target +
      " -o DIR --variant=" + key +
      "` (or `ce-gen --all`, every variant of the target)";
  // Which targets the bundle has at all, and which of them have this key.
  std::set<std::string> targets, targetsWithKey;
  for (const KernelInfo &kernel : bundle.kernels()) {
    targets.insert(kernel.target);
    if (kernel.key == key)
      targetsWithKey.insert(kernel.target);
  }
  auto join = [](const std::set<std::string> &names) {
    std::string text;
    for (const std::string &name : names)
      text += (text.empty() ? "" : ", ") + name;
    return text;
  };
  if (!targets.count(target))
    return Status::error(
        CE_ERROR_VARIANT_NOT_FOUND,
        message + " (the bundle has no " + target + " kernels; it has " +
            (targets.empty() ? std::string("no kernels")
                             : "kernels for targets " + join(targets)) +
            (targetsWithKey.empty()
                 ? std::string()
                 : ", this variant for " + join(targetsWithKey)) +
            ")");
  std::vector<std::pair<int, const std::string *>> candidates;
  for (const KernelInfo &kernel : bundle.kernels())
    if (kernel.target == target)
      candidates.push_back({keyDistance(kernel.key, key), &kernel.key});
  std::stable_sort(
      candidates.begin(), candidates.end(),
      [](const auto &a, const auto &b) { return a.first < b.first; });
  message += " (the bundle has " + std::to_string(candidates.size()) + " " +
             target + " kernels; nearest:";
  for (size_t i = 0; i < candidates.size() && i < 3; ++i)
    message += (i ? ", \"" : " \"") + *candidates[i].second + "\"";
  if (!targetsWithKey.empty())
    message += "; this variant exists for " + join(targetsWithKey);
  return Status::error(CE_ERROR_VARIANT_NOT_FOUND, message + ")");
}

Status launch(const Bundle &bundle, const LaunchRequest &request) {
  LaunchPlan plan;
  if (Status status = validateLaunch(request, plan); !status.isOk())
    return status;
  std::string target, description;
  if (Status status =
          deviceTarget(plan.device, plan.deviceIndex, target, description);
      !status.isOk())
    return status;

  const KernelInfo *info = findServingKernel(bundle, target, plan);
  if (!info)
    return variantNotFoundError(bundle, target, plan, description);
  if (plan.device != CE_DEVICE_HOST) {
    if (plan.numTokens == 0)
      return Status::ok();
    return launchGpuKernel(bundle, *info, plan, request.stream);
  }

  LoadedKernel kernel;
  KernelCacheKey cacheKey{bundle.id(), info->key + '\n' + info->symbol,
                          plan.device, plan.deviceIndex,
                          0};
  if (Status status = KernelCache::global().getOrLoad(
          cacheKey,
          [&](LoadedKernel &loaded) {
            loaded.info = info;
            loaded.entry = bundle.hostEntry(*info);
            if (!loaded.entry)
              return Status::error(CE_ERROR_BACKEND,
                                   "kernel \"" + info->key +
                                       "\" has no host entry point");
            return Status::ok();
          },
          kernel);
      !status.isOk())
    return status;

  if (plan.numTokens == 0)
    return Status::ok();
  // The runtime owns the status word: zeroed here, read after the call.
  int64_t labelStatus = 0;
  if (Status status = launchHostKernel(kernel, plan, labelStatus);
      !status.isOk())
    return status;
  if (labelStatus != 0)
    return labelStatusError(labelStatus, labelContext(plan), readHostLabel,
                            /*deferred=*/false);
  return Status::ok();
}

} // namespace ce
