/*===- fake_kernels.c - Stand-in host kernels for runtime tests -----------===*
 *
 * Implements the host kernel ABI of docs/bundle-format.md (bundle format
 * version 5: one pointer per tensor, each to an MLIR strided memref
 * descriptor, then the eight option values by value: int64_t flags, int64_t
 * ignore_index, float label_smoothing, float z_loss, int64_t shard_start,
 * int64_t shard_vocab, float logit_scale, float logit_softcap) with trivial
 * bodies whose outputs reveal whether the runtime passed the right descriptors:
 *
 *   loss[t] = 1.5
 *   lse[t]  = 2.5 + logits[row(t)][label[t]]       (forward, fused)
 *   lse_low[t] = 0.125 + t                         (forward, fused; flag 8)
 *   entropy[t] = 0.25 + t                          (forward, fused; flag 16)
 *   argmax[t]  = 1000 + t                          (forward, fused; flag 32)
 *   grad[row(t)][j] = grad_loss[t] * 0.5 + lse[t]  (backward)
 *                     + lse_low[t]                 (with flag 8)
 *   grad[row(t)][j] = weight(t)                    (fused)
 *
 * where weight(t) reads the token-shaped weights descriptor at its strides
 * (a scalar weight arrives with strides 0: fused kernels take per-token
 * weights only), and row(t) maps the linear token index t (row-major over the
 *labels' shape T) to its logits row per layout. A label outside [0, V) stores
 * 1 + t in status (the first such token) and NaN as that token's outputs,
 * as the contract asks, with the contract's two exceptions, which read the
 * value arguments: with flag bit 1 (kFlagIgnoreIndex) a label equal to
 * ignore_index is ignored (loss 0, lse 2.5, gradient row 0); with bit 0
 * (kFlagMegatronLabels) no label is reported (loss 1.5, lse 2.5, gradient
 * row as for a good label). Every call also records the descriptors and the
 * value arguments it got in `ce_fake_record`, which the tests read through
 * dlsym. Without flag bit 3 (kFlagLseLow, 8) the lse_low argument is a
 * placeholder that is neither read nor written; so are entropy and argmax
 * without bits 4 and 5 (16, 32). Logits are f32.
 *
 *===----------------------------------------------------------------------===*/

#include <math.h>
#include <stdint.h>
#include <string.h>

#define FAKE_MAX_ARGS 10

/* What the last call received. */
typedef struct FakeRecord {
  int64_t calls;
  int32_t num_args;
  int32_t ranks[FAKE_MAX_ARGS];
  void *allocated[FAKE_MAX_ARGS];
  void *aligned[FAKE_MAX_ARGS];
  int64_t offsets[FAKE_MAX_ARGS];
  int64_t sizes[FAKE_MAX_ARGS][3];
  int64_t strides[FAKE_MAX_ARGS][3];
  int64_t status_on_entry;
  /* The value arguments of the last call. */
  int64_t flags;
  int64_t ignore_index;
  float label_smoothing;
  float z_loss;
  int64_t shard_start;
  int64_t shard_vocab;
  float logit_scale;
  float logit_softcap;
} FakeRecord;

__attribute__((visibility("default"))) FakeRecord ce_fake_record;

/* A descriptor seen as words: allocated, aligned, offset, sizes, strides. */
typedef int64_t Desc;

enum Layout { FLAT, SBV_BS, SBV_SB };

static void *aligned_of(Desc *d) {
  void *pointer;
  memcpy(&pointer, &d[1], sizeof(pointer));
  return pointer;
}
static int64_t size_of(Desc *d, int rank, int i) {
  (void)rank;
  return d[3 + i];
}
static int64_t stride_of(Desc *d, int rank, int i) { return d[3 + rank + i]; }

/* The value arguments every kernel takes after its descriptors. */
typedef struct Values {
  int64_t flags, ignore_index;
  float label_smoothing, z_loss;
  int64_t shard_start, shard_vocab;
  float logit_scale, logit_softcap;
} Values;

