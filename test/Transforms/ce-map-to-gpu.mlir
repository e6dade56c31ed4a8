// RUN: ce-opt %s --pass-pipeline='builtin.module(gpu.module(ce-map-to-gpu{block-size=128 subgroup-size=32 unroll=2},canonicalize,cse))' | FileCheck %s

// One token per workgroup; the row is split over 128 threads with 16-byte
// aligned vector loads; states meet through xor shuffles, then 4 subgroup
// slots in workgroup memory; thread 0 stores the per-token outputs.

// CHECK-LABEL: gpu.func @forward
// CHECK-SAME: workgroup(%[[SCRATCH:.*]] : memref<12xf32, #gpu.address_space<workgroup>>)
// CHECK-SAME: kernel attributes {known_block_size = array<i32: 128, 1, 1>}
// CHECK-DAG: %[[TID:.*]] = gpu.thread_id x
// CHECK-DAG: %[[BID:.*]] = gpu.block_id x
// CHECK: memref.extract_aligned_pointer_as_index
// CHECK: scf.for
// CHECK: vector.load {{.*}} {alignment = 16 : i64} : memref<?x?xbf16, #gpu.address_space<global>>, vector<8xbf16>
// CHECK: gpu.shuffle xor %{{.*}}, %{{.*}}, %{{.*}} : f32
// CHECK: memref.store %{{.*}}, %[[SCRATCH]]
// CHECK: gpu.barrier
// CHECK: memref.load %[[SCRATCH]]
// CHECK: scf.if
// CHECK: memref.store %{{.*}}, %arg2
gpu.module @kernels {
  gpu.func @forward(%x: memref<?x?xbf16, #gpu.address_space<global>>, %y: memref<?xi64, #gpu.address_space<global>>, %loss: memref<?xf32, #gpu.address_space<global>>, %lse: memref<?xf32, #gpu.address_space<global>>) kernel {
    ce.forward %x, %y into %loss, %lse layout = flat : memref<?x?xbf16, #gpu.address_space<global>>, memref<?xi64, #gpu.address_space<global>> into memref<?xf32, #gpu.address_space<global>>, memref<?xf32, #gpu.address_space<global>>
    gpu.return
  }
}

// Backward under overwrite_input: a barrier after the target gather (no
// thread may overwrite x[y] before all have read it) and another before
// thread 0 rewrites the target element.

// CHECK-LABEL: gpu.func @backward
// CHECK: scf.if
// CHECK: gpu.barrier
// CHECK: vector.store {{.*}} {alignment = 16 : i64}
// CHECK: gpu.barrier
// CHECK: memref.store %{{.*}}, %arg0
gpu.module @kernels2 {
  gpu.func @backward(%x: memref<?x?xf32, #gpu.address_space<global>>, %y: memref<?xi64, #gpu.address_space<global>>, %lse: memref<?xf32, #gpu.address_space<global>>, %g: memref<?xf32, #gpu.address_space<global>>) kernel {
    ce.backward %x, %y, %lse, %g into %x layout = flat {overwrite_input} : memref<?x?xf32, #gpu.address_space<global>>, memref<?xi64, #gpu.address_space<global>>, memref<?xf32, #gpu.address_space<global>>, memref<?xf32, #gpu.address_space<global>> into memref<?x?xf32, #gpu.address_space<global>>
    gpu.return
  }
}
