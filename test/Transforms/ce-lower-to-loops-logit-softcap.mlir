// RUN: ce-opt %s --ce-lower-to-loops --canonicalize --split-input-file | FileCheck %s

// The logit softcap z = cap tanh(s x / cap) (run-time f32s s and cap) as
// z = cap - 2 cap r, r = 1 / (1 + 2^(x k)): k = fl(s / cap) 2 log2 e and
// -2 cap once per op; per loaded element a multiply, an exp2, an add, one
// reciprocal and one FMA, before the online softmax, which then runs with no
// scale. The reciprocal of half of each vector's lanes (the NVIDIA share the
// host takes too) is built from FMAs: a clamp to 2^64, the guess
// 0x7EF311C3 - bits(a), a Newton step and a third-order step; the other
// half's is approximate (afn).

// CHECK-LABEL: func.func @forward_softcap
// CHECK-SAME: %[[S:[^:]*]]: f32, %[[CAP:[^:]*]]: f32)
// CHECK: %[[Q:.*]] = arith.divf %[[S]], %[[CAP]] : f32
// CHECK: %[[K:.*]] = arith.mulf %[[Q]], %{{.*}} : f32
// CHECK: %[[N2C:.*]] = arith.mulf %[[CAP]], %{{.*}} : f32
// CHECK: scf.for
// CHECK: %[[KV:.*]] = vector.broadcast %[[K]] : f32 to vector<8xf32>
// CHECK: %[[Y:.*]] = arith.mulf %{{.*}}, %[[KV]] : vector<8xf32>
// CHECK: %[[E:.*]] = math.exp2 %[[Y]] : vector<8xf32>
// CHECK: %[[E1:.*]] = arith.addf %[[E]], %{{.*}} : vector<8xf32>
// CHECK: %[[HEAD:.*]] = vector.shuffle %[[E1]], %[[E1]] [0, 1, 2, 3] : vector<8xf32>, vector<8xf32>
// CHECK: %[[TAIL:.*]] = vector.shuffle %[[E1]], %[[E1]] [4, 5, 6, 7] : vector<8xf32>, vector<8xf32>
// CHECK: %[[RT:.*]] = arith.divf %[[ONE:.*]], %[[TAIL]] fastmath<afn> : vector<4xf32>
// CHECK: %[[A:.*]] = arith.minimumf %[[HEAD]], %{{.*}} : vector<4xf32>
// CHECK: %[[BITS:.*]] = arith.bitcast %[[A]] : vector<4xf32> to vector<4xi32>
// CHECK: %[[GUESS:.*]] = arith.subi %{{.*}}, %[[BITS]] : vector<4xi32>
// CHECK: %[[Y0:.*]] = arith.bitcast %[[GUESS]] : vector<4xi32> to vector<4xf32>
// CHECK: %[[NA:.*]] = arith.negf %[[A]] : vector<4xf32>
// CHECK: %[[E0:.*]] = math.fma %[[NA]], %[[Y0]], %[[ONE]] : vector<4xf32>
// CHECK: %[[Y1:.*]] = math.fma %[[Y0]], %[[E0]], %[[Y0]] : vector<4xf32>
// CHECK: %[[EN:.*]] = math.fma %[[NA]], %[[Y1]], %[[ONE]] : vector<4xf32>
// CHECK: %[[EE:.*]] = math.fma %[[EN]], %[[EN]], %[[EN]] : vector<4xf32>
// CHECK: %[[RH:.*]] = math.fma %[[Y1]], %[[EE]], %[[Y1]] : vector<4xf32>
// CHECK: %[[R:.*]] = vector.shuffle %[[RH]], %[[RT]] [0, 1, 2, 3, 4, 5, 6, 7] : vector<4xf32>, vector<4xf32>
// CHECK: %[[CV:.*]] = vector.broadcast %[[CAP]] : f32 to vector<8xf32>
// CHECK: %[[NV:.*]] = vector.broadcast %[[N2C]] : f32 to vector<8xf32>
// CHECK: math.fma %[[R]], %[[NV]], %[[CV]] : vector<8xf32>
// CHECK: math.exp2
func.func @forward_softcap(%x: memref<?x?xf32>, %y: memref<?xi64>, %loss: memref<?xf32>, %lse: memref<?xf32>, %s: f32, %cap: f32) {
  ce.forward %x, %y into %loss, %lse logit_scale(%s) logit_softcap(%cap) layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}

