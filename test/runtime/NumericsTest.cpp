//===- NumericsTest.cpp - Generated kernels against a float64 reference ---===//
//
// Usage: runtime_numerics_test BUNDLE_DIR... (or CE_TEST_BUNDLES=dir:dir)
//   CE_TEST_SEED=n      reuse the inputs of an earlier run (printed each run)
//   CE_TEST_FILTER=str  only kernels whose variant key contains str
//   CE_TEST_VERBOSE=1   one line per case
//
// Every kernel of every bundle runs through the C API on fresh random inputs
// over a fixed list of shapes (V from 1 to 128256, N from 0 to a few dozen),
// packed and as strided views, with special rows (-inf everywhere but one
// entry, a target probability above 0.999, large offsets, maxima past 2^24
// and near 2^100, a half row near -1e30, a row whose plain sum overflows),
// ignored tokens and an all-ignored batch, per-token and broadcast upstream
// gradients or weights, and with out-of-range labels in memory that faults
// beyond the tensors. Outputs are poisoned before each call; padding and inputs
// must survive it. Tolerances (the numerics contract):
//   loss, lse: |kernel - ref| <= 1e-5 max(1, |ref|)
//   gradient:  one ulp of the logits dtype at ref (bf16, f16), or
//              1e-5 of the row's largest |ref| (f32), plus 4 f32 ulps of
//              the terms no fp32 evaluation can avoid rounding (p_j c, s/V,
//              1 - s, with the fp32 lse; see referenceGrad). The floor only
//              matters where those terms cancel, e.g. p_j c ~ s/V with label
//              smoothing, where the bare bound is below fp32 resolution; it
//              does not cover p_y - 1 or (1 + 2 z lse) - 1, which a kernel
//              can and must form without cancellation.
//   lse_low:   |lse + lse_low - ref| <= 1e-5 max(1, ref - max): the pair
//              carries the log of the sum to f32's precision at any |max|
//   entropy:   |kernel - ref| <= 1e-4 max(1, ref), NaN where lse is not
//              finite (an f32 sum of V terms: see checkEntropy)
//   argmax:    the lowest index of the maximum of z, -1 for a row with a
//              NaN, 0 for an all -inf row; either of two values of z within
//              2^-23 of each other (f32 rounding of z), never past an exact
//              tie
// The entropy and argmax outputs (ce_options.entropy / argmax) are asked
// for in every other case each, independently, poisoned with -7 first and
// checked for every token whatever its label (bad labels included); without
// them the lse's view is their placeholder and must keep the lse. Two cases
// add rows for them: all -inf, a NaN, equal maxima (one last), offsets of
// 1e4 to 1e6, half the row -inf.
// Every case draws a logit scale s (ce_options.logit_scale: 1 half of the
// time, else log-uniform in [0.05, 20]); the references are float64 of
// z = s x, formed from the f32 s and the logits (exact in double), and the
// gradient's is s times that of z.
// A softcap kernel (softcap=on) draws a cap (log-uniform in [1, 64], with
// the scale as above): the references see z = cap tanh(s x / cap) in
// float64 and the gradient is the one of z times dz/dx = s (1 - tanh^2),
// with an allowance of s 2^-18 |dL/dz| for the f32 evaluation of 1 - t^2.
// The backward reference uses the lse the forward kernel returned (the
// backward takes lse as an input); fused gradients, and backward gradients
// given lse's low part (ce_options.lse_low, every other case), are compared
// with the full float64 reference: their error must not grow with |x|.
//
//===----------------------------------------------------------------------===//

#include "Reference.h"
#include "TestData.h"

#include "ce/runtime/VariantKey.h"
#include "ce/runtime/ce_runtime.h"

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

using namespace ce;
using namespace ce::test;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

//===----------------------------------------------------------------------===//
// Cases
//===----------------------------------------------------------------------===//

/// One shape and one set of input features, applied to every kernel.
struct CaseSpec {
  const char *name;
  int64_t flatTokens; ///< N for [N, V] logits.
  int64_t seq, batch; ///< S, B for [S, B, V] logits.
  int64_t vocab;      ///< V.
  bool views;         ///< Strided, padded and transposed views everywhere.
  bool specialRows;   ///< -inf rows, a confident row, shifted and extreme rows.
  bool broadcast;     ///< Stride-0 upstream gradient / token weights.
  bool allIgnored;    ///< Every label is the ignore_index.
  /// CE_LABEL_POLICY_MEGATRON, with every third label outside [0, V).
  bool megatronLabels = false;
  /// Rows for the entropy and argmax outputs: all -inf, a NaN, two equal
  /// maxima, the maximum last, offsets of 1e4 to 1e6, half the row -inf
  /// (an ignore_index is always set: the first two rows are ignored).
  bool outputRows = false;
};

const CaseSpec kCases[] = {
    {"empty", 0, 0, 3, 7, false, false, false, false},
    {"vocab1", 1, 1, 1, 1, false, false, false, false},
    {"vocab2", 37, 5, 7, 2, false, false, false, false},
    {"views-vocab7", 45, 5, 9, 7, true, true, true, false},
    {"vocab4095", 24, 4, 6, 4095, false, true, false, false},
    {"views-vocab32000", 3, 1, 3, 32000, true, true, true, false},
    {"vocab50257", 2, 2, 1, 50257, false, true, false, false},
    {"views-vocab128256", 2, 1, 2, 128256, true, false, false, false},
    {"special-vocab32000", 9, 9, 1, 32000, false, true, false, false},
    {"all-ignored", 16, 4, 4, 7, true, false, false, true},
    {"megatron-labels-vocab7", 45, 5, 9, 7, true, true, true, false, true},
    {"megatron-labels-vocab32000", 12, 3, 4, 32000, false, true, false, false,
     true},
    {"outputs-vocab9", 16, 4, 4, 9, true, false, false, false, false, true},
    {"outputs-vocab32001", 8, 4, 2, 32001, false, false, false, false, false,
     true},
};

/// The inputs of the bad-label cases.
const CaseSpec kBadLabelSpec = {"bad-label", 9,     3,     3,
                                7,           false, false, false, false};

//===----------------------------------------------------------------------===//
// Failure reporting
//===----------------------------------------------------------------------===//

/// Counts checks and failures; prints the first few failures of each case.
class Report {
public:
  void startCase(const std::string &key, const std::string &caseName) {
    currentKey = key;
    currentCase = caseName;
    printedInCase = 0;
  }
  void check(bool ok, const std::function<std::string()> &describe) {
    ++checks;
    if (ok)
      return;
    ++failures;
    ++failuresInKernel;
    if (printedInCase++ < kMaxPrinted)
      std::printf("    FAIL %s [%s]: %s\n", currentCase.c_str(),
                  currentKey.c_str(), describe().c_str());
    else if (printedInCase == kMaxPrinted + 1)
      std::printf("    ... more failures in case %s not shown\n",
                  currentCase.c_str());
  }
  int64_t takeKernelFailures() {
    int64_t count = failuresInKernel;
    failuresInKernel = 0;
    return count;
  }

  int64_t checks = 0;
  int64_t failures = 0;

private:
  static constexpr int kMaxPrinted = 6;
  std::string currentKey, currentCase;
  int printedInCase = 0;
  int64_t failuresInKernel = 0;
};

std::string formatDouble(double value) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "%.9g", value);
  return buffer;
}

/// "[x0, x1, ...]" with round-trip precision, to reproduce a failure.
std::string formatRow(const double *row, int64_t count) {
  std::string text = "[";
  for (int64_t j = 0; j < count; ++j)
    text += (j ? ", " : "") + formatDouble(row[j]);
  return text + "]";
}

//===----------------------------------------------------------------------===//
// Problems: inputs, their tensors and the token <-> element mapping
//===----------------------------------------------------------------------===//

struct Problem {
  KernelVariantKey key;
  ReferenceOptions reference;
  ce_options options;
  int tokenRank = 1;
  int64_t tokenSizes[2] = {0, 1};
  int64_t numTokens = 0, vocab = 0;
  int64_t seq = 0, batch = 0;
  bool views = false;

