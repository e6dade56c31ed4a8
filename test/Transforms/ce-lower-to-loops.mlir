// RUN: ce-opt %s --ce-lower-to-loops="vector-width=4 unroll=2" --canonicalize --cse --split-input-file | FileCheck %s

// The forward: one loop over tokens; per token a guarded label gather, a
// vectorized statistics sweep carrying one maximum and a rest per lane,
// stepping 4 lanes x 2 vectors, single vectors after it, a scalar tail, and
// the loss/lse stores.

// CHECK-LABEL: func @forward
// CHECK-SAME: %[[X:[^:]*]]: memref<?x?xbf16>, %[[Y:[^:]*]]: memref<?xi64>, %[[L:[^:]*]]: memref<?xf32>, %[[E:[^:]*]]: memref<?xf32>, %[[ST:[^:]*]]: memref<1xi64>
// CHECK-DAG: %[[C8:.*]] = arith.constant 8 : index
// CHECK: scf.for %[[T:.*]] = %{{.*}} to %{{.*}} step %{{.*}} {
// CHECK:   %[[LABEL:.*]] = memref.load %[[Y]][%[[T]]] : memref<?xi64>
// CHECK:   %[[TARGET:.*]] = scf.if %{{.*}} -> (f32) {
// CHECK:     memref.load %[[X]][%[[T]], %{{.*}}] : memref<?x?xbf16>
// CHECK:   scf.if %{{.*}} {
// CHECK:     memref.store %{{.*}}, %[[ST]][%{{.*}}] : memref<1xi64>
// The state: the maximum, the lanes' small terms, the maxima's count apart.
// CHECK:   %[[MAIN:.*]]:3 = scf.for %[[J:.*]] = %{{.*}} to %{{.*}} step %[[C8]] iter_args(%{{.*}} = %{{.*}}, %{{.*}} = %{{.*}}, %{{.*}} = %{{.*}}) -> (f32, vector<4xf32>, f32) {
// CHECK:     vector.load %[[X]][%[[T]], %[[J]]] : memref<?x?xbf16>, vector<4xbf16>
// CHECK:     vector.load %[[X]][%[[T]], %{{.*}}] : memref<?x?xbf16>, vector<4xbf16>
// CHECK:     arith.maximumf %{{.*}} : vector<4xf32>
// CHECK:     vector.reduction <maximumf>, %{{.*}} : vector<4xf32> into f32
// CHECK:     math.exp2 %{{.*}} : vector<4xf32>
// CHECK:     math.roundeven
// CHECK:     scf.yield %{{.*}}, %{{.*}}, %{{.*}} : f32, vector<4xf32>, f32
// Whole vectors after the last step, one at a time, on the same state.
// CHECK:   %[[REM:.*]]:3 = scf.for %{{.*}} = %{{.*}} to %{{.*}} step %{{.*}} iter_args(%{{.*}} = %[[MAIN]]#0, %{{.*}} = %[[MAIN]]#1, %{{.*}} = %[[MAIN]]#2) -> (f32, vector<4xf32>, f32) {
// CHECK:     vector.load %[[X]][%[[T]], %{{.*}}] : memref<?x?xbf16>, vector<4xbf16>
// The lanes share the maximum: their partial sums add, then the count.
// CHECK:   %[[LANES:.*]] = vector.reduction <add>, %[[REM]]#1 : vector<4xf32> into f32
// CHECK:   arith.addf %[[LANES]], %[[REM]]#2 : f32
// CHECK:   %[[TAIL:.*]]:2 = scf.for %{{.*}} = %{{.*}} to %{{.*}} step %{{.*}} iter_args({{.*}}) -> (f32, f32) {
// CHECK:     memref.load %[[X]]
// CHECK:   arith.bitcast %{{.*}} : f32 to i32
// CHECK:   memref.store %{{.*}}, %[[L]][%[[T]]] : memref<?xf32>
// CHECK:   memref.store %{{.*}}, %[[E]][%[[T]]] : memref<?xf32>
// CHECK-NOT: ce.forward
func.func @forward(%x: memref<?x?xbf16>, %y: memref<?xi64>, %loss: memref<?xf32>, %lse: memref<?xf32>, %st: memref<1xi64>) {
  ce.forward %x, %y into %loss, %lse status(%st : memref<1xi64>) layout = flat : memref<?x?xbf16>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}

