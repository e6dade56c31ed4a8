// RUN: ce-opt %s | ce-opt | FileCheck %s
// RUN: ce-opt %s --mlir-print-op-generic | ce-opt | FileCheck %s

// CHECK-LABEL: func @forward_sbv_bs
// CHECK-SAME: %[[X:.*]]: memref<?x?x?xbf16>, %[[Y:.*]]: memref<?x?xi64>, %[[L:.*]]: memref<?x?xf32>, %[[E:.*]]: memref<?x?xf32>
func.func @forward_sbv_bs(%x: memref<?x?x?xbf16>, %y: memref<?x?xi64>, %loss: memref<?x?xf32>, %lse: memref<?x?xf32>) {
  // CHECK: ce.forward %[[X]], %[[Y]] into %[[L]], %[[E]] layout = sbv_bs : memref<?x?x?xbf16>, memref<?x?xi64> into memref<?x?xf32>, memref<?x?xf32>
  ce.forward %x, %y into %loss, %lse layout = sbv_bs : memref<?x?x?xbf16>, memref<?x?xi64> into memref<?x?xf32>, memref<?x?xf32>
  return
}

// CHECK-LABEL: func @forward_sbv_sb_static
func.func @forward_sbv_sb_static(%x: memref<4x2x7xf16>, %y: memref<4x2xi32>, %loss: memref<4x2xf32>, %lse: memref<4x2xf32>, %st: memref<1xi64>) {
  // CHECK: ce.forward %{{.*}}, %{{.*}} into %{{.*}}, %{{.*}} status(%{{.*}} : memref<1xi64>) layout = sbv_sb
  // CHECK-SAME: ignore_index = -100 : i64
  // CHECK-SAME: label_smoothing = 1.000000e-01 : f32
  // CHECK-SAME: z_loss = 9.99999974E-5 : f32
  ce.forward %x, %y into %loss, %lse status(%st : memref<1xi64>) layout = sbv_sb {ignore_index = -100 : i64, label_smoothing = 0.1 : f32, z_loss = 1.0e-4 : f32} : memref<4x2x7xf16>, memref<4x2xi32> into memref<4x2xf32>, memref<4x2xf32>
  return
}

// CHECK-LABEL: func @fused_with_flags
// CHECK-SAME: %[[F:[^:]*]]: i64
func.func @fused_with_flags(%x: memref<?x?xbf16>, %y: memref<?xi64>, %w: memref<f32>, %loss: memref<?xf32>, %lse: memref<?xf32>, %st: memref<1xi64>, %flags: i64) {
  // CHECK: ce.fused {{.*}} status(%{{.*}} : memref<1xi64>) flags(%[[F]]) layout = flat {overwrite_input}
  ce.fused %x, %y, %w into %loss, %lse, %x status(%st : memref<1xi64>) flags(%flags) layout = flat {overwrite_input} : memref<?x?xbf16>, memref<?xi64>, memref<f32> into memref<?xf32>, memref<?xf32>, memref<?x?xbf16>
  // CHECK: ce.forward {{.*}} flags(%[[F]]) layout = flat :
  ce.forward %x, %y into %loss, %lse flags(%flags) layout = flat : memref<?x?xbf16>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}

