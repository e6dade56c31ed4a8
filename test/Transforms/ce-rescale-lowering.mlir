// RUN: ce-opt %s --ce-lower-to-loops=vector-width=4 --canonicalize --cse | FileCheck %s --check-prefix=HOST
// RUN: ce-opt %s --pass-pipeline='builtin.module(gpu.module(ce-map-to-gpu{block-size=128 subgroup-size=32 unroll=2},canonicalize,cse))' | FileCheck %s --check-prefix=GPU

// ce.rescale lowers to one row per token: load g and w, and only where
// g != w (unordered: a NaN g rescales) sweep the row once, multiplying each
// element by g / w (0 where g == 0) and storing it back in place. No labels,
// no statistics, no workgroup memory.

// HOST-LABEL: func.func @rescale
// HOST: scf.for %[[T:.*]] =
// HOST-DAG: %[[G:.*]] = memref.load %arg2[%[[T]]]
// HOST-DAG: %[[W:.*]] = memref.load %arg1[%[[T]]]
// HOST-DAG: %[[NE:.*]] = arith.cmpf une, %[[G]], %[[W]]
// HOST-DAG: %[[ZERO:.*]] = arith.cmpf oeq, %[[G]], %{{.*}}
// HOST-DAG: %[[Q:.*]] = arith.divf %[[G]], %[[W]]
// HOST: %[[R:.*]] = arith.select %[[ZERO]], %{{.*}}, %[[Q]]
// HOST: scf.if %[[NE]]
// HOST: vector.load %arg0
// HOST: arith.mulf
// HOST: vector.store {{.*}}, %arg0
// HOST-NOT: math.exp
func.func @rescale(%g: memref<?x?xbf16>, %w: memref<?xf32>, %d: memref<?xf32>) {
  ce.rescale %g, %w, %d layout = flat : memref<?x?xbf16>, memref<?xf32>, memref<?xf32>
  return
}

// GPU-LABEL: gpu.func @rescale
// GPU-NOT: workgroup(
// GPU-SAME: kernel attributes {known_block_size = array<i32: 128, 1, 1>}
// GPU: gpu.block_id x
// GPU: arith.cmpf une
// GPU: scf.if
// GPU: vector.load {{.*}} {alignment = 16 : i64} : memref<?x?x?xbf16, #gpu.address_space<global>>, vector<8xbf16>
// GPU: arith.mulf {{.*}} : vector<8xf32>
// GPU: vector.store
// GPU-NOT: gpu.barrier
// GPU-NOT: gpu.shuffle
gpu.module @kernels {
  gpu.func @rescale(%g: memref<?x?x?xbf16, #gpu.address_space<global>>, %w: memref<?x?xf32, #gpu.address_space<global>>, %d: memref<?x?xf32, #gpu.address_space<global>>) kernel {
    ce.rescale %g, %w, %d layout = sbv_bs : memref<?x?x?xbf16, #gpu.address_space<global>>, memref<?x?xf32, #gpu.address_space<global>>, memref<?x?xf32, #gpu.address_space<global>>
    gpu.return
  }
}