// -----

// Smoothing adds a third lane accumulator (the row sum).

// CHECK-LABEL: func @forward_smoothing
// CHECK: scf.for {{.*}} -> (f32, vector<4xf32>, vector<4xf32>, f32)
// CHECK: vector.reduction <add>
func.func @forward_smoothing(%x: memref<?x?xf32>, %y: memref<?xi64>, %loss: memref<?xf32>, %lse: memref<?xf32>) {
  ce.forward %x, %y into %loss, %lse layout = flat {label_smoothing = 0.1 : f32} : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}

// -----

// [S, B, V] logits with [B, S] labels: the token loops walk s then b, and
// the labels are read at [b, s] in place.

// CHECK-LABEL: func @forward_sbv_bs
// CHECK-SAME: %[[X:[^:]*]]: memref<?x?x?xf16>, %[[Y:[^:]*]]: memref<?x?xi32, strided<[?, ?], offset: ?>>
// CHECK: scf.for %[[S:.*]] = %{{.*}} to %{{.*}} step
// CHECK:   scf.for %[[B:.*]] = %{{.*}} to %{{.*}} step
// CHECK:     memref.load %[[Y]][%[[B]], %[[S]]]
// CHECK:     arith.extsi %{{.*}} : i32 to i64
// CHECK:     vector.load %[[X]][%[[S]], %[[B]], %{{.*}}] : memref<?x?x?xf16>, vector<4xf16>
func.func @forward_sbv_bs(%x: memref<?x?x?xf16>, %y: memref<?x?xi32, strided<[?, ?], offset: ?>>, %loss: memref<?x?xf32>, %lse: memref<?x?xf32>) {
  ce.forward %x, %y into %loss, %lse layout = sbv_bs : memref<?x?x?xf16>, memref<?x?xi32, strided<[?, ?], offset: ?>> into memref<?x?xf32>, memref<?x?xf32>
  return
}

// -----

// Backward with overwrite_input: the gradient sweep stores into the logits
// buffer itself, an ignored token gets a zero row, and the target element
// is written last from expm1 of its log-probability (a Taylor polynomial
// near 0, exp2 beyond).

// CHECK-LABEL: func @backward_overwrite
// CHECK-SAME: %[[X:[^:]*]]: memref<?x?xbf16>, %[[Y:[^:]*]]: memref<?xi64>, %[[E:[^:]*]]: memref<?xf32>, %[[G:[^:]*]]: memref<?xf32>
// CHECK-DAG: %[[IGNORE:.*]] = arith.constant -100 : i64
// CHECK: scf.for %[[T:.*]] = %{{.*}} to %{{.*}} step
// CHECK:   %[[LABEL:.*]] = memref.load %[[Y]][%[[T]]]
// CHECK:   %[[IGNORED:.*]] = arith.cmpi eq, %[[LABEL]], %[[IGNORE]]
// CHECK:   memref.load %[[E]][%[[T]]]
// CHECK:   memref.load %[[G]][%[[T]]]
// CHECK:   scf.if %[[IGNORED]] {
// CHECK:     vector.store %{{.*}}, %[[X]][%[[T]], %{{.*}}] : memref<?x?xbf16>, vector<4xbf16>
// CHECK:   } else {
// CHECK:     scf.for
// CHECK:       vector.load %[[X]][%[[T]], %{{.*}}]
// CHECK:       math.exp2 %{{.*}} : vector<4xf32>
// CHECK:       vector.store %{{.*}}, %[[X]][%[[T]], %{{.*}}] : memref<?x?xbf16>, vector<4xbf16>
// CHECK:     scf.if
// CHECK:       math.fma %{{.*}} : f32
// CHECK:       math.exp2 %{{.*}} : f32
// CHECK:       memref.store %{{.*}}, %[[X]][%[[T]], %{{.*}}] : memref<?x?xbf16>
func.func @backward_overwrite(%x: memref<?x?xbf16>, %y: memref<?xi64>, %lse: memref<?xf32>, %g: memref<?xf32>) {
  ce.backward %x, %y, %lse, %g into %x layout = flat {overwrite_input, ignore_index = -100 : i64} : memref<?x?xbf16>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xbf16>
  return
}