  std::vector<double> x;       ///< Logits values, [token][j].
  double logitScale = 1.0;     ///< s, the f32 the kernel is given.
  double logitSoftcap = 0.0;   ///< the cap, the f32 the kernel is given (0: none)
  /// dz/dx per element (s without a softcap), [token][j].
  std::vector<double> slope;
  /// z = s x in float64 (exact: a product of two f32s), [token][j]: what
  /// the references see.
  std::vector<double> z;
  std::vector<int64_t> labels; ///< Per token.
  std::vector<double> scale;   ///< grad_loss (backward) or weight (fused).

  TestTensor logits, labelTensor, gradLoss, weights;

  bool flat() const { return key.layout == LabelLayout::Flat; }

  /// Row-major index into the logits view of element j of token t.
  int64_t logitsIndex(int64_t t, int64_t j) const {
    if (flat())
      return t * vocab + j;
    int64_t i0 = t / tokenSizes[1], i1 = t % tokenSizes[1];
    int64_t s = key.layout == LabelLayout::SbvBs ? i1 : i0;
    int64_t b = key.layout == LabelLayout::SbvBs ? i0 : i1;
    return (s * batch + b) * vocab + j;
  }

  std::string where(int64_t t) const {
    if (flat())
      return "token " + std::to_string(t) + " (n=" + std::to_string(t) + ")";
    int64_t i0 = t / tokenSizes[1], i1 = t % tokenSizes[1];
    return "token " + std::to_string(t) +
           (key.layout == LabelLayout::SbvBs
                ? " (b=" + std::to_string(i0) + ", s=" + std::to_string(i1)
                : " (s=" + std::to_string(i0) + ", b=" + std::to_string(i1)) +
           ")";
  }

  std::vector<int64_t> tokenShape() const {
    return std::vector<int64_t>(tokenSizes, tokenSizes + tokenRank);
  }
  std::vector<int64_t> logitsShape() const {
    return flat() ? std::vector<int64_t>{numTokens, vocab}
                  : std::vector<int64_t>{seq, batch, vocab};
  }

  /// Strides of a token-shaped tensor: packed, or with gaps (`gap`), or
  /// transposed (`gap` == 0) when the case asks for views.
  std::vector<int64_t> tokenStrides(int gap) const {
    std::vector<int64_t> shape = tokenShape();
    if (!views)
      return packedStrides(shape);
    if (tokenRank == 1)
      return {gap ? gap : 2};
    if (gap == 0) // a transposed view of a [d1, d0] buffer
      return {1, tokenSizes[0]};
    return {tokenSizes[1] * gap, gap};
  }

  /// Strides of the logits: rows padded, and [S, B, V] transposed from a
  /// [B, S, V + pad] buffer, when the case asks for views.
  std::vector<int64_t> logitsStrides() const {
    if (!views)
      return packedStrides(logitsShape());
    int64_t row = vocab + 3;
    if (flat())
      return {row, 1};
    return {row, seq * row, 1};
  }
  /// Gradient strides: rows padded differently from the logits.
  std::vector<int64_t> gradStrides() const {
    if (!views)
      return packedStrides(logitsShape());
    int64_t row = vocab + 1;
    if (flat())
      return {row, 1};
    return {batch * row, row, 1};
  }
};

/// The run-time option values of one case (kernel arguments since bundle
/// format version 3, so every case draws its own).
struct CaseOptions {
  std::optional<int64_t> ignoreIndex;
  float labelSmoothing = 0.0f;
  float zLoss = 0.0f;
  float logitScale = 1.0f;
  float logitSoftcap = 0.0f;

  std::string str() const {
    return "ignore_index=" +
           (ignoreIndex ? std::to_string(*ignoreIndex) : std::string("none")) +
           " label_smoothing=" + formatF32(labelSmoothing) +
           " z_loss=" + formatF32(zLoss) +
           " logit_scale=" + formatF32(logitScale) +
           (logitSoftcap != 0.0f ? " logit_softcap=" + formatF32(logitSoftcap)
                                 : std::string());
  }
};

/// Draws the option values of a case: an ignore_index on most cases (-100,
/// -7, or class 3 of the row, whose tokens are then ignored, except in
/// bad-label cases where the label next to it must be an error), and a
/// smoothing or z-loss coefficient where the kernel computes one, spread
/// over the usual ranges and sometimes exactly 0.
CaseOptions drawOptions(const KernelVariantKey &key, const CaseSpec &spec,
                        bool badLabelCase, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  CaseOptions options;
  if (spec.allIgnored || spec.outputRows || uniform(rng) < 0.75) {
    double pick = uniform(rng);
    options.ignoreIndex = pick < 0.4 ? -100
                          : pick < 0.8 || badLabelCase || spec.vocab <= 3
                              ? -7
                              : 3;
  }
  if (key.smoothing && uniform(rng) >= 0.1)
    options.labelSmoothing = static_cast<float>(0.01 + 0.29 * uniform(rng));
  if (key.zLoss && uniform(rng) >= 0.1)
    options.zLoss = static_cast<float>(1e-5 * std::pow(100.0, uniform(rng)));
  // The logit scale: every kernel takes one. 1 half of the time, else
  // log-uniform in [0.05, 20].
  if (uniform(rng) >= 0.5)
    options.logitScale =
        static_cast<float>(0.05 * std::pow(400.0, uniform(rng)));
  if (key.softcap)
    options.logitSoftcap = static_cast<float>(std::pow(64.0, uniform(rng)));
  return options;
}

ce_options optionsFor(const KernelVariantKey &key, const CaseOptions &values) {
  ce_options options;
  ce_options_init(&options);
  options.has_ignore_index = values.ignoreIndex.has_value();
  options.ignore_index = values.ignoreIndex.value_or(-100);
  options.label_smoothing = values.labelSmoothing;
  options.z_loss = values.zLoss;
  options.logit_scale = values.logitScale;
  options.logit_softcap = values.logitSoftcap;
  options.overwrite_input = key.overwrite;
  options.label_layout =
      key.layout == LabelLayout::SbvSb ? CE_LABELS_SB : CE_LABELS_BS;
  return options;
}

/// Sets up the shape and options of `problem` for `key` and `spec`.
void initProblem(Problem &problem, const KernelVariantKey &key,
                 const CaseSpec &spec, const CaseOptions &values) {
  problem.key = key;
  problem.options = optionsFor(key, values);
  problem.reference.ignoreIndex = values.ignoreIndex;
  problem.reference.labelSmoothing = values.labelSmoothing;
  problem.reference.zLoss = values.zLoss;
  problem.logitScale = values.logitScale;
  problem.logitSoftcap = values.logitSoftcap;
  if (spec.megatronLabels) {
    problem.options.label_policy = CE_LABEL_POLICY_MEGATRON;
    problem.reference.megatronLabels = true;
  }
  problem.vocab = spec.vocab;
  problem.views = spec.views;
  if (key.layout == LabelLayout::Flat) {
    problem.tokenRank = 1;
    problem.tokenSizes[0] = spec.flatTokens;
    problem.numTokens = spec.flatTokens;
  } else {
    problem.seq = spec.seq;
    problem.batch = spec.batch;
    problem.tokenRank = 2;
    bool bs = key.layout == LabelLayout::SbvBs;
    problem.tokenSizes[0] = bs ? spec.batch : spec.seq;
    problem.tokenSizes[1] = bs ? spec.seq : spec.batch;
    problem.numTokens = spec.seq * spec.batch;
  }
}

