//===- CEOps.td - Cross-entropy dialect operations ---------*- tablegen -*-===//

#ifndef CE_DIALECT_CE_IR_CEOPS_TD
#define CE_DIALECT_CE_IR_CEOPS_TD

include "ce/Dialect/CE/IR/CEAttrs.td"
include "mlir/Interfaces/SideEffectInterfaces.td"

//===----------------------------------------------------------------------===//
// Shared operands and attributes
//===----------------------------------------------------------------------===//

def CE_LogitsMemRef : MemRefOf<[BF16, F16, F32]>;
def CE_LabelsMemRef : MemRefOf<[I32, I64]>;
def CE_TokenMemRef : MemRefOf<[F32]>;
def CE_StatusMemRef : MemRefOf<[I64]>;
def CE_IndexTokenMemRef : MemRefOf<[I64]>;

/// The configuration every cross-entropy op carries.
defvar CE_ConfigAttrs = (ins
  CE_LayoutAttr:$layout,
  OptionalAttr<I64Attr>:$ignore_index,
  DefaultValuedAttr<F32Attr, "0.0f">:$label_smoothing,
  DefaultValuedAttr<F32Attr, "0.0f">:$z_loss,
  OptionalAttr<CE_ShardAttr>:$shard);

defvar CE_StatusOperand = (ins
  Arg<Optional<CE_StatusMemRef>, "bad-label status", [MemWrite]>:$status,
  Optional<I64>:$flags,
  Optional<I64>:$ignore_index_value,
  Optional<F32>:$label_smoothing_value,
  Optional<F32>:$z_loss_value,
  Optional<I64>:$shard_start,
  Optional<I64>:$shard_vocab,
  Optional<F32>:$logit_scale,
  Optional<F32>:$logit_softcap);

/// lse's low part: written by ce.forward and ce.fused, read by ce.backward.
defvar CE_LseLowFormat =
  "(`lse_low` `(` $lse_low^ `:` type($lse_low) `)`)? ";

/// The optional per-token outputs of ce.forward and ce.fused.
defvar CE_OutputsFormat =
  "(`entropy` `(` $entropy^ `:` type($entropy) `)`)? "
  "(`argmax` `(` $argmax^ `:` type($argmax) `)`)? ";
defvar CE_OutputOperands = (ins
  Arg<Optional<CE_TokenMemRef>, "per-token entropy of softmax(z)",
      [MemWrite]>:$entropy,
  Arg<Optional<CE_IndexTokenMemRef>, "per-token index of the largest z",
      [MemWrite]>:$argmax);

defvar CE_StatusFormat =
  "(`status` `(` $status^ `:` type($status) `)`)? "
  "(`flags` `(` $flags^ `)`)? "
  "(`ignore_index` `(` $ignore_index_value^ `)`)? "
  "(`label_smoothing` `(` $label_smoothing_value^ `)`)? "
  "(`z_loss` `(` $z_loss_value^ `)`)? "
  "(`shard_bounds` `(` $shard_start^ `,` $shard_vocab `)`)? "
  "(`logit_scale` `(` $logit_scale^ `)`)? "
  "(`logit_softcap` `(` $logit_softcap^ `)`)? "
  "`layout` `=` custom<Layout>($layout)";

