/*===- ce_runtime.h - C API of the cegen runtime ---------------------------===*
 *
 * The runtime loads kernel bundles written by ce-gen (docs/bundle-format.md)
 * and launches them on caller-owned tensors. It links neither MLIR nor LLVM.
 * Every function returns a ce_status; on failure ce_last_error_message()
 * gives a human-readable reason (thread-local, valid until the next call on
 * the same thread; "" after a success). Nothing is launched when validation
 * fails, and nothing when there are no tokens.
 *
 * Validation rules, error codes, the label-status design and thread safety:
 * docs/runtime.md. In short: any number of threads may launch at once, on
 * one bundle or several; `options` may be NULL (the defaults).
 *
 * Devices: tensors say where they live (ce_tensor.device, device_index);
 * all tensors of a call share one device. Host kernels run on the calling
 * thread and have finished when a call returns; `stream` is ignored.
 * CE_DEVICE_CUDA tensors run through the CUDA driver API and CE_DEVICE_HIP
 * tensors through HIP, both opened with dlopen on first use; a machine
 * without the driver or device answers CE_ERROR_NO_DEVICE. GPU calls enqueue
 * the kernel on `stream` (a CUstream / hipStream_t; NULL is the default
 * stream) in the context current on the calling thread when it belongs to
 * the tensors' device, else in that device's primary context, and return
 * without synchronizing (so they can be captured into a CUDA graph). Their
 * out-of-range labels are reported later, by ce_check_label_status.
 *
 *===----------------------------------------------------------------------===*/

#ifndef CE_RUNTIME_CE_RUNTIME_H
#define CE_RUNTIME_CE_RUNTIME_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CE_RUNTIME_BUNDLE_VERSION 5
#define CE_MAX_RANK 3

typedef enum ce_status {
  CE_OK = 0,
  CE_ERROR_INVALID_ARGUMENT = 1, /* shapes, strides, dtypes, options */
  CE_ERROR_BUNDLE = 2,           /* missing, truncated, corrupt, too new */
  CE_ERROR_VARIANT_NOT_FOUND = 3,
  CE_ERROR_LABEL_OUT_OF_RANGE = 4,
  CE_ERROR_NO_DEVICE = 5,
  CE_ERROR_BACKEND = 6
} ce_status;

typedef enum ce_dtype {
  CE_DTYPE_BF16 = 0,
  CE_DTYPE_F16 = 1,
  CE_DTYPE_F32 = 2,
  CE_DTYPE_I32 = 3,
  CE_DTYPE_I64 = 4
} ce_dtype;

typedef enum ce_device_type {
  CE_DEVICE_HOST = 0,
  CE_DEVICE_CUDA = 1,
  CE_DEVICE_HIP = 2
} ce_device_type;

/* Which dimension order [S,B,V] logits' labels use; ignored for [N,V]. */
typedef enum ce_label_layout {
  CE_LABELS_BS = 0, /* labels [B,S]: Megatron's */
  CE_LABELS_SB = 1  /* labels [S,B] */
} ce_label_layout;

/* A strided view. Strides are in elements and may be 0 (broadcast) for
 * read-only per-token tensors. ndim 0 is a scalar. */
typedef struct ce_tensor {
  void *data;
  ce_dtype dtype;
  int32_t ndim;
  int64_t sizes[CE_MAX_RANK];
  int64_t strides[CE_MAX_RANK];
  ce_device_type device;
  int32_t device_index;
} ce_tensor;

/* What a label outside [0, V) (outside [0, shard_vocab) for a shard) that is
 * not the ignore_index means. A run-time value: one kernel serves both. */
