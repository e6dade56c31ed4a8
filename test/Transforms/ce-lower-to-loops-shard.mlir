// RUN: ce-opt %s --ce-lower-to-loops --canonicalize | FileCheck %s

// A vocabulary slice [64, 128) of 192 ids. Labels are global: valid in
// [0, 192), in this row when label - 64 lies in [0, 64); the target logit
// is gathered from that column only then. The four partial statistics are
// stored per token: max, rest (sum of exp - 1), target (NaN for a bad
// label, 0 when ignored) and the row sum (smoothing asks for it).

// CHECK-LABEL: func.func @stats
// CHECK-DAG: %[[NAN:.*]] = arith.constant 0x7FC00000 : f32
// CHECK-DAG: %[[ZERO:.*]] = arith.constant 0.000000e+00 : f32
// CHECK-DAG: %[[START:.*]] = arith.constant 64 : i64
// CHECK-DAG: %[[VOCAB:.*]] = arith.constant 192 : i64
// CHECK-DAG: %[[IGNORE:.*]] = arith.constant -100 : i64
// CHECK: scf.for %[[T:.*]] = %{{.*}} to %{{.*}} step
// CHECK: %[[LABEL:.*]] = memref.load %arg1[%[[T]]]
// CHECK: %[[BELOW:.*]] = arith.cmpi slt, %[[LABEL]], %[[VOCAB]]
// CHECK: %[[VALID:.*]] = arith.andi %{{.*}}, %[[BELOW]] : i1
// CHECK: %[[COLUMN:.*]] = arith.subi %[[LABEL]], %[[START]]
// CHECK: %[[INROW:.*]] = arith.andi %[[VALID]], %{{.*}} : i1
// CHECK: %[[IGNORED:.*]] = arith.cmpi eq, %[[LABEL]], %[[IGNORE]]
// CHECK: %[[TARGET:.*]] = scf.if %[[INROW]] -> (f32) {
// CHECK:   %[[COL:.*]] = arith.index_cast %[[COLUMN]] : i64 to index
// CHECK:   memref.load %arg0[%[[T]], %[[COL]]]
// CHECK: } else {
// CHECK:   scf.yield %[[ZERO]]
// CHECK: memref.store %{{.*}}, %arg3[
// CHECK: %[[CHECKED:.*]] = arith.select %[[VALID]], %[[TARGET]], %[[NAN]] : f32
// CHECK: %[[STAT2:.*]] = arith.select %[[IGNORED]], %[[ZERO]], %[[CHECKED]] : f32
// CHECK: memref.store %{{.*}}, %arg2[%[[T]], %c0]
// CHECK: memref.store %{{.*}}, %arg2[%[[T]], %c1]
// CHECK: memref.store %[[STAT2]], %arg2[%[[T]], %c2]
// CHECK: memref.store %{{.*}}, %arg2[%[[T]], %c3]
func.func @stats(%x: memref<?x64xf32>, %y: memref<?xi64>, %s: memref<?x4xf32>, %st: memref<1xi64>) {
  ce.shard_stats %x, %y into %s status(%st : memref<1xi64>) layout = flat {ignore_index = -100 : i64, label_smoothing = 0.1 : f32, shard = #ce.shard<start = 64, vocab = 192>} : memref<?x64xf32>, memref<?xi64> into memref<?x4xf32>
  return
}

// The sharded backward rewrites the target element only when the label is
// in this row. With global smoothing s = alpha V / (V - 1) over V = 192,
// and the target's s - s/V folds to alpha exactly.

// CHECK-LABEL: func.func @backward
// CHECK-DAG: %[[ALPHA:.*]] = arith.constant 1.000000e-01 : f32
// CHECK-DAG: arith.constant 5.23560215E-4 : f32
// CHECK: %[[VALID:.*]] = arith.andi %{{.*}}, %{{.*}} : i1
// CHECK: %[[INROW:.*]] = arith.andi %[[VALID]], %{{.*}} : i1
// CHECK: scf.if %[[INROW]] -> (f32)
// CHECK: scf.for
// CHECK: vector.store
// CHECK: scf.if %[[INROW]] {
// CHECK: arith.addf %{{.*}}, %[[ALPHA]] : f32
// CHECK: memref.store %{{.*}}, %arg0[
func.func @backward(%x: memref<?x64xf32>, %y: memref<?xi64>, %lse: memref<?xf32>, %g: memref<?xf32>) {
  ce.backward %x, %y, %lse, %g into %x layout = flat {overwrite_input, label_smoothing = 0.1 : f32, shard = #ce.shard<start = 64, vocab = 192, global_smoothing = true>} : memref<?x64xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x64xf32>
  return
}

// Megatron's (local) smoothing uses V_local = 64: s / V = 0.1 / 63 for
// every element (global smoothing would give 0.1 / 191).

// CHECK-LABEL: func.func @backward_local
// CHECK: arith.constant 0.00158730161 : f32
func.func @backward_local(%x: memref<?x64xf32>, %y: memref<?xi64>, %lse: memref<?xf32>, %g: memref<?xf32>, %d: memref<?x64xf32>) {
  ce.backward %x, %y, %lse, %g into %d layout = flat {label_smoothing = 0.1 : f32, shard = #ce.shard<start = 0, vocab = 192>} : memref<?x64xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x64xf32>
  return
}