class CE_CrossEntropyOp<string mnemonic, list<Trait> traits = []>
    : CE_Op<mnemonic, !listconcat(traits, [AttrSizedOperandSegments])> {
  let hasVerifier = 1;
  code commonDescription = [{
    Configuration (shared by all `ce` ops):
    - `layout`: `flat` (`[N, V]` logits, `[N]` per-token tensors), `sbv_bs`
      (`[S, B, V]`, `[B, S]`) or `sbv_sb` (`[S, B, V]`, `[S, B]`).
    - `ignore_index` (optional): tokens with this label get loss 0 and a
      zero gradient row.
    - `label_smoothing` in `[0, 1)`, Megatron's formula; `z_loss` >= 0.
    - `shard` (optional): the logits are a tensor-parallel vocabulary slice
      and labels are global ids; `ce.shard_stats` and `ce.backward` take it.

    Preconditions: the vocabulary (last) dimension of the logits has unit
    stride; per-token tensors have the layout's token shape; all per-token
    floats are f32. If `status` (a `memref<1xi64>`) is given, a token whose
    label lies outside `[0, V)` (the shard's global vocabulary when sharded)
    and is not `ignore_index` stores
    `1 + linear token index` there; that token's loss and gradient row are NaN
    and nothing is read or written out of bounds.

    Run-time option values: `ignore_index`, `label_smoothing` and `z_loss`
    may instead be operands (`ignore_index(%i)`, an i64; `label_smoothing(%a)`
    and `z_loss(%z)`, f32s of the same ranges), read when the op runs, so one
    compiled kernel serves every value; an op gives each option as an
    attribute or as an operand, not both. The smoothing and z-loss work is
    built when the option is given either way (an operand that is 0 at run
    time gives the plain loss). A sharded op may take its slice at run time:
    `shard_bounds(%start, %vocab)` (i64s) with a `shard` attribute that
    holds no bounds (`#ce.shard<>` or `#ce.shard<global_smoothing = true>`).

    Logit scale (optional `logit_scale(%s)`, an f32 read at run time; absent
    means 1): every logit x is replaced by `z = s * x` before the softmax.
    The loss, the log-sum-exp (and its low part), the smoothing mean and the
    z-loss are all of z, and the gradient is with respect to x (`s` times
    the gradient with respect to z). `s` must be finite and positive (a
    constant operand is checked here; the runtime checks a run-time value).
    Exponents are taken of `(x - max) * s` (the subtraction exact near the
    maximum, then one relative rounding), never of `s x - s max`.
    `ce.shard_stats` writes `[1]` of z, and `[0]`, `[2]`, `[3]` of x (see
    there).

    Logit softcap (optional `logit_softcap(%cap)`, an f32 read at run time;
    absent means none): every logit becomes `z = cap * tanh(s * x / cap)`
    (the scale first, then the cap), so every z lies in `[-cap, cap]`
    (`+-inf` logits give `+-cap`, NaN stays NaN). The loss, the log-sum-exp,
    the smoothing mean and the z-loss are of z, and the gradient is taken
    through `dz/dx = s * (1 - tanh^2(s * x / cap))`. Each element is
    transformed once where it is loaded and the sweeps then run on z with
    no further scale (a softcap op is a kernel of its own: the ops without
    one carry no tanh). `cap` must be finite and positive (a constant
    operand is checked here; the runtime checks a run-time value).
    `ce.shard_stats` then writes all four statistics of z.

    Run-time flags (optional `flags`, an i64 read at run time, so one
    compiled kernel serves every value; absent means 0):
    - bit 0, Megatron-Core's label contract: a label outside `[0, V)` (the
      shard's global vocabulary when sharded) that is not `ignore_index` is
      no error. As in Megatron-Core's vocab-parallel cross entropy, its
      target logit is taken as the row maximum (Core's predicted logit 0
      after the max shift): the loss is `lse - max` (plus the smoothing and
      z-loss terms), the gradient has no one-hot term, `ce.shard_stats`
      writes 0 as its target, and `status` is not written.
    - bit 1, the `ignore_index` operand is in force: without it no token is
      ignored (the operand's value is not read). An `ignore_index`
      attribute is always in force.
    - bit 2, a sharded op smooths over the global vocabulary, as the
      `shard` attribute's `global_smoothing = true` does.
    - bit 3, the `lse_low` operand is in force: ce.forward and ce.fused
      write lse's low part there (`lse + lse_low` is the log-sum-exp to
      twice f32's precision), ce.backward reads it and takes its exponents
      as `(x - lse) - lse_low`, so that their error does not grow with the
      logits' magnitude. Without the bit the operand is a placeholder that
      is neither written nor used; without `flags` a given `lse_low` is in
      force.
    - bit 4, the `entropy` operand is in force: ce.forward and ce.fused
      write each row's entropy `H = sum_j p_j (lse - z_j)` of the softmax
      of the transformed logits z (NaN where lse is not finite);
      ce.shard_stats that of its slice (the combine merges them).
    - bit 5, the `argmax` operand is in force: ce.forward and ce.fused
      write the index of each row's largest z, the lowest index on ties,
      -1 for a row with a NaN; ce.shard_stats its slice's, as a global id.
      Without bit 4 (5) the `entropy` (`argmax`) operand is a placeholder
      that is not written; without `flags` a given one is in force. Both
      depend on the logits only: an ignored token or a bad label gets its
      row's values.
  }];
}

//===----------------------------------------------------------------------===//
// ForwardOp
//===----------------------------------------------------------------------===//

def CE_ForwardOp : CE_CrossEntropyOp<"forward"> {
  let summary = "Per-token cross-entropy loss and log-sum-exp";
  let description = !strconcat([{
    Reads each logits row once and writes the per-token loss and log-sum-exp
    (kept for the backward) in the layout's token shape.

    Example:

    ```mlir
    ce.forward %logits, %labels into %loss, %lse layout = sbv_bs
        {ignore_index = -100 : i64, label_smoothing = 1.000000e-01 : f32}
        : memref<?x?x?xbf16>, memref<?x?xi64> into memref<?x?xf32>, memref<?x?xf32>
    ```
  }], commonDescription);
  let arguments = !con((ins
    Arg<CE_LogitsMemRef, "logits", [MemRead]>:$logits,
    Arg<CE_LabelsMemRef, "labels", [MemRead]>:$labels,
    Arg<CE_TokenMemRef, "per-token loss", [MemWrite]>:$loss,
    Arg<CE_TokenMemRef, "per-token log-sum-exp", [MemWrite]>:$lse,
    Arg<Optional<CE_TokenMemRef>, "lse's low part", [MemWrite]>:$lse_low),
    CE_OutputOperands, CE_StatusOperand, CE_ConfigAttrs);
  let assemblyFormat = !strconcat(
    "$logits `,` $labels `into` $loss `,` $lse ", CE_LseLowFormat,
    CE_OutputsFormat, CE_StatusFormat,
    " attr-dict `:` type($logits) `,` type($labels) `into` type($loss) `,` ",
    "type($lse)");
}

//===----------------------------------------------------------------------===//
// BackwardOp
//===----------------------------------------------------------------------===//

def CE_BackwardOp : CE_CrossEntropyOp<"backward"> {
  let summary = "Cross-entropy gradient from a stored log-sum-exp";
  let description = !strconcat([{
    Writes `dX = g * (softmax(X) * (1 + 2 z lse) - (1 - s) onehot(y) - s / V)`
    from the forward's `lse` and the upstream per-token gradient `grad_loss`
    (any strides, including 0). With `overwrite_input`, `grad` must be the
    logits buffer itself and the gradient replaces the logits; without it,
    `grad` must be a different buffer.

    Example:

    ```mlir
    ce.backward %logits, %labels, %lse, %dloss into %logits layout = sbv_bs
        {overwrite_input}
        : memref<?x?x?xbf16>, memref<?x?xi64>, memref<?x?xf32>, memref<?x?xf32>
        into memref<?x?x?xbf16>
    ```
  }], commonDescription);
  let arguments = !con((ins
    Arg<CE_LogitsMemRef, "logits", [MemRead]>:$logits,
    Arg<CE_LabelsMemRef, "labels", [MemRead]>:$labels,
    Arg<CE_TokenMemRef, "per-token log-sum-exp", [MemRead]>:$lse,
    Arg<CE_TokenMemRef, "upstream per-token gradient", [MemRead]>:$grad_loss,
    Arg<CE_LogitsMemRef, "logits gradient", [MemWrite]>:$grad,
    Arg<Optional<CE_TokenMemRef>, "lse's low part", [MemRead]>:$lse_low),
    CE_StatusOperand, CE_ConfigAttrs, (ins UnitAttr:$overwrite_input));
  let assemblyFormat = !strconcat(
    "$logits `,` $labels `,` $lse `,` $grad_loss `into` $grad ",
    CE_LseLowFormat, CE_StatusFormat, " attr-dict `:` type($logits) `,` type($labels) `,` ",
    "type($lse) `,` type($grad_loss) `into` type($grad)");
}

//===----------------------------------------------------------------------===//
// FusedOp
//===----------------------------------------------------------------------===//

def CE_FusedOp : CE_CrossEntropyOp<"fused"> {
  let summary = "Cross-entropy loss, log-sum-exp and gradient in one op";
  let description = !strconcat([{
    The forward and the backward in one: legal when the per-token gradient
    weights are known when the forward runs (a mean over tokens, or given
    per-token weights). `weights` is a `memref<f32>` scalar applied to every
    token, or a per-token tensor. `overwrite_input` and `grad` follow
    `ce.backward`. A lowering reads each logits row once for the statistics
    and writes the gradient in a second sweep over the same row.

    Example:

    ```mlir
    ce.fused %logits, %labels, %w into %loss, %lse, %logits layout = flat
        {overwrite_input, z_loss = 1.000000e-04 : f32}
        : memref<?x?xbf16>, memref<?xi64>, memref<f32>
        into memref<?xf32>, memref<?xf32>, memref<?x?xbf16>
    ```
  }], commonDescription);
  let arguments = !con((ins
    Arg<CE_LogitsMemRef, "logits", [MemRead]>:$logits,
    Arg<CE_LabelsMemRef, "labels", [MemRead]>:$labels,
    Arg<CE_TokenMemRef, "gradient weights", [MemRead]>:$weights,
    Arg<CE_TokenMemRef, "per-token loss", [MemWrite]>:$loss,
    Arg<CE_TokenMemRef, "per-token log-sum-exp", [MemWrite]>:$lse,
    Arg<CE_LogitsMemRef, "logits gradient", [MemWrite]>:$grad,
    Arg<Optional<CE_TokenMemRef>, "lse's low part", [MemWrite]>:$lse_low),
    CE_OutputOperands, CE_StatusOperand, CE_ConfigAttrs,
    (ins UnitAttr:$overwrite_input));
  let assemblyFormat = !strconcat(
    "$logits `,` $labels `,` $weights `into` $loss `,` $lse `,` $grad ",
    CE_LseLowFormat, CE_OutputsFormat, CE_StatusFormat, " attr-dict `:` type($logits) `,` type($labels) `,` ",
    "type($weights) `into` type($loss) `,` type($lse) `,` type($grad)");
}

//===----------------------------------------------------------------------===//
// ShardStatsOp
//===----------------------------------------------------------------------===//

def CE_ShardStatsOp : CE_CrossEntropyOp<"shard_stats"> {
  let summary = "Partial statistics of a tensor-parallel vocabulary slice";
  let description = !strconcat([{
    The forward of a vocab-parallel cross entropy, on one rank: reads each
    row of the local slice once and writes four f32 partial statistics per
    token into `stats`, whose shape is the token shape followed by 4:

    - `[0]` `m`: the maximum over the slice;
    - `[1]` `r`: `sum_j exp(s (x_j - m)) - 1` over the slice (the maximum's
      own term is implicit, as in the unsharded lowering), `s` the logit
      scale (1 without one): of z = s x, at the scale `s m`;
    - `[2]` the target logit `x[label - start]` when the label falls in the
      slice, 0 when it lies elsewhere in `[0, vocab)` or is `ignore_index`,
      NaN for a bad label;
    - `[3]` `sum_j x_j` over the slice with label smoothing, else 0.

    With a logit scale `[0]`, `[2]` and `[3]` stay of x, unscaled and exact:
    the combine multiplies them by `s` (its `target - max` then subtracts
    before it scales, which `s x_y - s m` in f32 would not).

    The statistics of all ranks combine into the loss and log-sum-exp
    (docs/tensor-parallel.md), and `ce.backward` with the same `shard` writes
    the local slice of the gradient from the combined log-sum-exp. `shard` is
    required; `z_loss` must be 0 (it applies to the combined log-sum-exp).

    Example:

    ```mlir
    ce.shard_stats %logits, %labels into %stats layout = sbv_bs
        {shard = #ce.shard<start = 64128, vocab = 128256>}
        : memref<?x?x?xbf16>, memref<?x?xi64> into memref<?x?x4xf32>
    ```
  }], commonDescription);
  let arguments = !con((ins
    Arg<CE_LogitsMemRef, "logits", [MemRead]>:$logits,
    Arg<CE_LabelsMemRef, "labels", [MemRead]>:$labels,
    Arg<CE_TokenMemRef, "per-token partial statistics", [MemWrite]>:$stats),
    CE_OutputOperands, CE_StatusOperand, CE_ConfigAttrs);
  let assemblyFormat = !strconcat(
    "$logits `,` $labels `into` $stats ", CE_OutputsFormat, CE_StatusFormat,
    " attr-dict `:` type($logits) `,` type($labels) `into` type($stats)");
}

//===----------------------------------------------------------------------===//
// RescaleOp
//===----------------------------------------------------------------------===//

def CE_RescaleOp : CE_Op<"rescale"> {
  let summary = "The fused gradient made that of the delivered upstream gradient";
  let description = [{
    `ce.fused` writes `w_t * dloss_t/dx` for the per-token weights `w` it was
    promised; autograd later delivers the real upstream gradient `g`. For each
    token, with `g_t = grad_loss[t]` and `w_t = weights[t]`:

    - `g_t == w_t`: the row is left alone (not read, not written), so the
      common case, a correct prediction, costs one read of two floats per
      token;
    - otherwise every element `d` of the row becomes `d * r` with `r = 0` when
      `g_t == 0` (a masked token) and `r = g_t / w_t` else. A token whose
      weight was 0 and whose `g_t` is not has a row of zeros times an
      infinite ratio: NaN, never a silently wrong gradient (the caller can
      report it without reading the row). A NaN `g_t` makes the row NaN.

    `grad` is the gradient `ce.fused` wrote (the logits' storage under
    overwrite), read and written in place; `layout` places the per-token
    values as for the other ops (`[N]`, `[B, S]` or `[S, B]`).

    Example:

    ```mlir
    ce.rescale %grad, %w, %dloss layout = sbv_bs
        : memref<?x?x?xbf16>, memref<?x?xf32>, memref<?x?xf32>
    ```
  }];
  let arguments = (ins
    Arg<CE_LogitsMemRef, "fused gradient, rescaled in place",
        [MemRead, MemWrite]>:$grad,
    Arg<CE_TokenMemRef, "the weights the fused op was given", [MemRead]>:$weights,
    Arg<CE_TokenMemRef, "delivered upstream per-token gradient",
        [MemRead]>:$grad_loss,
    CE_LayoutAttr:$layout);
  let assemblyFormat =
      "$grad `,` $weights `,` $grad_loss `layout` `=` custom<Layout>($layout) "
      "attr-dict `:` type($grad) `,` type($weights) `,` type($grad_loss)";
  let hasVerifier = 1;
}

#endif // CE_DIALECT_CE_IR_CEOPS_TD
