// RUN: ce-opt %s --pass-pipeline='builtin.module(gpu.module(ce-map-to-gpu{block-size=64 subgroup-size=32 unroll=2},canonicalize,cse))' | FileCheck %s

// A fused kernel with a `ce.tuning` row cache: the statistics sweep stores the
// row's first chunks (2 of 16 x 2 x 64 bytes here) into dynamic workgroup
// memory as it loads them, and the gradient sweep reads them back from
// there; the other chunks are read twice from global memory (the gradient
// sweep walks them from the row's end, after the row's last vectors).

// CHECK-LABEL: gpu.func @fused
// CHECK-SAME: ce.tuning = #ce.tuning<block_size = 64, unroll = 2, row_cache_bytes = 4096>
// CHECK: %[[RAW:.*]] = gpu.dynamic_shared_memory : memref<?xi8, #gpu.address_space<workgroup>>
// CHECK: %[[CACHE:.*]] = memref.view %[[RAW]][%{{.*}}][] : memref<?xi8, #gpu.address_space<workgroup>> to memref<1024xf32, #gpu.address_space<workgroup>>
// Statistics: the cached chunks, stored as loaded...
// CHECK: scf.for %{{.*}} = %{{.*}} to %[[CACHEEND:[^ ]*]] step
// CHECK-COUNT-2: vector.load %arg0{{.*}} : memref<?x?xf32, #gpu.address_space<global>>, vector<4xf32>
// CHECK: vector.store %{{.*}}, %[[CACHE]][%{{.*}}] {alignment = 16 : i64}
// CHECK: vector.store %{{.*}}, %[[CACHE]][%{{.*}}] {alignment = 16 : i64}
// CHECK: scf.yield
// ...then the other chunks, then the masked last step.
// CHECK: scf.for %{{.*}} = %{{.*}} to %{{.*}}
// CHECK-NOT: %[[CACHE]]
// (The masked last step's offsets: ce-map-to-gpu-masked-step.mlir.)
// CHECK: scf.if
// CHECK: arith.select
// CHECK: gpu.shuffle xor
// Gradient: the masked last step (stores only inside the row)...
// CHECK: scf.if
// CHECK: vector.load %arg0
// CHECK: scf.if
// CHECK: vector.store %{{.*}}, %arg0
// ...the uncached chunks from the last...
// CHECK: scf.for
// CHECK: vector.load %arg0
// CHECK: vector.store %{{.*}}, %arg0
// ...and the cached chunks from workgroup memory.
// CHECK: scf.for %{{.*}} = %{{.*}} to %[[CACHEEND]] step
// CHECK-NOT: vector.load %arg0
// CHECK: vector.load %[[CACHE]][%{{.*}}] {alignment = 16 : i64} : memref<1024xf32, #gpu.address_space<workgroup>>, vector<4xf32>
// CHECK-NOT: vector.load %arg0
// CHECK: vector.store %{{.*}}, %arg0
gpu.module @kernels {
  gpu.func @fused(%x: memref<?x?xf32, #gpu.address_space<global>>, %y: memref<?xi64, #gpu.address_space<global>>, %w: memref<?xf32, #gpu.address_space<global>>, %loss: memref<?xf32, #gpu.address_space<global>>, %lse: memref<?xf32, #gpu.address_space<global>>) kernel attributes {ce.tuning = #ce.tuning<block_size = 64, unroll = 2, row_cache_bytes = 4096>} {
    ce.fused %x, %y, %w into %loss, %lse, %x layout = flat {overwrite_input} : memref<?x?xf32, #gpu.address_space<global>>, memref<?xi64, #gpu.address_space<global>>, memref<?xf32, #gpu.address_space<global>> into memref<?xf32, #gpu.address_space<global>>, memref<?xf32, #gpu.address_space<global>>, memref<?x?xf32, #gpu.address_space<global>>
    gpu.return
  }
}

// Without the attribute (and for the other ops) there is no row cache.
// CHECK-LABEL: gpu.func @plain
// CHECK-NOT: gpu.dynamic_shared_memory
// CHECK: gpu.return
gpu.module @kernels2 {
  gpu.func @plain(%x: memref<?x?xf32, #gpu.address_space<global>>, %y: memref<?xi64, #gpu.address_space<global>>, %w: memref<?xf32, #gpu.address_space<global>>, %loss: memref<?xf32, #gpu.address_space<global>>, %lse: memref<?xf32, #gpu.address_space<global>>) kernel {
    ce.fused %x, %y, %w into %loss, %lse, %x layout = flat {overwrite_input} : memref<?x?xf32, #gpu.address_space<global>>, memref<?xi64, #gpu.address_space<global>>, memref<?xf32, #gpu.address_space<global>> into memref<?xf32, #gpu.address_space<global>>, memref<?xf32, #gpu.address_space<global>>, memref<?x?xf32, #gpu.address_space<global>>
    gpu.return
  }
}