typedef enum ce_label_policy {
  /* Bad input: that token's loss and gradient row are NaN and the call (on
   * a GPU, ce_check_label_status) answers CE_ERROR_LABEL_OUT_OF_RANGE. */
  CE_LABEL_POLICY_STRICT = 0,
  /* Megatron-Core's contract: its target logit is taken as the row maximum
   * (Core's predicted logit 0 after the max shift), so its loss is
   * lse - max plus the smoothing and z-loss terms, its gradient has no
   * one-hot term, ce_shard_stats writes 0 as its target; no error. */
  CE_LABEL_POLICY_MEGATRON = 1
} ce_label_policy;

typedef struct ce_options {
  int32_t has_ignore_index;
  int64_t ignore_index;
  float label_smoothing; /* Megatron's formula, in [0, 1) */
  float z_loss;          /* >= 0 */
  int32_t overwrite_input;
  ce_label_layout label_layout;
  /* Tensor-parallel vocabulary slice (docs/tensor-parallel.md): with
   * shard_vocab > 0 the logits hold global ids [shard_start, shard_start +
   * V_local) of shard_vocab and labels are global ids. Only ce_shard_stats
   * and ce_backward take a shard. shard_global_smoothing non-zero smooths
   * over shard_vocab instead of V_local (Megatron's). */
  int64_t shard_start;
  int64_t shard_vocab;
  int32_t shard_global_smoothing;
  ce_label_policy label_policy;
  /* Optional (NULL: none): the low part of the log-sum-exp, f32 with the
   * labels' shape. ce_forward and ce_fused write it, lse + lse_low being
   * the log-sum-exp to twice f32's precision; ce_backward reads it with its
   * lse, so that its gradient's error does not grow with the logits'
   * magnitude (without it, |lse| 2^-24 in every exponent: 6e-4 relative at
   * logits near 1e6). Ignored by ce_shard_stats and ce_rescale. */
  const struct ce_tensor *lse_low;
  /* Every logit x is taken as z = logit_scale * x before the softmax (1:
   * none): loss, lse (and lse_low), the smoothing mean and the z-loss are
   * of z, the gradient is with respect to x (logit_scale times that with
   * respect to z). Finite and > 0. ce_shard_stats writes the slice's
   * sum_j exp(z_j - z_max) - 1 and keeps its max, target and row sum of x
   * (docs/tensor-parallel.md). Checked, not used, by ce_rescale. */
  float logit_scale;
  /* Logit softcap (0: none): every logit is z = logit_softcap *
   * tanh(logit_scale * x / logit_softcap) before the softmax, the gradient
   * through dz/dx = logit_scale (1 - tanh^2). A cap selects the softcap
   * kernels (variant key softcap=on); it must be finite and > 0, with
   * logit_scale / logit_softcap finite. ce_shard_stats then writes all four
   * statistics of z (docs/tensor-parallel.md). Checked, not used, by
   * ce_rescale. */
  float logit_softcap;
  /* Optional outputs of ce_forward and ce_fused (NULL: not computed), with
   * the labels' shape: `entropy` (f32) gets each row's entropy of
   * softmax(z), sum_j p_j (lse - z_j) (NaN where lse is not finite);
   * `argmax` (i64) the index of the row's largest z, the lowest index on
   * ties, -1 for a row with a NaN. Both depend on the logits only (an
   * ignored token gets its row's values) and cost one more read of the row
   * (from L2 where it still is). ce_shard_stats writes its slice's entropy
   * and argmax (a global id) for the combine (docs/tensor-parallel.md).
   * Ignored by ce_backward and ce_rescale. */
  const struct ce_tensor *entropy;
  const struct ce_tensor *argmax;
} ce_options;

typedef struct ce_bundle ce_bundle;

/* Fills `options` with the defaults: no ignore_index, no smoothing, no
 * z-loss, no overwrite, [B,S] labels, no shard, CE_LABEL_POLICY_STRICT, no
 * lse_low, logit_scale 1, no logit_softcap, no entropy or argmax. */
void ce_options_init(ce_options *options);

ce_status ce_bundle_open(const char *directory, ce_bundle **bundle);
void ce_bundle_close(ce_bundle *bundle);

