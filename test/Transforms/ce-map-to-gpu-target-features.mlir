// RUN: ce-opt %s --pass-pipeline='builtin.module(gpu.module(ce-map-to-gpu{target=nvvm block-size=64 subgroup-size=32 unroll=2 async-copy=1 packed-max=1},canonicalize,cse))' | FileCheck %s --check-prefix=NVVM
// RUN: ce-opt %s --pass-pipeline='builtin.module(gpu.module(ce-map-to-gpu{target=rocdl block-size=64 subgroup-size=64 unroll=2},canonicalize,cse))' | FileCheck %s --check-prefix=ROCDL

// The target features of ce-map-to-gpu, each built by the target's
// TargetInfo: on nvvm the fused kernel's row cache is filled by cp.async
// copies in groups, waited for chunk by chunk, the uncached rest of the row
// is prefetched into L2, a bf16 step's maximum is taken on packed values,
// and the forward streams its chunks through a ring of cp.async stages;
// rocdl has none of them (ordinary loads and stores, widened maxima).

// NVVM-LABEL: gpu.func @fused
// NVVM: nvgpu.device_async_copy %{{.*}}, %{{.*}}, 8 {bypassL1}
// NVVM: nvgpu.device_async_create_group
// NVVM: nvvm.cp.async.bulk.prefetch
// NVVM: nvgpu.device_async_wait %{{.*}} {numGroups = 3 : i32}
// NVVM: nvgpu.device_async_wait %{{.*}}{{$}}
// NVVM-LABEL: gpu.func @forward_stream
// NVVM: nvgpu.device_async_copy
// NVVM: nvgpu.device_async_wait %{{.*}} {numGroups = 1 : i32}
// NVVM: arith.maximumf %{{.*}}, %{{.*}} : vector<8xbf16>

// ROCDL-LABEL: gpu.func @fused
// ROCDL-NOT: nvgpu.
// ROCDL-NOT: nvvm.
// ROCDL-NOT: arith.maximumf %{{.*}}, %{{.*}} : vector<8xbf16>
// ROCDL: gpu.return
// ROCDL-LABEL: gpu.func @forward_stream
// ROCDL-NOT: nvgpu.
// ROCDL-NOT: arith.maximumf %{{.*}}, %{{.*}} : vector<8xbf16>
// ROCDL: gpu.return

gpu.module @kernels {
  gpu.func @fused(%x: memref<?x?xbf16, #gpu.address_space<global>>, %y: memref<?xi64, #gpu.address_space<global>>, %w: memref<?xf32, #gpu.address_space<global>>, %loss: memref<?xf32, #gpu.address_space<global>>, %lse: memref<?xf32, #gpu.address_space<global>>) kernel attributes {ce.row_cache_bytes = 4096 : i64} {
    ce.fused %x, %y, %w into %loss, %lse, %x layout = flat {overwrite_input} : memref<?x?xbf16, #gpu.address_space<global>>, memref<?xi64, #gpu.address_space<global>>, memref<?xf32, #gpu.address_space<global>> into memref<?xf32, #gpu.address_space<global>>, memref<?xf32, #gpu.address_space<global>>, memref<?x?xbf16, #gpu.address_space<global>>
    gpu.return
  }
  gpu.func @forward_stream(%x: memref<?x?xbf16, #gpu.address_space<global>>, %y: memref<?xi64, #gpu.address_space<global>>, %loss: memref<?xf32, #gpu.address_space<global>>, %lse: memref<?xf32, #gpu.address_space<global>>) kernel attributes {ce.stream_stages = 2 : i64} {
    ce.forward %x, %y into %loss, %lse layout = flat : memref<?x?xbf16, #gpu.address_space<global>>, memref<?xi64, #gpu.address_space<global>> into memref<?xf32, #gpu.address_space<global>>, memref<?xf32, #gpu.address_space<global>>
    gpu.return
  }
}
