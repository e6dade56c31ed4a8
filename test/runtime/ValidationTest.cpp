//===- ValidationTest.cpp - Every validation rule, one mutation each ------===//
//
// Each case starts from a valid call, breaks one thing, and expects
// CE_ERROR_INVALID_ARGUMENT with a message naming the tensor or option and
// the problem, and no kernel call.
//
//===----------------------------------------------------------------------===//

#include "TestBundle.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <vector>

using namespace ce;
using namespace ce::test;
using ::testing::HasSubstr;

namespace {

constexpr int64_t N = 5, V = 7, S = 3, B = 4;

/// A valid call of any op, flat ([N, V]) or [S, B, V] with [B, S] labels,
/// whose tensors and options a case can change before running it.
struct Call {
  KernelOp op;
  bool sbv;
  ce_options options = defaultOptions();
  std::vector<float> logits, grad, loss, lse, gradLoss, weights, stats;
  std::vector<int64_t> labels;
  float weight = 1.0f;
  ce_tensor tLogits, tLabels, tLoss, tLse, tGradLoss, tWeights, tGrad, tStats;
  const ce_tensor *pLogits = &tLogits, *pLabels = &tLabels, *pLoss = &tLoss,
                  *pLse = &tLse, *pGradLoss = &tGradLoss, *pWeights = &tWeights,
                  *pGrad = &tGrad, *pStats = &tStats;

  Call(KernelOp op, bool sbv = false)
      : op(op), sbv(sbv), logits(N * V * 4, 0.5f), grad(N * V * 4), loss(N * 4),
        lse(N * 4), gradLoss(N * 4, 1.0f), weights(N * 4), stats(N * 16),
        labels(N * 4, 1) {
    if (op == KernelOp::ShardStats) {
      options.shard_start = 0;
      options.shard_vocab = 2 * V;
    }
    if (!sbv) {
      tLogits = packed(logits.data(), CE_DTYPE_F32, {N, V});
      tGrad = packed(grad.data(), CE_DTYPE_F32, {N, V});
      tLabels = packed(labels.data(), CE_DTYPE_I64, {N});
      tLoss = packed(loss.data(), CE_DTYPE_F32, {N});
      tLse = packed(lse.data(), CE_DTYPE_F32, {N});
      tGradLoss = packed(gradLoss.data(), CE_DTYPE_F32, {N});
      tStats = packed(stats.data(), CE_DTYPE_F32, {N, 4});
    } else {
      tLogits = packed(logits.data(), CE_DTYPE_F32, {S, B, V});
      tGrad = packed(grad.data(), CE_DTYPE_F32, {S, B, V});
      tLabels = packed(labels.data(), CE_DTYPE_I64, {B, S});
      tLoss = packed(loss.data(), CE_DTYPE_F32, {B, S});
      tLse = packed(lse.data(), CE_DTYPE_F32, {B, S});
      tGradLoss = packed(gradLoss.data(), CE_DTYPE_F32, {B, S});
      tStats = packed(stats.data(), CE_DTYPE_F32, {B, S, 4});
    }
    tWeights = view(&weight, CE_DTYPE_F32, {}, {});
  }
  Call(const Call &) = delete;

