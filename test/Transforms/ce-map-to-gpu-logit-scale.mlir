// RUN: ce-opt %s --pass-pipeline='builtin.module(gpu.module(ce-map-to-gpu{block-size=128 subgroup-size=32 unroll=2},canonicalize,cse))' | FileCheck %s

// The logit scale on GPUs: fl(s log2 e) is computed once per kernel and
// takes log2 e's place in the sweep's FMA exponents and in the merges of
// the threads' states (the xor shuffles), whose rescale is
// exp2((m_low - m_top) fl(s log2 e)); lse = s max + log1p(rest).

// CHECK-LABEL: gpu.func @forward
// CHECK-SAME: %[[S:[^:]*]]: f32)
// CHECK: %[[K:.*]] = arith.mulf %[[S]], %{{.*}} : f32
// CHECK: %[[KV:.*]] = vector.broadcast %[[K]] : f32 to vector<8xf32>
// CHECK: math.fma %{{.*}}, %[[KV]], %{{.*}} : vector<8xf32>
// CHECK: %[[OTHER:.*]], %{{.*}} = gpu.shuffle xor
// CHECK: %[[TOP:.*]] = arith.cmpf oge, %{{.*}}, %[[OTHER]] : f32
// CHECK: %[[D:.*]] = arith.subf %{{.*}}, %{{.*}} : f32
// CHECK-NEXT: %[[E:.*]] = arith.mulf %[[D]], %[[K]] : f32
// CHECK-NEXT: math.exp2 %[[E]] : f32
// CHECK: %[[STATS:.*]]:2 = scf.if
// CHECK: %[[SM:.*]] = arith.mulf %[[STATS]]#0, %[[S]] : f32
// CHECK: arith.addf %[[SM]], %{{.*}} : f32
gpu.module @kernels {
  gpu.func @forward(%x: memref<?x?xbf16, #gpu.address_space<global>>, %y: memref<?xi64, #gpu.address_space<global>>, %loss: memref<?xf32, #gpu.address_space<global>>, %lse: memref<?xf32, #gpu.address_space<global>>, %s: f32) kernel {
    ce.forward %x, %y into %loss, %lse logit_scale(%s) layout = flat : memref<?x?xbf16, #gpu.address_space<global>>, memref<?xi64, #gpu.address_space<global>> into memref<?xf32, #gpu.address_space<global>>, memref<?xf32, #gpu.address_space<global>>
    gpu.return
  }
}

// The backward on GPUs: log p_j = fma(s, x_j, -lse), the weight times s.

// CHECK-LABEL: gpu.func @backward
// CHECK-SAME: %[[S:[^:]*]]: f32)
// CHECK: %[[LSE:.*]] = memref.load %arg2
// CHECK: %[[G:.*]] = memref.load %arg3
// CHECK: %[[NEG:.*]] = arith.negf %[[LSE]] : f32
// CHECK: math.fma %[[S]], %{{.*}}, %[[NEG]] : f32
// CHECK: arith.mulf %[[G]], %[[S]] : f32
// CHECK-DAG: %[[SV:.*]] = vector.broadcast %[[S]] : f32 to vector<4xf32>
// CHECK-DAG: %[[NEGV:.*]] = vector.broadcast %[[NEG]] : f32 to vector<4xf32>
// CHECK: math.fma %[[SV]], %{{.*}}, %[[NEGV]] : vector<4xf32>
gpu.module @kernels2 {
  gpu.func @backward(%x: memref<?x?xf32, #gpu.address_space<global>>, %y: memref<?xi64, #gpu.address_space<global>>, %lse: memref<?xf32, #gpu.address_space<global>>, %g: memref<?xf32, #gpu.address_space<global>>, %s: f32) kernel {
    ce.backward %x, %y, %lse, %g into %x logit_scale(%s) layout = flat {overwrite_input} : memref<?x?xf32, #gpu.address_space<global>>, memref<?xi64, #gpu.address_space<global>>, memref<?xf32, #gpu.address_space<global>>, memref<?xf32, #gpu.address_space<global>> into memref<?x?xf32, #gpu.address_space<global>>
    gpu.return
  }
}