#define VALUE_PARAMS                                                           \
  int64_t flags, int64_t ignore_index, float label_smoothing, float z_loss,    \
      int64_t shard_start, int64_t shard_vocab, float logit_scale,             \
      float logit_softcap
#define VALUES                                                                 \
  ((Values){flags, ignore_index, label_smoothing, z_loss, shard_start,         \
            shard_vocab, logit_scale, logit_softcap})

enum {
  FLAG_MEGATRON_LABELS = 1,
  FLAG_IGNORE_INDEX = 2,
  FLAG_LSE_LOW = 8,
  FLAG_ENTROPY = 16,
  FLAG_ARGMAX = 32
};

static void record(int n, Desc **descs, const int *ranks, Values v) {
  ce_fake_record.calls++;
  ce_fake_record.flags = v.flags;
  ce_fake_record.ignore_index = v.ignore_index;
  ce_fake_record.label_smoothing = v.label_smoothing;
  ce_fake_record.z_loss = v.z_loss;
  ce_fake_record.shard_start = v.shard_start;
  ce_fake_record.shard_vocab = v.shard_vocab;
  ce_fake_record.logit_scale = v.logit_scale;
  ce_fake_record.logit_softcap = v.logit_softcap;
  ce_fake_record.num_args = n;
  for (int a = 0; a < n; ++a) {
    ce_fake_record.ranks[a] = ranks[a];
    memcpy(&ce_fake_record.allocated[a], &descs[a][0], sizeof(void *));
    ce_fake_record.aligned[a] = aligned_of(descs[a]);
    ce_fake_record.offsets[a] = descs[a][2];
    for (int i = 0; i < ranks[a]; ++i) {
      ce_fake_record.sizes[a][i] = size_of(descs[a], ranks[a], i);
      ce_fake_record.strides[a][i] = stride_of(descs[a], ranks[a], i);
    }
  }
}

/* Element offset of token (i0, i1) in a token-shaped descriptor. */
static int64_t token_offset(Desc *d, int rank, int64_t i0, int64_t i1) {
  int64_t offset = d[2] + i0 * stride_of(d, rank, 0);
  if (rank == 2)
    offset += i1 * stride_of(d, rank, 1);
  return offset;
}

typedef struct Call {
  int layout;
  int labels_i32;
  Desc *logits, *labels, *loss, *lse_out, *lse_in, *lse_low, *grad_loss,
      *weights, *grad, *status;
  Values values;
  Desc *entropy, *argmax;
} Call;

