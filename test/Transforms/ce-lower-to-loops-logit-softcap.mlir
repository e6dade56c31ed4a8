// RUN: ce-opt %s --ce-lower-to-loops --canonicalize --split-input-file | FileCheck %s

// The logit softcap z = cap tanh(s x / cap) (run-time f32s s and cap): k =
// s / cap once per op; each loaded element y = x k is clamped to [-9, 9]
// (NaN kept), t = y P(y^2) / Q(y^2) (six and three FMAs, one division,
// approximate: afn) and z = t cap, before the online softmax, which then
// runs with no scale.

// CHECK-LABEL: func.func @forward_softcap
// CHECK-SAME: %[[S:[^:]*]]: f32, %[[CAP:[^:]*]]: f32)
// CHECK: %[[K:.*]] = arith.divf %[[S]], %[[CAP]] : f32
// CHECK: scf.for
// CHECK: %[[KV:.*]] = vector.broadcast %[[K]] : f32 to vector<8xf32>
// CHECK: %[[Y:.*]] = arith.mulf %{{.*}}, %[[KV]] : vector<8xf32>
// CHECK: %[[LO:.*]] = arith.minimumf %[[Y]], %{{.*}} : vector<8xf32>
// CHECK: %[[C:.*]] = arith.maximumf %[[LO]], %{{.*}} : vector<8xf32>
// CHECK: %[[U:.*]] = arith.mulf %[[C]], %[[C]] : vector<8xf32>
// CHECK-COUNT-6: math.fma %{{.*}}, %[[U]], %{{.*}} : vector<8xf32>
// CHECK: %[[NUM:.*]] = arith.mulf %[[C]], %{{.*}} : vector<8xf32>
// CHECK-COUNT-3: math.fma %{{.*}}, %[[U]], %{{.*}} : vector<8xf32>
// CHECK: %[[T:.*]] = arith.divf %[[NUM]], %{{.*}} fastmath<afn> : vector<8xf32>
// CHECK: arith.mulf %[[T]], %{{.*}} : vector<8xf32>
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

// The gradient sweep: from the same t, dz/dx = s max(1 - t^2, 0) (one FMA),
// exp of z - lse, and the element's gradient times dz/dx (the chain rule).
// The target term is multiplied by dz/dx at x_y too.

// CHECK-LABEL: func.func @backward_softcap
// CHECK-SAME: %[[S:[^:]*]]: f32, %[[CAP:[^:]*]]: f32)
// CHECK: arith.divf %[[S]], %[[CAP]] : f32
// CHECK: %[[TY:.*]] = arith.divf %{{.*}}, %{{.*}} : f32
// CHECK: %[[NTY:.*]] = arith.negf %[[TY]] : f32
// CHECK: %[[ONEY:.*]] = math.fma %[[NTY]], %[[TY]], %{{.*}} : f32
// CHECK: %[[POSY:.*]] = arith.maximumf %[[ONEY]], %{{.*}} : f32
// CHECK: %[[SLOPEY:.*]] = arith.mulf %[[POSY]], %[[S]] : f32
// CHECK: scf.for
// CHECK: %[[T:.*]] = arith.divf %{{.*}}, %{{.*}} : vector<8xf32>
// CHECK: %[[Z:.*]] = arith.mulf %[[T]], %{{.*}} : vector<8xf32>
// CHECK: %[[NT:.*]] = arith.negf %[[T]] : vector<8xf32>
// CHECK: %[[ONE:.*]] = math.fma %[[NT]], %[[T]], %{{.*}} : vector<8xf32>
// CHECK: %[[POS:.*]] = arith.maximumf %[[ONE]], %{{.*}} : vector<8xf32>
// CHECK: %[[SV:.*]] = vector.broadcast %[[S]] : f32 to vector<8xf32>
// CHECK: %[[SLOPE:.*]] = arith.mulf %[[POS]], %[[SV]] : vector<8xf32>
// CHECK: arith.subf %[[Z]], %{{.*}} : vector<8xf32>
// CHECK: %[[P:.*]] = math.exp2 %{{.*}} : vector<8xf32>
// CHECK: %[[G:.*]] = math.fma %[[P]], %{{.*}}, %{{.*}} : vector<8xf32>
// CHECK: %[[DX:.*]] = arith.mulf %[[G]], %[[SLOPE]] : vector<8xf32>
// CHECK: vector.store %[[DX]]
// CHECK: arith.mulf %{{.*}}, %[[SLOPEY]] : f32
// CHECK: memref.store
func.func @backward_softcap(%x: memref<?x?xf32>, %y: memref<?xi64>, %lse: memref<?xf32>, %g: memref<?xf32>, %dx: memref<?x?xf32>, %s: f32, %cap: f32) {
  ce.backward %x, %y, %lse, %g into %dx logit_scale(%s) logit_softcap(%cap) layout = flat : memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xf32>
  return
}
