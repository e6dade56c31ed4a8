//===- LaunchTest.cpp - Launching fake kernels through the C API ----------===//
//
// The fake kernels (fake_kernels.c) record the descriptors they receive and
// write outputs that depend on the inputs through their strides, so these
// tests see exactly what crossed the ABI: pointers, offsets, sizes, strides
// and argument order, the option values passed by value after the
// descriptors (bundle format version 3), the token-to-row mapping of each
// layout, the status word, and the empty-batch and device rules.
//
//===----------------------------------------------------------------------===//

#include "TestBundle.h"

#include "ce/runtime/BundleAbi.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

using namespace ce;
using namespace ce::test;
using ::testing::HasSubstr;

extern "C" ce_status
ce_test_check_label_status_raw(int32_t device, int32_t index, int32_t wait);

namespace {

constexpr float kPoison = -7.0f;

KernelVariantKey makeKey(KernelOp op, LabelLayout layout,
                         WeightsKind weights = WeightsKind::None,
                         bool overwrite = false) {
  KernelVariantKey key = forwardKey(layout);
  key.op = op;
  key.weights = weights;
  key.overwrite = overwrite;
  return key;
}

/// `key` with smoothing and z-loss on or off.
KernelVariantKey withTerms(KernelVariantKey key, bool smoothing, bool zLoss) {
  key.smoothing = smoothing;
  key.zLoss = zLoss;
  return key;
}

/// Every fake variant the launch tests use.
std::vector<KernelSpec> allFakeKernels() {
  KernelVariantKey i32 = forwardKey();
  i32.labels = ElemType::I32;
  return {
      {forwardKey(), "fake_forward_flat", {}},
      {i32, "fake_forward_flat_i32", {}},
      {withTerms(forwardKey(), true, true), "fake_forward_flat", {}},
      {forwardKey(LabelLayout::SbvBs), "fake_forward_bs", {}},
      {forwardKey(LabelLayout::SbvSb), "fake_forward_sb", {}},
      {makeKey(KernelOp::Backward, LabelLayout::Flat),
       "fake_backward_flat",
       {}},
      {makeKey(KernelOp::Backward, LabelLayout::SbvBs), "fake_backward_bs", {}},
      {makeKey(KernelOp::Backward, LabelLayout::Flat, WeightsKind::None, true),
       "fake_backward_flat_overwrite",
       {}},
      {makeKey(KernelOp::Fused, LabelLayout::Flat, WeightsKind::Token),
       "fake_fused_flat_token",
       {}},
      {makeKey(KernelOp::Fused, LabelLayout::SbvSb, WeightsKind::Token),
       "fake_fused_sb_token",
       {}},
      {makeKey(KernelOp::Fused, LabelLayout::Flat, WeightsKind::Token, true),
       "fake_fused_flat_token_overwrite",
       {}},
  };
}

/// A flat problem: logits [N, V] with padded rows, labels with stride 3,
/// loss with stride 2, lse packed. x[n][j] = 100 n + j.
struct FlatProblem {
  int64_t n, v, rowStride;
  std::vector<float> logits, loss, lse, grad;
  std::vector<int64_t> labels;
  ce_tensor tLogits, tLabels, tLoss, tLse, tGrad;

  FlatProblem(int64_t n = 5, int64_t v = 7)
      : n(n), v(v), rowStride(v + 3), logits(n * rowStride + 1, kPoison),
        loss(2 * n + 1, kPoison), lse(n + 1, kPoison),
        grad(n * rowStride + 1, kPoison), labels(3 * n + 1, -1) {
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < v; ++j)
        logits[i * rowStride + j] = static_cast<float>(100 * i + j);
      labels[3 * i] = (2 * i + 1) % v;
    }
    tLogits = view(logits.data(), CE_DTYPE_F32, {n, v}, {rowStride, 1});
    tLabels = view(labels.data(), CE_DTYPE_I64, {n}, {3});
    tLoss = view(loss.data(), CE_DTYPE_F32, {n}, {2});
    tLse = packed(lse.data(), CE_DTYPE_F32, {n});
    tGrad = view(grad.data(), CE_DTYPE_F32, {n, v}, {rowStride, 1});
  }
  int64_t label(int64_t i) const { return labels[3 * i]; }
  float target(int64_t i) const { return logits[i * rowStride + label(i)]; }
};

TEST(Launch, ForwardFlatPassesDescriptors) {
  FakeBundle bundle(allFakeKernels());
  FlatProblem p;
  ce_options options = defaultOptions();
  ASSERT_EQ(ce_forward(bundle.get(), &options, &p.tLogits, &p.tLabels, &p.tLoss,
                       &p.tLse, nullptr),
            CE_OK)
      << ce_last_error_message();
  EXPECT_STREQ(ce_last_error_message(), "");

  const FakeRecord &r = bundle.record();
  ASSERT_EQ(r.calls, 1);
  ASSERT_EQ(r.numArgs, 8);
  // Without options->lse_low, entropy and argmax their arguments are the
  // lse's own view, and flag bits 3 to 5 are off: the kernel neither writes
  // nor reads them.
  void *data[] = {p.logits.data(), p.labels.data(), p.loss.data(), p.lse.data(),
                  p.lse.data(),    p.lse.data(),    p.lse.data()};
  int ranks[] = {2, 1, 1, 1, 1, 1, 1, 1};
  for (int a = 0; a < 8; ++a) {
    SCOPED_TRACE(a);
    EXPECT_EQ(r.ranks[a], ranks[a]);
    EXPECT_EQ(r.offsets[a], 0);
    EXPECT_EQ(r.allocated[a], r.aligned[a]);
    if (a < 7) {
      EXPECT_EQ(r.aligned[a], data[a]);
    }
  }
  EXPECT_EQ(r.flags & (kFlagLseLow | kFlagEntropy | kFlagArgmax), 0);
  EXPECT_EQ(r.sizes[0][0], p.n);
  EXPECT_EQ(r.sizes[0][1], p.v);
  EXPECT_EQ(r.strides[0][0], p.rowStride);
  EXPECT_EQ(r.strides[0][1], 1);
  EXPECT_EQ(r.sizes[1][0], p.n);
  EXPECT_EQ(r.strides[1][0], 3);
  EXPECT_EQ(r.strides[2][0], 2);
  EXPECT_EQ(r.strides[3][0], 1);
  EXPECT_EQ(r.strides[4][0], 1);
  EXPECT_EQ(r.strides[5][0], 1);
  EXPECT_EQ(r.strides[6][0], 1);
  EXPECT_EQ(r.sizes[7][0], 1);   // status
  EXPECT_EQ(r.strides[7][0], 1); // status
  EXPECT_EQ(r.statusOnEntry, 0); // the runtime zeroes it

  for (int64_t i = 0; i < p.n; ++i) {
    EXPECT_EQ(p.loss[2 * i], 1.5f);
    EXPECT_EQ(p.loss[2 * i + 1], kPoison); // between strided elements
    EXPECT_EQ(p.lse[i], 2.5f + p.target(i));
  }
  EXPECT_EQ(p.lse[p.n], kPoison);
}

TEST(Launch, LseLowIsWrittenAndReadWhereItIsGiven) {
  // With options->lse_low the forward and the fused kernels write lse's low
  // part there (flag bit 3 on), and the backward reads it; one options
  // struct serves a whole step, so shard_stats ignores it.
  FakeBundle bundle(allFakeKernels());
  FlatProblem p;
  std::vector<float> low(2 * p.n + 1, kPoison);
  ce_tensor tLow = view(low.data(), CE_DTYPE_F32, {p.n}, {2});
  ce_options options = defaultOptions();
  options.lse_low = &tLow;
  ASSERT_EQ(ce_forward(bundle.get(), &options, &p.tLogits, &p.tLabels,
                       &p.tLoss, &p.tLse, nullptr),
            CE_OK)
      << ce_last_error_message();
  const FakeRecord &r = bundle.record();
  ASSERT_EQ(r.numArgs, 8);
  EXPECT_EQ(r.aligned[4], low.data());
  EXPECT_EQ(r.strides[4][0], 2);
  EXPECT_EQ(r.flags & kFlagLseLow, kFlagLseLow);
  EXPECT_EQ(int64_t{kFlagLseLow}, 8); // the ABI's bit
  for (int64_t i = 0; i < p.n; ++i) {
    EXPECT_EQ(low[2 * i], 0.125f + i);
    EXPECT_EQ(low[2 * i + 1], kPoison); // between strided elements
  }

  // The backward reads it: the fake adds it to its gradient.
  std::vector<float> gradLoss(p.n, 2.0f);
  ce_tensor tGradLoss = packed(gradLoss.data(), CE_DTYPE_F32, {p.n});
  ASSERT_EQ(ce_backward(bundle.get(), &options, &p.tLogits, &p.tLabels,
                        &p.tLse, &tGradLoss, &p.tGrad, nullptr),
            CE_OK)
      << ce_last_error_message();
  ASSERT_EQ(r.numArgs, 7);
  EXPECT_EQ(r.aligned[3], low.data());
  for (int64_t i = 0; i < p.n; ++i)
    EXPECT_EQ(p.grad[i * p.rowStride], 1.0f + p.lse[i] + 0.125f + i);

  // The fused kernel writes it too.
  std::fill(low.begin(), low.end(), kPoison);
  float weight = 1.0f;
  ce_tensor tWeight = view(&weight, CE_DTYPE_F32, {}, {});
  ASSERT_EQ(ce_fused(bundle.get(), &options, &p.tLogits, &p.tLabels, &tWeight,
                     &p.tLoss, &p.tLse, &p.tGrad, nullptr),
            CE_OK)
      << ce_last_error_message();
  ASSERT_EQ(r.numArgs, 10);
  EXPECT_EQ(r.aligned[5], low.data());
  EXPECT_EQ(low[2 * (p.n - 1)], 0.125f + (p.n - 1));

  // shard_stats does not take it.
  KernelVariantKey stats = forwardKey();
  stats.op = KernelOp::ShardStats;
  FakeBundle statsBundle({{stats, "fake_shard_stats_flat", {}}});
  options.shard_start = 0;
  options.shard_vocab = 2 * p.v;
  std::vector<float> statsOut(p.n * 4);
  ce_tensor tStats = packed(statsOut.data(), CE_DTYPE_F32, {p.n, 4});
  ASSERT_EQ(ce_shard_stats(statsBundle.get(), &options, &p.tLogits,
                           &p.tLabels, &tStats, nullptr),
            CE_OK)
      << ce_last_error_message();
  EXPECT_EQ(statsBundle.record().numArgs, 6);
  EXPECT_EQ(statsBundle.record().flags & kFlagLseLow, 0);
}