static void run(const Call *c) {
  int token_rank = c->layout == FLAT ? 1 : 2;
  int logits_rank = token_rank + 1;
  int64_t t0 = size_of(c->labels, token_rank, 0);
  int64_t t1 = token_rank == 2 ? size_of(c->labels, token_rank, 1) : 1;
  int64_t vocab = size_of(c->logits, logits_rank, logits_rank - 1);
  int64_t *status = (int64_t *)aligned_of(c->status) + c->status[2];
  ce_fake_record.status_on_entry = *status;
  float *x = (float *)aligned_of(c->logits) + c->logits[2];
  for (int64_t i0 = 0; i0 < t0; ++i0) {
    for (int64_t i1 = 0; i1 < t1; ++i1) {
      int64_t t = i0 * t1 + i1;
      /* Logits row of the token: [N] -> n; [B,S] -> (s, b); [S,B] -> (s, b). */
      int64_t rowOffset;
      if (c->layout == FLAT)
        rowOffset = i0 * stride_of(c->logits, 2, 0);
      else if (c->layout == SBV_BS)
        rowOffset =
            i1 * stride_of(c->logits, 3, 0) + i0 * stride_of(c->logits, 3, 1);
      else
        rowOffset =
            i0 * stride_of(c->logits, 3, 0) + i1 * stride_of(c->logits, 3, 1);
      int64_t labelOffset = token_offset(c->labels, token_rank, i0, i1);
      int64_t label = c->labels_i32
                          ? ((int32_t *)aligned_of(c->labels))[labelOffset]
                          : ((int64_t *)aligned_of(c->labels))[labelOffset];
      int ignored = (c->values.flags & FLAG_IGNORE_INDEX) &&
                    label == c->values.ignore_index;
      int outside = !ignored && (label < 0 || label >= vocab);
      int megatron = (c->values.flags & FLAG_MEGATRON_LABELS) != 0;
      int bad = outside && !megatron;
      if (bad && *status == 0)
        *status = 1 + t;
      float target = bad                  ? NAN
                     : ignored || outside ? 0.0f
                                          : x[rowOffset + label];

      float lse = 0.0f;
      if (c->loss) {
        float *loss = (float *)aligned_of(c->loss);
        loss[token_offset(c->loss, token_rank, i0, i1)] = bad       ? NAN
                                                          : ignored ? 0.0f
                                                                    : 1.5f;
      }
      int withLow = (c->values.flags & FLAG_LSE_LOW) != 0;
      if (c->lse_out) {
        lse = 2.5f + target;
        float *out = (float *)aligned_of(c->lse_out);
        out[token_offset(c->lse_out, token_rank, i0, i1)] = lse;
        if (withLow) {
          float *low = (float *)aligned_of(c->lse_low);
          low[token_offset(c->lse_low, token_rank, i0, i1)] = 0.125f + t;
        }
        if (c->values.flags & FLAG_ENTROPY) {
          float *h = (float *)aligned_of(c->entropy);
          h[token_offset(c->entropy, token_rank, i0, i1)] = 0.25f + t;
        }
        if (c->values.flags & FLAG_ARGMAX) {
          int64_t *a = (int64_t *)aligned_of(c->argmax);
          a[token_offset(c->argmax, token_rank, i0, i1)] = 1000 + t;
        }
      }
      if (!c->grad)
        continue;
      float value = 0.0f;
      if (c->grad_loss) {
        float *g = (float *)aligned_of(c->grad_loss);
        float *l = (float *)aligned_of(c->lse_in);
        value = g[token_offset(c->grad_loss, token_rank, i0, i1)] * 0.5f +
                l[token_offset(c->lse_in, token_rank, i0, i1)];
        if (withLow)
          value += ((float *)aligned_of(
              c->lse_low))[token_offset(c->lse_low, token_rank, i0, i1)];
      } else if (c->weights) {
        float *w = (float *)aligned_of(c->weights);
        value = w[token_offset(c->weights, token_rank, i0, i1)];
      }
      if (bad)
        value = NAN;
      if (ignored)
        value = 0.0f;
      float *grad = (float *)aligned_of(c->grad) + c->grad[2];
      int64_t gradRow;
      if (c->layout == FLAT)
        gradRow = i0 * stride_of(c->grad, 2, 0);
      else if (c->layout == SBV_BS)
        gradRow = i1 * stride_of(c->grad, 3, 0) + i0 * stride_of(c->grad, 3, 1);
      else
        gradRow = i0 * stride_of(c->grad, 3, 0) + i1 * stride_of(c->grad, 3, 1);
      for (int64_t j = 0; j < vocab; ++j)
        grad[gradRow + j * stride_of(c->grad, logits_rank, logits_rank - 1)] =
            value;
    }
  }
}

#define EXPORT __attribute__((visibility("default")))

/* ---- forward: (logits, labels, loss, lse, lse_low, entropy, argmax,
 * status, values) */

static void forward(int layout, int labels_i32, Desc *logits, Desc *labels,
                    Desc *loss, Desc *lse, Desc *low, Desc *entropy,
                    Desc *argmax, Desc *status, Values v) {
  int tr = layout == FLAT ? 1 : 2;
  Desc *descs[] = {logits, labels, loss, lse, low, entropy, argmax, status};
  int ranks[] = {tr + 1, tr, tr, tr, tr, tr, tr, 1};
  record(8, descs, ranks, v);
  Call c = {layout, labels_i32, logits, labels, loss,   lse, 0,
            low,    0,          0,      0,      status, v,   entropy, argmax};
  run(&c);
}