// CHECK-LABEL: func @shard_stats_flat_strided
func.func @shard_stats_flat_strided(%x: memref<?x64xf32, strided<[128, 1], offset: ?>>, %y: memref<?xi64, strided<[?], offset: ?>>, %s: memref<?x4xf32, strided<[?, ?], offset: ?>>, %st: memref<1xi64>) {
  // CHECK: ce.shard_stats %{{.*}}, %{{.*}} into %{{.*}} status(%{{.*}} : memref<1xi64>) layout = flat {shard = #ce.shard<start = 64, vocab = 128>}
  ce.shard_stats %x, %y into %s status(%st : memref<1xi64>) layout = flat {shard = #ce.shard<start = 64, vocab = 128>} : memref<?x64xf32, strided<[128, 1], offset: ?>>, memref<?xi64, strided<[?], offset: ?>> into memref<?x4xf32, strided<[?, ?], offset: ?>>
  return
}

// CHECK-LABEL: func @backward_shard_global_smoothing
func.func @backward_shard_global_smoothing(%x: memref<?x?x?xbf16>, %y: memref<?x?xi64>, %lse: memref<?x?xf32>, %g: memref<?x?xf32>) {
  // A start of 0 is the default and is not printed.
  // CHECK: layout = sbv_bs {label_smoothing = 1.000000e-01 : f32, overwrite_input, shard = #ce.shard<vocab = 256, global_smoothing = true>}
  ce.backward %x, %y, %lse, %g into %x layout = sbv_bs {overwrite_input, label_smoothing = 0.1 : f32, shard = #ce.shard<start = 0, vocab = 256, global_smoothing = true>} : memref<?x?x?xbf16>, memref<?x?xi64>, memref<?x?xf32>, memref<?x?xf32> into memref<?x?x?xbf16>
  return
}

// Option values as run-time operands (bundle format version 3): one kernel
// serves every ignore_index, smoothing and z-loss coefficient, and a shard's
// bounds, given as operands after `flags`.
// CHECK-LABEL: func @forward_runtime_options
// CHECK-SAME: %[[F:[^:]*]]: i64, %[[I:[^:]*]]: i64, %[[A:[^:]*]]: f32, %[[Z:[^:]*]]: f32
func.func @forward_runtime_options(%x: memref<?x?xbf16>, %y: memref<?xi64>, %loss: memref<?xf32>, %lse: memref<?xf32>, %st: memref<1xi64>, %flags: i64, %ignore: i64, %alpha: f32, %z: f32) {
  // CHECK: ce.forward {{.*}} status(%{{.*}} : memref<1xi64>) flags(%[[F]]) ignore_index(%[[I]]) label_smoothing(%[[A]]) z_loss(%[[Z]]) layout = flat : memref<?x?xbf16>
  ce.forward %x, %y into %loss, %lse status(%st : memref<1xi64>) flags(%flags) ignore_index(%ignore) label_smoothing(%alpha) z_loss(%z) layout = flat : memref<?x?xbf16>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  // Each operand on its own, without flags or status.
  // CHECK: ce.forward {{.*}} into %{{.*}}, %{{.*}} ignore_index(%[[I]]) layout = flat :
  ce.forward %x, %y into %loss, %lse ignore_index(%ignore) layout = flat : memref<?x?xbf16>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  // CHECK: ce.forward {{.*}} into %{{.*}}, %{{.*}} z_loss(%[[Z]]) layout = flat {ignore_index = -100 : i64, label_smoothing = 1.000000e-01 : f32} :
  ce.forward %x, %y into %loss, %lse z_loss(%z) layout = flat {ignore_index = -100 : i64, label_smoothing = 0.1 : f32} : memref<?x?xbf16>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}

// CHECK-LABEL: func @fused_runtime_options
// CHECK-SAME: %[[A:[^:]*]]: f32, %[[Z:[^:]*]]: f32
func.func @fused_runtime_options(%x: memref<?x?x?xf32>, %y: memref<?x?xi32>, %w: memref<?x?xf32>, %loss: memref<?x?xf32>, %lse: memref<?x?xf32>, %st: memref<1xi64>, %alpha: f32, %z: f32) {
  // CHECK: ce.fused {{.*}} status(%{{.*}} : memref<1xi64>) label_smoothing(%[[A]]) z_loss(%[[Z]]) layout = sbv_sb {overwrite_input} :
  ce.fused %x, %y, %w into %loss, %lse, %x status(%st : memref<1xi64>) label_smoothing(%alpha) z_loss(%z) layout = sbv_sb {overwrite_input} : memref<?x?x?xf32>, memref<?x?xi32>, memref<?x?xf32> into memref<?x?xf32>, memref<?x?xf32>, memref<?x?x?xf32>
  return
}

// A shard whose bounds are run-time operands: `#ce.shard<>` (or with only
// global_smoothing) and `shard_bounds(%start, %vocab)`.
// CHECK-LABEL: func @shard_runtime_bounds
// CHECK-SAME: %[[F:[^:]*]]: i64, %[[I:[^:]*]]: i64, %[[A:[^:]*]]: f32, %[[S:[^:]*]]: i64, %[[V:[^:]*]]: i64
func.func @shard_runtime_bounds(%x: memref<?x?x?xbf16>, %y: memref<?x?xi64>, %lse: memref<?x?xf32>, %g: memref<?x?xf32>, %stats: memref<?x?x4xf32>, %st: memref<1xi64>, %flags: i64, %ignore: i64, %alpha: f32, %start: i64, %vocab: i64) {
  // CHECK: ce.shard_stats {{.*}} status(%{{.*}} : memref<1xi64>) flags(%[[F]]) ignore_index(%[[I]]) label_smoothing(%[[A]]) shard_bounds(%[[S]], %[[V]]) layout = sbv_bs {shard = #ce.shard<>} :
  ce.shard_stats %x, %y into %stats status(%st : memref<1xi64>) flags(%flags) ignore_index(%ignore) label_smoothing(%alpha) shard_bounds(%start, %vocab) layout = sbv_bs {shard = #ce.shard<>} : memref<?x?x?xbf16>, memref<?x?xi64> into memref<?x?x4xf32>
  // CHECK: ce.backward {{.*}} into %{{.*}} status(%{{.*}} : memref<1xi64>) flags(%[[F]]) ignore_index(%[[I]]) label_smoothing(%[[A]]) shard_bounds(%[[S]], %[[V]]) layout = sbv_bs {overwrite_input, shard = #ce.shard<global_smoothing = true>} :
  ce.backward %x, %y, %lse, %g into %x status(%st : memref<1xi64>) flags(%flags) ignore_index(%ignore) label_smoothing(%alpha) shard_bounds(%start, %vocab) layout = sbv_bs {overwrite_input, shard = #ce.shard<global_smoothing = true>} : memref<?x?x?xbf16>, memref<?x?xi64>, memref<?x?xf32>, memref<?x?xf32> into memref<?x?x?xbf16>
  return
}

// The logit scale, a run-time f32 on every op, printed after shard_bounds.
// CHECK-LABEL: func @logit_scale
// CHECK-SAME: %[[SC:[^:]*]]: f32, %[[S:[^:]*]]: i64, %[[V:[^:]*]]: i64
func.func @logit_scale(%x: memref<?x?xbf16>, %y: memref<?xi64>, %w: memref<?xf32>, %loss: memref<?xf32>, %lse: memref<?xf32>, %low: memref<?xf32>, %g: memref<?xf32>, %dx: memref<?x?xbf16>, %stats: memref<?x4xf32>, %scale: f32, %start: i64, %vocab: i64) {
  // CHECK: ce.forward {{.*}} lse_low(%{{.*}} : memref<?xf32>) logit_scale(%[[SC]]) layout = flat :
  ce.forward %x, %y into %loss, %lse lse_low(%low : memref<?xf32>) logit_scale(%scale) layout = flat : memref<?x?xbf16>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  // CHECK: ce.backward {{.*}} into %{{.*}} lse_low(%{{.*}} : memref<?xf32>) shard_bounds(%[[S]], %[[V]]) logit_scale(%[[SC]]) layout = flat {shard = #ce.shard<>} :
  ce.backward %x, %y, %lse, %g into %dx lse_low(%low : memref<?xf32>) shard_bounds(%start, %vocab) logit_scale(%scale) layout = flat {shard = #ce.shard<>} : memref<?x?xbf16>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xbf16>
  // CHECK: ce.fused {{.*}} logit_scale(%[[SC]]) layout = flat {overwrite_input} :
  ce.fused %x, %y, %w into %loss, %lse, %x logit_scale(%scale) layout = flat {overwrite_input} : memref<?x?xbf16>, memref<?xi64>, memref<?xf32> into memref<?xf32>, memref<?xf32>, memref<?x?xbf16>
  // CHECK: ce.shard_stats {{.*}} shard_bounds(%[[S]], %[[V]]) logit_scale(%[[SC]]) layout = flat {shard = #ce.shard<>} :
  ce.shard_stats %x, %y into %stats shard_bounds(%start, %vocab) logit_scale(%scale) layout = flat {shard = #ce.shard<>} : memref<?x?xbf16>, memref<?xi64> into memref<?x4xf32>
  return
}

// The logit softcap, a run-time f32, printed after the logit scale.
// CHECK-LABEL: func @logit_softcap
// CHECK-SAME: %[[SC:[^:]*]]: f32, %[[CAP:[^:]*]]: f32, %[[S:[^:]*]]: i64, %[[V:[^:]*]]: i64
func.func @logit_softcap(%x: memref<?x?xbf16>, %y: memref<?xi64>, %w: memref<?xf32>, %loss: memref<?xf32>, %lse: memref<?xf32>, %g: memref<?xf32>, %dx: memref<?x?xbf16>, %stats: memref<?x4xf32>, %scale: f32, %cap: f32, %start: i64, %vocab: i64) {
  // CHECK: ce.forward {{.*}} logit_scale(%[[SC]]) logit_softcap(%[[CAP]]) layout = flat :
  ce.forward %x, %y into %loss, %lse logit_scale(%scale) logit_softcap(%cap) layout = flat : memref<?x?xbf16>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  // CHECK: ce.backward {{.*}} shard_bounds(%[[S]], %[[V]]) logit_softcap(%[[CAP]]) layout = flat {shard = #ce.shard<>} :
  ce.backward %x, %y, %lse, %g into %dx shard_bounds(%start, %vocab) logit_softcap(%cap) layout = flat {shard = #ce.shard<>} : memref<?x?xbf16>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xbf16>
  // CHECK: ce.fused {{.*}} logit_softcap(%[[CAP]]) layout = flat {overwrite_input} :
  ce.fused %x, %y, %w into %loss, %lse, %x logit_softcap(%cap) layout = flat {overwrite_input} : memref<?x?xbf16>, memref<?xi64>, memref<?xf32> into memref<?xf32>, memref<?xf32>, memref<?x?xbf16>
  // CHECK: ce.shard_stats {{.*}} logit_scale(%[[SC]]) logit_softcap(%[[CAP]]) layout = flat {shard = #ce.shard<>} :
  ce.shard_stats %x, %y into %stats shard_bounds(%start, %vocab) logit_scale(%scale) logit_softcap(%cap) layout = flat {shard = #ce.shard<>} : memref<?x?xbf16>, memref<?xi64> into memref<?x4xf32>
  return
}

// CHECK-LABEL: func @backward_overwrite
// CHECK-SAME: %[[X:.*]]: memref<?x?x?xbf16>
func.func @backward_overwrite(%x: memref<?x?x?xbf16>, %y: memref<?x?xi64>, %lse: memref<?x?xf32>, %g: memref<?x?xf32, strided<[0, 0]>>) {
  // CHECK: ce.backward %[[X]], %{{.*}}, %{{.*}}, %{{.*}} into %[[X]] layout = sbv_bs {overwrite_input}
  ce.backward %x, %y, %lse, %g into %x layout = sbv_bs {overwrite_input} : memref<?x?x?xbf16>, memref<?x?xi64>, memref<?x?xf32>, memref<?x?xf32, strided<[0, 0]>> into memref<?x?x?xbf16>
  return
}

// CHECK-LABEL: func @backward_separate_grad
// CHECK-SAME: %[[X:.*]]: memref<?x?xf32>, %{{.*}}: memref<?xi32>, %{{.*}}: memref<?xf32>, %{{.*}}: memref<?xf32>, %[[G:.*]]: memref<?x?xf32>
func.func @backward_separate_grad(%x: memref<?x?xf32>, %y: memref<?xi32>, %lse: memref<?xf32>, %g: memref<?xf32>, %dx: memref<?x?xf32>, %st: memref<1xi64>) {
  // CHECK: ce.backward %[[X]], {{.*}} into %[[G]] status({{.*}}) layout = flat {ignore_index = 0 : i64}
  ce.backward %x, %y, %lse, %g into %dx status(%st : memref<1xi64>) layout = flat {ignore_index = 0 : i64} : memref<?x?xf32>, memref<?xi32>, memref<?xf32>, memref<?xf32> into memref<?x?xf32>
  return
}

// CHECK-LABEL: func @fused_scalar_weight
func.func @fused_scalar_weight(%x: memref<?x?xbf16>, %y: memref<?xi64>, %w: memref<f32>, %loss: memref<?xf32>, %lse: memref<?xf32>) {
  // CHECK: ce.fused {{.*}} layout = flat {overwrite_input, z_loss = 9.99999974E-5 : f32} : memref<?x?xbf16>, memref<?xi64>, memref<f32> into memref<?xf32>, memref<?xf32>, memref<?x?xbf16>
  ce.fused %x, %y, %w into %loss, %lse, %x layout = flat {overwrite_input, z_loss = 1.0e-4 : f32} : memref<?x?xbf16>, memref<?xi64>, memref<f32> into memref<?xf32>, memref<?xf32>, memref<?x?xbf16>
  return
}

// CHECK-LABEL: func @fused_token_weights
func.func @fused_token_weights(%x: memref<?x?x?xf32>, %y: memref<?x?xi64>, %w: memref<?x?xf32>, %loss: memref<?x?xf32>, %lse: memref<?x?xf32>, %dx: memref<?x?x?xf32>) {
  // CHECK: ce.fused {{.*}} layout = sbv_sb {label_smoothing = 5.000000e-02 : f32}
  ce.fused %x, %y, %w into %loss, %lse, %dx layout = sbv_sb {label_smoothing = 0.05 : f32} : memref<?x?x?xf32>, memref<?x?xi64>, memref<?x?xf32> into memref<?x?xf32>, memref<?x?xf32>, memref<?x?x?xf32>
  return
}

// CHECK-LABEL: func @layout_attr_forms
// (Held by an attribute of no registered dialect: `ce.tuning` is the ce
// dialect's only discardable attribute.)
func.func @layout_attr_forms() attributes {test.layouts = [#ce<layout flat>, #ce<layout sbv_bs>, #ce<layout sbv_sb>], test.shard = #ce.shard<start = 0, vocab = 1>, test.shards = [#ce.shard<start = 3, vocab = 9>, #ce.shard<>, #ce.shard<start = 0, vocab = 0, global_smoothing = true>]} {
  // CHECK: test.layouts = [#ce<layout flat>, #ce<layout sbv_bs>, #ce<layout sbv_sb>]
  // CHECK-SAME: test.shard = #ce.shard<vocab = 1>
  // CHECK-SAME: test.shards = [#ce.shard<start = 3, vocab = 9>, #ce.shard<>, #ce.shard<global_smoothing = true>]
  return
}

// The entropy and argmax outputs of ce.forward and ce.fused (optional,
// printed after lse_low).
// CHECK-LABEL: func @outputs
// CHECK-SAME: %[[H:[^:]*]]: memref<?xf32>, %[[A:[^:]*]]: memref<?xi64>
func.func @outputs(%x: memref<?x?xbf16>, %y: memref<?xi64>, %w: memref<?xf32>, %loss: memref<?xf32>, %lse: memref<?xf32>, %low: memref<?xf32>, %h: memref<?xf32>, %a: memref<?xi64>, %flags: i64) {
  // CHECK: ce.forward {{.*}} lse_low(%{{.*}} : memref<?xf32>) entropy(%[[H]] : memref<?xf32>) argmax(%[[A]] : memref<?xi64>) flags(%{{.*}}) layout = flat :
  ce.forward %x, %y into %loss, %lse lse_low(%low : memref<?xf32>) entropy(%h : memref<?xf32>) argmax(%a : memref<?xi64>) flags(%flags) layout = flat : memref<?x?xbf16>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  // CHECK: ce.fused {{.*}} argmax(%[[A]] : memref<?xi64>) layout = flat {overwrite_input} :
  ce.fused %x, %y, %w into %loss, %lse, %x argmax(%a : memref<?xi64>) layout = flat {overwrite_input} : memref<?x?xbf16>, memref<?xi64>, memref<?xf32> into memref<?xf32>, memref<?xf32>, memref<?x?xbf16>
  return
}