/// Random inputs per the case; writes the logits and labels tensors.
void fillInputs(Problem &p, const CaseSpec &spec, std::mt19937_64 &rng,
                bool logitsAtStart = false) {
  int64_t n = p.numTokens, v = p.vocab;
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::uniform_int_distribution<int64_t> anyLabel(0,
                                                  std::max<int64_t>(v - 1, 0));
  ElemType type = p.key.logits;

  p.x.assign(n * v, 0.0);
  p.labels.assign(n, 0);
  for (int64_t t = 0; t < n; ++t) {
    double sigma = t % 3 == 0 ? 0.5 : t % 3 == 1 ? 2.0 : 4.0;
    for (int64_t j = 0; j < v; ++j)
      p.x[t * v + j] = roundTo(type, sigma * normal(rng));
    p.labels[t] = anyLabel(rng);
    if (p.reference.ignoreIndex && (spec.allIgnored || uniform(rng) < 0.2))
      p.labels[t] = *p.reference.ignoreIndex;
  }

  // Special rows on the first tokens.
  if (spec.specialRows && v >= 2) {
    bool f16 = type == ElemType::F16;
    for (int64_t t = 0; t < std::min<int64_t>(n, 9); ++t) {
      double *row = &p.x[t * v];
      int64_t label = anyLabel(rng);
      p.labels[t] = label;
      if (t == 0 || t == 1) {
        // -inf everywhere but one entry; for t == 1 the target is one of
        // the -inf entries, so the loss is +inf.
        // With a softcap -inf is -cap: every other entry keeps its value,
        // so that the row is not tens of thousands of equal terms, whose
        // sequential f32 sum on the host errs by more than the tolerance
        // (a summation limit, not the softcap's; no real row is like it).
        int64_t keep = anyLabel(rng);
        for (int64_t j = 0; j < v; ++j)
          if (!p.key.softcap || j % 2 == 0 || j == keep + 1)
            row[j] = j == keep ? roundTo(type, 2.0 * normal(rng)) : -kInf;
        p.labels[t] = t == 0 ? keep : (keep + 1) % v;
      } else if (t == 2) {
        // A confident row: p(target) = 1999/2000 before rounding x_target.
        double others = -kInf, max = -kInf;
        for (int64_t j = 0; j < v; ++j)
          if (j != label)
            max = std::fmax(max, row[j]);
        double sum = 0.0;
        for (int64_t j = 0; j < v; ++j)
          if (j != label)
            sum += std::exp(row[j] - max);
        others = max + std::log(sum);
        row[label] = roundTo(type, others + std::log(1999.0));
      } else if (t == 3) {
        // A large common offset: exp without the max subtraction overflows.
        // The label at the second largest value: the loss is then of order
        // s (x_max - x_y), so its tolerance sees the rounding of s x_y - s m
        // formed as two products (a kernel must take (x_y - m) s).
        for (int64_t j = 0; j < v; ++j)
          row[j] = roundTo(type, row[j] + 100.0);
        int64_t top = std::max_element(row, row + v) - row;
        int64_t second = top == 0 ? 1 : 0;
        for (int64_t j = 0; j < v; ++j)
          if (j != top && row[j] > row[second] && row[j] < row[top])
            second = j;
        p.labels[t] = second;
      } else if (t == 4) {
        // A maximum past 2^24 (the kernels sweep such a row again with exact
        // subtractions): nine values 2^20 apart (f16: 1024), so the maximum
        // has ties and the row sum is exact in f32.
        double unit = f16 ? 1024.0 : 0x1p20;
        double base = f16 ? 58.0 : 29.0;
        for (int64_t j = 0; j < v; ++j)
          row[j] = roundTo(
              type, unit * (base + std::clamp(std::round(row[j]), -4.0, 4.0)));
      } else if (t == 5) {
        // Huge values, 2^94 apart (f16: 512) around 2^100 (the ulp of
        // max * log2(e) is about 2^77); the row sum is exact in f32.
        double unit = f16 ? 512.0 : 0x1p94;
        for (int64_t j = 0; j < v; ++j)
          row[j] = roundTo(
              type, unit * (64.0 + std::clamp(std::round(row[j]), -8.0, 8.0)));
      }
      if (t == 4 || t == 5) {
        // The label at a maximum: the loss is then log(ties), of order 1,
        // so the 1e-5 loss tolerance sees the re-sweep's count of the
        // maximum's ties (with another label the loss is about |max| and
        // its tolerance hides the sum).
        p.labels[t] = std::max_element(row, row + v) - row;
      }
      if (t == 6) {
        // A first half far below the rest: the running maximum starts
        // below -2^24 and then grows.
        for (int64_t j = 0; j < v / 2; ++j)
          row[j] = roundTo(type, row[j] - 1.0e30);
      } else if (t == 7) {
        // Every other value near the most negative finite one, the rest
        // ordinary: the maximum is small, but the plain row sum overflows
        // f32, so label smoothing's mean is taken from the re-sweep's
        // shifted sum (issue 23, item 4). The loss is finite, about
        // s * FLT_MAX / 2.
        double most = f16 ? -65504.0 : -3.0e38;
        for (int64_t j = 0; j < v; j += 2)
          row[j] = roundTo(type, most);
        p.labels[t] = std::min<int64_t>(v - 1, 1);
      } else if (t == 8 && !p.key.softcap) {
        // Two equal maxima first in the row (one thread's first vector), then
        // V - 2 terms of about e^-14.5 (z = s x: the gap is 14.5 / s), the
        // label at a maximum: the loss is about ln 2 + V 2^-21. A count of
        // the maxima kept in one lane with its small terms rounds every
        // term added after it (two bits of 24 left at 2.0): the loss and
        // lse + lse_low off by 1.4e-5 at V = 32000 on the host.
        // The gaps vary by up to 10 % (equal terms would make the sums'
        // own rounding, label smoothing's mean included, err alike).
        double gap = 14.5 / p.logitScale;
        for (int64_t j = 0; j < v; ++j)
          row[j] = roundTo(type, 1.0 - gap * (j % 3 == 0 ? 2.0 : 1.0) *
                                     (1.0 + 0.1 * uniform(rng)));
        row[0] = row[1] = 1.0;
        p.labels[t] = label % 2;
      }
    }
  }

  // Rows for the entropy and argmax outputs on the first tokens.
  if (spec.outputRows && v >= 2) {
    std::uniform_int_distribution<int64_t> anyIndex(0, v - 1);
    for (int64_t t = 0; t < std::min<int64_t>(n, 8); ++t) {
      double *row = &p.x[t * v];
      double top = *std::max_element(row, row + v) + 1.0;
      if (t == 0) {
        // Every logit -inf: argmax 0 (all tie), entropy NaN. Ignored, so
        // that the loss (0) and the gradient (a zero row) are defined.
        std::fill(row, row + v, -kInf);
        p.labels[t] = *p.reference.ignoreIndex;
      } else if (t == 1) {
        // A NaN: argmax -1, entropy NaN; ignored too.
        row[anyIndex(rng)] = std::numeric_limits<double>::quiet_NaN();
        p.labels[t] = *p.reference.ignoreIndex;
      } else if (t == 2 || t == 3) {
        // Two equal maxima: the lower index. t == 3: at 0 and in the last
        // element (the row's tail, past the vector steps).
        int64_t first = t == 2 ? anyIndex(rng) : 0;
        int64_t second = t == 2 ? anyIndex(rng) : v - 1;
        if (second == first)
          second = (first + 1) % v;
        row[first] = row[second] = roundTo(type, top);
      } else if (t == 4) {
        // The only maximum in the last element.
        row[v - 1] = roundTo(type, top);
      } else if (t == 5 || t == 6) {
        // A common offset of 1e4 to 1e6, log-uniform (f16: to 6e4, its
        // range), positive (t == 5) or negative: p from x - max, never from
        // exp(s x); in bf16 and f16 many values then tie.
        double offset =
            1e4 * std::pow(type == ElemType::F16 ? 6.0 : 100.0, uniform(rng));
        for (int64_t j = 0; j < v; ++j)
          row[j] = roundTo(type, row[j] + (t == 5 ? offset : -offset));
      } else if (t == 7) {
        // Half the row -inf (a masked vocabulary): those p are 0 and add
        // nothing to the entropy; the label on a finite logit.
        int64_t keep = anyIndex(rng);
        for (int64_t j = 0; j < v; ++j)
          if (j % 2 != keep % 2)
            row[j] = -kInf;
        if (p.labels[t] != *p.reference.ignoreIndex)
          p.labels[t] = keep;
      }
    }
  }

  // Out-of-range labels among the others (the special rows included):
  // Megatron's SFT -100, V itself, past V, -1 and one far outside.
  if (spec.megatronLabels) {
    bool i64 = p.key.labels == ElemType::I64;
    const int64_t outside[] = {-100, v, v + 5, -1,
                               i64 ? int64_t(1) << 40 : INT32_MIN};
    for (int64_t t = 1; t < n; t += 3)
      p.labels[t] = outside[(t / 3) % 5];
  }

  p.logits =
      makeTensor(type, p.logitsShape(), p.logitsStrides(), logitsAtStart);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < v; ++j)
      p.logits.set(p.logitsIndex(t, j), p.x[t * v + j]);
  // What the references see: z = s x, exact in double, or with a softcap
  // z = cap tanh(s x / cap) (+-inf: +-cap), and dz/dx.
  p.z.resize(p.x.size());
  p.slope.resize(p.x.size());
  for (size_t i = 0; i < p.x.size(); ++i) {
    if (p.logitSoftcap == 0.0) {
      p.z[i] = p.logitScale * p.x[i];
      p.slope[i] = p.logitScale;
      continue;
    }
    double t = std::tanh(p.logitScale * p.x[i] / p.logitSoftcap);
    p.z[i] = p.logitSoftcap * t;
    p.slope[i] = p.logitScale * (1.0 - t * t);
  }
  p.labelTensor = makeTensor(p.key.labels, p.tokenShape(), p.tokenStrides(0));
  for (int64_t t = 0; t < n; ++t)
    p.labelTensor.setInt(t, p.labels[t]);
}