TEST(Launch, LseLowIsCheckedLikeTheLse) {
  FakeBundle bundle(allFakeKernels());
  FlatProblem p;
  ce_options options = defaultOptions();
  // The lse's own buffer: an output twice.
  options.lse_low = &p.tLse;
  EXPECT_EQ(ce_forward(bundle.get(), &options, &p.tLogits, &p.tLabels,
                       &p.tLoss, &p.tLse, nullptr),
            CE_ERROR_INVALID_ARGUMENT);
  EXPECT_THAT(ce_last_error_message(), HasSubstr("options->lse_low"));
  // Another dtype, another shape.
  std::vector<int64_t> wide(p.n);
  ce_tensor tWide = packed(wide.data(), CE_DTYPE_I64, {p.n});
  options.lse_low = &tWide;
  EXPECT_EQ(ce_forward(bundle.get(), &options, &p.tLogits, &p.tLabels,
                       &p.tLoss, &p.tLse, nullptr),
            CE_ERROR_INVALID_ARGUMENT);
  EXPECT_THAT(ce_last_error_message(), HasSubstr("options->lse_low"));
  std::vector<float> shortLow(p.n - 1);
  ce_tensor tShort = packed(shortLow.data(), CE_DTYPE_F32, {p.n - 1});
  options.lse_low = &tShort;
  EXPECT_EQ(ce_forward(bundle.get(), &options, &p.tLogits, &p.tLabels,
                       &p.tLoss, &p.tLse, nullptr),
            CE_ERROR_INVALID_ARGUMENT);
  EXPECT_THAT(ce_last_error_message(), HasSubstr("options->lse_low"));
  EXPECT_EQ(bundle.calls(), 0);
}

/// The value arguments the fake kernels of `bundle` received last.
KernelValues receivedValues(const FakeBundle &bundle) {
  const FakeRecord &r = bundle.record();
  return {r.flags,      r.ignoreIndex, r.labelSmoothing, r.zLoss,
          r.shardStart, r.shardVocab,  r.logitScale,     r.logitSoftcap};
}

void expectValues(const KernelValues &got, const KernelValues &want) {
  EXPECT_EQ(got.flags, want.flags);
  EXPECT_EQ(got.ignoreIndex, want.ignoreIndex);
  EXPECT_EQ(got.labelSmoothing, want.labelSmoothing);
  EXPECT_EQ(got.zLoss, want.zLoss);
  EXPECT_EQ(got.shardStart, want.shardStart);
  EXPECT_EQ(got.shardVocab, want.shardVocab);
  EXPECT_EQ(got.logitScale, want.logitScale);
  EXPECT_EQ(got.logitSoftcap, want.logitSoftcap);
}

TEST(Launch, OptionValuesArePassedByValue) {
  // Every value distinct, so that two values swapped, dropped or passed in
  // the wrong type (a float as a double, an i64 as an i32) show.
  FakeBundle bundle(allFakeKernels());
  FlatProblem p;
  ce_options options = defaultOptions();
  options.has_ignore_index = 1;
  options.ignore_index = -7;
  options.label_smoothing = 0.125f;
  options.z_loss = 3.0e-4f;
  options.logit_scale = 2.75f;
  options.label_policy = CE_LABEL_POLICY_MEGATRON;
  ASSERT_EQ(ce_forward(bundle.get(), &options, &p.tLogits, &p.tLabels, &p.tLoss,
                       &p.tLse, nullptr),
            CE_OK)
      << ce_last_error_message();
  EXPECT_EQ(bundle.record().numArgs, 8); // the descriptors
  // Unsharded, every kernel is passed the slice [0, V) of V.
  expectValues(receivedValues(bundle), {kFlagMegatronLabels | kFlagIgnoreIndex,
                                        -7, 0.125f, 3.0e-4f, 0, p.v, 2.75f});
  options.logit_scale = 1.0f;
  EXPECT_EQ(p.lse[0], 2.5f + p.target(0)); // the descriptors still line up

  // Each flag on its own; without an ignore_index its bit is off (its
  // value is then not read, and not checked here).
  options.label_policy = CE_LABEL_POLICY_STRICT;
  ASSERT_EQ(ce_forward(bundle.get(), &options, &p.tLogits, &p.tLabels, &p.tLoss,
                       &p.tLse, nullptr),
            CE_OK)
      << ce_last_error_message();
  EXPECT_EQ(bundle.record().flags, int64_t{kFlagIgnoreIndex});
  EXPECT_EQ(bundle.record().ignoreIndex, -7);
  options.has_ignore_index = 0;
  options.label_policy = CE_LABEL_POLICY_MEGATRON;
  ASSERT_EQ(ce_forward(bundle.get(), &options, &p.tLogits, &p.tLabels, &p.tLoss,
                       &p.tLse, nullptr),
            CE_OK)
      << ce_last_error_message();
  EXPECT_EQ(bundle.record().flags, int64_t{kFlagMegatronLabels});
  EXPECT_EQ(bundle.record().labelSmoothing, 0.125f);
  EXPECT_EQ(bundle.record().zLoss, 3.0e-4f);
  // The defaults: every value 0 but the slice, [0, V) of V, and the logit
  // scale 1 (KernelValues' default).
  ASSERT_EQ(ce_forward(bundle.get(), nullptr, &p.tLogits, &p.tLabels, &p.tLoss,
                       &p.tLse, nullptr),
            CE_OK)
      << ce_last_error_message();
  expectValues(receivedValues(bundle), {0, 0, 0.0f, 0.0f, 0, p.v});
}

TEST(Launch, AnUnshardedBackwardIsTheSliceZeroToV) {
  // Every backward kernel takes a vocabulary slice; without a shard the
  // runtime passes [0, V) of V (not a vocabulary of 0), and no global
  // smoothing flag.
  FakeBundle bundle(
      {{makeKey(KernelOp::Backward, LabelLayout::Flat), "fake_backward_flat", {}},
       {withTerms(makeKey(KernelOp::Backward, LabelLayout::Flat), true, false),
        "fake_backward_flat",
        {}},
       {makeKey(KernelOp::Backward, LabelLayout::Flat, WeightsKind::None, true),
        "fake_backward_flat_overwrite",
        {}}});
  FlatProblem p;
  std::vector<float> gradLoss(p.n, 1.0f);
  ce_tensor tGradLoss = packed(gradLoss.data(), CE_DTYPE_F32, {p.n});
  ce_options options = defaultOptions();
  options.label_smoothing = 0.25f;
  options.shard_global_smoothing = 1; // no shard: not in force
  ASSERT_EQ(ce_backward(bundle.get(), &options, &p.tLogits, &p.tLabels,
                        &p.tLse, &tGradLoss, &p.tGrad, nullptr),
            CE_OK)
      << ce_last_error_message();
  EXPECT_EQ(bundle.record().numArgs, 7);
  expectValues(receivedValues(bundle), {0, 0, 0.25f, 0.0f, 0, p.v});
  // The defaults, and the overwrite kernel, alike.
  ASSERT_EQ(ce_backward(bundle.get(), nullptr, &p.tLogits, &p.tLabels,
                        &p.tLse, &tGradLoss, &p.tGrad, nullptr),
            CE_OK)
      << ce_last_error_message();
  expectValues(receivedValues(bundle), {0, 0, 0.0f, 0.0f, 0, p.v});
  options = defaultOptions();
  options.overwrite_input = 1;
  FlatProblem q(p.n, 11);
  ASSERT_EQ(ce_backward(bundle.get(), &options, &q.tLogits, &q.tLabels,
                        &q.tLse, &tGradLoss, nullptr, nullptr),
            CE_OK)
      << ce_last_error_message();
  EXPECT_EQ(bundle.record().numArgs, 6);
  expectValues(receivedValues(bundle), {0, 0, 0.0f, 0.0f, 0, 11});
}

TEST(Launch, ShardBoundsArePassedByValue) {
  // A slice [3, 3 + V) of a vocabulary of 40 with global smoothing: the
  // backward and shard_stats kernels get the bounds as values and the
  // global smoothing as flag bit 2 (keys carry no shard).
  KernelVariantKey backward = makeKey(KernelOp::Backward, LabelLayout::Flat);
  backward.smoothing = true;
  KernelVariantKey stats = forwardKey();
  stats.op = KernelOp::ShardStats;
  stats.smoothing = true;
  FakeBundle bundle({{backward, "fake_backward_flat", {}},
                     {stats, "fake_shard_stats_flat", {}}});
  FlatProblem p;
  ce_options options = defaultOptions();
  options.has_ignore_index = 1;
  options.ignore_index = -100;
  options.label_smoothing = 0.25f;
  options.shard_start = 3;
  options.shard_vocab = 40;
  options.shard_global_smoothing = 1;
  std::vector<float> gradLoss(p.n, 1.0f);
  ce_tensor tGradLoss = packed(gradLoss.data(), CE_DTYPE_F32, {p.n});
  ASSERT_EQ(ce_backward(bundle.get(), &options, &p.tLogits, &p.tLabels, &p.tLse,
                        &tGradLoss, &p.tGrad, nullptr),
            CE_OK)
      << ce_last_error_message();
  EXPECT_EQ(bundle.record().numArgs, 7);
  expectValues(receivedValues(bundle),
               {kFlagIgnoreIndex | kFlagGlobalSmoothing, -100, 0.25f, 0.0f, 3,
                40});
  EXPECT_EQ(int64_t{kFlagGlobalSmoothing}, 4); // the ABI's bit

  // Megatron's local smoothing: the same kernel, without the bit.
  options.shard_global_smoothing = 0;
  ASSERT_EQ(ce_backward(bundle.get(), &options, &p.tLogits, &p.tLabels, &p.tLse,
                        &tGradLoss, &p.tGrad, nullptr),
            CE_OK)
      << ce_last_error_message();
  expectValues(receivedValues(bundle),
               {kFlagIgnoreIndex, -100, 0.25f, 0.0f, 3, 40});
  options.shard_global_smoothing = 1;

  std::vector<float> statsOut(p.n * 4);
  ce_tensor tStats = packed(statsOut.data(), CE_DTYPE_F32, {p.n, 4});
  options.shard_start = 7;
  ASSERT_EQ(ce_shard_stats(bundle.get(), &options, &p.tLogits, &p.tLabels,
                           &tStats, nullptr),
            CE_OK)
      << ce_last_error_message();
  EXPECT_EQ(bundle.record().numArgs, 6);
  expectValues(receivedValues(bundle),
               {kFlagIgnoreIndex | kFlagGlobalSmoothing, -100, 0.25f, 0.0f, 7,
                40});
  EXPECT_EQ(bundle.record().aligned[2], statsOut.data());
}