/* Number of kernels in the bundle, and the variant key and target ("host",
 * "sm_90", "gfx942", ...) of one of them. */
int64_t ce_bundle_num_kernels(const ce_bundle *bundle);
const char *ce_bundle_kernel_key(const ce_bundle *bundle, int64_t index);
const char *ce_bundle_kernel_target(const ce_bundle *bundle, int64_t index);

/* Per-token loss and log-sum-exp. `loss` and `lse` have the labels' shape. */
ce_status ce_forward(ce_bundle *bundle, const ce_options *options,
                     const ce_tensor *logits, const ce_tensor *labels,
                     const ce_tensor *loss, const ce_tensor *lse,
                     void *stream);

/* Gradient from the forward's lse and the upstream per-token gradient.
 * With options->overwrite_input, `grad` must be NULL or describe exactly the
 * logits, and the gradient is written over the logits. */
ce_status ce_backward(ce_bundle *bundle, const ce_options *options,
                      const ce_tensor *logits, const ce_tensor *labels,
                      const ce_tensor *lse, const ce_tensor *grad_loss,
                      const ce_tensor *grad, void *stream);

/* Forward and backward in one kernel; `weights` (ndim 0, or the labels'
 * shape) is the per-token gradient weight known at forward time. */
ce_status ce_fused(ce_bundle *bundle, const ce_options *options,
                   const ce_tensor *logits, const ce_tensor *labels,
                   const ce_tensor *weights, const ce_tensor *loss,
                   const ce_tensor *lse, const ce_tensor *grad, void *stream);

/* The fused gradient made that of the upstream gradient autograd delivered,
 * in place and without a host synchronization: `grad` (what ce_fused wrote
 * with `weights`, the logits' storage under overwrite_input) has each row t
 * multiplied by grad_loss[t] / weights[t] (0 where grad_loss[t] is 0), and
 * rows where grad_loss[t] == weights[t] are not touched, so a correct
 * prediction costs one read of two floats per token. A token of weight 0
 * whose grad_loss is not 0 gets a NaN row (ce_fused never computed it).
 * `weights` (ndim 0, or the labels' shape) and `grad_loss` (the labels'
 * shape, any strides) are f32. Of `options` only label_layout is read. */
ce_status ce_rescale(ce_bundle *bundle, const ce_options *options,
                     const ce_tensor *grad, const ce_tensor *weights,
                     const ce_tensor *grad_loss, void *stream);

/* The partial statistics of a vocabulary slice (options->shard_vocab > 0,
 * options->z_loss 0): `stats` is f32 with the labels' shape followed by 4
 * (any strides): per token the slice's max m, sum_j exp(s (x_j - m)) - 1
 * (s = options->logit_scale), the
 * target logit when the label falls in the slice (0 elsewhere or when
 * ignored, NaN for a label outside [0, shard_vocab)), and the slice's row
 * sum with label smoothing (else 0). */
ce_status ce_shard_stats(ce_bundle *bundle, const ce_options *options,
                         const ce_tensor *logits, const ce_tensor *labels,
                         const ce_tensor *stats, void *stream);

/* Out-of-range labels met by GPU kernels launched on `stream` of the given
 * device (or captured into a graph on that device) since the last check.
 * With `wait` non-zero, synchronizes `stream` first, so every such launch is
 * seen; with `wait` 0, never blocks and sees the kernels that have finished.
 * Returns CE_ERROR_LABEL_OUT_OF_RANGE naming the first unreported launch,
 * token and label (each report is made once), CE_OK otherwise. Host
 * launches report at the call, so CE_DEVICE_HOST always gets CE_OK. */
ce_status ce_check_label_status(ce_device_type device, int32_t device_index,
                                void *stream, int32_t wait);

const char *ce_last_error_message(void);
const char *ce_status_string(ce_status status);

#ifdef __cplusplus
}
#endif

#endif /* CE_RUNTIME_CE_RUNTIME_H */
