// abi_probe.cu - one kernel written by hand to the GPU kernel ABI of
// docs/bundle-format.md ("memref-descriptor-fields", bundle format version 5),
// for checking the runtime's CUDA backend independently of ce-gen's code
// generation.
//
// Variant: op=forward, f32 logits, i64 labels, flat, no ignore_index, no
// smoothing, no z-loss, logit scale 1, no softcap. One block of 256 threads per
// token; double-precision arithmetic, so it is exact enough for any tolerance
// the tests use. Of the value arguments it declares only the first, the flags:
// lse's low part (bit 3), the entropy (bit 4) and the argmax (bit 5) are
// written only where asked for (the runtime passes placeholders otherwise).
// Built on the GPU machine by test_h200.py (`nvcc -ptx -arch=sm_90`).

#include <math.h>

#define DESC1(T, name)                                                         \
  T *name##_allocated, T *name, long long name##_offset, long long name##_n,   \
      long long name##_stride

enum : long long { kLseLow = 8, kEntropy = 16, kArgmax = 32 };

// Reduces `value` over the block with `op`; every thread gets the result.
template <typename Op>
__device__ double blockReduce(double *partial, double value, Op op) {
  partial[threadIdx.x] = value;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half)
      partial[threadIdx.x] =
          op(partial[threadIdx.x], partial[threadIdx.x + half]);
    __syncthreads();
  }
  double result = partial[0];
  __syncthreads();
  return result;
}

extern "C" __global__ void __launch_bounds__(256)
    ce_probe_forward(const float *logits_allocated, const float *logits,
                     long long logits_offset, long long n, long long v,
                     long long row_stride, long long vocab_stride,
                     DESC1(const long long, labels), DESC1(float, loss),
                     DESC1(float, lse), DESC1(float, lse_low),
                     DESC1(float, entropy), DESC1(long long, argmax),
                     DESC1(long long, status), long long flags) {
  __shared__ double partial[256];
  long long t = blockIdx.x;
  const float *row = logits + logits_offset + t * row_stride;
  auto maxOp = [](double a, double b) { return fmax(a, b); };
  auto addOp = [](double a, double b) { return a + b; };
  double m = -INFINITY;
  bool nan = false;
  for (long long j = threadIdx.x; j < v; j += blockDim.x) {
    double x = row[j * vocab_stride];
    nan = nan || isnan(x);
    m = fmax(m, x);
  }
  bool rowNan = blockReduce(partial, nan ? 1.0 : 0.0, maxOp) != 0.0;
  m = blockReduce(partial, m, maxOp);
  double sum = 0.0, weighted = 0.0, first = (double)v;
  for (long long j = threadIdx.x; j < v; j += blockDim.x) {
    double x = row[j * vocab_stride];
    double e = exp(x - m);
    sum += e;
    if (e > 0.0)
      weighted += e * (x - m);
    if (x == m && (double)j < first)
      first = (double)j;
  }
  sum = blockReduce(partial, sum, addOp);
  weighted = blockReduce(partial, weighted, addOp);
  first = blockReduce(partial, first, [](double a, double b) {
    return fmin(a, b);
  });
  if (threadIdx.x != 0)
    return;
  double lse_value = isinf(m) ? m : m + log(sum);
  float rounded = (float)lse_value;
  lse[lse_offset + t * lse_stride] = rounded;
  if (flags & kLseLow)
    lse_low[lse_low_offset + t * lse_low_stride] =
        isfinite(lse_value) ? (float)(lse_value - (double)rounded) : 0.0f;
  if (flags & kEntropy)
    entropy[entropy_offset + t * entropy_stride] =
        isfinite(lse_value) ? (float)(log(sum) - weighted / sum) : NAN;
  if (flags & kArgmax)
    argmax[argmax_offset + t * argmax_stride] =
        rowNan ? -1 : (first < (double)v ? (long long)first : 0);
  long long label = labels[labels_offset + t * labels_stride];
  if (label < 0 || label >= v) {
    status[status_offset] = t + 1;
    loss[loss_offset + t * loss_stride] = NAN;
    return;
  }
  // log(sum) - (x_y - m), not lse - x_y: at |m| near 2^100 the double lse
  // has lost log(sum) to rounding.
  double target = (double)row[label * vocab_stride];
  loss[loss_offset + t * loss_stride] =
      (float)(isinf(m) ? lse_value - target : log(sum) - (target - m));
}