TEST(Launch, TheKernelHonorsTheValuesItIsGiven) {
  // End to end through the fake's label rules: a label equal to the
  // request's ignore_index is ignored (loss 0, no report) only with that
  // value; under Megatron's policy an out-of-range label is not reported.
  FakeBundle bundle(allFakeKernels());
  ce_options options = defaultOptions();
  options.has_ignore_index = 1;
  options.ignore_index = -7;
  FlatProblem p;
  p.labels[3 * 2] = -7;
  ASSERT_EQ(ce_forward(bundle.get(), &options, &p.tLogits, &p.tLabels, &p.tLoss,
                       &p.tLse, nullptr),
            CE_OK)
      << ce_last_error_message();
  EXPECT_EQ(p.loss[2 * 2], 0.0f);
  EXPECT_EQ(p.loss[2 * 1], 1.5f);
  options.ignore_index = -8;
  EXPECT_EQ(ce_forward(bundle.get(), &options, &p.tLogits, &p.tLabels, &p.tLoss,
                       &p.tLse, nullptr),
            CE_ERROR_LABEL_OUT_OF_RANGE);
  EXPECT_THAT(ce_last_error_message(),
              HasSubstr("token 2 (n=2): label -7 is not in [0, 7) and is not "
                        "the ignore_index -8"));
  options.label_policy = CE_LABEL_POLICY_MEGATRON;
  EXPECT_EQ(ce_forward(bundle.get(), &options, &p.tLogits, &p.tLabels, &p.tLoss,
                       &p.tLse, nullptr),
            CE_OK)
      << ce_last_error_message();
  EXPECT_EQ(p.loss[2 * 2], 1.5f);
}

TEST(Launch, AZeroCoefficientIsServedByAKernelThatComputesTheTerm) {
  // A kernel with smoothing or z-loss "on" computes the plain loss for a
  // coefficient of 0, so the runtime falls back to it when the bundle lacks
  // the "off" kernel; it prefers the request's own variant. The "on" kernel
  // here reports a status that names no token, so taking it shows.
  FlatProblem p;
  KernelVariantKey off = forwardKey();
  KernelVariantKey on = withTerms(forwardKey(), true, true);
  KernelVariantKey smoothingOnly = withTerms(forwardKey(), true, false);
  ce_options zeros = defaultOptions();
  ce_options smoothing = defaultOptions();
  smoothing.label_smoothing = 0.1f;
  ce_options zLoss = defaultOptions();
  zLoss.z_loss = 1e-4f;
  {
    FakeBundle bundle({{off, "fake_forward_flat", {}},
                       {on, "fake_forward_flat_bad_status", {}}});
    EXPECT_EQ(ce_forward(bundle.get(), &zeros, &p.tLogits, &p.tLabels, &p.tLoss,
                         &p.tLse, nullptr),
              CE_OK)
        << ce_last_error_message();
    ce_options both = smoothing;
    both.z_loss = 1e-4f;
    EXPECT_EQ(ce_forward(bundle.get(), &both, &p.tLogits, &p.tLabels, &p.tLoss,
                         &p.tLse, nullptr),
              CE_ERROR_BACKEND);
    EXPECT_THAT(ce_last_error_message(), HasSubstr("names no token"));
  }
  {
    FakeBundle bundle({{on, "fake_forward_flat", {}}});
    for (const ce_options *options : {&zeros, &smoothing, &zLoss}) {
      EXPECT_EQ(ce_forward(bundle.get(), options, &p.tLogits, &p.tLabels,
                           &p.tLoss, &p.tLse, nullptr),
                CE_OK)
          << ce_last_error_message();
      expectValues(receivedValues(bundle),
                   {0, 0, options->label_smoothing, options->z_loss, 0, p.v});
    }
  }
  {
    // No kernel with z-loss: a non-zero z_loss is not served.
    FakeBundle bundle({{smoothingOnly, "fake_forward_flat", {}}});
    EXPECT_EQ(ce_forward(bundle.get(), &zeros, &p.tLogits, &p.tLabels, &p.tLoss,
                         &p.tLse, nullptr),
              CE_OK)
        << ce_last_error_message();
    EXPECT_EQ(ce_forward(bundle.get(), &zLoss, &p.tLogits, &p.tLabels, &p.tLoss,
                         &p.tLse, nullptr),
              CE_ERROR_VARIANT_NOT_FOUND);
    EXPECT_THAT(
        ce_last_error_message(),
        HasSubstr("\"" + withTerms(forwardKey(), false, true).str() + "\""));
  }
}

TEST(Launch, UnknownLabelPolicyIsAnError) {
  FakeBundle bundle(allFakeKernels());
  FlatProblem p;
  ce_options options = defaultOptions();
  setRawEnum(options.label_policy, 2);
  EXPECT_EQ(ce_forward(bundle.get(), &options, &p.tLogits, &p.tLabels, &p.tLoss,
                       &p.tLse, nullptr),
            CE_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ce_last_error_message())
                .find("options->label_policy: must be CE_LABEL_POLICY_STRICT"),
            std::string::npos)
      << ce_last_error_message();
  EXPECT_EQ(bundle.calls(), 0);
}

TEST(Launch, NullOptionsMeanDefaults) {
  FakeBundle bundle(allFakeKernels());
  FlatProblem p;
  EXPECT_EQ(ce_forward(bundle.get(), nullptr, &p.tLogits, &p.tLabels, &p.tLoss,
                       &p.tLse, nullptr),
            CE_OK)
      << ce_last_error_message();
}

TEST(Launch, ArgumentsInAnotherOrderAreRefusedAtOpen) {
  // The runtime calls a kernel with its tensors, then the values, in the
  // ABI's order; a manifest that lists another order cannot be honored (the
  // C signature is fixed), so the bundle does not open, and no kernel is
  // called with arguments in the wrong places.
  auto reversed = canonicalArgs(forwardKey());
  std::reverse(reversed.begin(), reversed.begin() + 8);
  TempDir dir;
  dir.copyFakeKernels();
  dir.write("manifest.json",
            manifestJson({{forwardKey(), "fake_forward_flat", reversed}}));
  ce_bundle *bundle = nullptr;
  EXPECT_EQ(ce_bundle_open(dir.path().c_str(), &bundle), CE_ERROR_BUNDLE);
  EXPECT_EQ(bundle, nullptr);
  EXPECT_THAT(ce_last_error_message(),
              HasSubstr(".args[0]: argument role \"status\" where this "
                        "variant takes \"logits\""));
}

TEST(Launch, Int32Labels) {
  FakeBundle bundle(allFakeKernels());
  FlatProblem p;
  std::vector<int32_t> labels(p.n);
  for (int64_t i = 0; i < p.n; ++i)
    labels[i] = static_cast<int32_t>(p.label(i));
  ce_tensor tLabels = packed(labels.data(), CE_DTYPE_I32, {p.n});
  ASSERT_EQ(ce_forward(bundle.get(), nullptr, &p.tLogits, &tLabels, &p.tLoss,
                       &p.tLse, nullptr),
            CE_OK)
      << ce_last_error_message();
  for (int64_t i = 0; i < p.n; ++i)
    EXPECT_EQ(p.lse[i], 2.5f + p.target(i));
}

/// [S, B, V] logits as a transposed, padded view of a [B, S, V + 2] buffer:
/// x[s][b][j] = 1000 s + 100 b + j.
struct SbvProblem {
  int64_t s = 3, b = 4, v = 5, pad = 2;
  std::vector<float> storage;
  ce_tensor tLogits;
  SbvProblem() : storage(b * s * (v + pad), kPoison) {
    for (int64_t si = 0; si < s; ++si)
      for (int64_t bi = 0; bi < b; ++bi)
        for (int64_t j = 0; j < v; ++j)
          storage[(bi * s + si) * (v + pad) + j] =
              static_cast<float>(1000 * si + 100 * bi + j);
    tLogits = view(storage.data(), CE_DTYPE_F32, {s, b, v},
                   {v + pad, s * (v + pad), 1});
  }
  float x(int64_t si, int64_t bi, int64_t j) const {
    return static_cast<float>(1000 * si + 100 * bi + j);
  }
};