EXPORT void fake_forward_flat(Desc *a, Desc *b, Desc *c, Desc *d, Desc *e, Desc *f,
                              Desc *g, Desc *h, VALUE_PARAMS) {
  forward(FLAT, 0, a, b, c, d, e, f, g, h, VALUES);
}
EXPORT void fake_forward_flat_i32(Desc *a, Desc *b, Desc *c, Desc *d, Desc *e, Desc *f,
                                  Desc *g, Desc *h, VALUE_PARAMS) {
  forward(FLAT, 1, a, b, c, d, e, f, g, h, VALUES);
}
EXPORT void fake_forward_bs(Desc *a, Desc *b, Desc *c, Desc *d, Desc *e, Desc *f,
                            Desc *g, Desc *h, VALUE_PARAMS) {
  forward(SBV_BS, 0, a, b, c, d, e, f, g, h, VALUES);
}
EXPORT void fake_forward_sb(Desc *a, Desc *b, Desc *c, Desc *d, Desc *e, Desc *f,
                            Desc *g, Desc *h, VALUE_PARAMS) {
  forward(SBV_SB, 0, a, b, c, d, e, f, g, h, VALUES);
}
/* Reports a status that names no token. */
EXPORT void fake_forward_flat_bad_status(Desc *a, Desc *b, Desc *c, Desc *d,
                                         Desc *e, Desc *f, Desc *g, Desc *h,
                                         VALUE_PARAMS) {
  forward(FLAT, 0, a, b, c, d, e, f, g, h, VALUES);
  *((int64_t *)aligned_of(h)) = 1 << 30;
}
/* Reports token 0 although its label is fine. */
EXPORT void fake_forward_flat_false_alarm(Desc *a, Desc *b, Desc *c, Desc *d,
                                          Desc *e, Desc *f, Desc *g, Desc *h,
                                          VALUE_PARAMS) {
  forward(FLAT, 0, a, b, c, d, e, f, g, h, VALUES);
  *((int64_t *)aligned_of(h)) = 1;
}

/* ---- backward: (logits, labels, lse, lse_low, grad_loss, [grad], status,
 * values) */

static void backward(int layout, Desc *logits, Desc *labels, Desc *lse,
                     Desc *low, Desc *grad_loss, Desc *grad, Desc *status,
                     Values v) {
  int tr = layout == FLAT ? 1 : 2;
  Desc *descs[] = {logits, labels, lse, low, grad_loss, grad, status};
  int ranks[] = {tr + 1, tr, tr, tr, tr, tr + 1, 1};
  if (grad) {
    record(7, descs, ranks, v);
  } else {
    descs[5] = status;
    ranks[5] = 1;
    record(6, descs, ranks, v);
  }
  Call c = {layout, 0,   logits, labels,    0,
            0,      lse, low,    grad_loss, 0,
            grad ? grad : logits, status, v, 0, 0};
  run(&c);
}

EXPORT void fake_backward_flat(Desc *a, Desc *b, Desc *c, Desc *d, Desc *e,
                               Desc *f, Desc *g, VALUE_PARAMS) {
  backward(FLAT, a, b, c, d, e, f, g, VALUES);
}
EXPORT void fake_backward_bs(Desc *a, Desc *b, Desc *c, Desc *d, Desc *e,
                             Desc *f, Desc *g, VALUE_PARAMS) {
  backward(SBV_BS, a, b, c, d, e, f, g, VALUES);
}
EXPORT void fake_backward_flat_overwrite(Desc *a, Desc *b, Desc *c, Desc *d,
                                         Desc *e, Desc *f, VALUE_PARAMS) {
  backward(FLAT, a, b, c, d, e, 0, f, VALUES);
}

