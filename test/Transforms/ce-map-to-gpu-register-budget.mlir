// RUN: ce-opt %s --pass-pipeline='builtin.module(gpu.module(ce-map-to-gpu{target=nvvm subgroup-size=32}))' | FileCheck %s
// RUN: ce-opt %s --pass-pipeline='builtin.module(gpu.module(ce-map-to-gpu{target=rocdl subgroup-size=64}))' -verify-diagnostics

// A kernel's register budget (the TargetInfo feature `hasRegisterBudget`):
// on nvvm the tuning's max_registers becomes `nvvm.maxnreg` on the kernel,
// which the NVVM translation turns into PTX's `.maxnreg`; rocdl has no such
// cap, and the pass rejects it there.

// CHECK-LABEL: gpu.func @forward
// CHECK-SAME: nvvm.maxnreg = 40 : i32

gpu.module @kernels {
  gpu.func @forward(%x: memref<?x?xbf16, #gpu.address_space<global>>, %y: memref<?xi64, #gpu.address_space<global>>, %loss: memref<?xf32, #gpu.address_space<global>>, %lse: memref<?xf32, #gpu.address_space<global>>) kernel attributes {ce.tuning = #ce.tuning<block_size = 64, unroll = 2, max_registers = 40>} {
    // expected-error @+1 {{max_registers needs a target that has a register budget; rocdl has none}}
    ce.forward %x, %y into %loss, %lse layout = flat : memref<?x?xbf16, #gpu.address_space<global>>, memref<?xi64, #gpu.address_space<global>> into memref<?xf32, #gpu.address_space<global>>, memref<?xf32, #gpu.address_space<global>>
    gpu.return
  }
}