TEST(Launch, ForwardSbvWithBsLabels) {
  FakeBundle bundle(allFakeKernels());
  SbvProblem p;
  // [B, S] labels read through a transposed view of an [S, B] buffer.
  std::vector<int64_t> labels(p.s * p.b);
  for (int64_t si = 0; si < p.s; ++si)
    for (int64_t bi = 0; bi < p.b; ++bi)
      labels[si * p.b + bi] = (si + 2 * bi) % p.v;
  ce_tensor tLabels = view(labels.data(), CE_DTYPE_I64, {p.b, p.s}, {1, p.b});
  std::vector<float> loss(p.b * p.s, kPoison), lse(p.b * p.s, kPoison);
  ce_tensor tLoss = packed(loss.data(), CE_DTYPE_F32, {p.b, p.s});
  ce_tensor tLse = packed(lse.data(), CE_DTYPE_F32, {p.b, p.s});
  ce_options options = defaultOptions();
  options.label_layout = CE_LABELS_BS;
  ASSERT_EQ(ce_forward(bundle.get(), &options, &p.tLogits, &tLabels, &tLoss,
                       &tLse, nullptr),
            CE_OK)
      << ce_last_error_message();
  const FakeRecord &r = bundle.record();
  EXPECT_EQ(r.ranks[0], 3);
  EXPECT_EQ(r.strides[0][0], p.v + p.pad);
  EXPECT_EQ(r.strides[0][1], p.s * (p.v + p.pad));
  EXPECT_EQ(r.sizes[1][0], p.b);
  EXPECT_EQ(r.sizes[1][1], p.s);
  EXPECT_EQ(r.strides[1][0], 1);
  EXPECT_EQ(r.strides[1][1], p.b);
  for (int64_t bi = 0; bi < p.b; ++bi)
    for (int64_t si = 0; si < p.s; ++si) {
      EXPECT_EQ(loss[bi * p.s + si], 1.5f);
      EXPECT_EQ(lse[bi * p.s + si], 2.5f + p.x(si, bi, labels[si * p.b + bi]));
    }
}

TEST(Launch, ForwardSbvWithSbLabels) {
  FakeBundle bundle(allFakeKernels());
  SbvProblem p;
  std::vector<int32_t> unused;
  std::vector<int64_t> labels(p.s * p.b);
  for (int64_t i = 0; i < p.s * p.b; ++i)
    labels[i] = (3 * i) % p.v;
  ce_tensor tLabels = packed(labels.data(), CE_DTYPE_I64, {p.s, p.b});
  std::vector<float> loss(p.s * p.b), lse(p.s * p.b);
  ce_tensor tLoss = packed(loss.data(), CE_DTYPE_F32, {p.s, p.b});
  ce_tensor tLse = packed(lse.data(), CE_DTYPE_F32, {p.s, p.b});
  ce_options options = defaultOptions();
  options.label_layout = CE_LABELS_SB;
  ASSERT_EQ(ce_forward(bundle.get(), &options, &p.tLogits, &tLabels, &tLoss,
                       &tLse, nullptr),
            CE_OK)
      << ce_last_error_message();
  for (int64_t si = 0; si < p.s; ++si)
    for (int64_t bi = 0; bi < p.b; ++bi)
      EXPECT_EQ(lse[si * p.b + bi], 2.5f + p.x(si, bi, labels[si * p.b + bi]));
}

/// Strided, poisoned entropy (stride 2) and argmax (stride 3) outputs of a
/// problem's tokens, poisoned between the elements too.
struct TokenOutputs {
  static constexpr int64_t kArgmaxPoison = -7;
  int64_t n;
  std::vector<float> entropy;
  std::vector<int64_t> argmax;
  ce_tensor tEntropy, tArgmax;
  explicit TokenOutputs(int64_t n)
      : n(n), entropy(2 * n + 1, kPoison), argmax(3 * n + 1, kArgmaxPoison) {
    tEntropy = view(entropy.data(), CE_DTYPE_F32, {n}, {2});
    tArgmax = view(argmax.data(), CE_DTYPE_I64, {n}, {3});
  }
  void poison() {
    std::fill(entropy.begin(), entropy.end(), kPoison);
    std::fill(argmax.begin(), argmax.end(), kArgmaxPoison);
  }
  /// What the fake writes where the output is asked for (fake_kernels.c),
  /// and nothing anywhere else.
  void expectWritten(bool withEntropy, bool withArgmax) const {
    for (int64_t t = 0; t < n; ++t) {
      SCOPED_TRACE(t);
      EXPECT_EQ(entropy[2 * t], withEntropy ? 0.25f + t : kPoison);
      EXPECT_EQ(entropy[2 * t + 1], kPoison);
      EXPECT_EQ(argmax[3 * t], withArgmax ? 1000 + t : kArgmaxPoison);
      EXPECT_EQ(argmax[3 * t + 1], kArgmaxPoison);
      EXPECT_EQ(argmax[3 * t + 2], kArgmaxPoison);
    }
    EXPECT_EQ(entropy[2 * n], kPoison);
    EXPECT_EQ(argmax[3 * n], kArgmaxPoison);
  }
};

TEST(Launch, EntropyAndArgmaxAreWrittenWhereTheyAreGiven) {
  // options->entropy and options->argmax are the forward's and the fused
  // kernel's arguments after lse_low, with flag bits 4 (16) and 5 (32);
  // each one absent is the lse's view with its bit off, and the kernel
  // leaves it alone (the lse keeps its values).
  EXPECT_EQ(int64_t{kFlagEntropy}, 16); // the ABI's bits
  EXPECT_EQ(int64_t{kFlagArgmax}, 32);
  FakeBundle bundle(allFakeKernels());
  const FakeRecord &r = bundle.record();
  for (int given = 0; given < 4; ++given) {
    bool withEntropy = given & 1, withArgmax = given & 2;
    SCOPED_TRACE(std::string("entropy ") + (withEntropy ? "on" : "off") +
                 ", argmax " + (withArgmax ? "on" : "off"));
    int64_t flags = (withEntropy ? int64_t{kFlagEntropy} : 0) |
                    (withArgmax ? int64_t{kFlagArgmax} : 0);
    FlatProblem p;
    TokenOutputs out(p.n);
    ce_options options = defaultOptions();
    options.entropy = withEntropy ? &out.tEntropy : nullptr;
    options.argmax = withArgmax ? &out.tArgmax : nullptr;
    const void *entropyData =
        withEntropy ? static_cast<void *>(out.entropy.data()) : p.lse.data();
    const void *argmaxData =
        withArgmax ? static_cast<void *>(out.argmax.data()) : p.lse.data();

    ASSERT_EQ(ce_forward(bundle.get(), &options, &p.tLogits, &p.tLabels,
                         &p.tLoss, &p.tLse, nullptr),
              CE_OK)
        << ce_last_error_message();
    ASSERT_EQ(r.numArgs, 8);
    EXPECT_EQ(r.flags & (kFlagEntropy | kFlagArgmax), flags);
    EXPECT_EQ(r.flags & kFlagLseLow, 0);
    EXPECT_EQ(r.aligned[4], p.lse.data()); // lse_low: the placeholder
    EXPECT_EQ(r.aligned[5], entropyData);
    EXPECT_EQ(r.aligned[6], argmaxData);
    EXPECT_EQ(r.ranks[5], 1);
    EXPECT_EQ(r.ranks[6], 1);
    EXPECT_EQ(r.sizes[5][0], p.n);
    EXPECT_EQ(r.sizes[6][0], p.n);
    EXPECT_EQ(r.strides[5][0], withEntropy ? 2 : 1);
    EXPECT_EQ(r.strides[6][0], withArgmax ? 3 : 1);
    out.expectWritten(withEntropy, withArgmax);
    for (int64_t i = 0; i < p.n; ++i) {
      EXPECT_EQ(p.lse[i], 2.5f + p.target(i));
      EXPECT_EQ(p.loss[2 * i], 1.5f);
    }

    // The fused kernel, with a gradient: entropy and argmax before it.
    out.poison();
    std::fill(p.lse.begin(), p.lse.end(), kPoison);
    float weight = 0.5f;
    ce_tensor tWeight = view(&weight, CE_DTYPE_F32, {}, {});
    ASSERT_EQ(ce_fused(bundle.get(), &options, &p.tLogits, &p.tLabels, &tWeight,
                       &p.tLoss, &p.tLse, &p.tGrad, nullptr),
              CE_OK)
        << ce_last_error_message();
    ASSERT_EQ(r.numArgs, 10);
    EXPECT_EQ(r.flags & (kFlagEntropy | kFlagArgmax), flags);
    EXPECT_EQ(r.aligned[6], entropyData);
    EXPECT_EQ(r.aligned[7], argmaxData);
    EXPECT_EQ(r.aligned[8], p.grad.data());
    out.expectWritten(withEntropy, withArgmax);
    for (int64_t i = 0; i < p.n; ++i) {
      EXPECT_EQ(p.lse[i], 2.5f + p.target(i));
      EXPECT_EQ(p.grad[i * p.rowStride], 0.5f);
    }

    // The fused kernel that overwrites the logits: no grad argument.
    out.poison();
    ce_options overwrite = options;
    overwrite.overwrite_input = 1;
    ASSERT_EQ(ce_fused(bundle.get(), &overwrite, &p.tLogits, &p.tLabels,
                       &tWeight, &p.tLoss, &p.tLse, nullptr, nullptr),
              CE_OK)
        << ce_last_error_message();
    ASSERT_EQ(r.numArgs, 9);
    EXPECT_EQ(r.flags & (kFlagEntropy | kFlagArgmax), flags);
    EXPECT_EQ(r.aligned[6], entropyData);
    EXPECT_EQ(r.aligned[7], argmaxData);
    EXPECT_EQ(r.ranks[8], 1); // status
    out.expectWritten(withEntropy, withArgmax);
  }
}

TEST(Launch, EntropyAndArgmaxTakeTheLabelsLayout) {
  // [S, B, V] logits with [B, S] labels: the outputs are [B, S] too, here a
  // transposed view of an [S, B] buffer; token t = b * S + s (the fake's
  // numbering of the labels' elements) lands at [s][b] of the buffer.
  FakeBundle bundle(allFakeKernels());
  SbvProblem p;
  std::vector<int64_t> labels(p.b * p.s, 1);
  std::vector<float> loss(p.b * p.s), lse(p.b * p.s);
  std::vector<float> entropy(p.s * p.b, kPoison);
  std::vector<int64_t> argmax(p.s * p.b, -7);
  ce_tensor tLabels = packed(labels.data(), CE_DTYPE_I64, {p.b, p.s});
  ce_tensor tLoss = packed(loss.data(), CE_DTYPE_F32, {p.b, p.s});
  ce_tensor tLse = packed(lse.data(), CE_DTYPE_F32, {p.b, p.s});
  ce_tensor tEntropy = view(entropy.data(), CE_DTYPE_F32, {p.b, p.s}, {1, p.b});
  ce_tensor tArgmax = view(argmax.data(), CE_DTYPE_I64, {p.b, p.s}, {1, p.b});
  ce_options options = defaultOptions();
  options.label_layout = CE_LABELS_BS;
  options.entropy = &tEntropy;
  options.argmax = &tArgmax;
  ASSERT_EQ(ce_forward(bundle.get(), &options, &p.tLogits, &tLabels, &tLoss,
                       &tLse, nullptr),
            CE_OK)
      << ce_last_error_message();
  const FakeRecord &r = bundle.record();
  EXPECT_EQ(r.ranks[5], 2);
  EXPECT_EQ(r.ranks[6], 2);
  EXPECT_EQ(r.strides[5][1], p.b);
  EXPECT_EQ(r.strides[6][1], p.b);
  for (int64_t bi = 0; bi < p.b; ++bi)
    for (int64_t si = 0; si < p.s; ++si) {
      int64_t t = bi * p.s + si;
      EXPECT_EQ(entropy[si * p.b + bi], 0.25f + t);
      EXPECT_EQ(argmax[si * p.b + bi], 1000 + t);
    }
}

