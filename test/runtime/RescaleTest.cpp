//===- RescaleTest.cpp - ce_rescale against a float64 reference -----------===//
//
// Usage: runtime_rescale_test BUNDLE_DIR...   (CE_TEST_SEED=n replays a run)
//
// Every rescale kernel of the bundles (op=rescale: each logits dtype and
// layout) runs through the C API on fresh random gradients, packed and as
// strided views in guarded buffers, with per-token upstream gradients g and
// weights w drawn so that every case of the contract (ce_runtime.h) occurs:
//   g == w (also both 0, and -0 against +0): the row is bitwise unchanged;
//   g != w: each element becomes x * g / w, within one ulp of the dtype
//           (plus 4 f32 ulps: the ratio is an f32) of the float64 product;
//   g == 0, w != 0: the row becomes 0;
//   w == 0, g != 0: the zero row ce_fused wrote becomes NaN;
//   g NaN: the row becomes NaN;
// with per-token, 0-d (scalar) and stride-0 weights, and stride-0 and
// strided upstream gradients. Padding and the read-only inputs must survive.
//
//===----------------------------------------------------------------------===//

#include "TestData.h"

#include "ce/runtime/VariantKey.h"
#include "ce/runtime/ce_runtime.h"

#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

using namespace ce;
using namespace ce::test;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

/// What a token's (g, w) pair should do to its row.
enum class Pair { Equal, Differ, MaskedG, ZeroWeight, NaNG, SignedZeros };

struct Case {
  const char *name;
  int64_t dim0, dim1, vocab; ///< dim1 0 for flat
  int64_t rowPad;            ///< extra elements between rows
  bool scalarWeight;         ///< a 0-d weight for every token
  bool broadcastG;           ///< grad_loss of stride 0
};

const Case kCases[] = {
    {"tiny", 5, 0, 1, 0, false, false},
    {"odd-vocab", 9, 0, 7, 3, false, false},
    {"vectors", 12, 0, 64, 0, false, false},
    {"long-rows", 13, 0, 4099, 5, false, false},
    {"scalar-weight", 11, 0, 1000, 0, true, false},
    {"broadcast-g", 10, 0, 333, 0, false, true},
    {"3d", 3, 4, 517, 2, false, false},
    {"3d-scalar", 4, 3, 96, 0, true, false},
};

struct Report {
  int64_t checks = 0, failures = 0;
  void fail(const std::string &what) {
    ++failures;
    if (failures <= 20)
      std::printf("    FAIL: %s\n", what.c_str());
  }
};

