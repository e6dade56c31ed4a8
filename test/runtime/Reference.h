//===- Reference.h - The float64 cross-entropy reference --------*- C++ -*-===//
//
// DESIGN.md section 1, in double precision, one token row at a time. The
// quantities that cancel near p_y = 1 (lse - x_y and p_y - 1) are formed
// from the row's statistics with log1p/expm1, so the reference stays accurate
// to ~1e-15 relative even when 1 - p_y is below double's resolution of 1.
//
//===----------------------------------------------------------------------===//

#ifndef CE_TEST_RUNTIME_REFERENCE_H
#define CE_TEST_RUNTIME_REFERENCE_H

#include <cstdint>
#include <optional>
#include <vector>

namespace ce::test {

/// The options that change the numbers.
struct ReferenceOptions {
  std::optional<int64_t> ignoreIndex;
  double labelSmoothing = 0.0; ///< alpha, as the f32 the kernel sees.
  double zLoss = 0.0;
  /// CE_LABEL_POLICY_MEGATRON: a label outside [0, V) is an absent class.
  bool megatronLabels = false;
};

/// Whether `label` is the ignore_index.
inline bool isIgnored(int64_t label, const ReferenceOptions &options) {
  return options.ignoreIndex && label == *options.ignoreIndex;
}

/// Whether `label` lies outside [0, V) and is not ignored, under Megatron's
/// contract (Core's predicted logit 0 after the max shift: the target logit
/// is taken as the row maximum, and no gradient element is the target's).
inline bool isAbsent(int64_t label, int64_t vocab,
                     const ReferenceOptions &options) {
  return options.megatronLabels && !isIgnored(label, options) &&
         (label < 0 || label >= vocab);
}

/// The effective smoothing s = alpha V / (V - 1); 0 when V == 1.
double smoothingFactor(double alpha, int64_t vocab);

/// Softmax statistics of one row: lse = max + log1p(rest), where rest sums
/// exp(x_j - max) over every entry but one maximal one.
struct RowStats {
  double max = 0.0;
  int64_t argmax = 0;
  double rest = 0.0;
  double lse = 0.0;

  /// log p_j = x_j - lse without rounding lse first:
  /// (x_j - max) - log1p(rest).
  double logProb(const double *row, int64_t j) const;
};

RowStats referenceStats(const double *row, int64_t vocab);

/// The loss of one token (0 for an ignored token; for an absent label,
/// lse - max = log1p(rest) in place of lse - x_y).
double referenceLoss(const double *row, int64_t vocab, int64_t label,
                     const RowStats &stats, const ReferenceOptions &options);

/// The gradient row of one token: upstream `scale` times
/// p_j (1 + 2 z lse) - (1 - s) [j == label] - s / V, p_j = exp(x_j - lse);
/// all zeros for an ignored token. `lse` is the one the kernel uses (its own
/// for fused, its input for backward) and `targetLogProb` is log p_label
/// computed without cancellation from it (RowStats::logProb, or x_y - lse for
/// an input lse, which is exact in double).
///
/// If `termScale` is not null it receives, per element, the magnitude of the
/// rounding errors fp32 arithmetic cannot avoid, in f32 ulps of 1: off the
/// target |scale| (p_j c (2 + |lse| + |x_j - lse|) + s/V), p_j being
/// exp of an fp32 difference with an fp32 lse; on the target |scale|
/// (|p_y - 1| c + |c - 1| + s), since p_y - 1 and c - 1 = 2 z lse can be
/// formed without cancellation (expm1, and 2 z lse directly). A few ulps of
/// it are the error floor of an fp32 kernel; it matters only where the
/// terms cancel (p_j c ~ s/V).
/// `exact`: the row's exact statistics, for a kernel that keeps the
/// maximum and the log of the sum apart (fused): p_j is then
/// exp((x_j - max) - log1p(rest)), which float64 keeps exact at any
/// magnitude (x_j - lse is not: near 2^100 a double lse has lost the log of
/// the sum), and `termScale` allows the ulps of log1p(rest) rather than of
/// |lse|, so that the allowance does not grow with the logits' magnitude.
/// Without it p_j is exp(x_j - lse) from the given (f32) lse, and |lse|'s
/// ulps are allowed (backward).
/// `extraExponentUlps`: more f32 ulps (of 1) of error allowed in every
/// exponent: a backward given lse's low part with a logit scale s != 1 gets
/// |lse| 2^-24 of them (an f32 lse_low holds the rounding of s max and the
/// log of the sum together, to 2^-48 |lse|).
void referenceGrad(const double *row, int64_t vocab, int64_t label, double lse,
                   double targetLogProb, double scale,
                   const ReferenceOptions &options, double *grad,
                   double *termScale = nullptr,
                   const RowStats *exact = nullptr,
                   double extraExponentUlps = 0.0);

/// The entropy of softmax(z) of one row (issue 17; test/python/
/// _reference_outputs.py): sum over p_j > 0 of p_j (lse - z_j), each
/// lse - z_j formed as log1p(rest) - (z_j - max) from the row's exact
/// statistics, so that it keeps the log of the sum at any |max| (a -inf
/// logit has p = 0 and adds nothing). NaN where lse is not finite (a NaN
/// or +inf logit, or every logit -inf).
double referenceEntropy(const double *row, int64_t vocab,
                        const RowStats &stats);

/// The lowest index of the row's maximum; -1 for a row with a NaN; 0 for a
/// row of -inf only (all tie).
int64_t referenceArgmax(const double *row, int64_t vocab);

/// Whether `argmax` is a right answer for the row when each value is known
/// to within `tolerance` (a kernel forms z in f32): -1 exactly for a row
/// with a NaN; otherwise an index in [0, V) whose value is within
/// `tolerance` of the maximum, with no lower index holding exactly the same
/// value (exact ties are ties in any precision: the lowest index must win).
/// test/python/_reference_outputs.py's argmax_acceptable.
bool argmaxAcceptable(const double *row, int64_t vocab, int64_t argmax,
                      double tolerance);

} // namespace ce::test

#endif // CE_TEST_RUNTIME_REFERENCE_H