/// The upstream per-token scale: grad_loss for a backward, weights for a
/// fused kernel (0-d, per token, or broadcast).
void fillScale(Problem &p, const CaseSpec &spec, std::mt19937_64 &rng) {
  std::uniform_real_distribution<double> uniform(-2.0, 2.0);
  int64_t n = p.numTokens;
  p.scale.assign(n, 0.0);
  if (p.key.op == KernelOp::Forward)
    return;
  // A 0-d weight on the large broadcast case (the runtime passes it to the
  // token kernel with stride 0), a stride-0 per-token weight on the others.
  bool scalar = p.key.op == KernelOp::Fused && spec.broadcast &&
                spec.vocab >= 32000;
  bool broadcast = scalar || spec.broadcast;
  double common = static_cast<float>(uniform(rng));
  for (int64_t t = 0; t < n; ++t)
    p.scale[t] = broadcast ? common : static_cast<float>(uniform(rng));
  std::vector<int64_t> strides =
      broadcast ? std::vector<int64_t>(p.tokenRank, 0) : p.tokenStrides(2);
  TestTensor tensor;
  if (scalar) {
    tensor = makeTensor(ElemType::F32, {}, {});
    tensor.set(0, common);
  } else {
    tensor = makeTensor(ElemType::F32, p.tokenShape(), strides);
    for (int64_t t = 0; t < n; ++t)
      tensor.set(t, p.scale[t]);
  }
  (p.key.op == KernelOp::Backward ? p.gradLoss : p.weights) = std::move(tensor);
}

//===----------------------------------------------------------------------===//
// Bundles
//===----------------------------------------------------------------------===//

struct OpenBundle {
  std::string directory;
  ce_bundle *bundle = nullptr;
  std::set<std::string> keys;
};

std::vector<OpenBundle> bundles;

/// A bundle holding `key`, or null.
ce_bundle *findBundle(const KernelVariantKey &key) {
  std::string wanted = key.str();
  for (const OpenBundle &open : bundles)
    if (open.keys.count(wanted))
      return open.bundle;
  return nullptr;
}

/// The forward variant whose lse a backward of `key` consumes.
KernelVariantKey forwardOf(const KernelVariantKey &key) {
  KernelVariantKey forward = key;
  forward.op = KernelOp::Forward;
  forward.overwrite = false;
  forward.weights = WeightsKind::None;
  return forward;
}

//===----------------------------------------------------------------------===//
// Checks
//===----------------------------------------------------------------------===//

/// loss or lse of one token against the reference.
void checkTokenValue(Report &report, const Problem &p, const char *what,
                     int64_t t, double kernel, double ref, bool exactZero) {
  bool ok;
  // The output is f32: a reference past its range rounds to infinity (the
  // z-loss of a row of values near 1e30).
  if (std::fabs(ref) > std::numeric_limits<float>::max())
    ref = static_cast<float>(ref);
  double tolerance = 1e-5 * std::fmax(1.0, std::fabs(ref));
  // A softcap's z is an f32 of a few ulps: up to 8 ulps of the cap more.
  tolerance += p.logitSoftcap * std::ldexp(8.0, -24);
  if (exactZero)
    ok = kernel == 0.0;
  else if (!std::isfinite(ref))
    ok = std::isnan(ref) ? std::isnan(kernel) : kernel == ref;
  else
    ok = std::fabs(kernel - ref) <= tolerance;
  report.check(ok, [&] {
    return std::string(what) + " of " + p.where(t) + " (label " +
           std::to_string(p.labels[t]) + "): kernel " + formatDouble(kernel) +
           ", reference " + formatDouble(ref) + ", tolerance " +
           (exactZero ? std::string("exactly 0") : formatDouble(tolerance));
  });
}

/// The gradient tolerance of element j: one ulp of the logits dtype at the
/// reference (bf16, f16) or 1e-5 of the row's largest |gradient| (f32), plus
/// 4 f32 ulps of the terms fp32 arithmetic cannot avoid rounding (see
/// referenceGrad), which only matters where those terms cancel.
double gradTolerance(ElemType type, double ref, double rowMax,
                     double termScale) {
  double base = type == ElemType::F32 ? 1e-5 * rowMax : ulpOf(type, ref);
  return base + 4.0 * std::ldexp(termScale, -24);
}

/// One gradient row: kernel values read by `get(j)` against `ref`.
void checkGradRow(Report &report, const Problem &p, int64_t t,
                  const std::function<double(int64_t)> &get,
                  const std::vector<double> &ref,
                  const std::vector<double> &termScale, double lseUsed) {
  ElemType type = p.key.logits;
  // The kernels' f32 p_j flush to 0 below 2^-126 (exp2 without subnormals
  // on the host and GPUs): |g s (1 + 2 z lse)| 2^-125 of absolute error.
  // With a logit scale p_j that small are common (s = 20 spreads a normal
  // row over hundreds in z); the double reference keeps them.
  double flushFloor = std::fabs(p.scale[t] * p.logitScale) *
                      std::fmax(1.0, std::fabs(1.0 + 2.0 * p.reference.zLoss *
                                                         lseUsed)) *
                      std::ldexp(1.0, -125);
  double rowMax = 0.0;
  for (double value : ref)
    rowMax = std::fmax(rowMax, std::fabs(value));
  int64_t worst = -1;
  double worstExcess = 0.0;
  int64_t bad = 0;
  for (int64_t j = 0; j < p.vocab; ++j) {
    double kernel = get(j);
    double tolerance =
        gradTolerance(type, ref[j], rowMax, termScale[j]) + flushFloor;
    // An infinite gradient (a z-loss of logits near 1e30) must be the
    // reference's exactly. A finite reference beyond the logits dtype's range
    // (f16 past 65520: a z-loss over logits near 65504 with a logit scale)
    // rounds to an infinity of its sign, which the kernel must then write.
    double error = kernel == ref[j] ? 0.0 : std::fabs(kernel - ref[j]);
    if (std::isinf(kernel) && std::signbit(kernel) == std::signbit(ref[j]) &&
        std::isinf(roundTo(type, ref[j] + std::copysign(tolerance, ref[j]))))
      error = 0.0;
    if (!(error <= tolerance)) {
      ++bad;
      double excess =
          std::isnan(error) ? kInf : error / std::fmax(tolerance, 1e-300);
      if (worst < 0 || excess > worstExcess) {
        worst = j;
        worstExcess = excess;
      }
    }
  }
  report.check(bad == 0, [&] {
    double kernel = get(worst);
    double tolerance =
        gradTolerance(type, ref[worst], rowMax, termScale[worst]) + flushFloor;
    return "grad of " + p.where(t) + " (label " + std::to_string(p.labels[t]) +
           ", lse " + formatDouble(lseUsed) + "): " + std::to_string(bad) +
           " of " + std::to_string(p.vocab) +
           " elements off; worst j=" + std::to_string(worst) +
           (worst == p.labels[t] ? " (target)" : "") + ": kernel " +
           formatDouble(kernel) + ", reference " + formatDouble(ref[worst]) +
           ", tolerance " + formatDouble(tolerance) +
           (type == ElemType::F32 ? " (1e-5 of row max" : " (1 ulp") +
           " + f32 floor " +
           formatDouble(4.0 * std::ldexp(termScale[worst], -24)) + ")" +
           (p.vocab <= 8 ? ", row " + formatRow(&p.x[t * p.vocab], p.vocab) +
                               ", scale " + formatDouble(p.scale[t]) +
                               ", logit scale " + formatDouble(p.logitScale)
                         : std::string());
  });
}