void runCase(Report &report, ce_bundle *bundle, const KernelVariantKey &key,
             const Case &spec, std::mt19937_64 &rng) {
  bool flat = key.layout == LabelLayout::Flat;
  if (flat != (spec.dim1 == 0))
    return;
  const int64_t dims0 = spec.dim0, dims1 = flat ? 1 : spec.dim1;
  const int64_t V = spec.vocab;
  // Gradient [N, V] or [S, B, V] with padded rows.
  std::vector<int64_t> sizes = flat ? std::vector<int64_t>{dims0, V}
                                    : std::vector<int64_t>{dims0, dims1, V};
  int64_t rowStride = V + spec.rowPad;
  std::vector<int64_t> strides =
      flat ? std::vector<int64_t>{rowStride, 1}
           : std::vector<int64_t>{dims1 * rowStride, rowStride, 1};
  TestTensor grad = makeTensor(key.logits, sizes, strides);
  // Token shape: [N], [B, S] (sbv_bs) or [S, B] (sbv_sb).
  std::vector<int64_t> tokenSizes =
      flat ? std::vector<int64_t>{dims0}
      : key.layout == LabelLayout::SbvBs ? std::vector<int64_t>{dims1, dims0}
                                         : std::vector<int64_t>{dims0, dims1};
  int64_t numTokens = dims0 * dims1;
  auto tokenOfRow = [&](int64_t row) -> int64_t {
    if (flat || key.layout == LabelLayout::SbvSb)
      return row; // [S, B] row-major is the rows' order
    int64_t s = row / dims1, b = row % dims1;
    return b * dims0 + s;
  };
  // A strided g (every other element) unless it is broadcast.
  std::vector<int64_t> gStrides = packedStrides(tokenSizes);
  for (int64_t &stride : gStrides)
    stride *= 2;
  if (spec.broadcastG)
    gStrides.assign(tokenSizes.size(), 0);
  TestTensor g = makeTensor(ElemType::F32, tokenSizes, gStrides);
  TestTensor w = spec.scalarWeight
                     ? makeTensor(ElemType::F32, {}, {})
                     : makeTensor(ElemType::F32, tokenSizes,
                                  packedStrides(tokenSizes));

  std::uniform_real_distribution<double> positive(0.25, 2.0);
  std::normal_distribution<double> normal(0.0, 1.5);
  std::uniform_int_distribution<int> pick(0, 5);
  // Per token: the pair kind and its values.
  std::vector<Pair> pairs(numTokens);
  std::vector<double> gValues(numTokens), wValues(numTokens);
  double sharedW = positive(rng), sharedG = positive(rng);
  for (int64_t t = 0; t < numTokens; ++t) {
    Pair kind = static_cast<Pair>(pick(rng));
    if (spec.scalarWeight || spec.broadcastG)
      kind = pick(rng) < 2 ? Pair::Equal : Pair::Differ;
    if (t == 0) // every case has one differing row
      kind = Pair::Differ;
    double gv = positive(rng), wv = spec.scalarWeight ? sharedW : positive(rng);
    switch (kind) {
    case Pair::Equal:
      gv = wv;
      break;
    case Pair::Differ:
      if (gv == wv)
        gv *= 1.5;
      break;
    case Pair::MaskedG:
      gv = 0.0;
      break;
    case Pair::ZeroWeight:
      wv = 0.0;
      break;
    case Pair::NaNG:
      gv = kNaN;
      break;
    case Pair::SignedZeros:
      gv = 0.0;
      wv = -0.0;
      break;
    }
    if (spec.broadcastG) {
      gv = sharedG;
      kind = gv == wv ? Pair::Equal : Pair::Differ;
    }
    // As the kernel sees them: f32s.
    gv = static_cast<float>(gv);
    wv = static_cast<float>(wv);
    pairs[t] = kind;
    gValues[t] = gv;
    wValues[t] = wv;
  }
  for (int64_t t = 0; t < numTokens; ++t) {
    g.set(spec.broadcastG ? 0 : t, gValues[t]);
    if (!spec.scalarWeight)
      w.set(t, wValues[t]);
  }
  if (spec.scalarWeight)
    w.set(0, sharedW);
  // Rows: random values, zeros where the weight was 0 (what ce_fused wrote).
  std::vector<double> before(numTokens * V);
  for (int64_t row = 0; row < numTokens; ++row)
    for (int64_t j = 0; j < V; ++j) {
      int64_t t = tokenOfRow(row);
      double x = pairs[t] == Pair::ZeroWeight ? 0.0 : normal(rng);
      grad.set(row * V + j, x);
      before[row * V + j] = grad.get(row * V + j);
    }
  std::vector<unsigned char> gBytes = g.snapshot(), wBytes = w.snapshot();
  std::vector<unsigned char> gradBytes = grad.snapshot();

  ce_options options;
  ce_options_init(&options);
  options.label_layout =
      key.layout == LabelLayout::SbvSb ? CE_LABELS_SB : CE_LABELS_BS;
  ce_status status =
      ce_rescale(bundle, &options, &grad.tensor, &w.tensor, &g.tensor, nullptr);
  ++report.checks;
  if (status != CE_OK) {
    report.fail(std::string("ce_rescale: ") + ce_last_error_message());
    return;
  }
  ++report.checks;
  if (!grad.paddingIntact(kPaddingFill))
    report.fail("padding of the gradient was written");
  ++report.checks;
  if (g.snapshot() != gBytes || w.snapshot() != wBytes)
    report.fail("grad_loss or weights changed");

  size_t elementBytes = key.logits == ElemType::F32 ? 4 : 2;
  std::vector<unsigned char> after = grad.snapshot();
  for (int64_t row = 0; row < numTokens; ++row) {
    int64_t t = tokenOfRow(row);
    double gv = gValues[t], wv = wValues[t];
    for (int64_t j = 0; j < V; ++j) {
      int64_t index = row * V + j;
      double x = before[index], got = grad.get(index);
      ++report.checks;
      char where[160];
      std::snprintf(where, sizeof(where),
                    "%s row %" PRId64 " token %" PRId64 " [%" PRId64
                    "]: x %.9g g %.9g w %.9g got %.9g",
                    spec.name, row, t, j, x, gv, wv, got);
      if (pairs[t] == Pair::Equal || pairs[t] == Pair::SignedZeros) {
        size_t at = static_cast<size_t>(grad.elementOffsets[index]) * elementBytes;
        if (std::memcmp(&after[at], &gradBytes[at], elementBytes) != 0)
          report.fail(std::string(where) + " (g == w: must be untouched)");
        continue;
      }
      if (pairs[t] == Pair::NaNG || pairs[t] == Pair::ZeroWeight) {
        if (!std::isnan(got))
          report.fail(std::string(where) + " (expected NaN)");
        continue;
      }
      float ratio = gv == 0.0 ? 0.0f
                              : static_cast<float>(gv) / static_cast<float>(wv);
      double ref = x * gv / wv;
      double tolerance = ulpOf(key.logits, ref) +
                         4 * ulpOf(ElemType::F32, ref) +
                         std::fabs(x * (static_cast<double>(ratio) - gv / wv));
      if (!(std::fabs(got - ref) <= tolerance))
        report.fail(std::string(where) + " ref " + std::to_string(ref));
    }
  }
}

} // namespace

