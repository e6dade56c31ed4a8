//===- Passes.td - Cross-entropy transformation passes -----*- tablegen -*-===//

#ifndef CE_TRANSFORMS_PASSES_TD
#define CE_TRANSFORMS_PASSES_TD

include "mlir/Pass/PassBase.td"

def CEFuseForwardBackward : Pass<"ce-fuse-forward-backward"> {
  let summary = "Fuse a ce.forward and the ce.backward that consumes it";
  let description = [{
    Rewrites a `ce.forward` followed by a `ce.backward` of the same logits,
    labels and configuration, whose `lse` is the forward's and whose upstream
    gradient is known when the forward runs, into one `ce.fused`: the logits
    are then read for the statistics and the gradient in one kernel.

    Fusion is legal only when, in the same block:
    - the backward's `grad_loss` is defined before the forward (its values
      are then the gradient weights of the fused op);
    - no operation between the two may write the logits, labels, `lse`,
      `grad_loss` or the gradient buffer, nor read the gradient buffer
      (under `overwrite_input`, the logits), which the fused op now writes
      earlier.

    Where fusion is not legal, the IR is left unchanged and a remark on the
    backward says why. The forward's `lse` output is kept.

    ```mlir
    ce.forward %x, %y into %loss, %lse layout = flat : ...
    ce.backward %x, %y, %lse, %g into %x layout = flat {overwrite_input} : ...
    // becomes
    ce.fused %x, %y, %g into %loss, %lse, %x layout = flat {overwrite_input} : ...
    ```
  }];
  let dependentDialects = ["::mlir::ce::CEDialect"];
}