/// Compares every gradient row written in `grad` (or the logits, when
/// overwriting) with the reference computed from `lseUsed`.
/// `inputLse`: the kernel took `lseUsed` as an input (backward); otherwise
/// it computed the lse itself (fused) and `stats` are the exact statistics.
void checkGrad(Report &report, const Problem &p, const TestTensor &grad,
               const std::vector<double> &lseUsed,
               const std::vector<RowStats> &stats, bool inputLse,
               bool backwardWithLow) {
  std::vector<double> ref(p.vocab), termScale(p.vocab);
  for (int64_t t = 0; t < p.numTokens; ++t) {
    const double *row = &p.z[t * p.vocab];
    int64_t label = p.labels[t];
    double targetLogProb = 0.0;
    if (!isIgnored(label, p.reference) && label >= 0 && label < p.vocab)
      targetLogProb =
          inputLse ? row[label] - lseUsed[t] : stats[t].logProb(row, label);
    // A fused kernel keeps the row maximum and the log of the sum apart:
    // its reference is exact at any magnitude, and only the log of the
    // sum's ulps are allowed (not |lse|'s).
    // The gradient of x: s times that of z.
    // A backward given lse_low with s != 1: the f32 low part holds s max's
    // rounding and log(sum) together, to 2^-48 |lse| (docs/lowering.md).
    double extraUlps = !inputLse && backwardWithLow && p.logitScale != 1.0
                           ? std::ldexp(std::fabs(lseUsed[t]), -24)
                           : 0.0;
    // Past |lse| = 2^47 that error reaches 1 in every exponent: such a
    // row's backward gradient is not checked (the fused kernel's is).
    if (std::ldexp(extraUlps, -24) > 0.5)
      continue;
    // The gradient of z, then times dz/dx per element.
    referenceGrad(row, p.vocab, label, lseUsed[t], targetLogProb, p.scale[t],
                  p.reference, ref.data(), termScale.data(),
                  inputLse ? nullptr : &stats[t], extraUlps);
    // A softcap's dz/dx = s (1 - t^2) from an f32 t of a few ulps is off by
    // up to about s 2^-19 in absolute terms where t nears +-1 (as in any
    // f32 evaluation of tanh's derivative, PyTorch's autograd included):
    // 16 s |dL/dz| more in the terms (gradTolerance takes 4 ulps of them):
    // 2^-18 s |dL/dz|.
    // And z itself is within a few ulps of the cap (cap - 2 cap r, r =
    // 1 / (1 + 2^(x k)) with an approximate exp2 and reciprocal: about 6
    // ulps of the cap, absolute, not relative to z), and so is lse: p_j
    // moves by up to p_j cap 12 2^-24 (4 more ulps of 3 p_j cap g).
    double slopeError = p.logitSoftcap != 0.0 ? 16.0 * p.logitScale : 0.0;
    for (int64_t j = 0; j < p.vocab; ++j) {
      double slope = p.slope[t * p.vocab + j];
      double zError = 0.0;
      if (p.logitSoftcap != 0.0 && std::isfinite(lseUsed[t]))
        zError = std::exp(row[j] - lseUsed[t]) * 3.0 * p.logitSoftcap *
                 std::fabs(p.scale[t]);
      // A zero row (an ignored token) stays zero whatever its logits: a
      // NaN logit's slope is NaN, 0 times it is not 0.
      if (ref[j] == 0.0 && termScale[j] == 0.0 && std::isnan(slope))
        continue;
      termScale[j] = (termScale[j] + zError) * slope;
      if (slopeError != 0.0) // (0 times an infinite gradient is not 0)
        termScale[j] += slopeError * std::fabs(ref[j]);
      ref[j] *= slope;
    }
    checkGradRow(
        report, p, t, [&](int64_t j) { return grad.get(p.logitsIndex(t, j)); },
        ref, termScale, lseUsed[t]);
  }
}

void checkUnchanged(Report &report, const char *what, const TestTensor &tensor,
                    const std::vector<unsigned char> &before) {
  report.check(tensor.snapshot() == before,
               [&] { return std::string(what) + " was modified by the call"; });
}

void checkPadding(Report &report, const char *what, const TestTensor &tensor) {
  report.check(tensor.paddingIntact(kPaddingFill), [&] {
    return std::string("bytes of the ") + what +
           " buffer outside the view were written";
  });
}

//===----------------------------------------------------------------------===//
// Running one case
//===----------------------------------------------------------------------===//

/// `low`: lse's low part, written with the lse; `entropy`, `argmax`: the
/// outputs (nullptr: not asked for).
ce_status runForward(ce_bundle *bundle, Problem &p, TestTensor &loss,
                     TestTensor &lse, TestTensor *low = nullptr,
                     TestTensor *entropy = nullptr,
                     TestTensor *argmax = nullptr) {
  ce_options options = p.options;
  options.lse_low = low ? &low->tensor : nullptr;
  options.entropy = entropy ? &entropy->tensor : nullptr;
  options.argmax = argmax ? &argmax->tensor : nullptr;
  return ce_forward(bundle, &options, &p.logits.tensor, &p.labelTensor.tensor,
                    &loss.tensor, &lse.tensor, nullptr);
}

/// lse + lse_low of token t against the float64 log-sum-exp: the pair
/// must carry log(sum) to f32's precision however large the row's maximum.
void checkLseLow(Report &report, const Problem &p, int64_t t, double lse,
                 double low, const RowStats &stats) {
  if (!std::isfinite(stats.lse) || !std::isfinite(lse))
    return; // NaN rows (bad labels) and overflowing ones: lse says it all
  double logSum = stats.lse - stats.max;
  double tolerance = 1e-5 * std::fmax(1.0, logSum);
  double error = std::fabs((lse + low) - stats.lse);
  report.check(error <= tolerance, [&] {
    return "lse + lse_low of " + p.where(t) + ": kernel " + formatDouble(lse) +
           " + " + formatDouble(low) + ", reference " +
           formatDouble(stats.lse) + " (error " + formatDouble(error) +
           ", tolerance " + formatDouble(tolerance) + ")";
  });
}

/// What the entropy and argmax outputs hold before a call: -7 is neither an
/// entropy (>= 0, or NaN) nor an argmax (-1, or in [0, V)).
constexpr int64_t kOutputPoison = -7;

/// Whether case `seed` asks for the entropy and the argmax outputs: every
/// other case each, independently (and of lse_low's bit 7).
bool asksEntropy(uint64_t seed) { return (seed >> 9) & 1; }
bool asksArgmax(uint64_t seed) { return (seed >> 10) & 1; }

/// A token-shaped output of `type`, every element kOutputPoison.
TestTensor poisonedOutput(const Problem &p, ElemType type,
                          const std::vector<int64_t> &strides) {
  TestTensor tensor = makeTensor(type, p.tokenShape(), strides);
  for (int64_t t = 0; t < p.numTokens; ++t)
    tensor.set(t, static_cast<double>(kOutputPoison));
  return tensor;
}

/// The largest entropy error seen, relative to max(1, H), for the summary.
double worstEntropyError = 0.0;
int64_t entropyValuesChecked = 0;

/// The entropy's tolerance, relative to max(1, H): see checkEntropy.
constexpr double kEntropyTolerance = 2e-5;

