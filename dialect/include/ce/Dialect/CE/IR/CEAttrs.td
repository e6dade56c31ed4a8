//===- CEAttrs.td - Cross-entropy dialect attributes -------*- tablegen -*-===//

#ifndef CE_DIALECT_CE_IR_CEATTRS_TD
#define CE_DIALECT_CE_IR_CEATTRS_TD

include "ce/Dialect/CE/IR/CEDialect.td"
include "mlir/IR/AttrTypeBase.td"
include "mlir/IR/EnumAttr.td"

def CE_LayoutFlat : I32EnumAttrCase<"flat", 0>;
def CE_LayoutSbvBs : I32EnumAttrCase<"sbv_bs", 1>;
def CE_LayoutSbvSb : I32EnumAttrCase<"sbv_sb", 2>;

def CE_Layout : I32EnumAttr<"Layout",
    "layout of the logits and of the per-token tensors",
    [CE_LayoutFlat, CE_LayoutSbvBs, CE_LayoutSbvSb]> {
  let cppNamespace = "::mlir::ce";
  let genSpecializedAttr = 0;
}

def CE_LayoutAttr : EnumAttr<CE_Dialect, CE_Layout, "layout"> {
  let summary = "Logits and label layout";
  let description = [{
    - `flat`: logits `[N, V]`, per-token tensors (labels, loss, ...) `[N]`.
    - `sbv_bs`: logits `[S, B, V]` (Megatron-Core's sequence-first layout),
      per-token tensors `[B, S]` (what Megatron hands to its loss).
    - `sbv_sb`: logits `[S, B, V]`, per-token tensors `[S, B]`.

    Example: `#ce<layout sbv_bs>`.
  }];
}

def CE_ShardAttr : AttrDef<CE_Dialect, "Shard"> {
  let mnemonic = "shard";
  let summary = "Tensor-parallel vocabulary shard";
  let description = [{
    The logits hold the global vocabulary ids `[start, start + V_local)` of a
    vocabulary of `vocab` ids, where `V_local` is the logits' last dimension.
    Labels are global ids. `global_smoothing` picks the `V` of label
    smoothing's `s = alpha * V / (V - 1)` and `s / V`: by default `V_local`,
    as Megatron-Core's vocab-parallel cross entropy does (each rank then
    smooths towards the mean of its own slice); with `global_smoothing =
    true` the global `vocab` (every rank's loss is then the unsharded loss).

    Example: `#ce.shard<start = 64128, vocab = 128256>`. Without `start`
    and `vocab` (`#ce.shard<>`, `vocab` 0) the op takes them at run time,
    as its `shard_bounds` operands.
  }];
  let parameters = (ins DefaultValuedParameter<"int64_t", "0">:$start,
                        DefaultValuedParameter<"int64_t", "0">:$vocab,
                        DefaultValuedParameter<"bool", "false">:$global_smoothing);
  let extraClassDeclaration = [{
    /// Whether the attribute holds the slice's bounds (else the op's
    /// `shard_bounds` operands give them at run time).
    bool hasBounds() const { return getVocab() != 0; }
  }];
  let assemblyFormat = "`<` struct(params) `>`";
  let genVerifyDecl = 1;
}

def CE_TuningAttr : AttrDef<CE_Dialect, "Tuning"> {
  let mnemonic = "tuning";
  let summary = "How a GPU kernel is mapped onto a workgroup";
  let description = [{
    Carried by a `gpu.func` kernel as the discardable attribute `ce.tuning`
    (ce-gen sets it from the per-chip, per-op table that
    `ce-gen --print-tuning` prints); `ce-map-to-gpu` reads it, and it wins
    over the pass's options. The dialect verifies it where it appears, and
    rejects any other `ce.*` discardable attribute, so a misspelt field or
    attribute is an error rather than a silent default.

    - `block_size`: threads per workgroup, in [1, 1024] (the mapping also
      needs a multiple of the subgroup size);
    - `unroll`: 16-byte vectors per thread and step, in [1, 16];
    - `row_cache_bytes`: fused kernels keep this many bytes of a row's first
      chunks in dynamic workgroup memory between their two sweeps (0: none);
    - `stream_stages`: forward and shard_stats kernels stream their chunks
      through a ring of this many chunks of workgroup memory by
      asynchronous copies (0: off, else [2, 8]);
    - `flush_denormals`: the kernel flushes f32 denormals;
    - `max_registers`: a cap on the registers per thread the target's
      compiler may use (NVIDIA `.maxnreg`; 0: its own choice; a target
      without such a cap rejects a non-zero value).

    Example: `ce.tuning = #ce.tuning<block_size = 256, unroll = 4,
    row_cache_bytes = 49152, flush_denormals = true>`.
  }];
  let parameters = (ins "unsigned":$block_size, "unsigned":$unroll,
                        DefaultValuedParameter<"unsigned", "0">:$row_cache_bytes,
                        DefaultValuedParameter<"unsigned", "0">:$stream_stages,
                        DefaultValuedParameter<"bool", "false">:$flush_denormals,
                        DefaultValuedParameter<"unsigned", "0">:$max_registers);
  let assemblyFormat = "`<` struct(params) `>`";
  let genVerifyDecl = 1;
  let extraClassDeclaration = [{
    /// The discardable attribute's name on a kernel.
    static ::llvm::StringRef getAttrName() { return "ce.tuning"; }
  }];
}

#endif // CE_DIALECT_CE_IR_CEATTRS_TD
