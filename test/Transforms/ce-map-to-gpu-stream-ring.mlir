// RUN: ce-opt %s --pass-pipeline='builtin.module(gpu.module(ce-map-to-gpu{target=nvvm block-size=64 subgroup-size=32 unroll=2 async-copy=1},canonicalize,cse))' | FileCheck %s --check-prefix=RING
// RUN: ce-opt %s --pass-pipeline='builtin.module(gpu.module(ce-map-to-gpu{target=nvvm block-size=64 subgroup-size=32 unroll=2},canonicalize,cse))' | FileCheck %s --check-prefix=NOASYNC

// The staging ring (a forward kernel whose `ce.tuning` has stream_stages =
// 2, on a target with asynchronous copies): the row's chunks go through a
// ring of two chunks of dynamic workgroup memory (2 x 16 bytes x unroll 2 x
// 64 threads = 2048 bf16); the first chunk's copies are issued before the
// loop, each iteration issues the next chunk's as one group and waits until
// at most one group is in flight before it reduces the current chunk from
// workgroup memory. Without async-copy the tuning's ring is not used.

// RING-LABEL: gpu.func @forward
// RING: %[[RAW:.*]] = gpu.dynamic_shared_memory
// RING: %[[RINGBUF:.*]] = memref.view %[[RAW]]{{.*}} to memref<2048xbf16, #gpu.address_space<workgroup>>
// RING: nvgpu.device_async_copy %arg0[{{.*}}], %[[RINGBUF]][{{.*}}], 8 {bypassL1}
// RING: nvgpu.device_async_create_group
// RING: scf.for
// RING: nvgpu.device_async_copy %arg0[{{.*}}], %[[RINGBUF]][{{.*}}], 8 {bypassL1}
// RING: %[[GROUP:.*]] = nvgpu.device_async_create_group
// RING-NEXT: nvgpu.device_async_wait %[[GROUP]] {numGroups = 1 : i32}
// RING: vector.load %[[RINGBUF]]

// NOASYNC-LABEL: gpu.func @forward
// NOASYNC-NOT: nvgpu.
// NOASYNC-NOT: gpu.dynamic_shared_memory
// NOASYNC: gpu.return

gpu.module @kernels {
  gpu.func @forward(%x: memref<?x?xbf16, #gpu.address_space<global>>, %y: memref<?xi64, #gpu.address_space<global>>, %loss: memref<?xf32, #gpu.address_space<global>>, %lse: memref<?xf32, #gpu.address_space<global>>) kernel attributes {ce.tuning = #ce.tuning<block_size = 64, unroll = 2, stream_stages = 2>} {
    ce.forward %x, %y into %loss, %lse layout = flat : memref<?x?xbf16, #gpu.address_space<global>>, memref<?xi64, #gpu.address_space<global>> into memref<?xf32, #gpu.address_space<global>>, memref<?xf32, #gpu.address_space<global>>
    gpu.return
  }
}