/// The entropy of token t against the float64 reference (referenceEntropy):
///   |kernel - ref| <= kEntropyTolerance max(1, ref), NaN exactly where ref
///   is NaN.
/// The kernel sums p_j log2 p_j in f32, log2 p_j = (x_j - m) fl(s log2 e) -
/// fl(log S) log2 e from the statistics sweep. The rounding of fl(s log2 e)
/// and of log S moves each log p_j by about 2^-23 (|z_j - max| + log S),
/// which moves H by ~2^-23 (1 + H + log V) (~2e-6 at V = 128256); the p_j
/// flushed to 0 below 2^-126 drop terms of < 2^-118. The V terms, all of
/// one sign, are summed per lane with Kahan's compensation: a plain f32 sum
/// drifted by up to 5.4e-5 of H (f16 rows of V = 32001 whose values tie
/// after rounding, measured on the host, Dec 2026); compensated, 6e-6 at
/// most over these cases (the summary line prints it).
/// 2e-5, the loss's 1e-5 with a margin of 2, still sees any error of a
/// term's form.
void checkEntropy(Report &report, const Problem &p, int64_t t, double kernel,
                  const RowStats &stats) {
  const double *row = &p.z[t * p.vocab];
  double ref = referenceEntropy(row, p.vocab, stats);
  double magnitude = std::fmax(1.0, std::fabs(ref));
  double tolerance = kEntropyTolerance * magnitude;
  bool ok;
  if (std::isnan(ref)) {
    ok = std::isnan(kernel);
  } else {
    double error = std::fabs(kernel - ref);
    ok = error <= tolerance; // false for a NaN kernel value
    if (std::isfinite(error)) {
      worstEntropyError = std::fmax(worstEntropyError, error / magnitude);
      ++entropyValuesChecked;
    }
  }
  report.check(ok, [&] {
    return "entropy of " + p.where(t) + " (label " +
           std::to_string(p.labels[t]) + "): kernel " + formatDouble(kernel) +
           ", reference " + formatDouble(ref) + ", tolerance " +
           formatDouble(tolerance) + ", logit scale " +
           formatDouble(p.logitScale) +
           (p.vocab <= 16 ? ", row " + formatRow(&p.x[t * p.vocab], p.vocab)
                          : std::string());
  });
}

/// The argmax of token t: the lowest index of the row's maximum of z, -1 for
/// a NaN row, 0 for an all -inf row. Where float64's top two values of z are
/// within f32 rounding of each other (2^-23 of the maximum) a kernel that
/// forms z in f32 may return either; an exact tie must go to the lower index
/// (argmaxAcceptable).
void checkArgmax(Report &report, const Problem &p, int64_t t, int64_t kernel) {
  const double *row = &p.z[t * p.vocab];
  int64_t ref = referenceArgmax(row, p.vocab);
  double top = ref >= 0 ? row[ref] : 0.0;
  double tolerance = std::isfinite(top) ? std::ldexp(std::fabs(top), -23) : 0.0;
  // A softcap's z is within a few ulps of the cap (about 6, absolute; then
  // the product): two z within 16 ulps of the cap's 2^-24 may compare either
  // way in the kernel, and a saturated cap ties what float64 still orders.
  if (p.logitSoftcap != 0.0)
    tolerance += p.logitSoftcap * std::ldexp(16.0, -24);
  report.check(argmaxAcceptable(row, p.vocab, kernel, tolerance), [&] {
    std::string there =
        kernel >= 0 && kernel < p.vocab
            ? " (x " + formatDouble(p.x[t * p.vocab + kernel]) + ")"
            : std::string();
    return "argmax of " + p.where(t) + ": kernel " + std::to_string(kernel) +
           there + ", reference " + std::to_string(ref) +
           (ref >= 0 ? " (x " + formatDouble(p.x[t * p.vocab + ref]) + ")"
                     : std::string()) +
           ", logit scale " + formatDouble(p.logitScale) +
           (p.vocab <= 16 ? ", row " + formatRow(&p.x[t * p.vocab], p.vocab)
                          : std::string());
  });
}

/// The entropy and argmax a forward or fused call was given, against the
/// references, for every token whatever its label; and their padding.
void checkOutputs(Report &report, const Problem &p,
                  const std::vector<RowStats> &stats, const TestTensor *entropy,
                  const TestTensor *argmax) {
  if (entropy) {
    checkPadding(report, "entropy", *entropy);
    for (int64_t t = 0; t < p.numTokens; ++t)
      checkEntropy(report, p, t, entropy->get(t), stats[t]);
  }
  if (argmax) {
    checkPadding(report, "argmax", *argmax);
    for (int64_t t = 0; t < p.numTokens; ++t)
      checkArgmax(report, p, t, argmax->getInt(t));
  }
}

void expectOk(Report &report, ce_status status, const char *function) {
  report.check(status == CE_OK, [&] {
    return std::string(function) + " returned " + ce_status_string(status) +
           ": " + ce_last_error_message();
  });
}

