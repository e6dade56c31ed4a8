//===- Reference.cpp - The float64 cross-entropy reference ----------------===//
//
// Terms that the formula multiplies by a zero coefficient are left out
// rather than evaluated: with s == 0 a row holding -inf has
// 0 * (lse - mean) = 0 * inf, which is NaN in IEEE arithmetic but 0 in the
// formula a user means.
//
//===----------------------------------------------------------------------===//

#include "Reference.h"

#include <cmath>
#include <limits>

namespace ce::test {

double smoothingFactor(double alpha, int64_t vocab) {
  if (vocab <= 1)
    return 0.0;
  return alpha * static_cast<double>(vocab) / static_cast<double>(vocab - 1);
}

double RowStats::logProb(const double *row, int64_t j) const {
  return (row[j] - max) - std::log1p(rest);
}

RowStats referenceStats(const double *row, int64_t vocab) {
  RowStats stats;
  stats.max = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < vocab; ++j)
    if (row[j] > stats.max || j == 0) {
      stats.max = row[j];
      stats.argmax = j;
    }
  if (std::isinf(stats.max)) {
    stats.lse = stats.max;
    return stats;
  }
  for (int64_t j = 0; j < vocab; ++j)
    if (j != stats.argmax)
      stats.rest += std::exp(row[j] - stats.max);
  stats.lse = stats.max + std::log1p(stats.rest);
  return stats;
}

double referenceLoss(const double *row, int64_t vocab, int64_t label,
                     const RowStats &stats, const ReferenceOptions &options) {
  if (isIgnored(label, options))
    return 0.0;
  double s = smoothingFactor(options.labelSmoothing, vocab);
  double lse = stats.lse;
  double loss = isAbsent(label, vocab, options)
                    ? std::log1p(stats.rest)      // lse - max
                    : -stats.logProb(row, label); // lse - x_y
  if (s != 0.0) {
    double sum = 0.0;
    for (int64_t j = 0; j < vocab; ++j)
      sum += row[j];
    double mean = sum / static_cast<double>(vocab);
    loss = (1.0 - s) * loss + s * (lse - mean);
  }
  if (options.zLoss != 0.0)
    loss += options.zLoss * lse * lse;
  return loss;
}

void referenceGrad(const double *row, int64_t vocab, int64_t label, double lse,
                   double targetLogProb, double scale,
                   const ReferenceOptions &options, double *grad,
                   double *termScale, const RowStats *exact,
                   double extraExponentUlps) {
  double lseMagnitude =
      (exact ? std::fabs(std::log1p(exact->rest)) : std::fabs(lse)) +
      extraExponentUlps;
  if (isIgnored(label, options)) {
    for (int64_t j = 0; j < vocab; ++j) {
      grad[j] = 0.0;
      if (termScale)
        termScale[j] = 0.0;
    }
    return;
  }
  double s = smoothingFactor(options.labelSmoothing, vocab);
  double zTerm = 2.0 * options.zLoss * lse;
  double zScale = 1.0 + zTerm;
  double uniform = s / static_cast<double>(vocab);
  for (int64_t j = 0; j < vocab; ++j) {
    if (j == label) {
      // p_y c - (1 - s) - s/V = (p_y - 1) c + (c - 1) + s - s/V.
      double pMinusOne = std::expm1(targetLogProb);
      grad[j] = scale * (pMinusOne * zScale + zTerm + s - uniform);
      if (termScale)
        termScale[j] =
            std::fabs(scale) *
            ((std::fabs(pMinusOne) +
              (extraExponentUlps ? std::exp(targetLogProb) * extraExponentUlps
                                 : 0.0)) *
                 std::fabs(zScale) +
             std::fabs(zTerm) + s);
      continue;
    }
    double exponent = exact ? (row[j] - exact->max) - std::log1p(exact->rest)
                            : row[j] - lse;
    double p = std::exp(exponent);
    grad[j] = scale * (p * zScale - uniform);
    if (termScale) {
      // p_j = exp(x_j - lse) in fp32 carries the rounding of lse (or of the
      // log of the sum, lseMagnitude) and of the difference: relative error
      // ~ (lseMagnitude + |x_j - lse|) ulps.
      double pError =
          p == 0.0 ? 0.0 : p * (2.0 + lseMagnitude + std::fabs(exponent));
      termScale[j] = std::fabs(scale) * (pError * std::fabs(zScale) + uniform);
    }
  }
}

double referenceEntropy(const double *row, int64_t vocab,
                        const RowStats &stats) {
  if (!std::isfinite(stats.lse))
    return std::numeric_limits<double>::quiet_NaN();
  double logSum = std::log1p(stats.rest);
  double entropy = 0.0;
  for (int64_t j = 0; j < vocab; ++j) {
    double shifted = row[j] - stats.max; // z_j - max, -inf for a -inf logit
    double p = std::exp(shifted - logSum);
    if (p > 0.0)
      entropy += p * (logSum - shifted);
  }
  return entropy;
}

int64_t referenceArgmax(const double *row, int64_t vocab) {
  int64_t best = 0;
  for (int64_t j = 0; j < vocab; ++j) {
    if (std::isnan(row[j]))
      return -1;
    if (row[j] > row[best])
      best = j;
  }
  return best;
}

bool argmaxAcceptable(const double *row, int64_t vocab, int64_t argmax,
                      double tolerance) {
  int64_t best = referenceArgmax(row, vocab);
  if (best < 0 || argmax < 0 || argmax >= vocab)
    return argmax == best;
  double chosen = row[argmax], top = row[best];
  if (!(chosen == top || chosen >= top - tolerance))
    return false;
  for (int64_t j = 0; j < argmax; ++j)
    if (row[j] == chosen)
      return false;
  return true;
}

} // namespace ce::test