  ce_status run(ce_bundle *bundle) const {
    switch (op) {
    case KernelOp::Forward:
      return ce_forward(bundle, &options, pLogits, pLabels, pLoss, pLse,
                        nullptr);
    case KernelOp::Backward:
      return ce_backward(bundle, &options, pLogits, pLabels, pLse, pGradLoss,
                         pGrad, nullptr);
    case KernelOp::Fused:
      return ce_fused(bundle, &options, pLogits, pLabels, pWeights, pLoss, pLse,
                      pGrad, nullptr);
    case KernelOp::ShardStats:
      return ce_shard_stats(bundle, &options, pLogits, pLabels, pStats,
                            nullptr);
    case KernelOp::Rescale:
      return ce_rescale(bundle, &options, pLogits, pWeights, pGradLoss,
                        nullptr);
    }
    return CE_OK;
  }
};

struct Case {
  const char *name;
  KernelOp op;
  bool sbv;
  std::function<void(Call &)> mutate;
  const char *message;
};

KernelVariantKey keyFor(KernelOp op, LabelLayout layout, bool overwrite) {
  KernelVariantKey key = forwardKey(layout);
  key.op = op;
  key.overwrite = overwrite;
  if (op == KernelOp::Fused)
    key.weights = WeightsKind::Token;
  return key;
}

/// A bundle whose every kernel is a fake that records calls; the tests only
/// count calls, so any fake of the right arity will do.
std::vector<KernelSpec> validationKernels() {
  std::vector<KernelSpec> kernels;
  for (LabelLayout layout : {LabelLayout::Flat, LabelLayout::SbvBs}) {
    bool flat = layout == LabelLayout::Flat;
    kernels.push_back({keyFor(KernelOp::Forward, layout, false),
                       flat ? "fake_forward_flat" : "fake_forward_bs",
                       {}});
    kernels.push_back({keyFor(KernelOp::Backward, layout, false),
                       flat ? "fake_backward_flat" : "fake_backward_bs",
                       {}});
    KernelVariantKey stats = keyFor(KernelOp::ShardStats, layout, false);
    kernels.push_back(
        {stats, flat ? "fake_shard_stats_flat" : "fake_shard_stats_bs", {}});
    if (flat) {
      kernels.push_back({keyFor(KernelOp::Backward, layout, true),
                         "fake_backward_flat_overwrite",
                         {}});
      kernels.push_back({keyFor(KernelOp::Fused, layout, false),
                         "fake_fused_flat_token",
                         {}});
      kernels.push_back({keyFor(KernelOp::Fused, layout, true),
                         "fake_fused_flat_token_overwrite",
                         {}});
    }
  }
  return kernels;
}

constexpr KernelOp Fwd = KernelOp::Forward, Bwd = KernelOp::Backward,
                   Fus = KernelOp::Fused, Sta = KernelOp::ShardStats;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

const Case kCases[] = {
    // Options.
    {"smoothing one", Fwd, false,
     [](Call &c) { c.options.label_smoothing = 1.0f; },
     "options->label_smoothing: must be in [0, 1), got 1"},
    {"smoothing negative", Fwd, false,
     [](Call &c) { c.options.label_smoothing = -0.25f; },
     "options->label_smoothing: must be in [0, 1), got -0.25"},
    {"smoothing NaN", Fwd, false,
     [](Call &c) { c.options.label_smoothing = kNaN; },
     "options->label_smoothing"},
    {"z-loss negative", Fwd, false, [](Call &c) { c.options.z_loss = -1.0f; },
     "options->z_loss: must be finite and >= 0, got -1"},
    {"z-loss infinite", Bwd, false, [](Call &c) { c.options.z_loss = kInf; },
     "options->z_loss: must be finite and >= 0, got inf"},
    {"z-loss NaN", Fus, false, [](Call &c) { c.options.z_loss = kNaN; },
     "options->z_loss"},
    {"logit scale 0", Fwd, false, [](Call &c) { c.options.logit_scale = 0.0f; },
     "options->logit_scale: must be finite and > 0, got 0"},
    {"logit scale negative", Bwd, false,
     [](Call &c) { c.options.logit_scale = -2.0f; },
     "options->logit_scale: must be finite and > 0, got -2"},
    {"logit scale infinite", Fus, false,
     [](Call &c) { c.options.logit_scale = kInf; },
     "options->logit_scale: must be finite and > 0, got inf"},
    {"logit scale NaN", Fwd, false,
     [](Call &c) { c.options.logit_scale = kNaN; }, "options->logit_scale"},
    {"logit softcap negative", Fwd, false,
     [](Call &c) { c.options.logit_softcap = -30.0f; },
     "options->logit_softcap: must be 0 (no softcap) or finite and > 0 with "
     "logit_scale / logit_softcap finite, got -30"},
    {"logit softcap infinite", Bwd, false,
     [](Call &c) { c.options.logit_softcap = kInf; },
     "options->logit_softcap: must be 0 (no softcap) or finite and > 0"},
    {"logit softcap NaN", Fus, false,
     [](Call &c) { c.options.logit_softcap = kNaN; },
     "options->logit_softcap"},
    {"logit scale / softcap overflows", Fwd, false,
     [](Call &c) {
       c.options.logit_scale = 1.0e30f;
       c.options.logit_softcap = 1.0e-30f;
     },
     "options->logit_softcap: must be 0 (no softcap) or finite and > 0 with "
     "logit_scale / logit_softcap finite, got 1e-30"},
    {"label layout", Fwd, true,
     [](Call &c) { setRawEnum(c.options.label_layout, 7); },
     "options->label_layout: must be CE_LABELS_BS (0) or CE_LABELS_SB (1)"},

    // Presence.
    {"logits NULL", Fwd, false, [](Call &c) { c.pLogits = nullptr; },
     "logits: is NULL"},
    {"labels NULL", Bwd, false, [](Call &c) { c.pLabels = nullptr; },
     "labels: is NULL"},
    {"loss NULL", Fwd, false, [](Call &c) { c.pLoss = nullptr; },
     "loss: is NULL"},
    {"lse NULL", Bwd, false, [](Call &c) { c.pLse = nullptr; }, "lse: is NULL"},
    {"grad_loss NULL", Bwd, false, [](Call &c) { c.pGradLoss = nullptr; },
     "grad_loss: is NULL"},
    {"weights NULL", Fus, false, [](Call &c) { c.pWeights = nullptr; },
     "weights: is NULL"},
    {"grad NULL", Bwd, false, [](Call &c) { c.pGrad = nullptr; },
     "grad: is NULL; pass a gradient tensor, or set "
     "options->overwrite_input"},
    {"fused grad NULL", Fus, false, [](Call &c) { c.pGrad = nullptr; },
     "grad: is NULL"},

    // Ranks, sizes, data.
    {"logits ndim 1", Fwd, false, [](Call &c) { c.tLogits.ndim = 1; },
     "logits: ndim must be 2 ([N, V]) or 3 ([S, B, V]), got 1"},
    {"logits ndim 4", Fwd, false, [](Call &c) { c.tLogits.ndim = 4; },
     "logits: ndim must be in [0, 3], got 4"},
    {"negative size", Fwd, false, [](Call &c) { c.tLoss.sizes[0] = -1; },
     "loss: negative size in dimension 0"},
    {"NULL data", Fwd, false, [](Call &c) { c.tLabels.data = nullptr; },
     "labels: data is NULL but the tensor has 5 elements"},
    {"empty vocabulary", Fwd, false, [](Call &c) { c.tLogits.sizes[1] = 0; },
     "logits: vocabulary size (last dimension) is 0 for 5 tokens"},
    {"vocabulary past 2^27", Fwd, false,
     [](Call &c) { c.tLogits.sizes[1] = (int64_t(1) << 27) + 1; },
     "logits: vocabulary size (last dimension) 134217729 exceeds 2^27 = "
     "134217728"},
    {"too many elements", Fwd, false,
     [](Call &c) {
       c.tLogits.sizes[0] = int64_t(1) << 40;
       c.tLogits.sizes[1] = int64_t(1) << 40;
     },
     "logits: sizes [1099511627776, 1099511627776] hold more than 2^63 "
     "elements"},
    {"beyond the address space", Fwd, false,
     [](Call &c) { c.tLse.strides[0] = int64_t(1) << 62; },
     "lse: sizes [5] and strides [4611686018427387904] reach outside the "
     "address space"},

    // Dtypes.
    {"logits dtype", Fwd, false,
     [](Call &c) { c.tLogits.dtype = CE_DTYPE_I32; },
     "logits: dtype must be bf16, f16 or f32, got i32"},
    {"invalid dtype", Fwd, false,
     [](Call &c) { setRawEnum(c.tLogits.dtype, 99); },
     "logits: invalid dtype 99"},
    {"labels dtype", Fwd, false,
     [](Call &c) { c.tLabels.dtype = CE_DTYPE_F32; },
     "labels: dtype must be i32 or i64, got f32"},
    {"loss dtype", Fwd, false, [](Call &c) { c.tLoss.dtype = CE_DTYPE_F16; },
     "loss: dtype must be f32, got f16"},
    {"lse dtype", Bwd, false, [](Call &c) { c.tLse.dtype = CE_DTYPE_BF16; },
     "lse: dtype must be f32, got bf16"},
    {"grad_loss dtype", Bwd, false,
     [](Call &c) { c.tGradLoss.dtype = CE_DTYPE_I32; },
     "grad_loss: dtype must be f32, got i32"},
    {"weights dtype", Fus, false,
     [](Call &c) { c.tWeights.dtype = CE_DTYPE_F16; },
     "weights: dtype must be f32, got f16"},
    {"grad dtype", Bwd, false, [](Call &c) { c.tGrad.dtype = CE_DTYPE_BF16; },
     "grad: dtype must be the logits' dtype f32, got bf16"},

    // Shapes.
    {"labels shape", Fwd, false, [](Call &c) { c.tLabels.sizes[0] = N + 1; },
     "labels: expected the labels' shape [N] = [5], got [6]"},
    {"labels rank", Fwd, false,
     [](Call &c) {
       c.tLabels = packed(c.labels.data(), CE_DTYPE_I64, {N, 1});
     },
     "labels: expected the labels' shape [N] = [5], got [5, 1] (ndim 2)"},
    {"labels transposed", Fwd, true,
     [](Call &c) {
       c.tLabels = packed(c.labels.data(), CE_DTYPE_I64, {S, B});
     },
     "labels: expected the labels' shape [B, S] = [4, 3], got [3, 4]; for "
     "[S, B] labels set options->label_layout to CE_LABELS_SB"},
    {"loss shape", Fwd, true,
     [](Call &c) { c.tLoss = packed(c.loss.data(), CE_DTYPE_F32, {B * S}); },
     "loss: expected the labels' shape [B, S] = [4, 3], got [12] (ndim 1)"},
    {"lse shape", Fwd, false, [](Call &c) { c.tLse.sizes[0] = 2; },
     "lse: expected the labels' shape"},
    {"grad_loss shape", Bwd, false,
     [](Call &c) { c.tGradLoss.sizes[0] = N - 1; },
     "grad_loss: expected the labels' shape [N] = [5], got [4]"},
    {"weights shape", Fus, false,
     [](Call &c) {
       c.tWeights = packed(c.weights.data(), CE_DTYPE_F32, {N + 1});
     },
     "weights: must be a scalar (ndim 0) or have the labels' shape [N] = "
     "[5], got [6]"},
    {"grad shape", Bwd, false,
     [](Call &c) {
       c.tGrad = packed(c.grad.data(), CE_DTYPE_F32, {N, V + 1});
     },
     "grad: shape must be the logits' shape [5, 7], got [5, 8]"},

    // Strides.
    {"logits vocab stride", Fwd, false,
     [](Call &c) {
       c.tLogits = view(c.logits.data(), CE_DTYPE_F32, {N, V}, {2 * V, 2});
     },
     "logits: the vocabulary dimension must have stride 1, got strides "
     "[14, 2]"},
    {"grad vocab stride", Bwd, false,
     [](Call &c) {
       c.tGrad = view(c.grad.data(), CE_DTYPE_F32, {N, V}, {1, N});
     },
     "grad: the vocabulary dimension must have stride 1"},
    {"broadcast output", Fwd, false, [](Call &c) { c.tLoss.strides[0] = 0; },
     "loss: stride 0 in dimension 0 (size 5): an output cannot be a "
     "broadcast view"},
    {"broadcast grad rows", Bwd, false, [](Call &c) { c.tGrad.strides[0] = 0; },
     "grad: stride 0 in dimension 0 (size 5)"},
    {"self-overlapping grad", Bwd, false,
     [](Call &c) { c.tGrad.strides[0] = 2; },
     "grad: strides [2, 1] make elements of sizes [5, 7] overlap: an output "
     "must not overlap itself"},
    {"self-overlapping loss", Fwd, true,
     [](Call &c) {
       c.tLoss.strides[0] = 1;
       c.tLoss.strides[1] = 1;
     },
     "loss: strides [1, 1] make elements of sizes [4, 3] overlap"},

    // Overlap between tensors.
    {"loss is lse", Fwd, false, [](Call &c) { c.tLse.data = c.loss.data(); },
     "loss: output memory overlaps output lse"},
    {"loss inside labels", Fwd, false,
     [](Call &c) { c.tLoss.data = c.labels.data() + 2; },
     "loss: output memory overlaps input labels; outputs must not share "
     "memory with any other tensor"},
    {"lse inside logits", Fus, false,
     [](Call &c) { c.tLse.data = c.logits.data() + V * N - 1; },
     "lse: output memory overlaps input logits"},
    {"grad over grad_loss", Bwd, false,
     [](Call &c) { c.tGradLoss.data = c.grad.data() + 3; },
     "grad: output memory overlaps input grad_loss"},
    {"grad is logits", Bwd, false, [](Call &c) { c.pGrad = &c.tLogits; },
     "grad: overlaps logits; to write the gradient over the logits set "
     "options->overwrite_input and pass grad as NULL or as the logits view"},
    {"grad partly on logits", Fus, false,
     [](Call &c) { c.tGrad.data = c.logits.data() + V; },
     "grad: overlaps logits"},

    // Overwrite.
    {"overwrite with another grad", Bwd, false,
     [](Call &c) { c.options.overwrite_input = 1; },
     "grad: with options->overwrite_input the gradient is written over the "
     "logits, so grad must be NULL or exactly the logits view"},
    {"overwrite with a shifted view", Fus, false,
     [](Call &c) {
       c.options.overwrite_input = 1;
       c.tGrad = c.tLogits;
       c.tGrad.strides[0] = V + 1;
     },
     "grad must be NULL or exactly the logits view"},
    {"overwrite broadcast logits", Bwd, false,
     [](Call &c) {
       c.options.overwrite_input = 1;
       c.pGrad = nullptr;
       c.tLogits.strides[0] = 0;
     },
     "logits: stride 0 in dimension 0 (size 5): with "
     "options->overwrite_input the logits are written, so they cannot be a "
     "broadcast view"},
    {"overwrite logits over lse", Bwd, false,
     [](Call &c) {
       c.options.overwrite_input = 1;
       c.pGrad = nullptr;
       c.tLse.data = c.logits.data() + 1;
     },
     "logits: output memory overlaps input lse"},

    // Vocabulary shards.
    {"shard stats without a shard", Sta, false,
     [](Call &c) { c.options.shard_vocab = 0; },
     "options->shard_vocab: ce_shard_stats needs a shard (shard_vocab > 0)"},
    {"negative shard vocab", Bwd, false,
     [](Call &c) { c.options.shard_vocab = -1; },
     "options->shard_vocab: must be 0 (no shard) or the global vocabulary "
     "size, got -1"},
    {"shard start past the vocabulary", Sta, false,
     [](Call &c) { c.options.shard_start = 2 * V; },
     "options->shard_start: must be in [0, shard_vocab = 14), got 14"},
    {"slice past the vocabulary", Sta, false,
     [](Call &c) { c.options.shard_start = V + 1; },
     "logits: the slice [8, 8 + 7) exceeds the vocabulary of "
     "options->shard_vocab = 14"},
    {"sharded forward", Fwd, false,
     [](Call &c) { c.options.shard_vocab = 2 * V; },
     "options->shard_vocab: a vocabulary slice has no forward kernel"},
    {"sharded fused", Fus, false,
     [](Call &c) { c.options.shard_vocab = 2 * V; },
     "options->shard_vocab: a vocabulary slice has no fused kernel"},
    {"shard stats with z-loss", Sta, false,
     [](Call &c) { c.options.z_loss = 1e-4f; },
     "options->z_loss: must be 0 for ce_shard_stats"},
    {"shard stats of the wrong shape", Sta, false,
     [](Call &c) { c.tStats.sizes[1] = 3; },
     "stats: must have the labels' shape [N] = [5] followed by 4, got [5, 3]"},
    {"shard stats of the wrong dtype", Sta, true,
     [](Call &c) { c.tStats.dtype = CE_DTYPE_BF16; },
     "stats: dtype must be f32"},
    {"shard stats over the labels", Sta, false,
     [](Call &c) { c.tStats.data = c.labels.data(); },
     "stats: output memory overlaps input labels"},
    {"shard stats NULL", Sta, false, [](Call &c) { c.pStats = nullptr; },
     "stats: is NULL"},

    // Devices.
    {"mixed devices", Fwd, false,
     [](Call &c) { c.tLabels.device = CE_DEVICE_CUDA; },
     "labels: is on CUDA device 0 but logits are on host device 0; all "
     "tensors must be on the same device"},
    {"mixed device indices", Fwd, false,
     [](Call &c) {
       for (ce_tensor *t : {&c.tLogits, &c.tLabels, &c.tLoss, &c.tLse})
         t->device = CE_DEVICE_HIP;
       c.tLse.device_index = 1;
     },
     "lse: is on HIP device 1 but logits are on HIP device 0"},
    {"invalid device", Fwd, false,
     [](Call &c) { setRawEnum(c.tLoss.device, 9); },
     "loss: invalid device type 9"},
};

class Validation : public ::testing::TestWithParam<Case> {};

TEST_P(Validation, RejectsWithoutLaunching) {
  const Case &test = GetParam();
  FakeBundle bundle(validationKernels());
  Call call(test.op, test.sbv);
  ASSERT_EQ(call.run(bundle.get()), CE_OK)
      << "the unmodified call must succeed: " << ce_last_error_message();
  int64_t calls = bundle.calls();
  Call broken(test.op, test.sbv);
  test.mutate(broken);
  EXPECT_EQ(broken.run(bundle.get()), CE_ERROR_INVALID_ARGUMENT)
      << ce_last_error_message();
  EXPECT_THAT(ce_last_error_message(), HasSubstr(test.message));
  EXPECT_EQ(bundle.calls(), calls) << "a rejected call launched a kernel";
}

INSTANTIATE_TEST_SUITE_P(AllRules, Validation, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<Case> &info) {
                           std::string name;
                           for (const char *c = info.param.name; *c; ++c)
                             name +=
                                 std::isalnum(static_cast<unsigned char>(*c))
                                     ? *c
                                     : '_';
                           return name;
                         });

