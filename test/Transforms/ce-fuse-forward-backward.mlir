// RUN: ce-opt %s --ce-fuse-forward-backward --split-input-file -verify-diagnostics | FileCheck %s

// Fusion fires: the upstream gradient exists before the forward, and the
// backward writes the gradient over the logits.

// CHECK-LABEL: func @fuse_overwrite
// CHECK-SAME: %[[X:[^:]*]]: memref<?x?xbf16>, %[[Y:[^:]*]]: memref<?xi64>, %[[G:[^:]*]]: memref<?xf32>, %[[L:[^:]*]]: memref<?xf32>, %[[E:[^:]*]]: memref<?xf32>
// CHECK-NEXT: ce.fused %[[X]], %[[Y]], %[[G]] into %[[L]], %[[E]], %[[X]] layout = flat {ignore_index = -100 : i64, overwrite_input}
// CHECK-NOT: ce.forward
// CHECK-NOT: ce.backward
func.func @fuse_overwrite(%x: memref<?x?xbf16>, %y: memref<?xi64>, %g: memref<?xf32>, %loss: memref<?xf32>, %lse: memref<?xf32>) {
  ce.forward %x, %y into %loss, %lse layout = flat {ignore_index = -100 : i64} : memref<?x?xbf16>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  ce.backward %x, %y, %lse, %g into %x layout = flat {overwrite_input, ignore_index = -100 : i64} : memref<?x?xbf16>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xbf16>
  return
}

// -----

// An upstream gradient allocated before the forward also fuses; the
// forward's status buffer is kept.

// CHECK-LABEL: func @fuse_allocated_gradient
// CHECK: %[[W:.*]] = memref.alloc(%{{.*}}, %{{.*}}) : memref<?x?xf32>
// CHECK: ce.fused %{{.*}}, %{{.*}}, %[[W]] into %{{.*}}, %{{.*}}, %{{.*}} status(%{{.*}} : memref<1xi64>) layout = sbv_bs {label_smoothing = 1.000000e-01 : f32}
func.func @fuse_allocated_gradient(%x: memref<?x?x?xf32>, %y: memref<?x?xi64>, %loss: memref<?x?xf32>, %lse: memref<?x?xf32>, %dx: memref<?x?x?xf32>, %st: memref<1xi64>, %b: index, %s: index) {
  %w = memref.alloc(%b, %s) : memref<?x?xf32>
  ce.forward %x, %y into %loss, %lse status(%st : memref<1xi64>) layout = sbv_bs {label_smoothing = 0.1 : f32} : memref<?x?x?xf32>, memref<?x?xi64> into memref<?x?xf32>, memref<?x?xf32>
  ce.backward %x, %y, %lse, %w into %dx layout = sbv_bs {label_smoothing = 0.1 : f32} : memref<?x?x?xf32>, memref<?x?xi64>, memref<?x?xf32>, memref<?x?xf32> into memref<?x?x?xf32>
  return
}

// -----

// Not fused: the upstream gradient is made after the forward.

// CHECK-LABEL: func @gradient_defined_after_forward
// CHECK: ce.forward
// CHECK: ce.backward
func.func @gradient_defined_after_forward(%x: memref<?x?xf32>, %y: memref<?xi64>, %loss: memref<?xf32>, %lse: memref<?xf32>, %dx: memref<?x?xf32>, %n: index) {
  ce.forward %x, %y into %loss, %lse layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  %g = memref.alloc(%n) : memref<?xf32>
  // expected-remark @+1 {{not fused: the upstream gradient is defined after the forward}}
  ce.backward %x, %y, %lse, %g into %dx layout = flat : memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xf32>
  return
}

// -----

// Not fused: something between them writes the upstream gradient.

