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

double referenceLse(const double *row, int64_t vocab) {
  double max = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < vocab; ++j)
    max = std::fmax(max, row[j]);
  if (std::isinf(max))
    return max;
  double sum = 0.0;
  for (int64_t j = 0; j < vocab; ++j)
    sum += std::exp(row[j] - max);
  return max + std::log(sum);
}

double referenceLoss(const double *row, int64_t vocab, int64_t label,
                     double lse, const ReferenceOptions &options) {
  if (isIgnored(label, options))
    return 0.0;
  double s = smoothingFactor(options.labelSmoothing, vocab);
  double loss = lse - row[label];
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
                   double scale, const ReferenceOptions &options, double *grad,
                   double *termScale) {
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
    double p = std::exp(row[j] - lse);
    double value = p * zScale - uniform;
    if (j == label)
      value -= 1.0 - s;
    grad[j] = scale * value;
    if (!termScale)
      continue;
    if (j == label) {
      termScale[j] = std::fabs(scale) *
                     (std::fabs(std::expm1(row[j] - lse)) * std::fabs(zScale) +
                      std::fabs(zTerm) + s);
    } else {
      // p_j = exp(x_j - lse) in fp32 carries the rounding of lse and of the
      // difference: relative error ~ (|lse| + |x_j - lse|) ulps.
      double pError =
          p == 0.0 ? 0.0 : p * (2.0 + std::fabs(lse) + std::fabs(row[j] - lse));
      termScale[j] = std::fabs(scale) * (pError * std::fabs(zScale) + uniform);
    }
  }
}

} // namespace ce::test
