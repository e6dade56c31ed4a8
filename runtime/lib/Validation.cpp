//===- Validation.cpp - Checking a launch request before any launch -------===//
//
// The rules of docs/runtime.md, "Validation". Each message starts with the
// name of the tensor or option at fault and says what was expected and what
// was given, so a user can fix the call without reading this file.
//
//===----------------------------------------------------------------------===//

#include "Validation.h"
#include "MemoryRange.h"

#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace ce {

std::string formatDims(const int64_t *values, int count) {
  std::string text = "[";
  for (int i = 0; i < count; ++i) {
    if (i)
      text += ", ";
    text += std::to_string(values[i]);
  }
  return text + "]";
}

int64_t dtypeSize(ce_dtype dtype) {
  switch (dtype) {
  case CE_DTYPE_BF16:
  case CE_DTYPE_F16:
    return 2;
  case CE_DTYPE_F32:
  case CE_DTYPE_I32:
    return 4;
  case CE_DTYPE_I64:
    return 8;
  }
  return 0;
}

std::string dtypeName(ce_dtype dtype) {
  switch (dtype) {
  case CE_DTYPE_BF16:
    return "bf16";
  case CE_DTYPE_F16:
    return "f16";
  case CE_DTYPE_F32:
    return "f32";
  case CE_DTYPE_I32:
    return "i32";
  case CE_DTYPE_I64:
    return "i64";
  }
  return "invalid dtype " + std::to_string(static_cast<int>(dtype));
}

