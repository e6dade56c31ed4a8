// RUN: ce-opt %s --ce-lower-to-loops --canonicalize --split-input-file | FileCheck %s

// The logit scale s (a run-time f32, z = s x): every exponent is of
// (x - max) s, the subtraction first. The statistics sweep's folded FMA
// exponents use fl(s log2 e), computed once per op, where they used log2 e;
// lse = s max + log1p(rest), its low part adds the product's own error
// fma(s, max, -s max); log p_y = (x_y - max) s - log1p(rest).

// CHECK-LABEL: func.func @forward_scale
// CHECK-SAME: %[[LSE:[^:]*]]: memref<?xf32>, %[[LOW:[^:]*]]: memref<?xf32>, %[[S:[^:]*]]: f32)
// CHECK: %[[K:.*]] = arith.mulf %[[S]], %{{.*}} : f32
// CHECK: scf.for
// CHECK: %[[KV:.*]] = vector.broadcast %[[K]] : f32 to vector<8xf32>
// CHECK: math.fma %{{.*}}, %[[KV]], %{{.*}} : vector<8xf32>
// CHECK: %[[STATS:.*]]:2 = scf.if
// CHECK: %[[SM:.*]] = arith.mulf %[[STATS]]#0, %[[S]] : f32
// CHECK: %[[LSEV:.*]] = arith.addf %[[SM]], %[[LOG:.*]] : f32
// CHECK: %[[SHIFT:.*]] = arith.subf %{{.*}}, %[[STATS]]#0 : f32
// CHECK: %[[SCALED:.*]] = arith.mulf %[[SHIFT]], %[[S]] : f32
// CHECK: arith.subf %[[SCALED]], %[[LOG]] : f32
// CHECK: %[[NEGSM:.*]] = arith.negf %[[SM]] : f32
// CHECK: math.fma %[[S]], %[[STATS]]#0, %[[NEGSM]] : f32
// CHECK: memref.store %[[LSEV]], %[[LSE]]
func.func @forward_scale(%x: memref<?x?xf32>, %y: memref<?xi64>, %loss: memref<?xf32>, %lse: memref<?xf32>, %low: memref<?xf32>, %s: f32) {
  ce.forward %x, %y into %loss, %lse lse_low(%low : memref<?xf32>) logit_scale(%s) layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}

// -----

// The backward has only lse (of z): log p_j = fma(s, x_j, -lse) - lse_low,
// one rounding, and the row's weight is g s (the gradient is of x).

// CHECK-LABEL: func.func @backward_scale
// CHECK-SAME: %[[S:[^:]*]]: f32)
// CHECK: %[[LSE:.*]] = memref.load %arg2
// CHECK: %[[G:.*]] = memref.load %arg4
// CHECK: %[[NEG:.*]] = arith.negf %[[LSE]] : f32
// CHECK: math.fma %[[S]], %{{.*}}, %[[NEG]] : f32
// CHECK: arith.mulf %[[G]], %[[S]] : f32
// CHECK: %[[SV:.*]] = vector.broadcast %[[S]] : f32 to vector<8xf32>
// CHECK: %[[LP:.*]] = math.fma %[[SV]], %{{.*}}, %{{.*}} : vector<8xf32>
// CHECK: %[[E:.*]] = math.fma %[[LP]], %{{.*}}, %{{.*}} : vector<8xf32>
// CHECK: math.exp2 %[[E]] : vector<8xf32>
func.func @backward_scale(%x: memref<?x?xf32>, %y: memref<?xi64>, %lse: memref<?xf32>, %low: memref<?xf32>, %g: memref<?xf32>, %d: memref<?x?xf32>, %s: f32) {
  ce.backward %x, %y, %lse, %g into %d lse_low(%low : memref<?xf32>) logit_scale(%s) layout = flat : memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xf32>
  return
}

// -----

// The fused gradient's exponent from the row maximum: exp2((x - m)
// fl(s log2 e) - L log2 e), one FMA after the exact subtraction; the
// weight times s.

// CHECK-LABEL: func.func @fused_scale
// CHECK-SAME: %[[W:[^:]*]]: memref<?xf32>, %{{[^:]*}}: memref<?xf32>, %{{[^:]*}}: memref<?xf32>, %[[S:[^:]*]]: f32)
// CHECK: %[[K:.*]] = arith.mulf %[[S]], %{{.*}} : f32
// CHECK: %[[WT:.*]] = memref.load %[[W]]
// CHECK: arith.mulf %[[WT]], %[[S]] : f32
// CHECK: %[[D:.*]] = arith.subf %{{.*}}, %{{.*}} : vector<8xf32>
// CHECK: %[[KV:.*]] = vector.broadcast %[[K]] : f32 to vector<8xf32>
// CHECK-NEXT: %[[E:.*]] = math.fma %[[D]], %[[KV]], %{{.*}} : vector<8xf32>
// CHECK: math.exp2 %[[E]] : vector<8xf32>
func.func @fused_scale(%x: memref<?x?xf32>, %y: memref<?xi64>, %w: memref<?xf32>, %loss: memref<?xf32>, %lse: memref<?xf32>, %s: f32) {
  ce.fused %x, %y, %w into %loss, %lse, %x logit_scale(%s) layout = flat {overwrite_input} : memref<?x?xf32>, memref<?xi64>, memref<?xf32> into memref<?xf32>, memref<?xf32>, memref<?x?xf32>
  return
}

// -----

// Smoothing's mean is of z: s_a log1p(rest) - (s_a s)(mean - max), s_a the
// smoothing factor, (s_a s) formed first.

// CHECK-LABEL: func.func @smoothing_scale
// CHECK-SAME: %[[S:[^:]*]]: f32)
// CHECK: %[[SA:.*]] = arith.select
// CHECK: %[[STATS:.*]]:3 = scf.if
// CHECK: %[[SAS:.*]] = arith.mulf %[[SA]], %[[S]] : f32
// CHECK: %[[MS:.*]] = arith.mulf %[[SAS]], %[[STATS]]#2 : f32
// CHECK: arith.subf %{{.*}}, %[[MS]] : f32
func.func @smoothing_scale(%x: memref<?x?xf32>, %y: memref<?xi64>, %loss: memref<?xf32>, %lse: memref<?xf32>, %a: f32, %s: f32) {
  ce.forward %x, %y into %loss, %lse label_smoothing(%a) logit_scale(%s) layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}

// -----

// shard_stats: the rest is of z (its exponents scaled), the maximum, target
// and row sum stay of x (stored unscaled).

// CHECK-LABEL: func.func @stats_scale
// CHECK-SAME: %[[ST:[^:]*]]: memref<?x4xf32>, %[[S:[^:]*]]: f32)
// CHECK: %[[K:.*]] = arith.mulf %[[S]], %{{.*}} : f32
// CHECK: %[[KV:.*]] = vector.broadcast %[[K]] : f32 to vector<8xf32>
// CHECK: math.fma %{{.*}}, %[[KV]], %{{.*}} : vector<8xf32>
// CHECK: %[[STATS:.*]]:2 = scf.if
// CHECK-NOT: arith.mulf %[[STATS]]#0
// CHECK: memref.store %[[STATS]]#0, %[[ST]]
// CHECK: memref.store %[[STATS]]#1, %[[ST]]
func.func @stats_scale(%x: memref<?x?xf32>, %y: memref<?xi64>, %st: memref<?x4xf32>, %s: f32) {
  ce.shard_stats %x, %y into %st logit_scale(%s) layout = flat {shard = #ce.shard<start = 0, vocab = 128>} : memref<?x?xf32>, memref<?xi64> into memref<?x4xf32>
  return
}