// -----

// Backward into a separate buffer: the logits are only read.

// CHECK-LABEL: func @backward_separate
// CHECK-SAME: %[[X:[^:]*]]: memref<?x?xf32>, %{{[^:]*}}: memref<?xi64>, %{{[^:]*}}: memref<?xf32>, %{{[^:]*}}: memref<?xf32>, %[[DX:[^:]*]]: memref<?x?xf32>
// CHECK-NOT: vector.store %{{.*}}, %[[X]]
// CHECK-NOT: memref.store %{{.*}}, %[[X]]
// CHECK: vector.store %{{.*}}, %[[DX]]
func.func @backward_separate(%x: memref<?x?xf32>, %y: memref<?xi64>, %lse: memref<?xf32>, %g: memref<?xf32>, %dx: memref<?x?xf32>) {
  ce.backward %x, %y, %lse, %g into %dx layout = flat : memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xf32>
  return
}

// -----

// Fused: the statistics sweep, then the gradient sweep over the same row;
// a scalar weight is loaded once, before the token loop.

// CHECK-LABEL: func @fused_scalar
// CHECK-SAME: %[[X:[^:]*]]: memref<?x?xbf16>, %{{[^:]*}}: memref<?xi64>, %[[W:[^:]*]]: memref<f32>
// CHECK: memref.load %[[W]][] : memref<f32>
// CHECK: scf.for
// CHECK:   scf.for {{.*}} -> (f32, vector<4xf32>, f32)
// CHECK:   memref.store
// CHECK:   memref.store
// CHECK:   scf.for
// CHECK:     vector.store %{{.*}}, %[[X]]
func.func @fused_scalar(%x: memref<?x?xbf16>, %y: memref<?xi64>, %w: memref<f32>, %loss: memref<?xf32>, %lse: memref<?xf32>) {
  ce.fused %x, %y, %w into %loss, %lse, %x layout = flat {overwrite_input, z_loss = 1.0e-4 : f32} : memref<?x?xbf16>, memref<?xi64>, memref<f32> into memref<?xf32>, memref<?xf32>, memref<?x?xbf16>
  return
}

// -----

// Run-time flags: bit 0 (Megatron's labels) widens the accepted labels, so
// an out-of-range label is neither reported nor NaN; its shifted target
// logit is 0 (the row maximum) where the label is not in the row.

// CHECK-LABEL: func @forward_flags
// CHECK-SAME: %[[F:[^:]*]]: i64
// CHECK-DAG: %[[ONE:.*]] = arith.constant 1 : i64
// CHECK: %[[BIT:.*]] = arith.andi %[[F]], %[[ONE]] : i64
// CHECK: %[[MEGATRON:.*]] = arith.cmpi ne, %[[BIT]], %{{.*}} : i64
// CHECK: %[[ACCEPTED:.*]] = arith.ori %[[VALID:.*]], %[[MEGATRON]] : i1
// CHECK: %[[NOTACCEPTED:.*]] = arith.xori %[[ACCEPTED]], %{{.*}} : i1
// CHECK: scf.if %[[NOTACCEPTED]] {
// CHECK:   memref.store %{{.*}}, %{{.*}}[%{{.*}}] : memref<1xi64>
// CHECK: arith.select %[[VALID]], %{{.*}}, %{{.*}} : f32
// CHECK: arith.select %[[ACCEPTED]], %{{.*}}, %{{.*}} : f32
func.func @forward_flags(%x: memref<?x?xf32>, %y: memref<?xi64>, %loss: memref<?xf32>, %lse: memref<?xf32>, %st: memref<1xi64>, %flags: i64) {
  ce.forward %x, %y into %loss, %lse status(%st : memref<1xi64>) flags(%flags) layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}