TEST(Launch, EntropyAndArgmaxAreCheckedLikeTheLse) {
  FakeBundle bundle(allFakeKernels());
  FlatProblem p;
  std::vector<float> f32Buffer(4 * p.n);
  std::vector<int64_t> i64Buffer(4 * p.n);
  ce_tensor f32Tokens = packed(f32Buffer.data(), CE_DTYPE_F32, {p.n});
  ce_tensor i64Tokens = packed(i64Buffer.data(), CE_DTYPE_I64, {p.n});
  ce_tensor f32Short = packed(f32Buffer.data(), CE_DTYPE_F32, {p.n - 1});
  ce_tensor i64Long = packed(i64Buffer.data(), CE_DTYPE_I64, {p.n + 1});
  ce_tensor i64Column = packed(i64Buffer.data(), CE_DTYPE_I64, {p.n, 1});
  ce_tensor i64Broadcast = view(i64Buffer.data(), CE_DTYPE_I64, {p.n}, {0});
  // The loss's, the lse's and the logits' memory seen as i64 tokens.
  ce_tensor argmaxOnLoss = packed(p.loss.data(), CE_DTYPE_I64, {p.n});
  ce_tensor argmaxOnLse = packed(p.lse.data(), CE_DTYPE_I64, {p.n});
  ce_tensor entropyInLogits = packed(p.logits.data(), CE_DTYPE_F32, {p.n});
  // The same bytes as both outputs.
  ce_tensor entropyOnArgmax = packed(i64Buffer.data(), CE_DTYPE_F32, {p.n});
  std::vector<float> low(p.n);
  ce_tensor tLow = packed(low.data(), CE_DTYPE_F32, {p.n});
  ce_tensor lowOnEntropy = packed(f32Buffer.data(), CE_DTYPE_F32, {p.n});

  struct Case {
    const char *what;
    const ce_tensor *entropy, *argmax, *lseLow;
    const char *name; ///< the argument the message names
    const char *words;
  } cases[] = {
      {"argmax f32", nullptr, &f32Tokens, nullptr, "options->argmax",
       "dtype must be i64"},
      {"entropy i64", &i64Tokens, nullptr, nullptr, "options->entropy",
       "dtype must be f32"},
      {"both swapped", &i64Tokens, &f32Tokens, nullptr, "options->entropy",
       "dtype must be f32"},
      {"entropy short", &f32Short, nullptr, nullptr, "options->entropy",
       "labels' shape"},
      {"argmax long", nullptr, &i64Long, nullptr, "options->argmax",
       "labels' shape"},
      {"argmax [N, 1]", nullptr, &i64Column, nullptr, "options->argmax",
       "labels' shape"},
      {"argmax broadcast", nullptr, &i64Broadcast, nullptr, "options->argmax",
       "broadcast"},
      {"entropy is the lse", &p.tLse, nullptr, nullptr, "options->entropy",
       "overlaps"},
      {"entropy is the loss", &p.tLoss, nullptr, nullptr, "options->entropy",
       "overlaps"},
      {"argmax over the loss", nullptr, &argmaxOnLoss, nullptr,
       "options->argmax", "overlaps"},
      {"argmax over the lse", nullptr, &argmaxOnLse, nullptr, "options->argmax",
       "overlaps"},
      {"entropy in the logits", &entropyInLogits, nullptr, nullptr,
       "options->entropy", "overlaps input logits"},
      {"entropy over argmax", &entropyOnArgmax, &i64Tokens, nullptr,
       "options->argmax", "overlaps"},
      {"lse_low over entropy", &f32Tokens, nullptr, &lowOnEntropy,
       "options->lse_low", "overlaps"},
  };
  for (const Case &c : cases) {
    SCOPED_TRACE(c.what);
    ce_options options = defaultOptions();
    options.entropy = c.entropy;
    options.argmax = c.argmax;
    options.lse_low = c.lseLow;
    EXPECT_EQ(ce_forward(bundle.get(), &options, &p.tLogits, &p.tLabels,
                         &p.tLoss, &p.tLse, nullptr),
              CE_ERROR_INVALID_ARGUMENT);
    EXPECT_THAT(ce_last_error_message(), HasSubstr(c.name));
    EXPECT_THAT(ce_last_error_message(), HasSubstr(c.words));
    // The fused call checks them the same way.
    float weight = 1.0f;
    ce_tensor tWeight = view(&weight, CE_DTYPE_F32, {}, {});
    EXPECT_EQ(ce_fused(bundle.get(), &options, &p.tLogits, &p.tLabels, &tWeight,
                       &p.tLoss, &p.tLse, &p.tGrad, nullptr),
              CE_ERROR_INVALID_ARGUMENT);
    EXPECT_THAT(ce_last_error_message(), HasSubstr(c.name));
  }
  EXPECT_EQ(bundle.calls(), 0);
  // The right ones, all three at once, are accepted.
  ce_options options = defaultOptions();
  options.entropy = &f32Tokens;
  options.argmax = &i64Tokens;
  options.lse_low = &tLow;
  EXPECT_EQ(ce_forward(bundle.get(), &options, &p.tLogits, &p.tLabels, &p.tLoss,
                       &p.tLse, nullptr),
            CE_OK)
      << ce_last_error_message();
  EXPECT_EQ(bundle.record().flags & (kFlagLseLow | kFlagEntropy | kFlagArgmax),
            kFlagLseLow | kFlagEntropy | kFlagArgmax);
}

TEST(Launch, BackwardIgnoresEntropyAndArgmax) {
  // One options struct serves a whole step: a backward call neither checks
  // nor passes entropy and argmax, even ones a forward would refuse (f32
  // argmax, i64 entropy), and their bits stay off.
  FakeBundle bundle(allFakeKernels());
  FlatProblem p;
  std::vector<int64_t> wrongEntropy(p.n, -7);
  std::vector<float> wrongArgmax(p.n, kPoison);
  ce_tensor tEntropy = packed(wrongEntropy.data(), CE_DTYPE_I64, {p.n});
  ce_tensor tArgmax = packed(wrongArgmax.data(), CE_DTYPE_F32, {p.n});
  ce_options options = defaultOptions();
  options.entropy = &tEntropy;
  options.argmax = &tArgmax;
  std::fill(p.lse.begin(), p.lse.end(), 1.0f);
  std::vector<float> gradLoss(p.n, 2.0f);
  ce_tensor tGradLoss = packed(gradLoss.data(), CE_DTYPE_F32, {p.n});
  ASSERT_EQ(ce_backward(bundle.get(), &options, &p.tLogits, &p.tLabels, &p.tLse,
                        &tGradLoss, &p.tGrad, nullptr),
            CE_OK)
      << ce_last_error_message();
  const FakeRecord &r = bundle.record();
  EXPECT_EQ(r.numArgs, 7); // logits, labels, lse, lse_low, grad_loss, grad,
                           // status
  EXPECT_EQ(r.flags & (kFlagEntropy | kFlagArgmax), 0);
  for (int a = 0; a < r.numArgs; ++a) {
    EXPECT_NE(r.aligned[a], static_cast<void *>(wrongEntropy.data())) << a;
    EXPECT_NE(r.aligned[a], static_cast<void *>(wrongArgmax.data())) << a;
  }
  EXPECT_EQ(p.grad[0], 2.0f); // 2 * 0.5 + lse
  for (int64_t t = 0; t < p.n; ++t) {
    EXPECT_EQ(wrongEntropy[t], -7);
    EXPECT_EQ(wrongArgmax[t], kPoison);
  }
}

TEST(Launch, ShardStatsTakeEntropyAndArgmaxAfterTheStats) {
  // A shard_stats kernel writes its slice's entropy and argmax for the
  // combine: options->entropy and options->argmax are its arguments after
  // the stats, with flag bits 4 and 5; without them (no lse in this call)
  // the placeholder is the labels' view, its bit off.
  KernelVariantKey stats = forwardKey();
  stats.op = KernelOp::ShardStats;
  FakeBundle bundle({{stats, "fake_shard_stats_flat", {}}});
  const FakeRecord &r = bundle.record();
  FlatProblem p;
  std::vector<float> statsOut(p.n * 4);
  ce_tensor tStats = packed(statsOut.data(), CE_DTYPE_F32, {p.n, 4});
  TokenOutputs out(p.n);
  for (int given = 0; given < 4; ++given) {
    bool withEntropy = given & 1, withArgmax = given & 2;
    SCOPED_TRACE(given);
    ce_options options = defaultOptions();
    options.shard_start = 0;
    options.shard_vocab = 2 * p.v;
    options.entropy = withEntropy ? &out.tEntropy : nullptr;
    options.argmax = withArgmax ? &out.tArgmax : nullptr;
    ASSERT_EQ(ce_shard_stats(bundle.get(), &options, &p.tLogits, &p.tLabels,
                             &tStats, nullptr),
              CE_OK)
        << ce_last_error_message();
    ASSERT_EQ(r.numArgs, 6);
    EXPECT_EQ(r.aligned[2], statsOut.data());
    EXPECT_EQ(r.aligned[3], withEntropy
                                ? static_cast<void *>(out.entropy.data())
                                : p.labels.data());
    EXPECT_EQ(r.aligned[4], withArgmax ? static_cast<void *>(out.argmax.data())
                                       : p.labels.data());
    EXPECT_EQ(r.strides[3][0], withEntropy ? 2 : 3);
    EXPECT_EQ(r.strides[4][0], 3);
    EXPECT_EQ(r.ranks[5], 1); // status
    EXPECT_EQ(r.flags & (kFlagEntropy | kFlagArgmax),
              (withEntropy ? int64_t{kFlagEntropy} : 0) |
                  (withArgmax ? int64_t{kFlagArgmax} : 0));
  }
  // Checked as a forward's are.
  std::vector<float> f32Tokens(p.n);
  ce_tensor tF32 = packed(f32Tokens.data(), CE_DTYPE_F32, {p.n});
  ce_options options = defaultOptions();
  options.shard_start = 0;
  options.shard_vocab = 2 * p.v;
  options.argmax = &tF32;
  int64_t calls = bundle.calls();
  EXPECT_EQ(ce_shard_stats(bundle.get(), &options, &p.tLogits, &p.tLabels,
                           &tStats, nullptr),
            CE_ERROR_INVALID_ARGUMENT);
  EXPECT_THAT(ce_last_error_message(), HasSubstr("options->argmax"));
  options.argmax = nullptr;
  options.entropy = &tStats;
  EXPECT_EQ(ce_shard_stats(bundle.get(), &options, &p.tLogits, &p.tLabels,
                           &tStats, nullptr),
            CE_ERROR_INVALID_ARGUMENT);
  EXPECT_THAT(ce_last_error_message(), HasSubstr("options->entropy"));
  EXPECT_EQ(bundle.calls(), calls);
}