// CHECK-LABEL: func @gradient_written_between
// CHECK: ce.forward
// CHECK: memref.store
// CHECK: ce.backward
func.func @gradient_written_between(%x: memref<?x?xf32>, %y: memref<?xi64>, %g: memref<?xf32>, %loss: memref<?xf32>, %lse: memref<?xf32>, %dx: memref<?x?xf32>, %v: f32, %i: index) {
  ce.forward %x, %y into %loss, %lse layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  memref.store %v, %g[%i] : memref<?xf32>
  // expected-remark @+1 {{not fused: an operation between forward and backward may write a buffer the fused op reads or writes ('memref.store')}}
  ce.backward %x, %y, %lse, %g into %dx layout = flat : memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xf32>
  return
}

// -----

// Not fused: under overwrite_input, an op between them reads the logits,
// which the fused op would already have overwritten.

// CHECK-LABEL: func @logits_read_between
// CHECK: ce.forward
// CHECK: memref.load
// CHECK: ce.backward
func.func @logits_read_between(%x: memref<?x?xf32>, %y: memref<?xi64>, %g: memref<?xf32>, %loss: memref<?xf32>, %lse: memref<?xf32>, %i: index) -> f32 {
  ce.forward %x, %y into %loss, %lse layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  %v = memref.load %x[%i, %i] : memref<?x?xf32>
  // expected-remark @+1 {{not fused: an operation between forward and backward reads the gradient buffer before the backward writes it ('memref.load')}}
  ce.backward %x, %y, %lse, %g into %x layout = flat {overwrite_input} : memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xf32>
  return %v : f32
}

// -----

// Not fused: other labels, or another configuration.

// CHECK-LABEL: func @mismatches
func.func @mismatches(%x: memref<?x?xf32>, %y: memref<?xi64>, %y2: memref<?xi64>, %g: memref<?xf32>, %loss: memref<?xf32>, %lse: memref<?xf32>, %dx: memref<?x?xf32>) {
  ce.forward %x, %y into %loss, %lse layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  // expected-remark @+1 {{not fused: the backward reads other labels than the forward}}
  ce.backward %x, %y2, %lse, %g into %dx layout = flat : memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xf32>
  // expected-remark @+1 {{not fused: forward and backward differ in layout, ignore_index, smoothing, z-loss or shard}}
  ce.backward %x, %y, %lse, %g into %dx layout = flat {z_loss = 1.0e-4 : f32} : memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xf32>
  return
}

// -----

// Not fused: the backward's run-time flags are not the forward's.

func.func @different_flags(%x: memref<?x?xf32>, %y: memref<?xi64>, %g: memref<?xf32>, %loss: memref<?xf32>, %lse: memref<?xf32>, %dx: memref<?x?xf32>, %f: i64, %f2: i64) {
  ce.forward %x, %y into %loss, %lse flags(%f) layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  // expected-remark @+1 {{not fused: forward and backward take different run-time flags}}
  ce.backward %x, %y, %lse, %g into %dx flags(%f2) layout = flat : memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xf32>
  return
}

// -----

// Not fused: the backward's logit scale is not the forward's (absent is 1,
// another value).

func.func @different_logit_scale(%x: memref<?x?xf32>, %y: memref<?xi64>, %g: memref<?xf32>, %loss: memref<?xf32>, %lse: memref<?xf32>, %dx: memref<?x?xf32>, %s: f32) {
  ce.forward %x, %y into %loss, %lse logit_scale(%s) layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  // expected-remark @+1 {{not fused: forward and backward take different logit scales}}
  ce.backward %x, %y, %lse, %g into %dx layout = flat : memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xf32>
  return
}

// -----

// Fused with the logit scale both ops take: the fused op carries it.

// CHECK-LABEL: func @same_logit_scale
// CHECK-SAME: %[[S:[^:]*]]: f32
// CHECK: ce.fused {{.*}} logit_scale(%[[S]]) layout = flat
func.func @same_logit_scale(%x: memref<?x?xf32>, %y: memref<?xi64>, %g: memref<?xf32>, %loss: memref<?xf32>, %lse: memref<?xf32>, %dx: memref<?x?xf32>, %s: f32) {
  ce.forward %x, %y into %loss, %lse logit_scale(%s) layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  ce.backward %x, %y, %lse, %g into %dx logit_scale(%s) layout = flat : memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xf32>
  return
}