void runCase(Report &report, ce_bundle *bundle, const KernelVariantKey &key,
             const CaseSpec &spec, const CaseOptions &values, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Problem p;
  initProblem(p, key, spec, values);
  fillInputs(p, spec, rng);
  fillScale(p, spec, rng);
  int64_t n = p.numTokens, v = p.vocab;

  // The float64 reference lse of every token.
  std::vector<RowStats> stats(n);
  std::vector<double> refLse(n);
  for (int64_t t = 0; t < n; ++t) {
    stats[t] = referenceStats(&p.z[t * v], v);
    refLse[t] = stats[t].lse;
  }

  auto labelsBefore = p.labelTensor.snapshot();
  auto logitsBefore = p.logits.snapshot();

  TestTensor loss, lse, grad, lseInput, low;
  std::vector<unsigned char> scaleBefore, lseInputBefore, lseLowBefore;
  std::vector<double> lseUsed = refLse; // what the gradient is computed from
  ce_status status = CE_OK;
  // Every other case passes ce_options.lse_low: forward and fused write it,
  // the backward reads it (and its gradient is then checked against the
  // exact reference). Without it the kernels must not touch it.
  bool withLow = (seed >> 7) & 1;
  if (withLow)
    low = makeTensor(ElemType::F32, p.tokenShape(), p.tokenStrides(4));
  ce_options options = p.options;
  options.lse_low = withLow ? &low.tensor : nullptr;
  // The entropy and argmax outputs, each in every other case: forward and
  // fused write them, a backward is given them too and must ignore them.
  // Without one the kernel gets the lse's view in its place (flag bit off)
  // and must leave it alone: the lse checks below see that it did.
  bool withEntropy = asksEntropy(seed), withArgmax = asksArgmax(seed);
  TestTensor entropy, argmax;
  if (withEntropy)
    entropy = poisonedOutput(p, ElemType::F32, p.tokenStrides(0));
  if (withArgmax)
    argmax = poisonedOutput(p, ElemType::I64, p.tokenStrides(5));
  std::vector<unsigned char> entropyBefore = entropy.snapshot(),
                             argmaxBefore = argmax.snapshot();
  options.entropy = withEntropy ? &entropy.tensor : nullptr;
  options.argmax = withArgmax ? &argmax.tensor : nullptr;

  switch (key.op) {
  case KernelOp::Forward:
    loss = makeTensor(ElemType::F32, p.tokenShape(), p.tokenStrides(3));
    lse = makeTensor(ElemType::F32, p.tokenShape(), p.tokenStrides(2));
    status = runForward(bundle, p, loss, lse, withLow ? &low : nullptr,
                        withEntropy ? &entropy : nullptr,
                        withArgmax ? &argmax : nullptr);
    expectOk(report, status, "ce_forward");
    break;
  case KernelOp::Backward: {
    // lse comes from the forward kernel when the bundles have it, as in
    // training; its rounding to f32 is part of the backward's input.
    lseInput = makeTensor(ElemType::F32, p.tokenShape(), p.tokenStrides(0));
    KernelVariantKey forwardKey = forwardOf(key);
    if (ce_bundle *forwardBundle = findBundle(forwardKey)) {
      TestTensor fLoss = makeTensor(ElemType::F32, p.tokenShape(),
                                    packedStrides(p.tokenShape()));
      TestTensor fLse = makeTensor(ElemType::F32, p.tokenShape(),
                                   packedStrides(p.tokenShape()));
      TestTensor fLow = makeTensor(ElemType::F32, p.tokenShape(),
                                   packedStrides(p.tokenShape()));
      ce_status forwardStatus = runForward(forwardBundle, p, fLoss, fLse,
                                           withLow ? &fLow : nullptr);
      expectOk(report, forwardStatus, "ce_forward (lse for the backward)");
      for (int64_t t = 0; t < n; ++t) {
        lseUsed[t] = fLse.get(t);
        if (withLow)
          low.set(t, fLow.get(t));
      }
    } else {
      for (int64_t t = 0; t < n; ++t) {
        float high = static_cast<float>(refLse[t]);
        lseUsed[t] = high;
        if (withLow)
          low.set(t, std::isfinite(high) ? static_cast<float>(refLse[t] - high)
                                         : 0.0f);
      }
    }
    for (int64_t t = 0; t < n; ++t)
      lseInput.set(t, lseUsed[t]);
    lseInputBefore = lseInput.snapshot();
    if (withLow) {
      lseLowBefore = low.snapshot();
      for (int64_t t = 0; t < n; ++t)
        lseUsed[t] += low.get(t);
    }
    scaleBefore = p.gradLoss.snapshot();
    if (!key.overwrite)
      grad = makeTensor(key.logits, p.logitsShape(), p.gradStrides());
    status =
        ce_backward(bundle, &options, &p.logits.tensor, &p.labelTensor.tensor,
                    &lseInput.tensor, &p.gradLoss.tensor,
                    key.overwrite ? nullptr : &grad.tensor, nullptr);
    expectOk(report, status, "ce_backward");
    break;
  }
  case KernelOp::Fused:
    loss = makeTensor(ElemType::F32, p.tokenShape(), p.tokenStrides(3));
    lse = makeTensor(ElemType::F32, p.tokenShape(), p.tokenStrides(2));
    scaleBefore = p.weights.snapshot();
    if (!key.overwrite)
      grad = makeTensor(key.logits, p.logitsShape(), p.gradStrides());
    status =
        ce_fused(bundle, &options, &p.logits.tensor, &p.labelTensor.tensor,
                 &p.weights.tensor, &loss.tensor, &lse.tensor,
                 key.overwrite ? nullptr : &grad.tensor, nullptr);
    expectOk(report, status, "ce_fused");
    break;
  case KernelOp::ShardStats:
    // Sharded kernels are checked by test/python/test_shard_kernels.py and
    // the multi-process tests; this suite's bundles hold none.
    report.check(false, [] { return std::string("unexpected shard_stats"); });
    return;
  case KernelOp::Rescale: // skipped by main(): runtime_rescale_test
    return;
  }
  if (status != CE_OK)
    return;

  // Inputs stay as they were; padding of every written buffer too.
  checkUnchanged(report, "labels", p.labelTensor, labelsBefore);
  if (key.op == KernelOp::Backward) {
    checkUnchanged(report, "lse (input)", lseInput, lseInputBefore);
    checkUnchanged(report, "grad_loss", p.gradLoss, scaleBefore);
    if (withLow)
      checkUnchanged(report, "lse_low (input)", low, lseLowBefore);
    if (withEntropy)
      checkUnchanged(report, "entropy (a backward's to ignore)", entropy,
                     entropyBefore);
    if (withArgmax)
      checkUnchanged(report, "argmax (a backward's to ignore)", argmax,
                     argmaxBefore);
  }
  if (key.op == KernelOp::Fused)
    checkUnchanged(report, "weights", p.weights, scaleBefore);
  if (key.overwrite)
    checkPadding(report, "logits (overwritten)", p.logits);
  else
    checkUnchanged(report, "logits", p.logits, logitsBefore);

  if (key.op != KernelOp::Backward) {
    checkPadding(report, "loss", loss);
    checkPadding(report, "lse", lse);
    for (int64_t t = 0; t < n; ++t) {
      double refLoss =
          referenceLoss(&p.z[t * v], v, p.labels[t], stats[t], p.reference);
      checkTokenValue(report, p, "loss", t, loss.get(t), refLoss,
                      isIgnored(p.labels[t], p.reference));
      checkTokenValue(report, p, "lse", t, lse.get(t), refLse[t], false);
      if (withLow)
        checkLseLow(report, p, t, lse.get(t), low.get(t), stats[t]);
    }
    if (withLow)
      checkPadding(report, "lse_low", low);
    checkOutputs(report, p, stats, withEntropy ? &entropy : nullptr,
                 withArgmax ? &argmax : nullptr);
  }
  if (key.op != KernelOp::Forward) {
    const TestTensor &written = key.overwrite ? p.logits : grad;
    if (!key.overwrite)
      checkPadding(report, "grad", grad);
    // Given lse's low part the backward's gradient is as exact as the
    // fused kernel's: the exact reference.
    checkGrad(report, p, written, lseUsed, stats,
              key.op == KernelOp::Backward && !withLow,
              key.op == KernelOp::Backward && withLow);
  }
}

/// A batch with one bad label, in memory that faults past the logits (or
/// before them, for a negative label): the kernel must report the token and
/// write NaN for it, without touching memory outside the tensors.
void runBadLabelCase(Report &report, ce_bundle *bundle,
                     const KernelVariantKey &key, int64_t badToken,
                     int64_t badLabel, bool logitsAtStart,
                     const CaseOptions &values, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Problem p;
  initProblem(p, key, kBadLabelSpec, values);
  fillInputs(p, kBadLabelSpec, rng, logitsAtStart);
  fillScale(p, kBadLabelSpec, rng);
  if (values.ignoreIndex)
    for (int64_t &label : p.labels)
      if (label == *values.ignoreIndex)
        label = 0;
  p.labels[badToken] = badLabel;
  for (int64_t t = 0; t < p.numTokens; ++t)
    p.labelTensor.setInt(t, p.labels[t]);

  TestTensor loss =
      makeTensor(ElemType::F32, p.tokenShape(), packedStrides(p.tokenShape()));
  TestTensor lse =
      makeTensor(ElemType::F32, p.tokenShape(), packedStrides(p.tokenShape()));
  TestTensor grad =
      makeTensor(key.logits, p.logitsShape(), packedStrides(p.logitsShape()));
  ce_tensor *gradArg = key.overwrite ? nullptr : &grad.tensor;
  // The entropy and argmax of every row, the bad label's included.
  TestTensor entropy =
      poisonedOutput(p, ElemType::F32, packedStrides(p.tokenShape()));
  TestTensor argmax =
      poisonedOutput(p, ElemType::I64, packedStrides(p.tokenShape()));
  ce_options options = p.options;
  options.entropy = &entropy.tensor;
  options.argmax = &argmax.tensor;
  ce_status status = CE_OK;
  switch (key.op) {
  case KernelOp::Forward:
    status = runForward(bundle, p, loss, lse, nullptr, &entropy, &argmax);
    break;
  case KernelOp::Backward:
    for (int64_t t = 0; t < p.numTokens; ++t)
      lse.set(t, referenceStats(&p.z[t * p.vocab], p.vocab).lse);
    status =
        ce_backward(bundle, &p.options, &p.logits.tensor, &p.labelTensor.tensor,
                    &lse.tensor, &p.gradLoss.tensor, gradArg, nullptr);
    break;
  case KernelOp::Fused:
    status = ce_fused(bundle, &options, &p.logits.tensor, &p.labelTensor.tensor,
                      &p.weights.tensor, &loss.tensor, &lse.tensor, gradArg,
                      nullptr);
    break;
  case KernelOp::ShardStats:
    report.check(false, [] { return std::string("unexpected shard_stats"); });
    return;
  case KernelOp::Rescale: // skipped by main(): runtime_rescale_test
    return;
  }
  std::string message = ce_last_error_message();
  report.check(status == CE_ERROR_LABEL_OUT_OF_RANGE, [&] {
    return "label " + std::to_string(badLabel) + " at " + p.where(badToken) +
           ": expected CE_ERROR_LABEL_OUT_OF_RANGE, got " +
           ce_status_string(status) + " " + message;
  });
  if (status != CE_ERROR_LABEL_OUT_OF_RANGE)
    return;
  std::string expected = p.where(badToken) + ": label " +
                         std::to_string(badLabel) + " is not in [0, " +
                         std::to_string(p.vocab) + ")";
  report.check(message.find(expected) != std::string::npos, [&] {
    return "message \"" + message + "\" lacks \"" + expected + "\"";
  });
  if (key.op != KernelOp::Backward) {
    report.check(std::isnan(loss.get(badToken)), [&] {
      return "loss of the bad " + p.where(badToken) + " is " +
             formatDouble(loss.get(badToken)) + ", not NaN";
    });
    std::vector<RowStats> stats(p.numTokens);
    for (int64_t t = 0; t < p.numTokens; ++t)
      stats[t] = referenceStats(&p.z[t * p.vocab], p.vocab);
    checkOutputs(report, p, stats, &entropy, &argmax);
  }
  if (key.op != KernelOp::Forward) {
    const TestTensor &written = key.overwrite ? p.logits : grad;
    bool allNaN = true;
    for (int64_t j = 0; j < p.vocab; ++j)
      allNaN &= std::isnan(written.get(p.logitsIndex(badToken, j)));
    report.check(allNaN, [&] {
      return "gradient row of the bad " + p.where(badToken) + " is not NaN";
    });
  }
}