TEST(Launch, BackwardWithBroadcastGradLoss) {
  FakeBundle bundle(allFakeKernels());
  FlatProblem p;
  for (int64_t i = 0; i < p.n; ++i)
    p.lse[i] = 10.0f * i;
  float upstream = 4.0f;
  ce_tensor tGradLoss = view(&upstream, CE_DTYPE_F32, {p.n}, {0});
  ASSERT_EQ(ce_backward(bundle.get(), nullptr, &p.tLogits, &p.tLabels, &p.tLse,
                        &tGradLoss, &p.tGrad, nullptr),
            CE_OK)
      << ce_last_error_message();
  const FakeRecord &r = bundle.record();
  ASSERT_EQ(r.numArgs, 7);
  EXPECT_EQ(r.aligned[4], &upstream);
  EXPECT_EQ(r.strides[4][0], 0);
  EXPECT_EQ(r.aligned[5], p.grad.data());
  EXPECT_EQ(r.strides[5][0], p.rowStride);
  for (int64_t i = 0; i < p.n; ++i) {
    for (int64_t j = 0; j < p.v; ++j)
      EXPECT_EQ(p.grad[i * p.rowStride + j], 2.0f + 10.0f * i);
    EXPECT_EQ(p.grad[i * p.rowStride + p.v], kPoison); // row padding
  }
  // The logits are untouched.
  EXPECT_EQ(p.logits[p.rowStride + 2], 102.0f);
}

TEST(Launch, BackwardSbvBs) {
  FakeBundle bundle(allFakeKernels());
  SbvProblem p;
  std::vector<int64_t> labels(p.b * p.s, 1);
  std::vector<float> lse(p.b * p.s), gradLoss(p.b * p.s);
  for (int64_t i = 0; i < p.b * p.s; ++i) {
    lse[i] = static_cast<float>(i);
    gradLoss[i] = static_cast<float>(2 * i);
  }
  std::vector<float> grad(p.s * p.b * p.v, kPoison);
  ce_tensor tLabels = packed(labels.data(), CE_DTYPE_I64, {p.b, p.s});
  ce_tensor tLse = packed(lse.data(), CE_DTYPE_F32, {p.b, p.s});
  ce_tensor tGradLoss = packed(gradLoss.data(), CE_DTYPE_F32, {p.b, p.s});
  ce_tensor tGrad = packed(grad.data(), CE_DTYPE_F32, {p.s, p.b, p.v});
  ASSERT_EQ(ce_backward(bundle.get(), nullptr, &p.tLogits, &tLabels, &tLse,
                        &tGradLoss, &tGrad, nullptr),
            CE_OK)
      << ce_last_error_message();
  for (int64_t si = 0; si < p.s; ++si)
    for (int64_t bi = 0; bi < p.b; ++bi)
      for (int64_t j = 0; j < p.v; ++j) {
        int64_t token = bi * p.s + si;
        EXPECT_EQ(grad[(si * p.b + bi) * p.v + j], 2.0f * token);
      }
}

TEST(Launch, BackwardOverwritesLogits) {
  FakeBundle bundle(allFakeKernels());
  ce_options options = defaultOptions();
  options.overwrite_input = 1;
  for (bool passLogitsAsGrad : {false, true}) {
    SCOPED_TRACE(passLogitsAsGrad);
    FlatProblem p;
    std::vector<float> gradLoss(p.n, 2.0f);
    ce_tensor tGradLoss = packed(gradLoss.data(), CE_DTYPE_F32, {p.n});
    for (int64_t i = 0; i < p.n; ++i)
      p.lse[i] = 1.0f;
    ASSERT_EQ(ce_backward(bundle.get(), &options, &p.tLogits, &p.tLabels,
                          &p.tLse, &tGradLoss,
                          passLogitsAsGrad ? &p.tLogits : nullptr, nullptr),
              CE_OK)
        << ce_last_error_message();
    EXPECT_EQ(bundle.record().numArgs, 6);
    for (int64_t i = 0; i < p.n; ++i) {
      for (int64_t j = 0; j < p.v; ++j)
        EXPECT_EQ(p.logits[i * p.rowStride + j], 2.0f);
      EXPECT_EQ(p.logits[i * p.rowStride + p.v], kPoison);
    }
    EXPECT_EQ(p.grad[0], kPoison);
  }
}

TEST(Launch, ForwardIgnoresOverwriteInput) {
  FakeBundle bundle(allFakeKernels());
  FlatProblem p;
  ce_options options = defaultOptions();
  options.overwrite_input = 1;
  EXPECT_EQ(ce_forward(bundle.get(), &options, &p.tLogits, &p.tLabels, &p.tLoss,
                       &p.tLse, nullptr),
            CE_OK)
      << ce_last_error_message();
}

TEST(Launch, FusedScalarAndTokenWeights) {
  // Fused kernels take per-token weights only: a scalar weight reaches the
  // token kernel as a descriptor of the labels' shape with strides 0.
  FakeBundle bundle(allFakeKernels());
  {
    FlatProblem p;
    float weight = 0.25f;
    ce_tensor tWeight = view(&weight, CE_DTYPE_F32, {}, {});
    ASSERT_EQ(ce_fused(bundle.get(), nullptr, &p.tLogits, &p.tLabels, &tWeight,
                       &p.tLoss, &p.tLse, &p.tGrad, nullptr),
              CE_OK)
        << ce_last_error_message();
    const FakeRecord &r = bundle.record();
    ASSERT_EQ(r.numArgs, 10);
    EXPECT_EQ(r.ranks[2], 1);
    EXPECT_EQ(r.aligned[2], &weight);
    EXPECT_EQ(r.offsets[2], 0);
    EXPECT_EQ(r.sizes[2][0], p.n);
    EXPECT_EQ(r.strides[2][0], 0);
    for (int64_t i = 0; i < p.n; ++i) {
      EXPECT_EQ(p.loss[2 * i], 1.5f);
      EXPECT_EQ(p.lse[i], 2.5f + p.target(i));
      EXPECT_EQ(p.grad[i * p.rowStride + p.v - 1], 0.25f);
    }
  }
  {
    FlatProblem p;
    std::vector<float> weights(2 * p.n);
    for (int64_t i = 0; i < p.n; ++i)
      weights[2 * i] = static_cast<float>(i) + 0.5f;
    ce_tensor tWeights = view(weights.data(), CE_DTYPE_F32, {p.n}, {2});
    ASSERT_EQ(ce_fused(bundle.get(), nullptr, &p.tLogits, &p.tLabels, &tWeights,
                       &p.tLoss, &p.tLse, &p.tGrad, nullptr),
              CE_OK)
        << ce_last_error_message();
    EXPECT_EQ(bundle.record().ranks[2], 1);
    EXPECT_EQ(bundle.record().strides[2][0], 2);
    for (int64_t i = 0; i < p.n; ++i)
      EXPECT_EQ(p.grad[i * p.rowStride], static_cast<float>(i) + 0.5f);
  }
}

TEST(Launch, ScalarWeightOnSbvLabelsIsATokenDescriptorOfStrideZero) {
  // [B, S] labels: the scalar becomes a rank-2 descriptor of the labels'
  // sizes, both strides 0, and every token's gradient row reads it.
  FakeBundle bundle(
      {{makeKey(KernelOp::Fused, LabelLayout::SbvBs, WeightsKind::Token),
        "fake_fused_bs_token",
        {}}});
  SbvProblem p;
  std::vector<int64_t> labels(p.s * p.b, 2);
  std::vector<float> loss(p.s * p.b), lse(p.s * p.b),
      grad(p.s * p.b * p.v, kPoison);
  float weight = 0.75f;
  ce_tensor tWeight = view(&weight, CE_DTYPE_F32, {}, {});
  ce_tensor tLabels = packed(labels.data(), CE_DTYPE_I64, {p.b, p.s});
  ce_tensor tLoss = packed(loss.data(), CE_DTYPE_F32, {p.b, p.s});
  ce_tensor tLse = packed(lse.data(), CE_DTYPE_F32, {p.b, p.s});
  ce_tensor tGrad = packed(grad.data(), CE_DTYPE_F32, {p.s, p.b, p.v});
  ce_options options = defaultOptions();
  options.label_layout = CE_LABELS_BS;
  ASSERT_EQ(ce_fused(bundle.get(), &options, &p.tLogits, &tLabels, &tWeight,
                     &tLoss, &tLse, &tGrad, nullptr),
            CE_OK)
      << ce_last_error_message();
  const FakeRecord &r = bundle.record();
  ASSERT_EQ(r.numArgs, 10);
  EXPECT_EQ(r.ranks[2], 2);
  EXPECT_EQ(r.aligned[2], &weight);
  EXPECT_EQ(r.sizes[2][0], p.b);
  EXPECT_EQ(r.sizes[2][1], p.s);
  EXPECT_EQ(r.strides[2][0], 0);
  EXPECT_EQ(r.strides[2][1], 0);
  for (int64_t i = 0; i < p.s * p.b; ++i)
    EXPECT_EQ(grad[i * p.v + 1], 0.75f) << i;
}