/* ---- fused: (logits, labels, weights, loss, lse, lse_low, entropy,
 * argmax, [grad], status, values) */

static void fused(int layout, Desc *logits, Desc *labels, Desc *weights,
                  Desc *loss, Desc *lse, Desc *low, Desc *entropy,
                  Desc *argmax, Desc *grad, Desc *status, Values v) {
  int tr = layout == FLAT ? 1 : 2;
  Desc *descs[] = {logits, labels,  weights, loss, lse,
                   low,    entropy, argmax,  grad, status};
  int ranks[] = {tr + 1, tr, tr, tr, tr, tr, tr, tr, tr + 1, 1};
  if (grad) {
    record(10, descs, ranks, v);
  } else {
    descs[8] = status;
    ranks[8] = 1;
    record(9, descs, ranks, v);
  }
  Call c = {layout, 0,   logits,  labels, loss,
            lse,    0,   low,     0,      weights,
            grad ? grad : logits, status, v, entropy, argmax};
  run(&c);
}

EXPORT void fake_fused_flat_token(Desc *a, Desc *b, Desc *c, Desc *d, Desc *e,
                                  Desc *f, Desc *g, Desc *h, Desc *i, Desc *j,
                                  VALUE_PARAMS) {
  fused(FLAT, a, b, c, d, e, f, g, h, i, j, VALUES);
}
EXPORT void fake_fused_bs_token(Desc *a, Desc *b, Desc *c, Desc *d, Desc *e,
                                  Desc *f, Desc *g, Desc *h, Desc *i, Desc *j,
                                  VALUE_PARAMS) {
  fused(SBV_BS, a, b, c, d, e, f, g, h, i, j, VALUES);
}
EXPORT void fake_fused_sb_token(Desc *a, Desc *b, Desc *c, Desc *d, Desc *e,
                                  Desc *f, Desc *g, Desc *h, Desc *i, Desc *j,
                                  VALUE_PARAMS) {
  fused(SBV_SB, a, b, c, d, e, f, g, h, i, j, VALUES);
}
EXPORT void fake_fused_flat_token_overwrite(Desc *a, Desc *b, Desc *c, Desc *d,
                                            Desc *e, Desc *f, Desc *g, Desc *h,
                                            Desc *i, VALUE_PARAMS) {
  fused(FLAT, a, b, c, d, e, f, g, h, 0, i, VALUES);
}

/* ---- shard_stats: (logits, labels, stats, entropy, argmax, status,
 * values); records only */

static void shard_stats(int layout, Desc *logits, Desc *labels, Desc *stats,
                        Desc *entropy, Desc *argmax, Desc *status, Values v) {
  int tr = layout == FLAT ? 1 : 2;
  Desc *descs[] = {logits, labels, stats, entropy, argmax, status};
  int ranks[] = {tr + 1, tr, tr + 1, tr, tr, 1};
  record(6, descs, ranks, v);
}

EXPORT void fake_shard_stats_flat(Desc *a, Desc *b, Desc *c, Desc *d, Desc *e,
                                  Desc *f, VALUE_PARAMS) {
  shard_stats(FLAT, a, b, c, d, e, f, VALUES);
}
EXPORT void fake_shard_stats_bs(Desc *a, Desc *b, Desc *c, Desc *d, Desc *e,
                                Desc *f, VALUE_PARAMS) {
  shard_stats(SBV_BS, a, b, c, d, e, f, VALUES);
}

/* Two builds of this file differ here (CMake builds it again with
 * CE_FAKE_KERNELS_BUILD=2): the fault tests swap the objects of two bundles,
 * as a manifest paired with another ce-gen run's object would be. */
#ifndef CE_FAKE_KERNELS_BUILD
#define CE_FAKE_KERNELS_BUILD 1
#endif
EXPORT const int ce_fake_kernels_build = CE_FAKE_KERNELS_BUILD;