TEST(ValidationAccepts, BroadcastAndStridedInputs) {
  FakeBundle bundle(validationKernels());
  Call call(KernelOp::Backward);
  float upstream = 2.0f;
  call.tGradLoss = view(&upstream, CE_DTYPE_F32, {N}, {0});
  // Labels and lse read with gaps; grad rows padded.
  call.tLabels = view(call.labels.data(), CE_DTYPE_I64, {N}, {3});
  call.tLse = view(call.lse.data(), CE_DTYPE_F32, {N}, {2});
  call.tGrad = view(call.grad.data(), CE_DTYPE_F32, {N, V}, {V + 2, 1});
  EXPECT_EQ(call.run(bundle.get()), CE_OK) << ce_last_error_message();
  // Inputs may overlap each other: lse and grad_loss share memory.
  call.tGradLoss = call.tLse;
  EXPECT_EQ(call.run(bundle.get()), CE_OK) << ce_last_error_message();
}

TEST(ValidationAccepts, OverwriteWithTheLogitsView) {
  FakeBundle bundle(validationKernels());
  for (KernelOp op : {KernelOp::Backward, KernelOp::Fused}) {
    Call call(op);
    call.options.overwrite_input = 1;
    call.pGrad = &call.tLogits;
    EXPECT_EQ(call.run(bundle.get()), CE_OK) << ce_last_error_message();
    call.pGrad = nullptr;
    EXPECT_EQ(call.run(bundle.get()), CE_OK) << ce_last_error_message();
  }
}

TEST(ValidationAccepts, NegativeStrides) {
  FakeBundle bundle(validationKernels());
  Call call(KernelOp::Forward);
  // Rows in reverse order: the view starts at the last row.
  call.tLogits =
      view(call.logits.data() + (N - 1) * V, CE_DTYPE_F32, {N, V}, {-V, 1});
  call.tLoss = view(call.loss.data() + N - 1, CE_DTYPE_F32, {N}, {-1});
  EXPECT_EQ(call.run(bundle.get()), CE_OK) << ce_last_error_message();
  EXPECT_EQ(bundle.record().strides[0][0], -V);
}

} // namespace
