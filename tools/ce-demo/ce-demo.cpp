//===- ce-demo.cpp - Run one forward and backward from a bundle -----------===//
//
// The quick start's last step: loads a host bundle through the C API (no
// MLIR, no LLVM), runs the forward and the backward on random bf16 logits in
// Megatron's layout ([S, B, V] logits, [B, S] labels), and prints the mean
// loss and the largest errors against a float64 reference.
//
//   ce-demo BUNDLE_DIR [S B V] [seed]
//
// Sizes it cannot run are refused with a message and exit status 2 before
// anything is allocated: S, B and V are whole numbers in [1, 2^31 - 1],
// S * B at most 2^24 tokens and S * B * V at most 2^30 elements (4 GiB of
// bf16 logits and gradient, a float64 reference in well under a minute).
//
//===----------------------------------------------------------------------===//

#include "ce/runtime/ce_runtime.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <random>
#include <stdexcept>
#include <vector>

namespace {

uint16_t toBF16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if (std::isnan(value))
    return 0x7fc0;
  uint32_t rounding = 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float fromBF16(uint16_t value) {
  uint32_t bits = static_cast<uint32_t>(value) << 16;
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
}

ce_tensor makeTensor(void *data, ce_dtype dtype, std::vector<int64_t> sizes,
                     std::vector<int64_t> strides) {
  ce_tensor tensor{};
  tensor.data = data;
  tensor.dtype = dtype;
  tensor.ndim = static_cast<int32_t>(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    tensor.sizes[i] = sizes[i];
    tensor.strides[i] = strides[i];
  }
  tensor.device = CE_DEVICE_HOST;
  return tensor;
}

int fail(const char *what, ce_status status) {
  std::fprintf(stderr, "ce-demo: %s failed: %s: %s\n", what,
               ce_status_string(status), ce_last_error_message());
  return 1;
}

/// The largest S, B and V: each is a tensor dimension of the C API (int64),
/// kept to what a 32-bit signed index holds so that no product below can wrap.
constexpr uint64_t kMaxDimension = (uint64_t(1) << 31) - 1;
/// The most tokens (S * B): labels, loss, lse and upstream gradient take 20
/// bytes each.
constexpr uint64_t kMaxTokens = uint64_t(1) << 24;
/// The most logits (S * B * V): the bf16 logits and gradient take 4 bytes
/// each, 4 GiB at this limit, and the float64 reference two exp() per element.
constexpr uint64_t kMaxElements = uint64_t(1) << 30;

const char *const kUsage = "usage: ce-demo BUNDLE_DIR [S B V] [seed]\n";

void printHelp() {
  std::printf(
      "%s\n"
      "Runs one forward and one backward of a host kernel bundle made by\n"
      "ce-gen on random bf16 logits [S, B, V] with int64 labels [B, S]\n"
      "(Megatron's layout), and compares loss and gradient with a float64\n"
      "reference. The bundle needs the forward and backward kernels for\n"
      "--logits=bf16 --labels=i64 --layout=sbv_bs, e.g.\n"
      "  ce-gen --target=host --op=forward,backward --logits=bf16 \\\n"
      "      --labels=i64 --layout=sbv_bs -o BUNDLE_DIR\n"
      "\n"
      "  BUNDLE_DIR  the bundle directory\n"
      "  S B V       sequence length, batch size, vocabulary size (default\n"
      "              16 4 32000): whole numbers in [1, %llu], with\n"
      "              S*B at most %llu tokens and S*B*V at most %llu elements\n"
      "  seed        random seed in [0, %llu] (default: a random one)\n"
      "  -h, --help  print this help and exit\n"
      "\n"
      "Exit status: 0 when loss and gradient match the reference, 1 on a\n"
      "mismatch or a runtime error, 2 for bad arguments.\n",
      kUsage, (unsigned long long)kMaxDimension, (unsigned long long)kMaxTokens,
      (unsigned long long)kMaxElements, (unsigned long long)UINT64_MAX);
}

/// Parses all of `text` as a decimal number in [min, max]: digits only, so
/// "3.5", "5abc", "-1", " 7" and "" are refused rather than read as a prefix.
bool parseWhole(const char *name, const char *text, uint64_t min, uint64_t max,
                uint64_t &value) {
  bool digits = *text != '\0';
  for (const char *c = text; *c; ++c)
    digits = digits && *c >= '0' && *c <= '9';
  if (digits) {
    errno = 0;
    unsigned long long parsed = std::strtoull(text, nullptr, 10);
    if (errno == 0 && parsed >= min && parsed <= max) {
      value = parsed;
      return true;
    }
  }
  std::fprintf(stderr,
               "ce-demo: %s must be a whole number in [%llu, %llu], got '%s'\n",
               name, (unsigned long long)min, (unsigned long long)max, text);
  return false;
}

/// Runs the forward and the backward on random data and checks them against
/// a float64 reference; the sizes have been checked against the limits.
int run(const char *bundleDir, int64_t S, int64_t B, int64_t V, uint64_t seed) {
  std::printf("ce-demo: logits [S=%lld, B=%lld, V=%lld] bf16, labels [B, S] "
              "i64, seed %llu\n",
              (long long)S, (long long)B, (long long)V,
              (unsigned long long)seed);

  // The bundle first: a wrong directory is reported before any allocation.
  ce_bundle *bundle = nullptr;
  if (ce_status status = ce_bundle_open(bundleDir, &bundle))
    return fail("opening the bundle", status);
  std::unique_ptr<ce_bundle, void (*)(ce_bundle *)> openBundle(bundle,
                                                               ce_bundle_close);

  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::uniform_int_distribution<int64_t> label(0, V - 1);
  std::uniform_real_distribution<float> upstream(0.5f, 1.5f);
  std::vector<uint16_t> logits(S * B * V);
  for (uint16_t &x : logits)
    x = toBF16(normal(rng));
  std::vector<int64_t> labels(B * S);
  for (int64_t &y : labels)
    y = label(rng);
  std::vector<float> gradLoss(B * S);
  for (float &g : gradLoss)
    g = upstream(rng);
  std::vector<float> loss(B * S, NAN), lse(B * S, NAN);
  std::vector<uint16_t> grad(S * B * V, 0xffff);

  ce_options options;
  ce_options_init(&options);
  options.label_layout = CE_LABELS_BS;
  ce_tensor logitsT =
      makeTensor(logits.data(), CE_DTYPE_BF16, {S, B, V}, {B * V, V, 1});
  ce_tensor labelsT = makeTensor(labels.data(), CE_DTYPE_I64, {B, S}, {S, 1});
  ce_tensor lossT = makeTensor(loss.data(), CE_DTYPE_F32, {B, S}, {S, 1});
  ce_tensor lseT = makeTensor(lse.data(), CE_DTYPE_F32, {B, S}, {S, 1});
  ce_tensor gradLossT =
      makeTensor(gradLoss.data(), CE_DTYPE_F32, {B, S}, {S, 1});
  ce_tensor gradT =
      makeTensor(grad.data(), CE_DTYPE_BF16, {S, B, V}, {B * V, V, 1});
  if (ce_status status = ce_forward(bundle, &options, &logitsT, &labelsT,
                                    &lossT, &lseT, nullptr))
    return fail("forward", status);
  if (ce_status status = ce_backward(bundle, &options, &logitsT, &labelsT,
                                     &lseT, &gradLossT, &gradT, nullptr))
    return fail("backward", status);
  openBundle.reset(); // closes it

  // float64 reference, per token.
  double meanLoss = 0, lossError = 0, gradError = 0, maxGrad = 0;
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t b = 0; b < B; ++b) {
      const uint16_t *row = &logits[(s * B + b) * V];
      double max = -INFINITY;
      for (int64_t j = 0; j < V; ++j)
        max = std::max(max, (double)fromBF16(row[j]));
      double sum = 0;
      for (int64_t j = 0; j < V; ++j)
        sum += std::exp((double)fromBF16(row[j]) - max);
      double refLse = max + std::log(sum);
      int64_t y = labels[b * S + s];
      double refLoss = refLse - fromBF16(row[y]);
      meanLoss += loss[b * S + s];
      lossError = std::max(lossError, std::fabs(loss[b * S + s] - refLoss));
      // The backward's contract takes the forward's lse as given.
      double givenLse = lse[b * S + s];
      for (int64_t j = 0; j < V; ++j) {
        double p = std::exp((double)fromBF16(row[j]) - givenLse);
        double ref = gradLoss[b * S + s] * (p - (j == y ? 1.0 : 0.0));
        double got = fromBF16(grad[(s * B + b) * V + j]);
        gradError = std::max(gradError, std::fabs(got - ref));
        maxGrad = std::max(maxGrad, std::fabs(ref));
      }
    }
  }
  meanLoss /= double(S * B);
  std::printf("ce-demo: mean loss %.6f (log V = %.6f)\n", meanLoss,
              std::log(double(V)));
  std::printf("ce-demo: max |loss - float64 reference| = %.3g\n", lossError);
  std::printf("ce-demo: max |grad - float64 reference| = %.3g (largest "
              "|grad| %.3g; bf16 spacing there %.3g)\n",
              gradError, maxGrad, std::ldexp(1.0, std::ilogb(maxGrad) - 7));
  bool ok = lossError <= 1e-4 &&
            gradError <= std::ldexp(1.0, std::ilogb(maxGrad) - 7);
  std::printf("ce-demo: %s\n", ok ? "OK" : "MISMATCH");
  return ok ? 0 : 1;
}

} // namespace

