//===- CEDialect.td - Cross-entropy dialect definition -----*- tablegen -*-===//
//
// The `ce` dialect describes softmax cross-entropy reductions over logits
// buffers, the way a language-model trainer uses them.
//
//===----------------------------------------------------------------------===//

#ifndef CE_DIALECT_CE_IR_CEDIALECT_TD
#define CE_DIALECT_CE_IR_CEDIALECT_TD

include "mlir/IR/OpBase.td"

def CE_Dialect : Dialect {
  let name = "ce";
  let cppNamespace = "::mlir::ce";
  let summary = "Softmax cross-entropy reductions for language-model training";
  let description = [{
    The `ce` dialect states *what* a softmax cross-entropy computes, on
    buffers (memrefs), and leaves *how* to the lowering passes. It has five
    operations: `ce.forward` (per-token loss and log-sum-exp),
    `ce.backward` (the gradient from a stored log-sum-exp and an upstream
    per-token gradient), `ce.fused` (both in one sweep, when the gradient
    weights are known when the forward runs), `ce.shard_stats` (the partial
    statistics of a tensor-parallel vocabulary slice) and `ce.rescale` (the
    fused gradient corrected in place where the delivered upstream gradient
    differs from the weights the fused op was given).

    Every cross-entropy operation carries the same configuration: the label layout, an
    optional `ignore_index`, label smoothing (Megatron's formula), a z-loss
    coefficient and an optional tensor-parallel vocabulary shard. Shapes may
    be dynamic; the vocabulary dimension of the logits must have unit stride.

    Numerics (per token `t`, fp32 arithmetic; `s = alpha * V / (V - 1)`, and
    `s = 0` when `V == 1`):

    ```
    lse_t  = max_j x_tj + log(sum_j exp(x_tj - max_j x_tj))
    loss_t = (1 - s) * (lse_t - x_t[y_t]) + s * (lse_t - mean_j x_tj)
             + z * lse_t^2
    dX_tj  = g_t * (p_tj * (1 + 2 z lse_t) - (1 - s) [j == y_t] - s / V)
    ```
  }];
  let useDefaultAttributePrinterParser = 1;
  let hasOperationAttrVerify = 1;
  let extraClassDeclaration = [{
    void registerAttributes();
  }];
}

class CE_Op<string mnemonic, list<Trait> traits = []>
    : Op<CE_Dialect, mnemonic, traits>;

#endif // CE_DIALECT_CE_IR_CEDIALECT_TD
