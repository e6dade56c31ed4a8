//===- ce-demo.cpp - Run one forward and backward from a bundle -----------===//
//
// The quick start's last step: loads a host bundle through the C API (no
// MLIR, no LLVM), runs the forward and the backward on random bf16 logits in
// Megatron's layout ([S, B, V] logits, [B, S] labels), and prints the mean
// loss and the largest errors against a float64 reference.
//
//   ce-demo BUNDLE_DIR [S B V] [seed]
//
//===----------------------------------------------------------------------===//

#include "ce/runtime/ce_runtime.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
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

} // namespace

int main(int argc, char **argv) {
  if (argc != 2 && argc != 5 && argc != 6) {
    std::fprintf(stderr, "usage: ce-demo BUNDLE_DIR [S B V] [seed]\n");
    return 2;
  }
  int64_t S = argc >= 5 ? std::atoll(argv[2]) : 16;
  int64_t B = argc >= 5 ? std::atoll(argv[3]) : 4;
  int64_t V = argc >= 5 ? std::atoll(argv[4]) : 32000;
  unsigned seed = argc == 6 ? static_cast<unsigned>(std::atoll(argv[5]))
                            : std::random_device{}();
  if (S <= 0 || B <= 0 || V <= 0) {
    std::fprintf(stderr, "ce-demo: S, B and V must be positive\n");
    return 2;
  }
  std::printf("ce-demo: logits [S=%lld, B=%lld, V=%lld] bf16, labels [B, S] "
              "i64, seed %u\n",
              (long long)S, (long long)B, (long long)V, seed);

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

  ce_bundle *bundle = nullptr;
  if (ce_status status = ce_bundle_open(argv[1], &bundle))
    return fail("opening the bundle", status);
  ce_options options;
  ce_options_init(&options);
  options.label_layout = CE_LABELS_BS;
  ce_tensor logitsT = makeTensor(logits.data(), CE_DTYPE_BF16, {S, B, V},
                                 {B * V, V, 1});
  ce_tensor labelsT = makeTensor(labels.data(), CE_DTYPE_I64, {B, S}, {S, 1});
  ce_tensor lossT = makeTensor(loss.data(), CE_DTYPE_F32, {B, S}, {S, 1});
  ce_tensor lseT = makeTensor(lse.data(), CE_DTYPE_F32, {B, S}, {S, 1});
  ce_tensor gradLossT =
      makeTensor(gradLoss.data(), CE_DTYPE_F32, {B, S}, {S, 1});
  ce_tensor gradT = makeTensor(grad.data(), CE_DTYPE_BF16, {S, B, V},
                               {B * V, V, 1});
  if (ce_status status = ce_forward(bundle, &options, &logitsT, &labelsT,
                                    &lossT, &lseT, nullptr))
    return fail("forward", status);
  if (ce_status status = ce_backward(bundle, &options, &logitsT, &labelsT,
                                     &lseT, &gradLossT, &gradT, nullptr))
    return fail("backward", status);
  ce_bundle_close(bundle);

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
  bool ok = lossError <= 1e-4 && gradError <= std::ldexp(1.0, std::ilogb(maxGrad) - 7);
  std::printf("ce-demo: %s\n", ok ? "OK" : "MISMATCH");
  return ok ? 0 : 1;
}