TEST(Launch, FusedSbvSbTokenWeights) {
  FakeBundle bundle(allFakeKernels());
  SbvProblem p;
  int64_t t = p.s * p.b;
  std::vector<int64_t> labels(t, 2);
  std::vector<float> weights(t), loss(t), lse(t), grad(t * p.v, kPoison);
  for (int64_t i = 0; i < t; ++i)
    weights[i] = static_cast<float>(i);
  ce_tensor tLabels = packed(labels.data(), CE_DTYPE_I64, {p.s, p.b});
  ce_tensor tWeights = packed(weights.data(), CE_DTYPE_F32, {p.s, p.b});
  ce_tensor tLoss = packed(loss.data(), CE_DTYPE_F32, {p.s, p.b});
  ce_tensor tLse = packed(lse.data(), CE_DTYPE_F32, {p.s, p.b});
  ce_tensor tGrad = packed(grad.data(), CE_DTYPE_F32, {p.s, p.b, p.v});
  ce_options options = defaultOptions();
  options.label_layout = CE_LABELS_SB;
  ASSERT_EQ(ce_fused(bundle.get(), &options, &p.tLogits, &tLabels, &tWeights,
                     &tLoss, &tLse, &tGrad, nullptr),
            CE_OK)
      << ce_last_error_message();
  for (int64_t i = 0; i < t; ++i)
    EXPECT_EQ(grad[i * p.v + 3], static_cast<float>(i));
}

TEST(Launch, FusedOverwrite) {
  FakeBundle bundle(allFakeKernels());
  FlatProblem p;
  float weight = 3.0f;
  ce_tensor tWeight = view(&weight, CE_DTYPE_F32, {}, {});
  ce_options options = defaultOptions();
  options.overwrite_input = 1;
  ASSERT_EQ(ce_fused(bundle.get(), &options, &p.tLogits, &p.tLabels, &tWeight,
                     &p.tLoss, &p.tLse, nullptr, nullptr),
            CE_OK)
      << ce_last_error_message();
  EXPECT_EQ(bundle.record().numArgs, 9);
  EXPECT_EQ(p.logits[2 * p.rowStride + 1], 3.0f);
  // The forward part read the logits before overwriting them.
  EXPECT_EQ(p.loss[0], 1.5f);
}

TEST(Launch, VocabularyOfOneAcceptsAnyVocabStride) {
  FakeBundle bundle(allFakeKernels());
  FlatProblem p(4, 1);
  std::vector<int64_t> zeros(3 * p.n, 0);
  ce_tensor tLabels = view(zeros.data(), CE_DTYPE_I64, {p.n}, {3});
  ce_tensor tLogits =
      view(p.logits.data(), CE_DTYPE_F32, {p.n, 1}, {p.rowStride, 0});
  ASSERT_EQ(ce_forward(bundle.get(), nullptr, &tLogits, &tLabels, &p.tLoss,
                       &p.tLse, nullptr),
            CE_OK)
      << ce_last_error_message();
  EXPECT_EQ(bundle.record().strides[0][1], 1); // normalized for the kernel
}

TEST(Launch, EmptyBatchLaunchesNothing) {
  FakeBundle bundle(allFakeKernels());
  float dummy = 0;
  int64_t label = 0;
  ce_tensor logits = view(nullptr, CE_DTYPE_F32, {0, 7}, {7, 1});
  ce_tensor labels = view(nullptr, CE_DTYPE_I64, {0}, {1});
  ce_tensor loss = view(nullptr, CE_DTYPE_F32, {0}, {1});
  ce_tensor lse = view(nullptr, CE_DTYPE_F32, {0}, {1});
  ce_tensor gradLoss = view(&dummy, CE_DTYPE_F32, {0}, {0});
  ce_tensor grad = view(nullptr, CE_DTYPE_F32, {0, 7}, {7, 1});
  ce_tensor weight = view(&dummy, CE_DTYPE_F32, {}, {});
  EXPECT_EQ(
      ce_forward(bundle.get(), nullptr, &logits, &labels, &loss, &lse, nullptr),
      CE_OK)
      << ce_last_error_message();
  EXPECT_EQ(ce_backward(bundle.get(), nullptr, &logits, &labels, &lse,
                        &gradLoss, &grad, nullptr),
            CE_OK)
      << ce_last_error_message();
  EXPECT_EQ(ce_fused(bundle.get(), nullptr, &logits, &labels, &weight, &loss,
                     &lse, &grad, nullptr),
            CE_OK)
      << ce_last_error_message();
  // [S, B, V] with S == 0 or B == 0; and V == 0 with no tokens.
  ce_options options = defaultOptions();
  for (auto [s, b, v] :
       {std::tuple<int64_t, int64_t, int64_t>{0, 4, 5}, {3, 0, 5}, {0, 0, 0}}) {
    SCOPED_TRACE(::testing::Message() << s << "," << b << "," << v);
    ce_tensor sbv = view(nullptr, CE_DTYPE_F32, {s, b, v}, {b * v, v, 1});
    ce_tensor tokens = view(&label, CE_DTYPE_I64, {b, s}, {s, 1});
    ce_tensor tokenOut = view(nullptr, CE_DTYPE_F32, {b, s}, {s, 1});
    ce_tensor tokenOut2 = view(nullptr, CE_DTYPE_F32, {b, s}, {s, 1});
    EXPECT_EQ(ce_forward(bundle.get(), &options, &sbv, &tokens, &tokenOut,
                         &tokenOut2, nullptr),
              CE_OK)
        << ce_last_error_message();
  }
  EXPECT_EQ(bundle.calls(), 0);

  // A missing variant is still an error with no tokens.
  ce_tensor f16Logits = view(nullptr, CE_DTYPE_F16, {0, 7}, {7, 1});
  EXPECT_EQ(ce_forward(bundle.get(), nullptr, &f16Logits, &labels, &loss, &lse,
                       nullptr),
            CE_ERROR_VARIANT_NOT_FOUND);
}

TEST(Launch, MissingVariantSaysHowToGenerateIt) {
  FakeBundle bundle({{forwardKey(), "fake_forward_flat", {}}});
  SbvProblem p;
  std::vector<int64_t> labels(p.s * p.b, 0);
  std::vector<float> loss(p.s * p.b), lse(p.s * p.b);
  ce_tensor tLabels = packed(labels.data(), CE_DTYPE_I64, {p.s, p.b});
  ce_tensor tLoss = packed(loss.data(), CE_DTYPE_F32, {p.s, p.b});
  ce_tensor tLse = packed(lse.data(), CE_DTYPE_F32, {p.s, p.b});
  ce_options options = defaultOptions();
  options.label_layout = CE_LABELS_SB;
  options.has_ignore_index = 1;
  options.ignore_index = -100;
  options.label_smoothing = 0.1f;
  ASSERT_EQ(ce_forward(bundle.get(), &options, &p.tLogits, &tLabels, &tLoss,
                       &tLse, nullptr),
            CE_ERROR_VARIANT_NOT_FOUND);
  // The key names no value: smoothing is on, the ignore_index is not in it.
  KernelVariantKey wanted = forwardKey(LabelLayout::SbvSb);
  wanted.smoothing = true;
  std::string message = ce_last_error_message();
  EXPECT_THAT(message, HasSubstr("ce_forward: kernel variant not found"));
  EXPECT_THAT(message, HasSubstr("\"" + wanted.str() + "\""));
  EXPECT_THAT(message, HasSubstr(bundle.path()));
  EXPECT_THAT(message,
              HasSubstr("ce-gen --target=host -o DIR --variant=" +
                        wanted.str() + "`"));
  EXPECT_THAT(message, HasSubstr("(or `ce-gen --all`, every variant of the "
                                 "target)"));
  EXPECT_THAT(message, HasSubstr("nearest: \"" + forwardKey().str() + "\""));
  EXPECT_EQ(bundle.calls(), 0);
}

TEST(Launch, LabelOutOfRangeFlat) {
  FakeBundle bundle(allFakeKernels());
  for (int64_t bad : {int64_t(12345), int64_t(7), int64_t(-5)}) {
    SCOPED_TRACE(bad);
    FlatProblem p(6, 7);
    p.labels[3 * 4] = bad;
    ASSERT_EQ(ce_forward(bundle.get(), nullptr, &p.tLogits, &p.tLabels,
                         &p.tLoss, &p.tLse, nullptr),
              CE_ERROR_LABEL_OUT_OF_RANGE);
    std::string message = ce_last_error_message();
    EXPECT_THAT(message, HasSubstr("token 4 (n=4)"));
    EXPECT_THAT(message, HasSubstr("label " + std::to_string(bad) +
                                   " is not in [0, 7)"));
    EXPECT_THAT(message, HasSubstr("no ignore_index is set"));
    EXPECT_THAT(message, HasSubstr("loss is NaN"));
    EXPECT_TRUE(std::isnan(p.loss[2 * 4]));
    EXPECT_EQ(bundle.record().statusOnEntry, 0);
  }
  // The next call starts from a zeroed status again.
  FlatProblem good;
  EXPECT_EQ(ce_forward(bundle.get(), nullptr, &good.tLogits, &good.tLabels,
                       &good.tLoss, &good.tLse, nullptr),
            CE_OK);
  EXPECT_EQ(bundle.record().statusOnEntry, 0);
}

TEST(Launch, LabelOutOfRangeNamesTheIgnoreIndex) {
  FakeBundle bundle(allFakeKernels());
  FlatProblem p;
  p.labels[0] = 12345;
  ce_options options = defaultOptions();
  options.has_ignore_index = 1;
  options.ignore_index = -100;
  ASSERT_EQ(ce_forward(bundle.get(), &options, &p.tLogits, &p.tLabels, &p.tLoss,
                       &p.tLse, nullptr),
            CE_ERROR_LABEL_OUT_OF_RANGE);
  EXPECT_THAT(ce_last_error_message(),
              HasSubstr("is not the ignore_index -100"));
}