namespace {

const char *deviceName(ce_device_type device) {
  switch (device) {
  case CE_DEVICE_HOST:
    return "host";
  case CE_DEVICE_CUDA:
    return "CUDA";
  case CE_DEVICE_HIP:
    return "HIP";
  }
  return "invalid device";
}

ElemType toElemType(ce_dtype dtype) {
  switch (dtype) {
  case CE_DTYPE_BF16:
    return ElemType::BF16;
  case CE_DTYPE_F16:
    return ElemType::F16;
  case CE_DTYPE_F32:
    return ElemType::F32;
  case CE_DTYPE_I32:
    return ElemType::I32;
  case CE_DTYPE_I64:
    return ElemType::I64;
  }
  return ElemType::F32;
}

/// A tensor of the request with the name messages use for it.
struct NamedTensor {
  const char *name;
  ArgRole role;
  const ce_tensor *tensor;
  bool isOutput;
};

/// The integer stored in a C enum field. Callers may pass any int there, and
/// loading a value outside the enumerators as the enum type is undefined
/// behavior, so fields are read as their underlying integer before checks.
template <typename Enum> int64_t rawEnum(const Enum &field) {
  std::underlying_type_t<Enum> raw;
  std::memcpy(&raw, &field, sizeof(raw));
  return static_cast<int64_t>(raw);
}

Status invalid(const std::string &name, const std::string &message) {
  return Status::invalidArgument(name + ": " + message);
}

Status checkOptions(const ce_options &options) {
  int64_t layout = rawEnum(options.label_layout);
  if (layout != CE_LABELS_BS && layout != CE_LABELS_SB)
    return invalid("options->label_layout",
                   "must be CE_LABELS_BS (0) or CE_LABELS_SB (1), got " +
                       std::to_string(layout));
  int64_t policy = rawEnum(options.label_policy);
  if (policy != CE_LABEL_POLICY_STRICT && policy != CE_LABEL_POLICY_MEGATRON)
    return invalid("options->label_policy",
                   "must be CE_LABEL_POLICY_STRICT (0) or "
                   "CE_LABEL_POLICY_MEGATRON (1), got " +
                       std::to_string(policy));
  float smoothing = options.label_smoothing;
  if (!(smoothing >= 0.0f && smoothing < 1.0f))
    return invalid("options->label_smoothing",
                   "must be in [0, 1), got " + formatF32(smoothing));
  float zLoss = options.z_loss;
  if (!std::isfinite(zLoss) || zLoss < 0.0f)
    return invalid("options->z_loss",
                   "must be finite and >= 0, got " + formatF32(zLoss));
  float logitScale = options.logit_scale;
  if (!std::isfinite(logitScale) || !(logitScale > 0.0f))
    return invalid("options->logit_scale",
                   "must be finite and > 0, got " + formatF32(logitScale));
  // A softcap z = cap tanh(s x / cap): 0 is none; a cap must be finite and
  // positive, and s / cap finite (the kernels take y = x fl(s / cap)).
  float softcap = options.logit_softcap;
  if (softcap != 0.0f && (!std::isfinite(softcap) || !(softcap > 0.0f) ||
                          !std::isfinite(logitScale / softcap)))
    return invalid("options->logit_softcap",
                   "must be 0 (no softcap) or finite and > 0 with "
                   "logit_scale / logit_softcap finite, got " +
                       formatF32(softcap));
  if (options.shard_vocab < 0)
    return invalid("options->shard_vocab",
                   "must be 0 (no shard) or the global vocabulary size, got " +
                       std::to_string(options.shard_vocab));
  if (options.shard_vocab > 0 &&
      (options.shard_start < 0 || options.shard_start >= options.shard_vocab))
    return invalid("options->shard_start",
                   "must be in [0, shard_vocab = " +
                       std::to_string(options.shard_vocab) + "), got " +
                       std::to_string(options.shard_start));
  return Status::ok();
}

/// Which ops take a shard, and what a shard_stats call needs.
Status checkShardUse(KernelOp op, const ce_options &options) {
  bool sharded = options.shard_vocab > 0;
  if (op == KernelOp::ShardStats && !sharded)
    return invalid("options->shard_vocab",
                   "ce_shard_stats needs a shard (shard_vocab > 0)");
  if (op == KernelOp::ShardStats && options.z_loss != 0.0f)
    return invalid("options->z_loss",
                   "must be 0 for ce_shard_stats: the z-loss applies to the "
                   "combined log-sum-exp, got " +
                       formatF32(options.z_loss));
  if (sharded && (op == KernelOp::Forward || op == KernelOp::Fused))
    return invalid("options->shard_vocab",
                   std::string("a vocabulary slice has no ") +
                       stringify(op) +
                       " kernel: its loss needs every rank's statistics; "
                       "use ce_shard_stats, combine, then ce_backward");
  return Status::ok();
}

/// Checks what every tensor needs regardless of its role.
Status checkWellFormed(const NamedTensor &arg) {
  const ce_tensor &tensor = *arg.tensor;
  if (tensor.ndim < 0 || tensor.ndim > CE_MAX_RANK)
    return invalid(arg.name, "ndim must be in [0, " +
                                 std::to_string(CE_MAX_RANK) + "], got " +
                                 std::to_string(tensor.ndim));
  int64_t dtype = rawEnum(tensor.dtype);
  if (dtype < CE_DTYPE_BF16 || dtype > CE_DTYPE_I64)
    return invalid(arg.name, "invalid dtype " + std::to_string(dtype));
  int64_t device = rawEnum(tensor.device);
  if (device != CE_DEVICE_HOST && device != CE_DEVICE_CUDA &&
      device != CE_DEVICE_HIP)
    return invalid(arg.name, "invalid device type " + std::to_string(device));
  for (int i = 0; i < tensor.ndim; ++i)
    if (tensor.sizes[i] < 0)
      return invalid(arg.name, "negative size in dimension " +
                                   std::to_string(i) + " (sizes " +
                                   formatDims(tensor.sizes, tensor.ndim) + ")");
  int64_t count = elementCount(tensor);
  if (count < 0)
    return invalid(arg.name, "sizes " + formatDims(tensor.sizes, tensor.ndim) +
                                 " hold more than 2^63 elements");
  ByteRange range;
  if (!byteRange(tensor, dtypeSize(tensor.dtype), range))
    return invalid(arg.name, "sizes " + formatDims(tensor.sizes, tensor.ndim) +
                                 " and strides " +
                                 formatDims(tensor.strides, tensor.ndim) +
                                 " reach outside the address space");
  if (count > 0 && !tensor.data)
    return invalid(arg.name, "data is NULL but the tensor has " +
                                 std::to_string(count) + " elements");
  return Status::ok();
}

Status checkDtype(const NamedTensor &arg, std::initializer_list<ce_dtype> ok,
                  const char *expected) {
  for (ce_dtype dtype : ok)
    if (arg.tensor->dtype == dtype)
      return Status::ok();
  return invalid(arg.name, std::string("dtype must be ") + expected + ", got " +
                               dtypeName(arg.tensor->dtype));
}

bool sameSizes(const ce_tensor &tensor, int rank, const int64_t *sizes) {
  if (tensor.ndim != rank)
    return false;
  for (int i = 0; i < rank; ++i)
    if (tensor.sizes[i] != sizes[i])
      return false;
  return true;
}

/// The token shape in words, for messages ("[B, S] = [4, 3]").
std::string describeTokenShape(const LaunchPlan &plan) {
  const char *names = plan.variant.layout == LabelLayout::Flat    ? "[N]"
                      : plan.variant.layout == LabelLayout::SbvBs ? "[B, S]"
                                                                  : "[S, B]";
  return std::string(names) + " = " +
         formatDims(plan.tokenSizes, plan.tokenRank);
}

Status checkTokenShaped(const NamedTensor &arg, const LaunchPlan &plan) {
  const ce_tensor &tensor = *arg.tensor;
  if (sameSizes(tensor, plan.tokenRank, plan.tokenSizes))
    return Status::ok();
  std::string message = "expected the labels' shape " +
                        describeTokenShape(plan) + ", got " +
                        formatDims(tensor.sizes, tensor.ndim);
  if (tensor.ndim != plan.tokenRank)
    message += " (ndim " + std::to_string(tensor.ndim) + ")";
  // Transposed token shapes are the likely mistake with [S,B,V] logits.
  int64_t swapped[2] = {plan.tokenSizes[1], plan.tokenSizes[0]};
  if (plan.tokenRank == 2 && swapped[0] != swapped[1] &&
      sameSizes(tensor, 2, swapped))
    message +=
        std::string("; for ") +
        (plan.variant.layout == LabelLayout::SbvBs ? "[S, B]" : "[B, S]") +
        " labels set options->label_layout to " +
        (plan.variant.layout == LabelLayout::SbvBs ? "CE_LABELS_SB"
                                                   : "CE_LABELS_BS");
  return invalid(arg.name, message);
}

bool sameView(const ce_tensor &a, const ce_tensor &b) {
  // `a` is not validated yet: compare its enum fields as integers.
  if (a.data != b.data || rawEnum(a.dtype) != rawEnum(b.dtype) ||
      a.ndim != b.ndim || rawEnum(a.device) != rawEnum(b.device) ||
      a.device_index != b.device_index)
    return false;
  if (a.ndim < 0 || a.ndim > CE_MAX_RANK)
    return false;
  for (int i = 0; i < a.ndim; ++i)
    if (a.sizes[i] != b.sizes[i] || a.strides[i] != b.strides[i])
      return false;
  return true;
}

/// Outputs are written, so no element may be reachable through two indices.
Status checkOutputLayout(const NamedTensor &arg, const std::string &why) {
  const ce_tensor &tensor = *arg.tensor;
  if (elementCount(tensor) == 0)
    return Status::ok(); // Nothing is written.
  for (int i = 0; i < tensor.ndim; ++i)
    if (tensor.strides[i] == 0 && tensor.sizes[i] > 1)
      return invalid(arg.name, "stride 0 in dimension " + std::to_string(i) +
                                   " (size " + std::to_string(tensor.sizes[i]) +
                                   "): " + why + " cannot be a broadcast view");
  if (mayWriteTwice(tensor))
    return invalid(arg.name,
                   "strides " + formatDims(tensor.strides, tensor.ndim) +
                       " make elements of sizes " +
                       formatDims(tensor.sizes, tensor.ndim) +
                       " overlap: " + why + " must not overlap itself");
  return Status::ok();
}

} // namespace