// -----

// Fused with the flags both ops take.

// CHECK-LABEL: func @same_flags
// CHECK-SAME: %[[F:[^:]*]]: i64
// CHECK: ce.fused {{.*}} flags(%[[F]]) layout = flat
func.func @same_flags(%x: memref<?x?xf32>, %y: memref<?xi64>, %g: memref<?xf32>, %loss: memref<?xf32>, %lse: memref<?xf32>, %dx: memref<?x?xf32>, %f: i64) {
  ce.forward %x, %y into %loss, %lse flags(%f) layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  ce.backward %x, %y, %lse, %g into %dx flags(%f) layout = flat : memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xf32>
  return
}

// -----

// Not fused (and the IR stays valid): the upstream gradient is the forward's
// own loss or lse buffer, which the fused op would write while reading it.

func.func @gradient_is_forward_output(%x: memref<?x?xf32>, %y: memref<?xi64>, %loss: memref<?xf32>, %lse: memref<?xf32>, %dx: memref<?x?xf32>) {
  ce.forward %x, %y into %loss, %lse layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  // expected-remark @+1 {{not fused: the upstream gradient is the forward's own loss buffer, which the fused op writes}}
  ce.backward %x, %y, %lse, %loss into %dx layout = flat : memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xf32>
  return
}

func.func @gradient_is_forward_lse(%x: memref<?x?xf32>, %y: memref<?xi64>, %loss: memref<?xf32>, %lse: memref<?xf32>, %dx: memref<?x?xf32>) {
  ce.forward %x, %y into %loss, %lse layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  // expected-remark @+1 {{not fused: the upstream gradient is the forward's own lse buffer, which the fused op writes}}
  ce.backward %x, %y, %lse, %lse into %dx layout = flat : memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xf32>
  return
}

// -----

// Not fused: no forward writes the lse.

func.func @no_forward(%x: memref<?x?xf32>, %y: memref<?xi64>, %g: memref<?xf32>, %lse: memref<?xf32>, %dx: memref<?x?xf32>) {
  // expected-remark @+1 {{not fused: no ce.forward in this block writes the backward's lse}}
  ce.backward %x, %y, %lse, %g into %dx layout = flat : memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xf32>
  return
}

// -----

// The forward's entropy and argmax outputs go to the fused op, which
// writes them from its statistics.

// CHECK-LABEL: func @fuse_outputs
// CHECK-SAME: %[[H:[^:]*]]: memref<?xf32>, %[[A:[^:]*]]: memref<?xi64>)
// CHECK-NEXT: ce.fused {{.*}} entropy(%[[H]] : memref<?xf32>) argmax(%[[A]] : memref<?xi64>) layout = flat {overwrite_input}
func.func @fuse_outputs(%x: memref<?x?xbf16>, %y: memref<?xi64>, %g: memref<?xf32>, %loss: memref<?xf32>, %lse: memref<?xf32>, %h: memref<?xf32>, %a: memref<?xi64>) {
  ce.forward %x, %y into %loss, %lse entropy(%h : memref<?xf32>) argmax(%a : memref<?xi64>) layout = flat : memref<?x?xbf16>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  ce.backward %x, %y, %lse, %g into %x layout = flat {overwrite_input} : memref<?x?xbf16>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xbf16>
  return
}

// -----

// The upstream gradient must not be the entropy buffer the fused op writes.

func.func @gradient_is_entropy(%x: memref<?x?xbf16>, %y: memref<?xi64>, %loss: memref<?xf32>, %lse: memref<?xf32>, %h: memref<?xf32>) {
  ce.forward %x, %y into %loss, %lse entropy(%h : memref<?xf32>) layout = flat : memref<?x?xbf16>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  // expected-remark @+1 {{not fused: the upstream gradient is the forward's own entropy buffer, which the fused op writes}}
  ce.backward %x, %y, %lse, %h into %x layout = flat {overwrite_input} : memref<?x?xbf16>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xbf16>
  return
}
