// abi_probe.cu - one kernel written by hand to the GPU kernel ABI of
// docs/bundle-format.md ("memref-descriptor-fields"), for checking the
// runtime's CUDA backend independently of ce-gen's code generation.
//
// Variant: op=forward, f32 logits, i64 labels, flat, no ignore_index, no
// smoothing, no z-loss. One block of 256 threads per token; double-precision
// arithmetic, so it is exact enough for any tolerance the tests use. Built on
// the GPU machine by test_h200.py (`nvcc -ptx -arch=sm_90`).

#include <math.h>

#define DESC1(T, name)                                                         \
  T *name##_allocated, T *name, long long name##_offset, long long name##_n,   \
      long long name##_stride

extern "C" __global__ void __launch_bounds__(256)
    ce_probe_forward(const float *logits_allocated, const float *logits,
                     long long logits_offset, long long n, long long v,
                     long long row_stride, long long vocab_stride,
                     DESC1(const long long, labels), DESC1(float, loss),
                     DESC1(float, lse), DESC1(long long, status)) {
  __shared__ double partial[256];
  long long t = blockIdx.x;
  const float *row = logits + logits_offset + t * row_stride;
  double m = -INFINITY;
  for (long long j = threadIdx.x; j < v; j += blockDim.x)
    m = fmax(m, (double)row[j * vocab_stride]);
  partial[threadIdx.x] = m;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half)
      partial[threadIdx.x] =
          fmax(partial[threadIdx.x], partial[threadIdx.x + half]);
    __syncthreads();
  }
  m = partial[0];
  __syncthreads();
  double sum = 0.0;
  for (long long j = threadIdx.x; j < v; j += blockDim.x)
    sum += exp((double)row[j * vocab_stride] - m);
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half)
      partial[threadIdx.x] += partial[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x != 0)
    return;
  double lse_value = isinf(m) ? m : m + log(partial[0]);
  lse[lse_offset + t * lse_stride] = (float)lse_value;
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
      (float)(isinf(m) ? lse_value - target : log(partial[0]) - (target - m));
}