int main(int argc, char **argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s BUNDLE_DIR...\n", argv[0]);
    return 2;
  }
  uint64_t seed = std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::system_clock::now().time_since_epoch())
                      .count();
  if (const char *fixed = std::getenv("CE_TEST_SEED"))
    seed = std::strtoull(fixed, nullptr, 0);
  std::printf("runtime_rescale_test: seed %" PRIu64
              " (rerun with CE_TEST_SEED=%" PRIu64 ")\n",
              seed, seed);
  std::mt19937_64 rng(seed);
  Report report;
  int64_t kernels = 0;
  for (int i = 1; i < argc; ++i) {
    ce_bundle *bundle = nullptr;
    if (ce_bundle_open(argv[i], &bundle) != CE_OK) {
      std::printf("FAIL: %s\n", ce_last_error_message());
      return 1;
    }
    for (int64_t k = 0; k < ce_bundle_num_kernels(bundle); ++k) {
      std::optional<KernelVariantKey> key =
          parseKernelVariantKey(ce_bundle_kernel_key(bundle, k));
      if (!key || key->op != KernelOp::Rescale)
        continue;
      ++kernels;
      int64_t failuresBefore = report.failures;
      for (const Case &spec : kCases)
        runCase(report, bundle, *key, spec, rng);
      std::printf("[%s] %s\n", report.failures > failuresBefore ? "FAIL" : " ok ",
                  key->str().c_str());
    }
    ce_bundle_close(bundle);
  }
  std::printf("%" PRId64 " rescale kernels, %" PRId64 " checks, %" PRId64
              " failures\n",
              kernels, report.checks, report.failures);
  if (kernels == 0) {
    std::printf("FAIL: no rescale kernel in the bundles\n");
    return 1;
  }
  return report.failures == 0 ? 0 : 1;
}