// -----

// Without the operand there is no tanh: no division per element.

// CHECK-LABEL: func.func @forward_no_softcap
// CHECK-NOT: arith.divf {{.*}} : vector<8xf32>
// CHECK: return
func.func @forward_no_softcap(%x: memref<?x?xf32>, %y: memref<?xi64>, %loss: memref<?xf32>, %lse: memref<?xf32>, %s: f32) {
  ce.forward %x, %y into %loss, %lse logit_scale(%s) layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}

// -----

// The gradient sweep: from the same r (a scalar's from FMAs), dz/dx = 4 s r (1 - r) as
// fma(-r, r, r) times 4 s (no clamp: r is in [0, 1]), exp of z - lse, and
// the element's gradient times dz/dx (the chain rule). The target term is
// multiplied by dz/dx at x_y too.

// CHECK-LABEL: func.func @backward_softcap
// CHECK-SAME: %[[S:[^:]*]]: f32, %[[CAP:[^:]*]]: f32)
// CHECK: arith.divf %[[S]], %[[CAP]] : f32
// CHECK: %[[S4:.*]] = arith.mulf %[[S]], %{{.*}} : f32
// CHECK: arith.subi %{{.*}}, %{{.*}} : i32
// CHECK: math.fma %{{.*}}, %{{.*}}, %{{.*}} : f32
// CHECK: math.fma %{{.*}}, %{{.*}}, %{{.*}} : f32
// CHECK: math.fma %{{.*}}, %{{.*}}, %{{.*}} : f32
// CHECK: math.fma %{{.*}}, %{{.*}}, %{{.*}} : f32
// CHECK: %[[RY:.*]] = math.fma %{{.*}}, %{{.*}}, %{{.*}} : f32
// CHECK: %[[NRY:.*]] = arith.negf %[[RY]] : f32
// CHECK: %[[PY:.*]] = math.fma %[[NRY]], %[[RY]], %[[RY]] : f32
// CHECK: %[[SLOPEY:.*]] = arith.mulf %[[PY]], %[[S4]] : f32
// CHECK: scf.for
// CHECK: arith.divf %{{.*}}, %{{.*}} fastmath<afn> : vector<4xf32>
// CHECK: %[[R:.*]] = vector.shuffle %{{.*}}, %{{.*}} [0, 1, 2, 3, 4, 5, 6, 7] : vector<4xf32>, vector<4xf32>
// CHECK: %[[NR:.*]] = arith.negf %[[R]] : vector<8xf32>
// CHECK: %[[P:.*]] = math.fma %[[NR]], %[[R]], %[[R]] : vector<8xf32>
// CHECK: %[[SV:.*]] = vector.broadcast %[[S4]] : f32 to vector<8xf32>
// CHECK: %[[SLOPE:.*]] = arith.mulf %[[P]], %[[SV]] : vector<8xf32>
// CHECK: %[[Z:.*]] = math.fma %[[R]], %{{.*}}, %{{.*}} : vector<8xf32>
// CHECK: arith.subf %[[Z]], %{{.*}} : vector<8xf32>
// CHECK: %[[EP:.*]] = math.exp2 %{{.*}} : vector<8xf32>
// CHECK: %[[G:.*]] = math.fma %[[EP]], %{{.*}}, %{{.*}} : vector<8xf32>
// CHECK: %[[DX:.*]] = arith.mulf %[[G]], %[[SLOPE]] : vector<8xf32>
// CHECK: vector.store %[[DX]]
// CHECK: arith.mulf %{{.*}}, %[[SLOPEY]] : f32
// CHECK: memref.store
func.func @backward_softcap(%x: memref<?x?xf32>, %y: memref<?xi64>, %lse: memref<?xf32>, %g: memref<?xf32>, %dx: memref<?x?xf32>, %s: f32, %cap: f32) {
  ce.backward %x, %y, %lse, %g into %dx logit_scale(%s) logit_softcap(%cap) layout = flat : memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xf32>
  return
}