def CELowerToLoops : Pass<"ce-lower-to-loops", "::mlir::func::FuncOp"> {
  let summary = "Lower ce ops to row-wise online-softmax loop nests";
  let description = [{
    Replaces each `ce` op by a loop over tokens whose body sweeps the logits
    row once with an online running max and sum of exponentials (vectors of
    `vector-width` lanes, `unroll` vectors per step, fp32 accumulation, exp
    and log through exp2/log2), then, for `ce.backward` and `ce.fused`, a
    second sweep that writes the gradient.

    The sum of exponentials is kept as `R` with `sum = 1 + R` per lane (the
    running maximum's own term is implicit), so the small terms of a confident
    row are never added to a 1 and lost; the target-class gradient is
    computed from `expm1` of the target's log-probability, which keeps its
    fp32 accuracy when the target's probability is near 1.

    Preconditions: the ops verify; `shard` is not set (vocab-parallel
    lowering is separate). Labels are read through their strides; a label
    outside `[0, V)` that is not `ignore_index` is never used as an index.

    ```mlir
    ce.forward %x, %y into %loss, %lse layout = flat : ...
    // becomes
    scf.for %t = %c0 to %n step %c1 {
      %row = scf.for ... iter_args(%max = ..., %rest = ...) -> (vector<8xf32>, ...)
      ...
    }
    ```
  }];
  let dependentDialects = [
    "::mlir::arith::ArithDialect", "::mlir::math::MathDialect",
    "::mlir::memref::MemRefDialect", "::mlir::scf::SCFDialect",
    "::mlir::vector::VectorDialect"
  ];
  let options = [
    Option<"vectorWidth", "vector-width", "unsigned", "8",
           "Lanes per vector in the row sweeps, a power of two in [1, 64] "
           "(1 disables vectors)">,
    Option<"unroll", "unroll", "unsigned", "4",
           "Vectors loaded per step of the row sweeps, in [1, 16]">
  ];
}

def CEMapToGPU : Pass<"ce-map-to-gpu", "::mlir::gpu::GPUModuleOp"> {
  let summary = "Map ce ops in GPU kernels onto workgroups, one token each";
  let description = [{
    Lowers each `ce` op inside a `gpu.func` kernel to the code of one
    token, for the token `gpu.block_id x`: the workgroup's threads split the
    row in 16-byte vectors, `unroll` per thread and step; per-thread states
    are combined by `gpu.shuffle xor` butterflies within a subgroup, then
    through one workgroup-memory slot per subgroup, in a fixed order (no
    float atomics: results are deterministic). Indices are 64-bit.

    A kernel's `ce.tuning` attribute (`#ce.tuning<...>`, set by ce-gen from
    `ce-gen --print-tuning`'s table) wins over the pass options: block size,
    unroll, a fused kernel's row cache in dynamic workgroup memory, a
    statistics kernel's stream ring, denormal flushing. Target features
    (asynchronous copies, packed maxima) come from the target's `TargetInfo`,
    and an option the target lacks is an error. docs/gpu-mapping.md has the
    design: the row cache, the stream ring, the masked last step.

    Preconditions: the kernel's memrefs are in the global address space;
    launch with the kernel's block size (`known_block_size`), one workgroup
    per token, and the dynamic workgroup memory of the manifest's
    `lds_bytes`.

    ```mlir
    gpu.func @k(...) kernel attributes {ce.tuning = #ce.tuning<block_size = 256, unroll = 2>} {
      ce.forward %x, %y into %loss, %lse layout = sbv_bs : ...
      gpu.return
    }
    // becomes gpu.thread_id/gpu.block_id, strided scf.for sweeps,
    // gpu.shuffle xor butterflies and gpu.barrier
    ```
  }];
  let dependentDialects = [
    "::mlir::arith::ArithDialect", "::mlir::gpu::GPUDialect",
    "::mlir::LLVM::LLVMDialect", "::mlir::math::MathDialect",
    "::mlir::memref::MemRefDialect", "::mlir::NVVM::NVVMDialect",
    "::mlir::nvgpu::NVGPUDialect", "::mlir::scf::SCFDialect",
    "::mlir::vector::VectorDialect"
  ];
  let options = [
    Option<"target", "target", "std::string", "\"nvvm\"",
           "The target whose features the mapping may use (nvvm or rocdl); "
           "an option the target lacks (async-copy, packed-max on rocdl) is "
           "an error">,
    Option<"blockSize", "block-size", "unsigned", "256",
           "Threads per workgroup (a multiple of the subgroup size)">,
    Option<"subgroupSize", "subgroup-size", "unsigned", "32",
           "Threads per warp (32, NVIDIA) or wave (64, AMD gfx9)">,
    Option<"unroll", "unroll", "unsigned", "2",
           "16-byte vectors loaded per thread and step, in [1, 16]">,
    Option<"asyncCopy", "async-copy", "bool", "false",
           "Fill the row cache by asynchronous global-to-workgroup copies "
           "(nvgpu.device_async_copy, NVIDIA sm_80+), all issued before the "
           "rest of the row is swept">,
    Option<"packedMax", "packed-max", "bool", "false",
           "Take each statistics step's maximum of bf16/f16 logits on the "
           "packed values, two per instruction (NVIDIA sm_80+: "
           "max.NaN.bf16x2 / f16x2), before widening">
  ];
}

//===----------------------------------------------------------------------===//
// Conversions
//===----------------------------------------------------------------------===//

def CEConvertGPUToTarget
    : Pass<"ce-convert-gpu-to-target", "::mlir::gpu::GPUModuleOp"> {
  let summary = "Lower a mapped gpu.module to the LLVM dialect with NVVM or "
                "ROCDL intrinsics";
  let description = [{
    One conversion for everything a `ce-map-to-gpu` kernel holds (arith,
    math, memref, vector, cf and gpu ops) with 64-bit indices and the
    global/workgroup address spaces mapped to LLVM's 1 and 3.

    Unlike upstream `convert-gpu-to-nvvm`/`convert-gpu-to-rocdl`, this keeps
    `math.exp2` and `math.log2` as `llvm.intr.exp2`/`llvm.intr.log2`
    instead of calls into libdevice or ocml, which would need those bitcode
    libraries at link time: NVPTX selects `ex2.approx`/`lg2.approx` and
    AMDGPU `v_exp_f32`/`v_log_f32` for them.

    Precondition: `scf` is already lowered to `cf`.

    ```mlir
    gpu.module @k { gpu.func @f(...) kernel { ... } }
    // becomes gpu.module @k { llvm.func @f(...) attributes {nvvm.kernel} }
    ```
  }];
  let dependentDialects = [
    "::mlir::LLVM::LLVMDialect", "::mlir::NVVM::NVVMDialect",
    "::mlir::ROCDL::ROCDLDialect"
  ];
  let options = [
    Option<"target", "target", "std::string", "\"nvvm\"",
           "nvvm or rocdl">,
    Option<"chipset", "chipset", "std::string", "\"gfx942\"",
           "AMDGPU chipset for rocdl (gfx942, gfx950, gfx90a)">
  ];
}

def CEExpandExp2 : Pass<"ce-expand-exp2"> {
  let summary = "Expand f32 math.exp2 into a vectorizable polynomial";
  let description = [{
    Rewrites `math.exp2` on f32 scalars and vectors into Cody-Waite range
    reduction (`2^x = 2^n * 2^f`, `n = roundeven(x)`, `|f| <= 1/2`), a
    degree-6 polynomial for `2^f` (Cephes' `exp2f` coefficients, relative
    error below 2e-7) and an exponent-field construction of `2^n`. Inputs
    below -127 give 0 (no denormal results), above 128 give +inf, and NaN
    stays NaN.

    For targets without a vector exp2 instruction (x86-64), where LLVM would
    otherwise scalarize `llvm.exp2` into libm calls. GPU pipelines keep
    `math.exp2`, which maps to one hardware instruction there.

    ```mlir
    %y = math.exp2 %x : vector<8xf32>
    // becomes arith.minimumf/maximumf, math.roundeven, math.fma chain,
    // arith.shli and arith.bitcast on vector<8xi32>
    ```
  }];
  let dependentDialects = ["::mlir::arith::ArithDialect",
                           "::mlir::math::MathDialect"];
}

#endif // CE_TRANSFORMS_PASSES_TD
