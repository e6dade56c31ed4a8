// RUN: ce-opt %s -split-input-file -verify-diagnostics | FileCheck %s

// ce.rescale: the fused gradient corrected in place. It round-trips in each
// layout; its verifier checks the gradient as the other ops check logits and
// the per-token operands against the layout's token shape.

// CHECK-LABEL: func.func @flat
// CHECK: ce.rescale %arg0, %arg1, %arg2 layout = flat : memref<?x?xbf16>, memref<?xf32>, memref<?xf32>
func.func @flat(%g: memref<?x?xbf16>, %w: memref<?xf32>, %d: memref<?xf32>) {
  ce.rescale %g, %w, %d layout = flat : memref<?x?xbf16>, memref<?xf32>, memref<?xf32>
  return
}

// CHECK-LABEL: func.func @sbv_bs
// CHECK: ce.rescale %arg0, %arg1, %arg2 layout = sbv_bs : memref<4x2x7xf32>, memref<2x4xf32>, memref<2x4xf32>
func.func @sbv_bs(%g: memref<4x2x7xf32>, %w: memref<2x4xf32>, %d: memref<2x4xf32>) {
  ce.rescale %g, %w, %d layout = sbv_bs : memref<4x2x7xf32>, memref<2x4xf32>, memref<2x4xf32>
  return
}

// The weights and the upstream gradient may be one buffer (a no-op).
// CHECK-LABEL: func.func @same_buffer
func.func @same_buffer(%g: memref<?x?xf16>, %w: memref<?xf32>) {
  ce.rescale %g, %w, %w layout = flat : memref<?x?xf16>, memref<?xf32>, memref<?xf32>
  return
}

// -----

func.func @rank(%g: memref<?x?x?xf32>, %w: memref<?xf32>, %d: memref<?xf32>) {
  // expected-error @+1 {{layout 'flat' expects rank-2 logits, got rank 3}}
  ce.rescale %g, %w, %d layout = flat : memref<?x?x?xf32>, memref<?xf32>, memref<?xf32>
  return
}

// -----

func.func @transposed(%g: memref<4x2x7xf32>, %w: memref<4x2xf32>, %d: memref<2x4xf32>) {
  // expected-error @+1 {{'weights' shape [4, 2] does not match the token shape [2, 4] of layout 'sbv_bs'}}
  ce.rescale %g, %w, %d layout = sbv_bs : memref<4x2x7xf32>, memref<4x2xf32>, memref<2x4xf32>
  return
}

// -----

func.func @grad_loss_shape(%g: memref<5x7xf32>, %w: memref<5xf32>, %d: memref<4xf32>) {
  // expected-error @+1 {{'grad_loss' shape [4] does not match the token shape [5] of layout 'flat'}}
  ce.rescale %g, %w, %d layout = flat : memref<5x7xf32>, memref<5xf32>, memref<4xf32>
  return
}

// -----

func.func @vocab_stride(%g: memref<?x?xf32, strided<[1, ?]>>, %w: memref<?xf32>, %d: memref<?xf32>) {
  // expected-error @+1 {{logits must have a static unit stride in the vocabulary dimension}}
  ce.rescale %g, %w, %d layout = flat : memref<?x?xf32, strided<[1, ?]>>, memref<?xf32>, memref<?xf32>
  return
}

// -----

func.func @labels_type(%g: memref<?x?xf32>, %w: memref<?xi64>, %d: memref<?xf32>) {
  // expected-error @+1 {{operand #1 must be memref of 32-bit float values}}
  ce.rescale %g, %w, %d layout = flat : memref<?x?xf32>, memref<?xi64>, memref<?xf32>
  return
}