TEST(Launch, LabelOutOfRangeGivesTokenCoordinates) {
  FakeBundle bundle(allFakeKernels());
  SbvProblem p;
  int64_t t = p.s * p.b;
  std::vector<float> loss(t), lse(t);
  {
    // [B, S] labels: token (b=2, s=1) is linear index 2 * S + 1.
    std::vector<int64_t> labels(t, 0);
    labels[2 * p.s + 1] = 12345;
    ce_tensor tLabels = packed(labels.data(), CE_DTYPE_I64, {p.b, p.s});
    ce_tensor tLoss = packed(loss.data(), CE_DTYPE_F32, {p.b, p.s});
    ce_tensor tLse = packed(lse.data(), CE_DTYPE_F32, {p.b, p.s});
    ASSERT_EQ(ce_forward(bundle.get(), nullptr, &p.tLogits, &tLabels, &tLoss,
                         &tLse, nullptr),
              CE_ERROR_LABEL_OUT_OF_RANGE);
    EXPECT_THAT(ce_last_error_message(),
                HasSubstr("token 7 (b=2, s=1): label 12345 is not in [0, 5)"));
  }
  {
    // [S, B] labels, strided: token (s=2, b=1) is linear index 2 * B + 1.
    std::vector<int64_t> labels(2 * t, 0);
    labels[2 * (2 * p.b + 1)] = -1;
    ce_tensor tLabels =
        view(labels.data(), CE_DTYPE_I64, {p.s, p.b}, {2 * p.b, 2});
    ce_tensor tLoss = packed(loss.data(), CE_DTYPE_F32, {p.s, p.b});
    ce_tensor tLse = packed(lse.data(), CE_DTYPE_F32, {p.s, p.b});
    ce_options options = defaultOptions();
    options.label_layout = CE_LABELS_SB;
    ASSERT_EQ(ce_forward(bundle.get(), &options, &p.tLogits, &tLabels, &tLoss,
                         &tLse, nullptr),
              CE_ERROR_LABEL_OUT_OF_RANGE);
    EXPECT_THAT(ce_last_error_message(),
                HasSubstr("token 9 (s=2, b=1): label -1 is not in [0, 5)"));
  }
}

TEST(Launch, LabelOutOfRangeInBackwardAndFused) {
  FakeBundle bundle(allFakeKernels());
  FlatProblem p;
  p.labels[3 * 2] = 99;
  std::vector<float> gradLoss(p.n, 1.0f);
  ce_tensor tGradLoss = packed(gradLoss.data(), CE_DTYPE_F32, {p.n});
  ASSERT_EQ(ce_backward(bundle.get(), nullptr, &p.tLogits, &p.tLabels, &p.tLse,
                        &tGradLoss, &p.tGrad, nullptr),
            CE_ERROR_LABEL_OUT_OF_RANGE);
  EXPECT_THAT(ce_last_error_message(), HasSubstr("ce_backward: "));
  EXPECT_THAT(ce_last_error_message(), HasSubstr("gradient row is NaN"));
  EXPECT_TRUE(std::isnan(p.grad[2 * p.rowStride]));
  float weight = 1.0f;
  ce_tensor tWeight = view(&weight, CE_DTYPE_F32, {}, {});
  ASSERT_EQ(ce_fused(bundle.get(), nullptr, &p.tLogits, &p.tLabels, &tWeight,
                     &p.tLoss, &p.tLse, &p.tGrad, nullptr),
            CE_ERROR_LABEL_OUT_OF_RANGE);
  EXPECT_THAT(ce_last_error_message(),
              HasSubstr("token 2 (n=2): label 99 is not in [0, 7)"));
  EXPECT_THAT(ce_last_error_message(),
              HasSubstr("loss and gradient row are NaN"));
}

TEST(Launch, InconsistentStatusIsABackendError) {
  FlatProblem p;
  {
    FakeBundle bundle({{forwardKey(), "fake_forward_flat_bad_status", {}}});
    EXPECT_EQ(ce_forward(bundle.get(), nullptr, &p.tLogits, &p.tLabels,
                         &p.tLoss, &p.tLse, nullptr),
              CE_ERROR_BACKEND);
    EXPECT_THAT(ce_last_error_message(), HasSubstr("names no token"));
  }
  {
    FakeBundle bundle({{forwardKey(), "fake_forward_flat_false_alarm", {}}});
    EXPECT_EQ(ce_forward(bundle.get(), nullptr, &p.tLogits, &p.tLabels,
                         &p.tLoss, &p.tLse, nullptr),
              CE_ERROR_BACKEND);
    EXPECT_THAT(ce_last_error_message(), HasSubstr("is valid"));
  }
}

TEST(Launch, GpuDevicesWithoutADriverAreNoDevice) {
  // This test runs where no GPU is reachable (CI): libcuda.so.1 is absent,
  // and libamdhip64 (if installed) finds no AMD GPU. On a machine with one,
  // the launch gets further and the test has nothing to check.
  FakeBundle bundle(allFakeKernels());
  for (auto [device, name] :
       {std::pair{CE_DEVICE_CUDA, "CUDA"}, std::pair{CE_DEVICE_HIP, "HIP"}}) {
    SCOPED_TRACE(name);
    FlatProblem p;
    for (ce_tensor *t : {&p.tLogits, &p.tLabels, &p.tLoss, &p.tLse}) {
      t->device = device;
      t->device_index = 1;
    }
    ce_status status = ce_forward(bundle.get(), nullptr, &p.tLogits, &p.tLabels,
                                  &p.tLoss, &p.tLse, nullptr);
    std::string message = ce_last_error_message();
    if (status != CE_ERROR_NO_DEVICE &&
        message.find("no " + std::string(name) + " device") ==
            std::string::npos)
      GTEST_SKIP() << "a " << name << " device is present: " << message;
    EXPECT_EQ(status, CE_ERROR_NO_DEVICE);
    EXPECT_THAT(message,
                HasSubstr(std::string("ce_forward: no ") + name + " device"));
    EXPECT_THAT(message, HasSubstr(std::string("the tensors are on ") + name +
                                   " device 1"));
    EXPECT_EQ(ce_check_label_status(device, 1, nullptr, 1), CE_ERROR_NO_DEVICE);
    EXPECT_THAT(ce_last_error_message(),
                HasSubstr(std::string("ce_check_label_status: no ") + name +
                          " device"));
  }
  EXPECT_EQ(bundle.calls(), 0);
}

TEST(Launch, LabelStatusChecksOnTheHostAlwaysPass) {
  EXPECT_EQ(ce_check_label_status(CE_DEVICE_HOST, 0, nullptr, 1), CE_OK);
  EXPECT_STREQ(ce_last_error_message(), "");
  EXPECT_EQ(ce_check_label_status(CE_DEVICE_HOST, 5, nullptr, 0), CE_OK);
  EXPECT_EQ(ce_test_check_label_status_raw(7, 0, 1), CE_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(ce_last_error_message(),
               "ce_check_label_status: invalid device type 7");
}

TEST(Launch, ErrorMessagesAreClearedAndThreadLocal) {
  FakeBundle bundle(allFakeKernels());
  FlatProblem p;
  EXPECT_EQ(ce_forward(nullptr, nullptr, &p.tLogits, &p.tLabels, &p.tLoss,
                       &p.tLse, nullptr),
            CE_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(ce_last_error_message(), "ce_forward: bundle is NULL");
  std::string other;
  std::thread([&] {
    EXPECT_STREQ(ce_last_error_message(), "");
    FlatProblem q;
    EXPECT_EQ(ce_forward(bundle.get(), nullptr, &q.tLogits, &q.tLabels,
                         &q.tLoss, &q.tLse, nullptr),
              CE_OK);
    other = ce_last_error_message();
  }).join();
  EXPECT_EQ(other, "");
  EXPECT_STREQ(ce_last_error_message(), "ce_forward: bundle is NULL");
  EXPECT_EQ(ce_forward(bundle.get(), nullptr, &p.tLogits, &p.tLabels, &p.tLoss,
                       &p.tLse, nullptr),
            CE_OK);
  EXPECT_STREQ(ce_last_error_message(), "");
}

TEST(Launch, ConcurrentLaunchesOnOneBundle) {
  FakeBundle bundle(allFakeKernels());
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int iteration = 0; iteration < 50; ++iteration) {
        FlatProblem p(3 + t, 5 + iteration % 3);
        KernelOp op = iteration % 2 ? KernelOp::Forward : KernelOp::Fused;
        float weight = 1.0f;
        ce_tensor tWeight = view(&weight, CE_DTYPE_F32, {}, {});
        ce_status status =
            op == KernelOp::Forward
                ? ce_forward(bundle.get(), nullptr, &p.tLogits, &p.tLabels,
                             &p.tLoss, &p.tLse, nullptr)
                : ce_fused(bundle.get(), nullptr, &p.tLogits, &p.tLabels,
                           &tWeight, &p.tLoss, &p.tLse, &p.tGrad, nullptr);
        if (status != CE_OK)
          ++failures;
        for (int64_t i = 0; i < p.n; ++i)
          if (p.lse[i] != 2.5f + p.target(i))
            ++failures;
      }
    });
  for (std::thread &thread : threads)
    thread.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST(Launch, ReopeningABundleDoesNotReuseStaleKernels) {
  FlatProblem p;
  {
    FakeBundle first({{forwardKey(), "fake_forward_flat_bad_status", {}}});
    EXPECT_EQ(ce_forward(first.get(), nullptr, &p.tLogits, &p.tLabels, &p.tLoss,
                         &p.tLse, nullptr),
              CE_ERROR_BACKEND);
  }
  FakeBundle second({{forwardKey(), "fake_forward_flat", {}}});
  EXPECT_EQ(ce_forward(second.get(), nullptr, &p.tLogits, &p.tLabels, &p.tLoss,
                       &p.tLse, nullptr),
            CE_OK)
      << ce_last_error_message();
}

} // namespace
