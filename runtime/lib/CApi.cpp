//===- CApi.cpp - The C API of ce_runtime.h -------------------------------===//
//
// A thin shell over the C++ layers: it converts pointers, catches every C++
// exception at the boundary (a C caller cannot handle one), and records the
// last error per thread. Only these functions are exported from the shared
// library; everything else is built with hidden visibility.
//
//===----------------------------------------------------------------------===//

#include "Bundle.h"
#include "KernelCache.h"
#include "Launch.h"
#include "ce/runtime/ce_runtime.h"

#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <string>

#define CE_EXPORT extern "C" __attribute__((visibility("default")))

struct ce_bundle {
  std::unique_ptr<ce::Bundle> impl;
};

namespace {

/// The message behind ce_last_error_message(), one per thread.
thread_local std::string lastErrorMessage;

ce_status finish(const char *function, const ce::Status &status) {
  if (status.isOk())
    lastErrorMessage.clear();
  else
    lastErrorMessage = std::string(function) + ": " + status.message();
  return status.code();
}

/// Runs `body` and converts escaping exceptions into CE_ERROR_BACKEND.
template <typename Body> ce_status guarded(const char *function, Body body) {
  try {
    return finish(function, body());
  } catch (const std::bad_alloc &) {
    return finish(function,
                  ce::Status::error(CE_ERROR_BACKEND, "out of host memory"));
  } catch (const std::exception &error) {
    return finish(function, ce::Status::error(CE_ERROR_BACKEND,
                                              std::string("internal error: ") +
                                                  error.what()));
  } catch (...) {
    return finish(function,
                  ce::Status::error(CE_ERROR_BACKEND, "internal error"));
  }
}

ce_status runOp(const char *function, ce_bundle *bundle,
                const ce::LaunchRequest &request) {
  return guarded(function, [&] {
    if (!bundle || !bundle->impl)
      return ce::Status::invalidArgument("bundle is NULL");
    return ce::launch(*bundle->impl, request);
  });
}

} // namespace

CE_EXPORT void ce_options_init(ce_options *options) {
  if (!options)
    return;
  options->has_ignore_index = 0;
  options->ignore_index = -100; // Megatron's value, should one be enabled.
  options->label_smoothing = 0.0f;
  options->z_loss = 0.0f;
  options->overwrite_input = 0;
  options->label_layout = CE_LABELS_BS;
  options->shard_start = 0;
  options->shard_vocab = 0;
  options->shard_global_smoothing = 0;
  options->label_policy = CE_LABEL_POLICY_STRICT;
  options->lse_low = nullptr;
  options->logit_scale = 1.0f;
  options->logit_softcap = 0.0f;
  options->entropy = nullptr;
  options->argmax = nullptr;
}

CE_EXPORT ce_status ce_bundle_open(const char *directory, ce_bundle **bundle) {
  if (bundle)
    *bundle = nullptr;
  return guarded("ce_bundle_open", [&] {
    if (!bundle)
      return ce::Status::invalidArgument("bundle (the output) is NULL");
    if (!directory)
      return ce::Status::invalidArgument("directory is NULL");
    std::unique_ptr<ce::Bundle> opened;
    if (ce::Status status = ce::Bundle::open(directory, opened); !status.isOk())
      return status;
    *bundle = new ce_bundle{std::move(opened)};
    return ce::Status::ok();
  });
}

CE_EXPORT void ce_bundle_close(ce_bundle *bundle) {
  if (!bundle)
    return;
  if (bundle->impl)
    ce::KernelCache::global().evictBundle(bundle->impl->id());
  delete bundle;
}

CE_EXPORT int64_t ce_bundle_num_kernels(const ce_bundle *bundle) {
  if (!bundle || !bundle->impl)
    return 0;
  return static_cast<int64_t>(bundle->impl->kernels().size());
}

CE_EXPORT const char *ce_bundle_kernel_key(const ce_bundle *bundle,
                                           int64_t index) {
  if (!bundle || !bundle->impl || index < 0 ||
      index >= static_cast<int64_t>(bundle->impl->kernels().size()))
    return nullptr;
  return bundle->impl->kernels()[index].key.c_str();
}

CE_EXPORT const char *ce_bundle_kernel_target(const ce_bundle *bundle,
                                              int64_t index) {
  if (!bundle || !bundle->impl || index < 0 ||
      index >= static_cast<int64_t>(bundle->impl->kernels().size()))
    return nullptr;
  return bundle->impl->kernels()[index].target.c_str();
}

