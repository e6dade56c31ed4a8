// RUN: ce-opt %s --ce-lower-to-loops --canonicalize --split-input-file | FileCheck %s

// Option values as run-time operands (bundle format version 3): the
// lowering reads them where it would otherwise use the attributes'
// constants. A slice's bounds: labels are valid below the global
// vocabulary and sit in this row at label - start; the ignore_index operand
// is in force only with flag bit 1 (kFlagIgnoreIndex), Megatron's label
// contract with bit 0.

// CHECK-LABEL: func.func @stats_runtime_bounds
// CHECK-SAME: %[[FLAGS:[^:]*]]: i64, %[[IGNORE:[^:]*]]: i64, %[[START:[^:]*]]: i64, %[[VOCAB:[^:]*]]: i64)
// CHECK-DAG: %[[C1:.*]] = arith.constant 1 : i64
// CHECK-DAG: %[[C2:.*]] = arith.constant 2 : i64
// CHECK: scf.for %[[T:.*]] = %{{.*}} to %{{.*}} step
// CHECK: %[[LABEL:.*]] = memref.load %arg1[%[[T]]]
// CHECK: arith.cmpi slt, %[[LABEL]], %[[VOCAB]] : i64
// CHECK: %[[COLUMN:.*]] = arith.subi %[[LABEL]], %[[START]] : i64
// CHECK: %[[MEGATRON:.*]] = arith.andi %[[FLAGS]], %[[C1]] : i64
// CHECK: %[[SAME:.*]] = arith.cmpi eq, %[[LABEL]], %[[IGNORE]] : i64
// CHECK: %[[BIT:.*]] = arith.andi %[[FLAGS]], %[[C2]] : i64
// CHECK: %[[INFORCE:.*]] = arith.cmpi ne, %[[BIT]], %{{.*}} : i64
// CHECK: arith.andi %[[INFORCE]], %[[SAME]] : i1
// CHECK: arith.index_cast %[[COLUMN]] : i64 to index
// CHECK-NOT: ce.shard_stats
func.func @stats_runtime_bounds(%x: memref<?x64xf32>, %y: memref<?xi64>, %s: memref<?x4xf32>, %st: memref<1xi64>, %flags: i64, %ignore: i64, %start: i64, %vocab: i64) {
  ce.shard_stats %x, %y into %s status(%st : memref<1xi64>) flags(%flags) ignore_index(%ignore) shard_bounds(%start, %vocab) layout = flat {shard = #ce.shard<>} : memref<?x64xf32>, memref<?xi64> into memref<?x4xf32>
  return
}

// -----

// Without flags the ignore_index operand is never in force: it is not read.

// CHECK-LABEL: func.func @ignore_without_flags
// CHECK-SAME: %[[IGNORE:[^:]*]]: i64)
// CHECK-NOT: %[[IGNORE]]
// CHECK: return
func.func @ignore_without_flags(%x: memref<?x?xf32>, %y: memref<?xi64>, %loss: memref<?xf32>, %lse: memref<?xf32>, %ignore: i64) {
  ce.forward %x, %y into %loss, %lse ignore_index(%ignore) layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}

// -----

// The smoothing coefficient scales into s = alpha V / (V - 1); the z-loss
// coefficient multiplies lse^2.

// CHECK-LABEL: func.func @forward_runtime_coefficients
// CHECK-SAME: %[[ALPHA:[^:]*]]: f32, %[[Z:[^:]*]]: f32)
// CHECK: %[[V:.*]] = arith.uitofp %{{.*}} : i64 to f32
// CHECK: arith.mulf %[[ALPHA]], %[[V]] : f32
// CHECK: scf.for
// CHECK: arith.mulf %[[Z]], %{{.*}} : f32
func.func @forward_runtime_coefficients(%x: memref<?x?xf32>, %y: memref<?xi64>, %loss: memref<?xf32>, %lse: memref<?xf32>, %alpha: f32, %z: f32) {
  ce.forward %x, %y into %loss, %lse label_smoothing(%alpha) z_loss(%z) layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}

// -----

// Global smoothing over a run-time vocabulary: V is the shard_vocab
// operand, and "more than one class" is decided at run time.

// CHECK-LABEL: func.func @backward_global_runtime_vocab
// CHECK-SAME: %[[ALPHA:[^:]*]]: f32, %[[START:[^:]*]]: i64, %[[VOCAB:[^:]*]]: i64)
// CHECK: %[[V:.*]] = arith.sitofp %[[VOCAB]] : i64 to f32
// CHECK: arith.cmpi sgt, %[[VOCAB]], %{{.*}} : i64
// CHECK: arith.mulf %[[ALPHA]], %[[V]] : f32
// CHECK: scf.for
// CHECK: arith.subi %{{.*}}, %[[START]] : i64
func.func @backward_global_runtime_vocab(%x: memref<?x?xf32>, %y: memref<?xi64>, %lse: memref<?xf32>, %g: memref<?xf32>, %alpha: f32, %start: i64, %vocab: i64) {
  ce.backward %x, %y, %lse, %g into %x label_smoothing(%alpha) shard_bounds(%start, %vocab) layout = flat {overwrite_input, shard = #ce.shard<global_smoothing = true>} : memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xf32>
  return
}

// -----

// ABI v3: how a slice smooths is run-time flag bit 4 (kFlagGlobalSmoothing)
// under a plain #ce.shard<>: the smoothing vocabulary and "more than one
// class" are selected between the global vocabulary (shard_vocab) and the
// slice's own V by (flags & 4) != 0.

// CHECK-LABEL: func.func @backward_flag_global_smoothing
// CHECK-SAME: %[[FLAGS:[^:]*]]: i64, %{{[^:]*}}: i64, %[[ALPHA:[^:]*]]: f32, %[[START:[^:]*]]: i64, %[[VOCAB:[^:]*]]: i64)
// CHECK-DAG: %[[C4:.*]] = arith.constant 4 : i64
// CHECK-DAG: %[[C0:.*]] = arith.constant 0 : i64
// CHECK: %[[LOCALV:.*]] = arith.uitofp %{{.*}} : i64 to f32
// CHECK: %[[BIT:.*]] = arith.andi %[[FLAGS]], %[[C4]] : i64
// CHECK: %[[GLOBAL:.*]] = arith.cmpi ne, %[[BIT]], %[[C0]] : i64
// CHECK: %[[GLOBALV:.*]] = arith.sitofp %[[VOCAB]] : i64 to f32
// CHECK: %[[V:.*]] = arith.select %[[GLOBAL]], %[[GLOBALV]], %[[LOCALV]] : f32
// CHECK: arith.cmpi sgt, %[[VOCAB]], %{{.*}} : i64
// CHECK: arith.select %[[GLOBAL]], %{{.*}}, %{{.*}} : i1
// CHECK: arith.mulf %[[ALPHA]], %[[V]] : f32
// CHECK: scf.for
// CHECK: arith.subi %{{.*}}, %[[START]] : i64
func.func @backward_flag_global_smoothing(%x: memref<?x?xf32>, %y: memref<?xi64>, %lse: memref<?xf32>, %g: memref<?xf32>, %st: memref<1xi64>, %flags: i64, %ignore: i64, %alpha: f32, %start: i64, %vocab: i64) {
  ce.backward %x, %y, %lse, %g into %x status(%st : memref<1xi64>) flags(%flags) ignore_index(%ignore) label_smoothing(%alpha) shard_bounds(%start, %vocab) layout = flat {overwrite_input, shard = #ce.shard<>} : memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xf32>
  return
}

// -----

// Without flags (a kernel not for a bundle) a plain #ce.shard<> smooths over
// the slice: no flag bit is read.

// CHECK-LABEL: func.func @backward_local_without_flags
// CHECK-NOT: arith.constant 4 : i64
// CHECK-NOT: arith.sitofp
// CHECK: scf.for
func.func @backward_local_without_flags(%x: memref<?x?xf32>, %y: memref<?xi64>, %lse: memref<?xf32>, %g: memref<?xf32>, %alpha: f32, %start: i64, %vocab: i64) {
  ce.backward %x, %y, %lse, %g into %x label_smoothing(%alpha) shard_bounds(%start, %vocab) layout = flat {overwrite_input, shard = #ce.shard<>} : memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xf32>
  return
}