Status validateLaunch(const LaunchRequest &request, LaunchPlan &plan) {
  plan = LaunchPlan();
  KernelOp op = request.op;
  if (request.options)
    plan.options = *request.options;
  else
    ce_options_init(&plan.options);
  const ce_options &options = plan.options;
  if (Status status = checkOptions(options); !status.isOk())
    return status;
  if (Status status = checkShardUse(op, options); !status.isOk())
    return status;
  // A forward writes no gradient, so overwrite_input does not apply to it;
  // the same options can then serve a forward and its backward.
  bool takesGrad = op == KernelOp::Backward || op == KernelOp::Fused;
  bool overwrite = takesGrad && options.overwrite_input != 0;

  // Presence. The gradient is the one optional tensor: it must be NULL or
  // the logits themselves when overwriting.
  std::vector<NamedTensor> args = {
      {"logits", ArgRole::Logits, request.logits, overwrite},
      {"labels", ArgRole::Labels, request.labels, false}};
  // A rescale's gradient (passed as the request's logits) takes the logits'
  // place: it decides the layout, the token shape and the vocabulary.
  if (op == KernelOp::Rescale)
    args = {{"grad", ArgRole::Grad, request.logits, true},
            {"weights", ArgRole::Weights, request.weights, false},
            {"grad_loss", ArgRole::GradLoss, request.gradLoss, false}};
  else if (op == KernelOp::Fused)
    args.push_back({"weights", ArgRole::Weights, request.weights, false});
  if (op == KernelOp::Rescale) {
  } else if (op == KernelOp::ShardStats) {
    args.push_back({"stats", ArgRole::Stats, request.stats, true});
  } else if (op != KernelOp::Backward) {
    args.push_back({"loss", ArgRole::Loss, request.loss, true});
    args.push_back({"lse", ArgRole::Lse, request.lse, true});
  } else {
    args.push_back({"lse", ArgRole::Lse, request.lse, false});
    args.push_back({"grad_loss", ArgRole::GradLoss, request.gradLoss, false});
  }
  for (const NamedTensor &arg : args)
    if (!arg.tensor)
      return invalid(arg.name, "is NULL");
  // lse's low part, optional: written by a forward and a fused kernel, read
  // by a backward; a shard_stats or rescale call ignores it (one options
  // struct may serve every call of a step).
  if (options.lse_low && (op == KernelOp::Forward || op == KernelOp::Fused ||
                          op == KernelOp::Backward))
    args.push_back({"options->lse_low", ArgRole::LseLow, options.lse_low,
                    op != KernelOp::Backward});
  // The optional outputs of a forward, a fused and a shard_stats call.
  if (op == KernelOp::Forward || op == KernelOp::Fused ||
      op == KernelOp::ShardStats) {
    if (options.entropy)
      args.push_back({"options->entropy", ArgRole::Entropy, options.entropy,
                      true});
    if (options.argmax)
      args.push_back({"options->argmax", ArgRole::Argmax, options.argmax,
                      true});
  }
  if (takesGrad) {
    if (overwrite) {
      if (request.grad && !sameView(*request.grad, *request.logits))
        return invalid(
            "grad",
            "with options->overwrite_input the gradient is written "
            "over the logits, so grad must be NULL or exactly the "
            "logits view (same data, dtype, sizes, strides and device)");
    } else {
      if (!request.grad)
        return invalid("grad", "is NULL; pass a gradient tensor, or set "
                               "options->overwrite_input to write the "
                               "gradient over the logits");
      args.push_back({"grad", ArgRole::Grad, request.grad, true});
    }
  }
  for (const NamedTensor &arg : args)
    if (Status status = checkWellFormed(arg); !status.isOk())
      return status;

  // Logits decide the layout, the token shape and the vocabulary.
  const NamedTensor &logitsArg = args[0];
  const ce_tensor &logits = *request.logits;
  if (Status status =
          checkDtype(logitsArg, {CE_DTYPE_BF16, CE_DTYPE_F16, CE_DTYPE_F32},
                     "bf16, f16 or f32");
      !status.isOk())
    return status;
  if (logits.ndim == 2) {
    plan.variant.layout = LabelLayout::Flat;
    plan.tokenRank = 1;
    plan.tokenSizes[0] = logits.sizes[0];
  } else if (logits.ndim == 3) {
    int64_t seq = logits.sizes[0], batch = logits.sizes[1];
    plan.tokenRank = 2;
    if (options.label_layout == CE_LABELS_BS) {
      plan.variant.layout = LabelLayout::SbvBs;
      plan.tokenSizes[0] = batch;
      plan.tokenSizes[1] = seq;
    } else {
      plan.variant.layout = LabelLayout::SbvSb;
      plan.tokenSizes[0] = seq;
      plan.tokenSizes[1] = batch;
    }
  } else {
    return invalid("logits", "ndim must be 2 ([N, V]) or 3 ([S, B, V]), got " +
                                 std::to_string(logits.ndim));
  }
  plan.vocabSize = logits.sizes[logits.ndim - 1];
  plan.numTokens = plan.tokenSizes[0];
  if (plan.tokenRank == 2 &&
      __builtin_mul_overflow(plan.numTokens, plan.tokenSizes[1],
                             &plan.numTokens))
    return invalid("logits", "sizes " + formatDims(logits.sizes, logits.ndim) +
                                 " hold more than 2^63 tokens");
  if (plan.numTokens > 0 && plan.vocabSize == 0)
    return invalid("logits", "vocabulary size (last dimension) is 0 for " +
                                 std::to_string(plan.numTokens) + " tokens");
  // Past 2^27 the f32 row sums lose the 1e-5 relative accuracy of the
  // numerics contract (docs/lowering.md): refused, not silently worse.
  if (plan.vocabSize > kMaxVocab)
    return invalid("logits", "vocabulary size (last dimension) " +
                                 std::to_string(plan.vocabSize) +
                                 " exceeds 2^27 = " + std::to_string(kMaxVocab) +
                                 ", the largest row the kernels keep to the "
                                 "1e-5 loss accuracy of the numerics contract"
                                 " (split the vocabulary over ranks)");
  if (plan.vocabSize > 1 && logits.strides[logits.ndim - 1] != 1)
    return invalid("logits", "the vocabulary dimension must have stride 1, "
                             "got strides " +
                                 formatDims(logits.strides, logits.ndim));

  if (options.shard_vocab > 0 &&
      plan.vocabSize > options.shard_vocab - options.shard_start)
    return invalid("logits",
                   "the slice [" + std::to_string(options.shard_start) +
                       ", " + std::to_string(options.shard_start) + " + " +
                       std::to_string(plan.vocabSize) +
                       ") exceeds the vocabulary of options->shard_vocab = " +
                       std::to_string(options.shard_vocab));

  plan.variant.op = op;
  plan.variant.logits = toElemType(logits.dtype);
  plan.variant.smoothing = options.label_smoothing != 0.0f;
  plan.variant.zLoss = options.z_loss != 0.0f;
  plan.variant.softcap = options.logit_softcap != 0.0f;
  plan.variant.overwrite = overwrite;
  if (op == KernelOp::Rescale)
    plan.variant.canonicalRescale();

  for (const NamedTensor &arg : args) {
    const ce_tensor &tensor = *arg.tensor;
    switch (arg.role) {
    case ArgRole::Logits:
    case ArgRole::Status:
    case ArgRole::Flags: // values, not tensors of the call
    case ArgRole::IgnoreIndex:
    case ArgRole::LabelSmoothing:
    case ArgRole::ZLoss:
    case ArgRole::ShardStart:
    case ArgRole::ShardVocab:
    case ArgRole::LogitScale:
    case ArgRole::LogitSoftcap:
      break;
    case ArgRole::Labels:
      if (Status status =
              checkDtype(arg, {CE_DTYPE_I32, CE_DTYPE_I64}, "i32 or i64");
          !status.isOk())
        return status;
      plan.variant.labels = toElemType(tensor.dtype);
      if (Status status = checkTokenShaped(arg, plan); !status.isOk())
        return status;
      break;
    case ArgRole::Loss:
    case ArgRole::Lse:
    case ArgRole::LseLow:
    case ArgRole::Entropy:
    case ArgRole::GradLoss:
      if (Status status = checkDtype(arg, {CE_DTYPE_F32}, "f32");
          !status.isOk())
        return status;
      if (Status status = checkTokenShaped(arg, plan); !status.isOk())
        return status;
      break;
    case ArgRole::Argmax:
      if (Status status = checkDtype(arg, {CE_DTYPE_I64}, "i64");
          !status.isOk())
        return status;
      if (Status status = checkTokenShaped(arg, plan); !status.isOk())
        return status;
      break;
    case ArgRole::Stats: {
      if (Status status = checkDtype(arg, {CE_DTYPE_F32}, "f32");
          !status.isOk())
        return status;
      int64_t want[3] = {plan.tokenSizes[0], plan.tokenSizes[1], 0};
      want[plan.tokenRank] = 4;
      if (!sameSizes(tensor, plan.tokenRank + 1, want))
        return invalid("stats", "must have the labels' shape " +
                                    describeTokenShape(plan) +
                                    " followed by 4, got " +
                                    formatDims(tensor.sizes, tensor.ndim));
      break;
    }
    case ArgRole::Weights:
      if (Status status = checkDtype(arg, {CE_DTYPE_F32}, "f32");
          !status.isOk())
        return status;
      plan.variant.weights = WeightsKind::Token;
      if (tensor.ndim != 0) {
        if (!sameSizes(tensor, plan.tokenRank, plan.tokenSizes))
          return invalid("weights", "must be a scalar (ndim 0) or have the "
                                    "labels' shape " +
                                        describeTokenShape(plan) + ", got " +
                                        formatDims(tensor.sizes, tensor.ndim));
      }
      break;
    case ArgRole::Grad:
      if (tensor.dtype != logits.dtype)
        return invalid("grad", "dtype must be the logits' dtype " +
                                   dtypeName(logits.dtype) + ", got " +
                                   dtypeName(tensor.dtype));
      if (!sameSizes(tensor, logits.ndim, logits.sizes))
        return invalid("grad", "shape must be the logits' shape " +
                                   formatDims(logits.sizes, logits.ndim) +
                                   ", got " +
                                   formatDims(tensor.sizes, tensor.ndim));
      if (plan.vocabSize > 1 && tensor.strides[tensor.ndim - 1] != 1)
        return invalid("grad", "the vocabulary dimension must have stride 1, "
                               "got strides " +
                                   formatDims(tensor.strides, tensor.ndim));
      break;
    }
  }

  // One device for all tensors.
  plan.device = logits.device;
  plan.deviceIndex = logits.device == CE_DEVICE_HOST ? 0 : logits.device_index;
  for (const NamedTensor &arg : args) {
    const ce_tensor &tensor = *arg.tensor;
    if (tensor.device != logits.device ||
        (tensor.device != CE_DEVICE_HOST &&
         tensor.device_index != logits.device_index))
      return invalid(arg.name,
                     std::string("is on ") + deviceName(tensor.device) +
                         " device " + std::to_string(tensor.device_index) +
                         " but logits are on " + deviceName(logits.device) +
                         " device " + std::to_string(logits.device_index) +
                         "; all tensors must be on the same device");
  }

  // Outputs: never broadcast, never self-overlapping, never sharing memory
  // with another tensor of the call.
  for (const NamedTensor &arg : args) {
    if (!arg.isOutput)
      continue;
    std::string why = arg.role == ArgRole::Logits
                          ? "with options->overwrite_input the logits are "
                            "written, so they"
                      : op == KernelOp::Rescale ? "the rescaled gradient"
                                                : "an output";
    if (Status status = checkOutputLayout(arg, why); !status.isOk())
      return status;
    ByteRange outputRange;
    (void)byteRange(*arg.tensor, dtypeSize(arg.tensor->dtype), outputRange);
    for (const NamedTensor &other : args) {
      if (&other == &arg)
        continue;
      ByteRange otherRange;
      (void)byteRange(*other.tensor, dtypeSize(other.tensor->dtype),
                      otherRange);
      if (!outputRange.overlaps(otherRange))
        continue;
      bool gradOnLogits =
          (arg.role == ArgRole::Grad && other.role == ArgRole::Logits) ||
          (arg.role == ArgRole::Logits && other.role == ArgRole::Grad);
      if (gradOnLogits)
        return invalid("grad", "overlaps logits; to write the gradient over "
                               "the logits set options->overwrite_input and "
                               "pass grad as NULL or as the logits view");
      // Report each pair once, the output first.
      return invalid(arg.name, std::string("output memory overlaps ") +
                                   (other.isOutput ? "output " : "input ") +
                                   other.name +
                                   "; outputs must not share memory with "
                                   "any other tensor");
    }
  }

  for (const NamedTensor &arg : args) {
    int role = static_cast<int>(arg.role);
    plan.tensors[role] = *arg.tensor;
    plan.present[role] = true;
  }
  // A scalar weight is a per-token weight of stride 0: the kernels take
  // per-token weights only.
  if (plan.present[static_cast<int>(ArgRole::Weights)]) {
    ce_tensor &weights = plan.tensors[static_cast<int>(ArgRole::Weights)];
    if (weights.ndim == 0) {
      weights.ndim = plan.tokenRank;
      for (int i = 0; i < plan.tokenRank; ++i) {
        weights.sizes[i] = plan.tokenSizes[i];
        weights.strides[i] = 0;
      }
    }
  }
  // With one vocabulary entry only index 0 is read, so any stride is as good
  // as 1; kernels may assume the unit stride the ABI promises.
  if (plan.vocabSize == 1) {
    for (ArgRole role : {ArgRole::Logits, ArgRole::Grad}) {
      ce_tensor &tensor = plan.tensors[static_cast<int>(role)];
      if (plan.present[static_cast<int>(role)])
        tensor.strides[tensor.ndim - 1] = 1;
    }
  }
  return Status::ok();
}

} // namespace ce
