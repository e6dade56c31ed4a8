// RUN: ce-opt %s --pass-pipeline='builtin.module(gpu.module(ce-map-to-gpu{target=rocdl subgroup-size=64 async-copy=1}))' -verify-diagnostics
// RUN: ce-opt %s --pass-pipeline='builtin.module(gpu.module(ce-map-to-gpu{target=rocdl subgroup-size=64 packed-max=1}))' -verify-diagnostics

// The pass, not the tool, rejects a feature its target lacks: AMD has no
// cp.async copies and no packed bf16 maximum.

// expected-error @+1 {{needs a target that has it; rocdl has none}}
gpu.module @kernels {
  gpu.func @forward(%x: memref<?x?xbf16, #gpu.address_space<global>>, %y: memref<?xi64, #gpu.address_space<global>>, %loss: memref<?xf32, #gpu.address_space<global>>, %lse: memref<?xf32, #gpu.address_space<global>>) kernel {
    ce.forward %x, %y into %loss, %lse layout = flat : memref<?x?xbf16, #gpu.address_space<global>>, memref<?xi64, #gpu.address_space<global>> into memref<?xf32, #gpu.address_space<global>>, memref<?xf32, #gpu.address_space<global>>
    gpu.return
  }
}