CE_EXPORT ce_status ce_forward(ce_bundle *bundle, const ce_options *options,
                               const ce_tensor *logits, const ce_tensor *labels,
                               const ce_tensor *loss, const ce_tensor *lse,
                               void *stream) {
  ce::LaunchRequest request;
  request.op = ce::KernelOp::Forward;
  request.options = options;
  request.logits = logits;
  request.labels = labels;
  request.loss = loss;
  request.lse = lse;
  request.stream = stream;
  return runOp("ce_forward", bundle, request);
}

CE_EXPORT ce_status ce_backward(ce_bundle *bundle, const ce_options *options,
                                const ce_tensor *logits,
                                const ce_tensor *labels, const ce_tensor *lse,
                                const ce_tensor *grad_loss,
                                const ce_tensor *grad, void *stream) {
  ce::LaunchRequest request;
  request.op = ce::KernelOp::Backward;
  request.options = options;
  request.logits = logits;
  request.labels = labels;
  request.lse = lse;
  request.gradLoss = grad_loss;
  request.grad = grad;
  request.stream = stream;
  return runOp("ce_backward", bundle, request);
}

CE_EXPORT ce_status ce_fused(ce_bundle *bundle, const ce_options *options,
                             const ce_tensor *logits, const ce_tensor *labels,
                             const ce_tensor *weights, const ce_tensor *loss,
                             const ce_tensor *lse, const ce_tensor *grad,
                             void *stream) {
  ce::LaunchRequest request;
  request.op = ce::KernelOp::Fused;
  request.options = options;
  request.logits = logits;
  request.labels = labels;
  request.weights = weights;
  request.loss = loss;
  request.lse = lse;
  request.grad = grad;
  request.stream = stream;
  return runOp("ce_fused", bundle, request);
}

CE_EXPORT ce_status ce_shard_stats(ce_bundle *bundle,
                                   const ce_options *options,
                                   const ce_tensor *logits,
                                   const ce_tensor *labels,
                                   const ce_tensor *stats, void *stream) {
  ce::LaunchRequest request;
  request.op = ce::KernelOp::ShardStats;
  request.options = options;
  request.logits = logits;
  request.labels = labels;
  request.stats = stats;
  request.stream = stream;
  return runOp("ce_shard_stats", bundle, request);
}

CE_EXPORT ce_status ce_rescale(ce_bundle *bundle, const ce_options *options,
                               const ce_tensor *grad, const ce_tensor *weights,
                               const ce_tensor *grad_loss, void *stream) {
  ce::LaunchRequest request;
  request.op = ce::KernelOp::Rescale;
  request.options = options;
  request.logits = grad; // it takes the logits' place (Validation.cpp)
  request.weights = weights;
  request.gradLoss = grad_loss;
  request.stream = stream;
  return runOp("ce_rescale", bundle, request);
}

CE_EXPORT ce_status ce_check_label_status(ce_device_type device,
                                          int32_t device_index, void *stream,
                                          int32_t wait) {
  return guarded("ce_check_label_status", [&] {
    // A C caller may pass any int as the enum.
    int32_t type;
    static_assert(sizeof(type) == sizeof(device), "ce_device_type is an int");
    std::memcpy(&type, &device, sizeof(type));
    if (type != CE_DEVICE_HOST && type != CE_DEVICE_CUDA &&
        type != CE_DEVICE_HIP)
      return ce::Status::invalidArgument("invalid device type " +
                                         std::to_string(type));
    return ce::checkLabelStatus(device, device_index, stream, wait != 0);
  });
}

CE_EXPORT const char *ce_last_error_message(void) {
  return lastErrorMessage.c_str();
}

CE_EXPORT const char *ce_status_string(ce_status status) {
  // A C caller may pass any int; loading one outside the enumerators as a
  // ce_status would be undefined behavior in C++.
  int32_t code;
  static_assert(sizeof(code) == sizeof(status), "ce_status is an int");
  std::memcpy(&code, &status, sizeof(code));
  switch (code) {
  case CE_OK:
    return "CE_OK";
  case CE_ERROR_INVALID_ARGUMENT:
    return "CE_ERROR_INVALID_ARGUMENT";
  case CE_ERROR_BUNDLE:
    return "CE_ERROR_BUNDLE";
  case CE_ERROR_VARIANT_NOT_FOUND:
    return "CE_ERROR_VARIANT_NOT_FOUND";
  case CE_ERROR_LABEL_OUT_OF_RANGE:
    return "CE_ERROR_LABEL_OUT_OF_RANGE";
  case CE_ERROR_NO_DEVICE:
    return "CE_ERROR_NO_DEVICE";
  case CE_ERROR_BACKEND:
    return "CE_ERROR_BACKEND";
  }
  return "unknown ce_status";
}