//===----------------------------------------------------------------------===//
// Driver
//===----------------------------------------------------------------------===//

uint64_t mix(uint64_t seed, const std::string &text) {
  uint64_t hash = seed ^ 0x9e3779b97f4a7c15ull;
  for (unsigned char c : text)
    hash = (hash ^ c) * 0x100000001b3ull;
  return hash;
}

const char *envOr(const char *name, const char *fallback) {
  const char *value = std::getenv(name);
  return value && *value ? value : fallback;
}

} // namespace

int main(int argc, char **argv) {
  std::vector<std::string> directories(argv + 1, argv + argc);
  if (directories.empty()) {
    std::stringstream list(envOr("CE_TEST_BUNDLES", ""));
    for (std::string dir; std::getline(list, dir, ':');)
      if (!dir.empty())
        directories.push_back(dir);
  }
  if (directories.empty()) {
    std::fprintf(stderr, "usage: %s BUNDLE_DIR... (or CE_TEST_BUNDLES)\n",
                 argv[0]);
    return 2;
  }

  uint64_t seed = std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::system_clock::now().time_since_epoch())
                      .count();
  if (const char *fixed = std::getenv("CE_TEST_SEED"))
    seed = std::strtoull(fixed, nullptr, 0);
  std::string filter = envOr("CE_TEST_FILTER", "");
  bool verbose = std::string(envOr("CE_TEST_VERBOSE", "0")) != "0";
  std::printf("runtime_numerics_test: seed %" PRIu64
              " (rerun with CE_TEST_SEED=%" PRIu64 ")\n",
              seed, seed);

  for (const std::string &dir : directories) {
    OpenBundle open;
    open.directory = dir;
    if (ce_bundle_open(dir.c_str(), &open.bundle) != CE_OK) {
      std::printf("FAIL: %s\n", ce_last_error_message());
      return 1;
    }
    for (int64_t i = 0; i < ce_bundle_num_kernels(open.bundle); ++i)
      open.keys.insert(ce_bundle_kernel_key(open.bundle, i));
    std::printf("bundle %s: %zu kernels\n", dir.c_str(), open.keys.size());
    bundles.push_back(std::move(open));
  }

  Report report;
  auto start = std::chrono::steady_clock::now();
  int64_t kernels = 0, failedKernels = 0;
  std::map<std::string, std::set<std::string>> coverage;
  for (const OpenBundle &open : bundles) {
    for (const std::string &keyText : open.keys) {
      if (keyText.find(filter) == std::string::npos)
        continue;
      std::optional<KernelVariantKey> key = parseKernelVariantKey(keyText);
      if (!key) {
        std::printf("FAIL: unparsable variant key \"%s\"\n", keyText.c_str());
        ++report.failures;
        continue;
      }
      if (key->op == KernelOp::Rescale)
        continue; // reads no labels: runtime_rescale_test checks it
      ++kernels;
      auto kernelStart = std::chrono::steady_clock::now();
      for (size_t begin = 0; begin <= keyText.size();) {
        size_t end = keyText.find(',', begin);
        std::string field = keyText.substr(begin, end - begin);
        size_t eq = field.find('=');
        coverage[field.substr(0, eq)].insert(field.substr(eq + 1));
        if (end == std::string::npos)
          break;
        begin = end + 1;
      }

      for (const CaseSpec &spec : kCases) {
        CaseOptions values = drawOptions(
            *key, spec, false, mix(seed, keyText + "/" + spec.name + "/options"));
        std::string name = std::string(spec.name) + " (" + values.str() + ")";
        for (const auto &[field, value] :
             {std::pair{"ignore_index", values.ignoreIndex ? "set" : "none"},
              std::pair{"label_smoothing_value",
                        values.labelSmoothing != 0.0f ? "nonzero" : "0"},
              std::pair{"z_loss_value", values.zLoss != 0.0f ? "nonzero" : "0"},
              std::pair{"logit_scale",
                        values.logitScale != 1.0f ? "drawn" : "1"},
              std::pair{"logit_softcap",
                        values.logitSoftcap != 0.0f ? "drawn" : "none"}})
          coverage[field].insert(value);
        if (key->op == KernelOp::Forward || key->op == KernelOp::Fused) {
          uint64_t caseSeed = mix(seed, keyText + "/" + spec.name);
          coverage["entropy"].insert(asksEntropy(caseSeed) ? "on" : "off");
          coverage["argmax"].insert(asksArgmax(caseSeed) ? "on" : "off");
        }
        report.startCase(keyText, name);
        if (verbose)
          std::printf("    case %s\n", name.c_str());
        runCase(report, open.bundle, *key, spec, values,
                mix(seed, keyText + "/" + spec.name));
      }
      CaseOptions badValues = drawOptions(*key, kBadLabelSpec, true,
                                          mix(seed, keyText + "/bad/options"));
      struct {
        int64_t token, label;
        bool atStart;
      } badCases[] = {
          {8, 7, false}, // just past the last row
          {0, -1, true}, // just before the first row
          {4, key->labels == ElemType::I64 ? int64_t(1) << 40 : 12345, false},
          // Next to the ignore_index: compared exactly, not by range.
          {5, badValues.ignoreIndex ? *badValues.ignoreIndex + 1 : 99, false},
      };
      for (auto &bad : badCases) {
        std::string name = "bad-label-" + std::to_string(bad.label) + " (" +
                           badValues.str() + ")";
        report.startCase(keyText, name);
        runBadLabelCase(report, open.bundle, *key, bad.token, bad.label,
                        bad.atStart, badValues,
                        mix(seed, keyText + "/bad-label-" +
                                      std::to_string(bad.label)));
      }
      int64_t failures = report.takeKernelFailures();
      double seconds = std::chrono::duration<double>(
                           std::chrono::steady_clock::now() - kernelStart)
                           .count();
      std::printf("[%s] %s (%.2f s)\n", failures ? "FAIL" : " ok ",
                  keyText.c_str(), seconds);
      if (failures)
        ++failedKernels;
      std::fflush(stdout);
    }
  }
  for (OpenBundle &open : bundles)
    ce_bundle_close(open.bundle);

  double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  std::printf("coverage:");
  for (auto &[field, values] : coverage) {
    std::printf(" %s={", field.c_str());
    bool first = true;
    for (const std::string &value : values) {
      std::printf("%s%s", first ? "" : ",", value.c_str());
      first = false;
    }
    std::printf("}");
  }
  std::printf("\nentropy: %" PRId64 " finite values, largest error %.3g of "
              "max(1, H) (tolerance %.3g)",
              entropyValuesChecked, worstEntropyError, kEntropyTolerance);
  std::printf("\n%" PRId64 " kernels, %" PRId64 " checks, %" PRId64
              " failures in %" PRId64 " kernels, %.1f s (seed %" PRIu64 ")\n",
              kernels, report.checks, report.failures, failedKernels, seconds,
              seed);
  if (kernels == 0) {
    std::printf("FAIL: no kernels matched\n");
    return 1;
  }
  return report.failures ? 1 : 0;
}
