//===- GpuTest.cpp - The GPU backends against a fake driver ---------------===//
//
// runtime_gpu_test runs with a directory first on LD_LIBRARY_PATH that holds
// fake_gpu_driver.c built as libcuda.so.1 and libamdhip64.so, so the
// runtime's CUDA and HIP backends run their real code paths (target
// selection, contexts, module and function caching, the kernel parameter
// ABI: the descriptor fields, then the eight option values by value, an f32
// as 4 bytes; grid and block, streams, graph capture, label status words)
// on a machine without a GPU. The fake records each launch's parameters; the
// test plays the kernel's part by writing the status word it was given.
//
//===----------------------------------------------------------------------===//

#include "TestBundle.h"

#include "ce/runtime/ce_runtime.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <dlfcn.h>
#include <fstream>
#include <set>
#include <thread>

using namespace ce;
using namespace ce::test;
using ::testing::HasSubstr;

namespace {

/// Mirrors FakeGpuState in fake_gpu_driver.c.
struct FakeGpuState {
  int32_t initResult;
  int32_t deviceCount;
  int32_t ccMajor[4], ccMinor[4];
  char arch[4][64];
  int32_t capturing;
  int32_t idle;
  int32_t failLaunch;
  void *currentContext;
  int32_t currentDevice;
  int64_t moduleLoads, moduleUnloads, launches, syncs, pushes, pops;
  int64_t hostAllocs, captureModeExchanges, setDevices;
  char symbol[64];
  uint32_t grid[3], block[3], sharedBytes;
  void *stream;
  void *launchContext;
  int32_t launchDevice;
  int32_t numParams;
  uint64_t params[80];
};

/// The fake's state in the copy of the library the runtime opens.
FakeGpuState &fake(ce_device_type device) {
  const char *name =
      device == CE_DEVICE_CUDA ? "libcuda.so.1" : "libamdhip64.so";
  void *handle = ::dlopen(name, RTLD_NOW | RTLD_LOCAL);
  if (!handle)
    ADD_FAILURE() << "the fake driver is not on LD_LIBRARY_PATH: "
                  << ::dlerror();
  auto *state = static_cast<FakeGpuState *>(::dlsym(handle, "fake_gpu_state"));
  if (!state)
    std::abort();
  return *state;
}

/// The primary context the fake hands out for `device`.
void *primaryOf(int device) {
  return reinterpret_cast<void *>(uintptr_t(0x1000 + device));
}

/// The value parameters after the descriptor fields (flags, ignore_index,
/// label_smoothing, z_loss, shard_start, shard_vocab, logit_scale,
/// logit_softcap).
constexpr int kValueParams = 8;

/// The byte size of each kernel parameter of `key`, one digit each (the
/// fake driver's SIZES): 8 per descriptor field, 8 per i64 value, 4 per f32
/// value.
std::string paramSizes(const KernelVariantKey &key) {
  std::string sizes;
  for (auto &[role, rank, dtype] : canonicalArgs(key))
    if (isValueArg(role))
      sizes += dtype == "f32" ? "4" : "8";
    else
      sizes += std::string(3 + 2 * rank, '8');
  return sizes;
}

int paramCount(const KernelVariantKey &key) {
  return int(paramSizes(key).size());
}

/// The 8-byte parameter slot the fake records for an f32 value: its 4 bytes
/// first, the rest zero (the driver reads 4).
uint64_t f32Param(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

struct GpuKernelSpec {
  KernelVariantKey key;
  std::string symbol;
  int64_t minVocab = 0; ///< launch.min_vocab, written when not 0
};

/// The fake code object for `target` (PTX or an HSACO) carrying `text`.
std::string gpuObject(const std::string &target, const std::string &text) {
  return target.rfind("sm_", 0) == 0 ? fakePtx(text) : fakeHsaco(text);
}

/// A bundle directory for GPU targets: one fake code object per target whose
/// text lists each kernel's symbol, parameter count and parameter sizes
/// (unless `listKernels` is false), and a sealed manifest that records each
/// object's SHA-256.
class GpuBundle {
public:
  GpuBundle(const std::vector<std::string> &targets,
            const std::vector<GpuKernelSpec> &kernels, int64_t blockSize = 256,
            int64_t rowsPerBlock = 1, int64_t ldsBytes = 0,
            const std::string &objectText = "", bool mustOpen = true,
            bool listKernels = true) {
    std::string objects, entries;
    for (const std::string &target : targets) {
      bool cuda = target.rfind("sm_", 0) == 0;
      std::string file = target + (cuda ? ".ptx" : ".hsaco");
      std::string text = objectText;
      for (const GpuKernelSpec &kernel : kernels)
        if (listKernels)
          text += kernel.symbol + " " + std::to_string(paramCount(kernel.key)) +
                  " " + paramSizes(kernel.key) + "\n";
      std::string object = gpuObject(target, text);
      dir.write(file, object);
      objects += std::string(objects.empty() ? "" : ", ") + "{\"file\": \"" +
                 file + "\", \"target\": \"" + target + "\", \"kind\": \"" +
                 (cuda ? "ptx" : "hsaco") + "\", \"sha256\": \"" +
                 sha256Of(object) + "\"}";
      for (const GpuKernelSpec &kernel : kernels) {
        std::string args = argsJson(canonicalArgs(kernel.key));
        entries += std::string(entries.empty() ? "" : ",\n") + "{\"key\": \"" +
                   kernel.key.str() + "\", \"target\": \"" + target +
                   "\", \"object\": \"" + file + "\", \"symbol\": \"" +
                   kernel.symbol +
                   "\", \"abi\": \"memref-descriptor-fields\", \"launch\": "
                   "{\"block_size\": " +
                   std::to_string(blockSize) +
                   ", \"rows_per_block\": " + std::to_string(rowsPerBlock) +
                   ", \"lds_bytes\": " + std::to_string(ldsBytes) +
                   (kernel.minVocab
                        ? ", \"min_vocab\": " + std::to_string(kernel.minVocab)
                        : std::string()) +
                   "}, \"args\": " + args + "}";
      }
    }
    std::string manifest = "{\"format\": \"cegen-bundle\", \"version\": " +
                           std::to_string(CE_RUNTIME_BUNDLE_VERSION) +
                           ", \"objects\": [" + objects + "], \"kernels\": [" +
                           entries + "], \"manifest_sha256\": \"" +
                           std::string(64, '0') + "\"}";
    dir.write("manifest.json", sealManifest(manifest));
    ce_status status = ce_bundle_open(dir.path().c_str(), &bundle);
    if (mustOpen) {
      EXPECT_EQ(status, CE_OK) << ce_last_error_message();
    }
  }
  ~GpuBundle() { ce_bundle_close(bundle); }
  ce_bundle *get() const { return bundle; }
  const std::string &path() const { return dir.path(); }

private:
  TempDir dir;
  ce_bundle *bundle = nullptr;
};

/// A flat forward problem whose tensors claim to live on `device`; the fake
/// driver reads "device memory" as host memory.
struct GpuProblem {
  int64_t n, v;
  std::vector<float> logits, loss, lse;
  std::vector<int64_t> labels;
  ce_tensor tLogits, tLabels, tLoss, tLse;

  GpuProblem(ce_device_type device, int32_t index, int64_t n = 5, int64_t v = 7)
      : n(n), v(v), logits(n * (v + 3) + 1), loss(2 * n + 1), lse(n + 1),
        labels(3 * n + 1) {
    for (int64_t i = 0; i < n; ++i)
      labels[3 * i] = i % v;
    tLogits = view(logits.data(), CE_DTYPE_F32, {n, v}, {v + 3, 1});
    tLabels = view(labels.data(), CE_DTYPE_I64, {n}, {3});
    tLoss = view(loss.data(), CE_DTYPE_F32, {n}, {2});
    tLse = packed(lse.data(), CE_DTYPE_F32, {n});
    for (ce_tensor *t : {&tLogits, &tLabels, &tLoss, &tLse}) {
      t->device = device;
      t->device_index = index;
    }
  }
  ce_status forward(ce_bundle *bundle, void *stream) {
    return ce_forward(bundle, nullptr, &tLogits, &tLabels, &tLoss, &tLse,
                      stream);
  }
};

void *fakeStream(uintptr_t id) { return reinterpret_cast<void *>(id); }

/// Resets the steering and counters that tests change.
class GpuTest : public ::testing::TestWithParam<ce_device_type> {
protected:
  void SetUp() override {
    FakeGpuState &s = fake(GetParam());
    s.deviceCount = 3;
    s.capturing = 0;
    s.idle = 1;
    s.failLaunch = 0;
    s.currentContext = GetParam() == CE_DEVICE_CUDA ? primaryOf(0) : nullptr;
    s.currentDevice = 0;
    // Earlier tests may have left reports behind on the streams used here.
    for (uintptr_t stream : {0, 1, 2, 3, 7, 8, 9})
      for (int device = 0; device < 3; ++device)
        while (ce_check_label_status(GetParam(), device, fakeStream(stream),
                                     1) == CE_ERROR_LABEL_OUT_OF_RANGE) {
        }
  }
  FakeGpuState &state() { return fake(GetParam()); }
  ce_device_type device() const { return GetParam(); }
  std::string target(int index = 0) const {
    if (GetParam() == CE_DEVICE_CUDA)
      return index == 2 ? "sm_80" : "sm_90";
    return index == 2 ? "gfx90a" : "gfx942";
  }
  /// Writes `value` into the status word of the last launch, as a kernel
  /// that met a bad label does: the last tensor's aligned pointer (its
  /// descriptor's 5 fields come before the values).
  void kernelReports(int64_t value) { *lastStatusWord() = value; }
  int64_t *lastStatusWord() {
    return reinterpret_cast<int64_t *>(
        state().params[state().numParams - kValueParams - 5 + 1]);
  }
};

TEST_P(GpuTest, PicksTheDevicesTargetAndPassesDescriptorFields) {
  KernelVariantKey key = forwardKey();
  GpuBundle bundle({target()}, {{key, "ce_forward_0"}}, 128, 1, 96);
  GpuProblem p(device(), 0);
  int64_t launches = state().launches;
  ASSERT_EQ(p.forward(bundle.get(), fakeStream(7)), CE_OK)
      << ce_last_error_message();
  EXPECT_STREQ(ce_last_error_message(), "");
  const FakeGpuState &s = state();
  ASSERT_EQ(s.launches, launches + 1);
  EXPECT_STREQ(s.symbol, "ce_forward_0");
  EXPECT_EQ(s.grid[0], 5u);
  EXPECT_EQ(s.grid[1], 1u);
  EXPECT_EQ(s.grid[2], 1u);
  EXPECT_EQ(s.block[0], 128u);
  EXPECT_EQ(s.block[1], 1u);
  EXPECT_EQ(s.sharedBytes, 96u);
  EXPECT_EQ(s.stream, fakeStream(7));
  ASSERT_EQ(s.numParams, paramCount(key));
  // logits [5, 7] strides [10, 1]; labels [5] stride 3; loss [5] stride 2;
  // lse [5] stride 1; lse_low, entropy and argmax as lse; status [1]
  // stride 1.
  auto ptr = [](const void *p) { return uint64_t(uintptr_t(p)); };
  std::vector<uint64_t> expected = {ptr(p.logits.data()),
                                    ptr(p.logits.data()),
                                    0,
                                    5,
                                    7,
                                    10,
                                    1,
                                    ptr(p.labels.data()),
                                    ptr(p.labels.data()),
                                    0,
                                    5,
                                    3,
                                    ptr(p.loss.data()),
                                    ptr(p.loss.data()),
                                    0,
                                    5,
                                    2,
                                    ptr(p.lse.data()),
                                    ptr(p.lse.data()),
                                    0,
                                    5,
                                    1,
                                    // lse_low, entropy, argmax: without
                                    // options->lse_low, entropy and
                                    // argmax, the lse's view (flag bits
                                    // 3 to 5 off).
                                    ptr(p.lse.data()),
                                    ptr(p.lse.data()),
                                    0,
                                    5,
                                    1,
                                    ptr(p.lse.data()),
                                    ptr(p.lse.data()),
                                    0,
                                    5,
                                    1,
                                    ptr(p.lse.data()),
                                    ptr(p.lse.data()),
                                    0,
                                    5,
                                    1};
  for (size_t i = 0; i < expected.size(); ++i)
    EXPECT_EQ(s.params[i], expected[i]) << "parameter " << i;
  // The status word: allocated == aligned, offset 0, size 1, stride 1,
  // zero, in memory the runtime owns.
  EXPECT_EQ(s.params[37], s.params[38]);
  EXPECT_NE(s.params[37], 0u);
  EXPECT_EQ(s.params[39], 0u);
  EXPECT_EQ(s.params[40], 1u);
  EXPECT_EQ(s.params[41], 1u);
  // The values last: all 0 by default but the slice, [0, V) of V, and the
  // logit scale 1 (the softcap, last, is 0: none).
  ASSERT_EQ(s.numParams, 42 + kValueParams);
  for (int i = 42; i < 42 + kValueParams - 3; ++i)
    EXPECT_EQ(s.params[i], 0u) << "parameter " << i;
  EXPECT_EQ(s.params[42 + kValueParams - 3], 7u);
  EXPECT_EQ(s.params[42 + kValueParams - 2], f32Param(1.0f));
  EXPECT_EQ(s.params[42 + kValueParams - 1], f32Param(0.0f));
  EXPECT_EQ(*lastStatusWord(), 0);
  EXPECT_EQ(ce_check_label_status(device(), 0, fakeStream(7), 1), CE_OK);
}

TEST_P(GpuTest, EntropyAndArgmaxAreTheirOwnDescriptorsWhenGiven) {
  // options->entropy and options->argmax replace the lse placeholders in
  // the forward's and the fused kernel's parameters (after lse_low), and
  // set flag bits 4 and 5, each on its own.
  KernelVariantKey forward = forwardKey();
  KernelVariantKey fused = forwardKey();
  fused.op = KernelOp::Fused;
  fused.weights = WeightsKind::Token;
  GpuBundle bundle({target()},
                   {{forward, "ce_forward_0"}, {fused, "ce_fused_0"}});
  GpuProblem p(device(), 0);
  std::vector<float> entropy(2 * p.n);
  std::vector<int64_t> argmax(p.n);
  ce_tensor tEntropy = view(entropy.data(), CE_DTYPE_F32, {p.n}, {2});
  ce_tensor tArgmax = packed(argmax.data(), CE_DTYPE_I64, {p.n});
  for (ce_tensor *t : {&tEntropy, &tArgmax}) {
    t->device = device();
    t->device_index = 0;
  }
  std::vector<float> grad(p.n * p.v);
  ce_tensor tGrad = packed(grad.data(), CE_DTYPE_F32, {p.n, p.v});
  tGrad.device = device();
  float weight = 1.0f;
  ce_tensor tWeight = view(&weight, CE_DTYPE_F32, {}, {});
  tWeight.device = device();
  auto ptr = [](const void *q) { return uint64_t(uintptr_t(q)); };
  /// A token tensor's 5 descriptor fields from parameter `firstField` on.
  struct Want {
    const void *data;
    uint64_t stride;
  };
  auto expectToken = [&](int firstField, Want want) {
    const FakeGpuState &s = state();
    EXPECT_EQ(s.params[firstField], ptr(want.data));
    EXPECT_EQ(s.params[firstField + 1], ptr(want.data));
    EXPECT_EQ(s.params[firstField + 2], 0u);
    EXPECT_EQ(s.params[firstField + 3], uint64_t(p.n));
    EXPECT_EQ(s.params[firstField + 4], want.stride);
  };
  for (int given = 1; given <= 3; ++given) {
    SCOPED_TRACE(given);
    bool withEntropy = given & 1, withArgmax = given & 2;
    ce_options options;
    ce_options_init(&options);
    options.entropy = withEntropy ? &tEntropy : nullptr;
    options.argmax = withArgmax ? &tArgmax : nullptr;
    int64_t flags = (withEntropy ? int64_t{kFlagEntropy} : 0) |
                    (withArgmax ? int64_t{kFlagArgmax} : 0);
    Want wantEntropy =
        withEntropy ? Want{entropy.data(), 2} : Want{p.lse.data(), 1};
    Want wantArgmax =
        withArgmax ? Want{argmax.data(), 1} : Want{p.lse.data(), 1};
    ASSERT_EQ(ce_forward(bundle.get(), &options, &p.tLogits, &p.tLabels,
                         &p.tLoss, &p.tLse, fakeStream(7)),
              CE_OK)
        << ce_last_error_message();
    {
      const FakeGpuState &s = state();
      EXPECT_STREQ(s.symbol, "ce_forward_0");
      ASSERT_EQ(s.numParams, paramCount(forward));
      // logits 7, labels, loss, lse, lse_low 5 each: entropy at 27.
      expectToken(22, {p.lse.data(), 1}); // lse_low: the placeholder
      expectToken(27, wantEntropy);
      expectToken(32, wantArgmax);
      EXPECT_EQ(int64_t(s.params[s.numParams - kValueParams]), flags);
    }
    ASSERT_EQ(ce_fused(bundle.get(), &options, &p.tLogits, &p.tLabels, &tWeight,
                       &p.tLoss, &p.tLse, &tGrad, fakeStream(7)),
              CE_OK)
        << ce_last_error_message();
    {
      const FakeGpuState &s = state();
      EXPECT_STREQ(s.symbol, "ce_fused_0");
      ASSERT_EQ(s.numParams, paramCount(fused));
      // The weights (5 fields) come before loss: everything 5 later.
      expectToken(32, wantEntropy);
      expectToken(37, wantArgmax);
      EXPECT_EQ(s.params[42], ptr(grad.data()));
      EXPECT_EQ(int64_t(s.params[s.numParams - kValueParams]), flags);
    }
  }
}

TEST_P(GpuTest, OptionValuesFollowTheDescriptorsByValue) {
  // Every value distinct, so that two swapped, one dropped, or one passed
  // in the wrong type (an f32 as a double, an i64 as an i32) shows.
  KernelVariantKey key = forwardKey();
  key.smoothing = true;
  key.zLoss = true;
  GpuBundle bundle({target()}, {{key, "ce_forward_0"}});
  GpuProblem p(device(), 0);
  ce_options options;
  ce_options_init(&options);
  options.has_ignore_index = 1;
  options.ignore_index = -7;
  options.label_smoothing = 0.125f;
  options.z_loss = 3.0e-4f;
  options.logit_scale = 2.75f;
  for (ce_label_policy policy :
       {CE_LABEL_POLICY_MEGATRON, CE_LABEL_POLICY_STRICT}) {
    SCOPED_TRACE(policy);
    options.label_policy = policy;
    ASSERT_EQ(ce_forward(bundle.get(), &options, &p.tLogits, &p.tLabels,
                         &p.tLoss, &p.tLse, fakeStream(7)),
              CE_OK)
        << ce_last_error_message();
    const FakeGpuState &s = state();
    ASSERT_EQ(s.numParams, paramCount(key));
    const uint64_t *values = s.params + s.numParams - kValueParams;
    uint64_t flags = kFlagIgnoreIndex;
    if (policy == CE_LABEL_POLICY_MEGATRON)
      flags |= kFlagMegatronLabels;
    EXPECT_EQ(values[0], flags);
    EXPECT_EQ(values[1], uint64_t(int64_t{-7}));
    EXPECT_EQ(values[2], f32Param(0.125f));
    EXPECT_EQ(values[3], f32Param(3.0e-4f));
    EXPECT_EQ(values[4], 0u);
    EXPECT_EQ(values[5], uint64_t(p.v));
    EXPECT_EQ(values[6], f32Param(2.75f));
    EXPECT_EQ(values[7], f32Param(0.0f)); // no softcap: the plain kernel
    EXPECT_EQ(s.params[0], uint64_t(uintptr_t(p.logits.data())));
  }
  EXPECT_EQ(ce_check_label_status(device(), 0, fakeStream(7), 1), CE_OK);
}

TEST_P(GpuTest, ShardBoundsFollowTheDescriptorsByValue) {
  // A backward over the slice [5, 5 + V) of a vocabulary of 64 with
  // Megatron's local smoothing, then with global smoothing (flag bit 2);
  // then unsharded, the slice [0, V) of V. One kernel serves all three.
  KernelVariantKey key = forwardKey();
  key.op = KernelOp::Backward;
  key.smoothing = true;
  GpuBundle bundle({target()}, {{key, "ce_backward_0"}});
  GpuProblem p(device(), 0);
  std::vector<float> gradLoss(p.n, 1.0f), grad(p.n * p.v);
  ce_tensor tGradLoss = packed(gradLoss.data(), CE_DTYPE_F32, {p.n});
  ce_tensor tGrad = packed(grad.data(), CE_DTYPE_F32, {p.n, p.v});
  for (ce_tensor *t : {&tGradLoss, &tGrad}) {
    t->device = device();
    t->device_index = 0;
  }
  ce_options options;
  ce_options_init(&options);
  options.label_smoothing = 0.5f;
  options.shard_start = 5;
  options.shard_vocab = 64;
  ASSERT_EQ(ce_backward(bundle.get(), &options, &p.tLogits, &p.tLabels, &p.tLse,
                        &tGradLoss, &tGrad, fakeStream(7)),
            CE_OK)
      << ce_last_error_message();
  const FakeGpuState &s = state();
  EXPECT_STREQ(s.symbol, "ce_backward_0");
  ASSERT_EQ(s.numParams, paramCount(key));
  const uint64_t *values = s.params + s.numParams - kValueParams;
  EXPECT_EQ(values[0], 0u);
  EXPECT_EQ(values[2], f32Param(0.5f));
  EXPECT_EQ(values[3], f32Param(0.0f));
  EXPECT_EQ(values[4], 5u);
  EXPECT_EQ(values[5], 64u);
  // The gradient's descriptor comes right before the status word's.
  EXPECT_EQ(s.params[s.numParams - kValueParams - 5 - 7 + 1],
            uint64_t(uintptr_t(grad.data())));
  EXPECT_EQ(ce_check_label_status(device(), 0, fakeStream(7), 1), CE_OK);

  options.shard_global_smoothing = 1;
  ASSERT_EQ(ce_backward(bundle.get(), &options, &p.tLogits, &p.tLabels, &p.tLse,
                        &tGradLoss, &tGrad, fakeStream(7)),
            CE_OK)
      << ce_last_error_message();
  values = state().params + state().numParams - kValueParams;
  EXPECT_EQ(values[0], uint64_t{kFlagGlobalSmoothing});
  EXPECT_EQ(values[0], 4u);
  EXPECT_EQ(values[4], 5u);
  EXPECT_EQ(values[5], 64u);
  EXPECT_EQ(ce_check_label_status(device(), 0, fakeStream(7), 1), CE_OK);

  // Unsharded (global smoothing asked for, but no shard): [0, V) of V, no
  // flag.
  options.shard_start = 0;
  options.shard_vocab = 0;
  ASSERT_EQ(ce_backward(bundle.get(), &options, &p.tLogits, &p.tLabels, &p.tLse,
                        &tGradLoss, &tGrad, fakeStream(7)),
            CE_OK)
      << ce_last_error_message();
  values = state().params + state().numParams - kValueParams;
  EXPECT_EQ(values[0], 0u);
  EXPECT_EQ(values[2], f32Param(0.5f));
  EXPECT_EQ(values[4], 0u);
  EXPECT_EQ(values[5], uint64_t(p.v));
  EXPECT_EQ(ce_check_label_status(device(), 0, fakeStream(7), 1), CE_OK);
}

TEST_P(GpuTest, AScalarWeightIsATokenDescriptorOfStrideZero) {
  // Fused kernels take per-token weights: a 0-d weight is passed as a
  // descriptor of the labels' shape whose stride is 0.
  KernelVariantKey key = forwardKey();
  key.op = KernelOp::Fused;
  key.weights = WeightsKind::Token;
  GpuBundle bundle({target()}, {{key, "ce_fused_0"}});
  GpuProblem p(device(), 0);
  float weight = 0.5f;
  std::vector<float> grad(p.n * p.v);
  ce_tensor tWeight = view(&weight, CE_DTYPE_F32, {}, {});
  ce_tensor tGrad = packed(grad.data(), CE_DTYPE_F32, {p.n, p.v});
  for (ce_tensor *t : {&tWeight, &tGrad}) {
    t->device = device();
    t->device_index = 0;
  }
  ASSERT_EQ(ce_fused(bundle.get(), nullptr, &p.tLogits, &p.tLabels, &tWeight,
                     &p.tLoss, &p.tLse, &tGrad, fakeStream(7)),
            CE_OK)
      << ce_last_error_message();
  const FakeGpuState &s = state();
  EXPECT_STREQ(s.symbol, "ce_fused_0");
  ASSERT_EQ(s.numParams, paramCount(key));
  // logits (7 fields), labels (5), then the weights: allocated, aligned,
  // offset, size N, stride 0.
  const uint64_t *weights = s.params + 7 + 5;
  EXPECT_EQ(weights[0], uint64_t(uintptr_t(&weight)));
  EXPECT_EQ(weights[1], uint64_t(uintptr_t(&weight)));
  EXPECT_EQ(weights[2], 0u);
  EXPECT_EQ(weights[3], uint64_t(p.n));
  EXPECT_EQ(weights[4], 0u);
  // The loss's descriptor follows.
  EXPECT_EQ(weights[5], uint64_t(uintptr_t(p.loss.data())));
  EXPECT_EQ(ce_check_label_status(device(), 0, fakeStream(7), 1), CE_OK);
}

TEST_P(GpuTest, MissingTargetNamesTheTargetsTheBundleHas) {
  GpuBundle bundle({target(0)}, {{forwardKey(), "ce_forward_0"}});
  GpuProblem p(device(), 2); // device 2 is the older chip
  EXPECT_EQ(p.forward(bundle.get(), nullptr), CE_ERROR_VARIANT_NOT_FOUND);
  std::string message = ce_last_error_message();
  EXPECT_THAT(message, HasSubstr("for target " + target(2)));
  EXPECT_THAT(message, HasSubstr(device() == CE_DEVICE_CUDA
                                     ? "CUDA device 2 (compute capability 8.0)"
                                     : "HIP device 2 (gfx90a)"));
  EXPECT_THAT(message,
              HasSubstr("the bundle has no " + target(2) +
                        " kernels; it has kernels for targets " + target(0) +
                        ", this variant for " + target(0)));
  EXPECT_THAT(message, HasSubstr("ce-gen --target=" + target(2)));
  // Device 3 does not exist.
  GpuProblem q(device(), 3);
  EXPECT_EQ(q.forward(bundle.get(), nullptr), CE_ERROR_NO_DEVICE);
  EXPECT_THAT(ce_last_error_message(), HasSubstr("this machine has 3"));
}

TEST_P(GpuTest, ModulesLoadOncePerDeviceAndEmptyBatchesLaunchNothing) {
  KernelVariantKey other = forwardKey();
  other.labels = ElemType::I32;
  GpuBundle bundle({target()},
                   {{forwardKey(), "ce_forward_0"}, {other, "ce_forward_1"}});
  int64_t loads = state().moduleLoads, launches = state().launches;
  GpuProblem empty(device(), 0, 0);
  EXPECT_EQ(empty.forward(bundle.get(), nullptr), CE_OK);
  EXPECT_EQ(state().moduleLoads, loads);
  EXPECT_EQ(state().launches, launches);

  for (int repeat = 0; repeat < 3; ++repeat)
    for (int index : {0, 1}) {
      GpuProblem p(device(), index);
      ASSERT_EQ(p.forward(bundle.get(), nullptr), CE_OK)
          << ce_last_error_message();
      std::vector<int32_t> labels32(p.n, 1);
      p.tLabels = view(labels32.data(), CE_DTYPE_I32, {p.n}, {1});
      p.tLabels.device = device();
      p.tLabels.device_index = index;
      ASSERT_EQ(p.forward(bundle.get(), nullptr), CE_OK)
          << ce_last_error_message();
      EXPECT_STREQ(state().symbol, "ce_forward_1");
    }
  // One module per device (and context), shared by both kernels.
  EXPECT_EQ(state().moduleLoads, loads + 2);
  EXPECT_EQ(state().launches, launches + 12);
  int64_t unloads = state().moduleUnloads;
  { GpuBundle unused({target()}, {{forwardKey(), "ce_forward_0"}}); }
  EXPECT_EQ(state().moduleUnloads, unloads); // never launched: nothing loaded
}

TEST_P(GpuTest, ClosingABundleUnloadsItsModules) {
  int64_t unloads = state().moduleUnloads;
  {
    GpuBundle bundle({target()}, {{forwardKey(), "ce_forward_0"}});
    GpuProblem p(device(), 0);
    ASSERT_EQ(p.forward(bundle.get(), nullptr), CE_OK);
  }
  EXPECT_EQ(state().moduleUnloads, unloads + 1);
}

TEST_P(GpuTest, KernelsRunInTheTensorsDevicesContext) {
  GpuBundle bundle({target()}, {{forwardKey(), "ce_forward_0"}});
  FakeGpuState &s = state();
  GpuProblem p0(device(), 0), p1(device(), 1);
  if (device() == CE_DEVICE_CUDA) {
    // The current context is on device 0: used as is.
    s.currentContext = primaryOf(0);
    int64_t pushes = s.pushes;
    ASSERT_EQ(p0.forward(bundle.get(), nullptr), CE_OK);
    EXPECT_EQ(s.launchContext, primaryOf(0));
    EXPECT_EQ(s.pushes, pushes);
    // A user's context on device 1 (not the primary one) is used as well.
    void *user = reinterpret_cast<void *>(uintptr_t(0x2001));
    s.currentContext = user;
    ASSERT_EQ(p1.forward(bundle.get(), nullptr), CE_OK);
    EXPECT_EQ(s.launchContext, user);
    // Tensors on device 1 while device 0's context is current: device 1's
    // primary context is pushed for the call and popped after.
    s.currentContext = primaryOf(0);
    int64_t pops = s.pops;
    ASSERT_EQ(p1.forward(bundle.get(), nullptr), CE_OK);
    EXPECT_EQ(s.launchContext, primaryOf(1));
    EXPECT_EQ(s.currentContext, primaryOf(0));
    EXPECT_EQ(s.pushes, pushes + 1);
    EXPECT_EQ(s.pops, pops + 1);
    // No current context at all: the primary context.
    s.currentContext = nullptr;
    ASSERT_EQ(p0.forward(bundle.get(), nullptr), CE_OK);
    EXPECT_EQ(s.launchContext, primaryOf(0));
    EXPECT_EQ(s.currentContext, nullptr);
  } else {
    s.currentDevice = 0;
    ASSERT_EQ(p1.forward(bundle.get(), nullptr), CE_OK);
    EXPECT_EQ(s.launchDevice, 1);
    EXPECT_EQ(s.currentDevice, 0); // restored
    ASSERT_EQ(p0.forward(bundle.get(), nullptr), CE_OK);
    EXPECT_EQ(s.launchDevice, 0);
  }
}

TEST_P(GpuTest, GridCoversTokensByRowsPerBlock) {
  GpuBundle bundle({target()}, {{forwardKey(), "ce_forward_0"}}, 64, 4, 0);
  GpuProblem p(device(), 0, 9);
  ASSERT_EQ(p.forward(bundle.get(), nullptr), CE_OK);
  EXPECT_EQ(state().grid[0], 3u); // ceil(9 / 4)
  EXPECT_EQ(state().block[0], 64u);
}

TEST_P(GpuTest, LongRowsTakeTheKernelWithTheLargestMinimumTheyReach) {
  GpuBundle bundle({target()},
                   {{forwardKey(), "ce_forward_long_rows", 8},
                    {forwardKey(), "ce_forward_0"},
                    {forwardKey(), "ce_forward_longer_rows", 100}});
  for (auto [vocab, symbol] :
       {std::pair{int64_t(7), "ce_forward_0"},
        std::pair{int64_t(8), "ce_forward_long_rows"},
        std::pair{int64_t(99), "ce_forward_long_rows"},
        std::pair{int64_t(100), "ce_forward_longer_rows"}}) {
    GpuProblem p(device(), 0, 3, vocab);
    ASSERT_EQ(p.forward(bundle.get(), nullptr), CE_OK)
        << ce_last_error_message();
    EXPECT_STREQ(state().symbol, symbol) << "V = " << vocab;
  }
}

TEST_P(GpuTest, TwoKernelsForOneKeyAndMinimumAreRejected) {
  {
    GpuBundle bundle({target()},
                     {{forwardKey(), "ce_forward_0", 8},
                      {forwardKey(), "ce_forward_1", 8}},
                     256, 1, 0, "", /*mustOpen=*/false);
    EXPECT_EQ(bundle.get(), nullptr);
  }
  EXPECT_NE(std::string(ce_last_error_message()).find("min_vocab 8"),
            std::string::npos)
      << ce_last_error_message();
}

TEST_P(GpuTest, LoadAndSymbolErrors) {
  {
    GpuBundle bundle({target()}, {{forwardKey(), "ce_forward_0"}}, 256, 1, 0,
                     "bad-ptx\n");
    GpuProblem p(device(), 0);
    EXPECT_EQ(p.forward(bundle.get(), nullptr), CE_ERROR_BACKEND);
    EXPECT_THAT(ce_last_error_message(), HasSubstr("cannot load '"));
    if (device() == CE_DEVICE_CUDA) {
      EXPECT_THAT(ce_last_error_message(),
                  HasSubstr("JIT log: ptxas fatal: fake syntax error"));
    }
  }
  {
    // The object lists another symbol than the manifest names.
    GpuBundle bundle({target()}, {{forwardKey(), "ce_forward_0"}}, 256, 1, 0,
                     "some_other_kernel 33\n", /*mustOpen=*/true,
                     /*listKernels=*/false);
    GpuProblem p(device(), 0);
    EXPECT_EQ(p.forward(bundle.get(), nullptr), CE_ERROR_BUNDLE);
    EXPECT_THAT(ce_last_error_message(),
                HasSubstr("kernel symbol 'ce_forward_0' not found"));
  }
  {
    GpuBundle bundle({target()}, {{forwardKey(), "ce_forward_0"}});
    state().failLaunch = 1;
    GpuProblem p(device(), 0);
    EXPECT_EQ(p.forward(bundle.get(), nullptr), CE_ERROR_BACKEND);
    EXPECT_THAT(ce_last_error_message(), HasSubstr("aunchKernel failed"));
    state().failLaunch = 0;
  }
}

TEST_P(GpuTest, AnObjectChangedAfterOpenIsNotLoaded) {
  // The object is checked again when it is read for loading: what the
  // driver gets is what the manifest's SHA-256 vouches for.
  std::string file =
      target() + (device() == CE_DEVICE_CUDA ? ".ptx" : ".hsaco");
  {
    // Another run's object, as well formed as the first.
    GpuBundle bundle({target()}, {{forwardKey(), "ce_forward_0"}});
    std::ofstream(bundle.path() + "/" + file, std::ios::binary)
        << gpuObject(target(), "ce_forward_0 33\n# another run\n");
    int64_t loads = state().moduleLoads;
    GpuProblem p(device(), 0);
    EXPECT_EQ(p.forward(bundle.get(), nullptr), CE_ERROR_BUNDLE);
    EXPECT_THAT(ce_last_error_message(),
                HasSubstr(bundle.path() + "/" + file + "' (objects[0]"));
    EXPECT_THAT(ce_last_error_message(), HasSubstr("does not match its "
                                                   "manifest"));
    EXPECT_EQ(state().moduleLoads, loads);
  }
  {
    // Cut short.
    GpuBundle bundle({target()}, {{forwardKey(), "ce_forward_0"}});
    std::string bytes = readFile(bundle.path() + "/" + file);
    std::ofstream(bundle.path() + "/" + file, std::ios::binary)
        << bytes.substr(0, bytes.size() - 3);
    int64_t loads = state().moduleLoads;
    GpuProblem p(device(), 0);
    EXPECT_EQ(p.forward(bundle.get(), nullptr), CE_ERROR_BUNDLE);
    EXPECT_THAT(ce_last_error_message(), HasSubstr("is damaged (not a valid"));
    EXPECT_EQ(state().moduleLoads, loads);
  }
}

TEST_P(GpuTest, BadLabelsAreReportedByTheCheckNotTheLaunch) {
  KernelVariantKey key = forwardKey();
  GpuBundle bundle({target()}, {{key, "ce_forward_0"}});
  GpuProblem p(device(), 0);
  ce_options options;
  ce_options_init(&options);
  options.has_ignore_index = 1;
  EXPECT_EQ(options.ignore_index, -100); // ce_options_init's
  p.labels[3 * 3] = 12345;
  void *stream = fakeStream(8);
  state().idle = 0; // the GPU is still busy
  ASSERT_EQ(ce_forward(bundle.get(), &options, &p.tLogits, &p.tLabels, &p.tLoss,
                       &p.tLse, stream),
            CE_OK);
  int64_t syncs = state().syncs;
  // Not yet written: a non-blocking check sees nothing.
  EXPECT_EQ(ce_check_label_status(device(), 0, stream, 0), CE_OK);
  kernelReports(1 + 3);
  EXPECT_EQ(ce_check_label_status(device(), 0, stream, 0),
            CE_ERROR_LABEL_OUT_OF_RANGE);
  EXPECT_EQ(state().syncs, syncs); // never waited
  std::string message = ce_last_error_message();
  EXPECT_THAT(message, HasSubstr("ce_check_label_status: ce_forward (launch "));
  EXPECT_THAT(
      message,
      HasSubstr(std::string(device() == CE_DEVICE_CUDA ? "CUDA" : "HIP") +
                " device 0, stream 0x8"));
  EXPECT_THAT(message, HasSubstr("variant \"" + key.str() + "\""));
  EXPECT_THAT(message,
              HasSubstr("token 3 (n=3): label 12345 is not in [0, 7) and is "
                        "not the ignore_index -100; that token's loss is NaN"));
  // Each report is made once.
  EXPECT_EQ(ce_check_label_status(device(), 0, stream, 0), CE_OK);
  // Other streams and devices have nothing to report.
  EXPECT_EQ(ce_check_label_status(device(), 0, fakeStream(9), 1), CE_OK);
  EXPECT_EQ(ce_check_label_status(device(), 1, stream, 1), CE_OK);
  // Waiting synchronizes the stream and frees the slots, zeroed.
  int64_t *first = lastStatusWord();
  syncs = state().syncs;
  EXPECT_EQ(ce_check_label_status(device(), 0, stream, 1), CE_OK);
  EXPECT_EQ(state().syncs, syncs + 1);
  EXPECT_EQ(*first, 0);
}

TEST_P(GpuTest, SlotsReturnWhenTheStreamIsSeenIdle) {
  GpuBundle bundle({target()}, {{forwardKey(), "ce_forward_0"}});
  GpuProblem p(device(), 0);
  p.labels[3 * 1] = 70;
  void *stream = fakeStream(1);
  ASSERT_EQ(ce_check_label_status(device(), 0, stream, 1), CE_OK);
  state().idle = 0;
  std::vector<int64_t *> words;
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(p.forward(bundle.get(), stream), CE_OK);
    words.push_back(lastStatusWord());
  }
  EXPECT_NE(words[0], words[1]);
  EXPECT_NE(words[1], words[2]);
  // The second launch reports; the message names it, not the others.
  *words[1] = 2;
  EXPECT_EQ(ce_check_label_status(device(), 0, stream, 0),
            CE_ERROR_LABEL_OUT_OF_RANGE);
  EXPECT_THAT(ce_last_error_message(),
              HasSubstr("token 1 (n=1): label 70 is not in [0, 7)"));
  state().idle = 1;
  EXPECT_EQ(ce_check_label_status(device(), 0, stream, 0), CE_OK);
  ASSERT_EQ(p.forward(bundle.get(), stream), CE_OK);
  EXPECT_EQ(lastStatusWord(), words[2] + 1);
  ASSERT_EQ(ce_check_label_status(device(), 0, stream, 1), CE_OK);
}

TEST_P(GpuTest, AFullRingSharesAnOverflowWord) {
  GpuBundle bundle({target()}, {{forwardKey(), "ce_forward_0"}});
  GpuProblem p(device(), 0);
  void *stream = fakeStream(2);
  ASSERT_EQ(ce_check_label_status(device(), 0, stream, 1), CE_OK);
  state().idle = 0;
  std::set<int64_t *> words;
  for (int i = 0; i < 1030; ++i) {
    ASSERT_EQ(p.forward(bundle.get(), stream), CE_OK);
    words.insert(lastStatusWord());
  }
  EXPECT_EQ(words.size(), 1025u);
  kernelReports(5);
  EXPECT_EQ(ce_check_label_status(device(), 0, stream, 0),
            CE_ERROR_LABEL_OUT_OF_RANGE);
  EXPECT_THAT(ce_last_error_message(),
              HasSubstr("one of the 6 launches from launch "));
  EXPECT_THAT(ce_last_error_message(),
              HasSubstr("a label out of range at token 4 of one of these "
                        "launches"));
  state().idle = 1;
  EXPECT_EQ(ce_check_label_status(device(), 0, stream, 1), CE_OK);
  EXPECT_EQ(*lastStatusWord(), 0);
  ASSERT_EQ(p.forward(bundle.get(), stream), CE_OK);
  EXPECT_EQ(lastStatusWord(), *words.begin()); // the ring starts over
}

TEST_P(GpuTest, CapturedLaunchesKeepTheirWords) {
  GpuBundle bundle({target()}, {{forwardKey(), "ce_forward_0"}});
  GpuProblem p(device(), 0);
  void *stream = fakeStream(3);
  state().capturing = 1;
  int64_t exchanges = state().captureModeExchanges;
  ASSERT_EQ(p.forward(bundle.get(), stream), CE_OK) << ce_last_error_message();
  int64_t *word = lastStatusWord();
  // Loading and allocating ran in relaxed capture mode.
  EXPECT_GT(state().captureModeExchanges, exchanges);
  // A waiting check cannot synchronize a capturing stream.
  EXPECT_EQ(ce_check_label_status(device(), 0, stream, 1),
            CE_ERROR_INVALID_ARGUMENT);
  EXPECT_THAT(ce_last_error_message(), HasSubstr("capturing a graph"));
  EXPECT_EQ(ce_check_label_status(device(), 0, stream, 0), CE_OK);
  state().capturing = 0;
  // Replays write the same word; each report clears it for the next one.
  for (int replay = 0; replay < 2; ++replay) {
    *word = 2;
    EXPECT_EQ(ce_check_label_status(device(), 0, fakeStream(9), 0),
              CE_ERROR_LABEL_OUT_OF_RANGE);
    EXPECT_THAT(ce_last_error_message(),
                HasSubstr("a launch captured into a graph on "));
    EXPECT_THAT(ce_last_error_message(), HasSubstr("token 1 (n=1)"));
    EXPECT_EQ(*word, 0);
  }
  EXPECT_EQ(ce_check_label_status(device(), 0, fakeStream(9), 0), CE_OK);
}

TEST_P(GpuTest, ChangedOrUnreadableLabelsAreStillReported) {
  GpuBundle bundle({target()}, {{forwardKey(), "ce_forward_0"}});
  GpuProblem p(device(), 0);
  void *stream = fakeStream(8);
  ASSERT_EQ(p.forward(bundle.get(), stream), CE_OK);
  kernelReports(2); // token 1, whose label 1 is valid by the time we look
  EXPECT_EQ(ce_check_label_status(device(), 0, stream, 1),
            CE_ERROR_LABEL_OUT_OF_RANGE);
  EXPECT_THAT(ce_last_error_message(),
              HasSubstr("token 1 (n=1): its label was not in [0, 7) and no "
                        "ignore_index is set when the kernel ran (it now "
                        "reads 1: the labels changed after the launch)"));
  // A status word that names no token is a kernel error.
  ASSERT_EQ(p.forward(bundle.get(), stream), CE_OK);
  kernelReports(99);
  EXPECT_EQ(ce_check_label_status(device(), 0, stream, 1), CE_ERROR_BACKEND);
  EXPECT_THAT(ce_last_error_message(), HasSubstr("names no token"));
}

TEST_P(GpuTest, ConcurrentLaunchesOnTwoStreams) {
  GpuBundle bundle({target()}, {{forwardKey(), "ce_forward_0"}});
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t)
    threads.emplace_back([&, t] {
      void *stream = fakeStream(100 + t);
      for (int i = 0; i < 300; ++i) {
        GpuProblem p(device(), 0, 3 + t);
        if (p.forward(bundle.get(), stream) != CE_OK)
          ++failures;
        if (i % 50 == 49 &&
            ce_check_label_status(device(), 0, stream, i % 100 == 99) != CE_OK)
          ++failures;
      }
    });
  for (std::thread &thread : threads)
    thread.join();
  EXPECT_EQ(failures.load(), 0);
}

INSTANTIATE_TEST_SUITE_P(Backends, GpuTest,
                         ::testing::Values(CE_DEVICE_CUDA, CE_DEVICE_HIP),
                         [](const auto &info) {
                           return std::string(
                               info.param == CE_DEVICE_CUDA ? "Cuda" : "Hip");
                         });

} // namespace