int main(int argc, char **argv) {
  // Options first; "--" ends them, so a bundle directory may start with '-'.
  std::vector<const char *> positional;
  bool optionsDone = false;
  for (int i = 1; i < argc; ++i) {
    const char *arg = argv[i];
    if (!optionsDone &&
        (!std::strcmp(arg, "-h") || !std::strcmp(arg, "--help"))) {
      printHelp();
      return 0;
    }
    if (!optionsDone && !std::strcmp(arg, "--")) {
      optionsDone = true;
      continue;
    }
    // A dash in a size's place is a bad size (reported below), not an option.
    if (!optionsDone && positional.empty() && arg[0] == '-') {
      std::fprintf(stderr,
                   "ce-demo: unknown option '%s' (see ce-demo --help)\n%s", arg,
                   kUsage);
      return 2;
    }
    positional.push_back(arg);
  }
  size_t count = positional.size();
  if (count != 1 && count != 4 && count != 5) {
    std::fprintf(stderr, "%s(see ce-demo --help)\n", kUsage);
    return 2;
  }
  uint64_t S = 16, B = 4, V = 32000;
  if (count >= 4 && !(parseWhole("S", positional[1], 1, kMaxDimension, S) &&
                      parseWhole("B", positional[2], 1, kMaxDimension, B) &&
                      parseWhole("V", positional[3], 1, kMaxDimension, V)))
    return 2;
  uint64_t seed = std::random_device{}();
  if (count == 5 && !parseWhole("seed", positional[4], 0, UINT64_MAX, seed))
    return 2;
  // S, B < 2^31, so S * B cannot wrap; with S * B <= 2^24 neither can S*B*V.
  uint64_t tokens = S * B;
  if (tokens > kMaxTokens) {
    std::fprintf(stderr,
                 "ce-demo: S * B = %llu tokens is more than ce-demo runs; "
                 "S * B must be in [1, %llu]\n",
                 (unsigned long long)tokens, (unsigned long long)kMaxTokens);
    return 2;
  }
  uint64_t elements = tokens * V;
  if (elements > kMaxElements) {
    std::fprintf(stderr,
                 "ce-demo: S * B * V = %llu logits is more than ce-demo runs; "
                 "S * B * V must be in [1, %llu] (4 GiB of bf16 logits and "
                 "gradient)\n",
                 (unsigned long long)elements,
                 (unsigned long long)kMaxElements);
    return 2;
  }
  try {
    return run(positional[0], int64_t(S), int64_t(B), int64_t(V), seed);
  } catch (const std::bad_alloc &) {
    std::fprintf(stderr,
                 "ce-demo: out of memory: [S=%llu, B=%llu, V=%llu] needs %llu "
                 "MiB; try smaller sizes\n",
                 (unsigned long long)S, (unsigned long long)B,
                 (unsigned long long)V,
                 (unsigned long long)((elements * 4 + tokens * 20) >> 20));
    return 1;
  }
}
