// RUN: ce-opt %s --pass-pipeline='builtin.module(gpu.module(ce-map-to-gpu{block-size=128 subgroup-size=32 unroll=2},canonicalize,cse))' | FileCheck %s

// The entropy and argmax outputs on GPUs: after the loss and lse stores,
// one more sweep of the row only where flag bit 4 or 5 is set. Per vector:
// log2 p = (x - max) fl(s log2 e) - log(S) log2 e, the term p log2 p (0
// where p is 0), and the lane's index where x equals the maximum (else
// INT32_MAX; -1 for a NaN), kept by a vector minsi; then the threads' sums
// and smallest indices are combined (xor shuffles of the i32, workgroup slots
// by its bits). No index found (an all -inf row) gives 0.

// CHECK-LABEL: gpu.func @forward
// CHECK-DAG: %[[NONE:.*]] = arith.constant 2147483647 : i32
// CHECK-DAG: %[[MINUS1:.*]] = arith.constant dense<-1> : vector<8xi32>
// CHECK: memref.store %{{.*}}, %arg3[%block_id_x]
// CHECK: %[[B4:.*]] = arith.andi %arg6, %c16_i64 : i64
// CHECK: %[[B5:.*]] = arith.andi %arg6, %c32_i64 : i64
// CHECK: %[[WANT:.*]] = arith.ori
// CHECK: scf.if %[[WANT]] {
// CHECK: math.exp2 %{{.*}} : vector<8xf32>
// CHECK: arith.cmpf ogt, %{{.*}} : vector<8xf32>
// CHECK: arith.cmpf oeq, %{{.*}} : vector<8xf32>
// CHECK: %[[NAN:.*]] = arith.cmpf uno, %{{.*}} : vector<8xf32>
// CHECK: arith.select %[[NAN]], %[[MINUS1]], %{{.*}} : vector<8xi1>, vector<8xi32>
// CHECK: arith.minsi %{{.*}} : vector<8xi32>
// CHECK: vector.reduction <minsi>, %{{.*}} : vector<8xi32> into i32
// CHECK: gpu.shuffle  xor %{{.*}} : f32
// CHECK: %[[SH:.*]], %{{.*}} = gpu.shuffle  xor %{{.*}} : i32
// CHECK: arith.minsi %{{.*}}, %[[SH]] : i32
// CHECK: arith.bitcast %{{.*}} : i32 to f32
// CHECK: gpu.barrier
// CHECK: arith.bitcast %{{.*}} : f32 to i32
// CHECK: %[[FOUND:.*]] = arith.cmpi ne, %{{.*}}, %[[NONE]] : i32
// CHECK: arith.select %[[FOUND]], %{{.*}}, %{{.*}} : i64
// CHECK: memref.store %{{.*}}, %arg4[%block_id_x] : memref<?xf32
// CHECK: memref.store %{{.*}}, %arg5[%block_id_x] : memref<?xi64
gpu.module @kernels {
  gpu.func @forward(%x: memref<?x?xbf16, #gpu.address_space<global>>, %y: memref<?xi64, #gpu.address_space<global>>, %loss: memref<?xf32, #gpu.address_space<global>>, %lse: memref<?xf32, #gpu.address_space<global>>, %h: memref<?xf32, #gpu.address_space<global>>, %a: memref<?xi64, #gpu.address_space<global>>, %flags: i64) kernel {
    ce.forward %x, %y into %loss, %lse entropy(%h : memref<?xf32, #gpu.address_space<global>>) argmax(%a : memref<?xi64, #gpu.address_space<global>>) flags(%flags) layout = flat : memref<?x?xbf16, #gpu.address_space<global>>, memref<?xi64, #gpu.address_space<global>> into memref<?xf32, #gpu.address_space<global>>, memref<?xf32, #gpu.address_space<global>>
    gpu.return
  }
}
