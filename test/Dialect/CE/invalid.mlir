// RUN: ce-opt %s -split-input-file -verify-diagnostics

func.func @flat_needs_rank2(%x: memref<?x?x?xf32>, %y: memref<?xi64>, %l: memref<?xf32>, %e: memref<?xf32>) {
  // expected-error @+1 {{layout 'flat' expects rank-2 logits, got rank 3}}
  ce.forward %x, %y into %l, %e layout = flat : memref<?x?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}

// -----

func.func @sbv_needs_rank3(%x: memref<?x?xf32>, %y: memref<?x?xi64>, %l: memref<?x?xf32>, %e: memref<?x?xf32>) {
  // expected-error @+1 {{layout 'sbv_bs' expects rank-3 logits, got rank 2}}
  ce.forward %x, %y into %l, %e layout = sbv_bs : memref<?x?xf32>, memref<?x?xi64> into memref<?x?xf32>, memref<?x?xf32>
  return
}

// -----

func.func @vocab_stride(%x: memref<?x?xf32, strided<[1, ?]>>, %y: memref<?xi64>, %l: memref<?xf32>, %e: memref<?xf32>) {
  // expected-error @+1 {{logits must have a static unit stride in the vocabulary dimension}}
  ce.forward %x, %y into %l, %e layout = flat : memref<?x?xf32, strided<[1, ?]>>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}

// -----

func.func @labels_transposed(%x: memref<4x2x7xf32>, %y: memref<4x2xi64>, %l: memref<2x4xf32>, %e: memref<2x4xf32>) {
  // expected-error @+1 {{'labels' shape [4, 2] does not match the token shape [2, 4] of layout 'sbv_bs'}}
  ce.forward %x, %y into %l, %e layout = sbv_bs : memref<4x2x7xf32>, memref<4x2xi64> into memref<2x4xf32>, memref<2x4xf32>
  return
}

// -----

func.func @loss_shape(%x: memref<4x2x7xf32>, %y: memref<4x2xi64>, %l: memref<4x3xf32>, %e: memref<4x2xf32>) {
  // expected-error @+1 {{'loss' shape [4, 3] does not match the token shape [4, 2] of layout 'sbv_sb'}}
  ce.forward %x, %y into %l, %e layout = sbv_sb : memref<4x2x7xf32>, memref<4x2xi64> into memref<4x3xf32>, memref<4x2xf32>
  return
}

// -----

func.func @lse_rank(%x: memref<?x?xf32>, %y: memref<?xi64>, %l: memref<?xf32>, %e: memref<?x?xf32>) {
  // expected-error @+1 {{'lse' shape [?, ?] does not match the token shape [?] of layout 'flat'}}
  ce.forward %x, %y into %l, %e layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?x?xf32>
  return
}

// -----

func.func @grad_loss_shape(%x: memref<8x7xf32>, %y: memref<8xi64>, %e: memref<8xf32>, %g: memref<9xf32>, %dx: memref<8x7xf32>) {
  // expected-error @+1 {{'grad_loss' shape [9] does not match the token shape [8] of layout 'flat'}}
  ce.backward %x, %y, %e, %g into %dx layout = flat : memref<8x7xf32>, memref<8xi64>, memref<8xf32>, memref<9xf32> into memref<8x7xf32>
  return
}

// -----

func.func @weights_shape(%x: memref<8x7xf32>, %y: memref<8xi64>, %w: memref<4xf32>, %l: memref<8xf32>, %e: memref<8xf32>, %dx: memref<8x7xf32>) {
  // expected-error @+1 {{'weights' shape [4] does not match the token shape [8] of layout 'flat'}}
  ce.fused %x, %y, %w into %l, %e, %dx layout = flat : memref<8x7xf32>, memref<8xi64>, memref<4xf32> into memref<8xf32>, memref<8xf32>, memref<8x7xf32>
  return
}

// -----

func.func @grad_element_type(%x: memref<?x?xbf16>, %y: memref<?xi64>, %e: memref<?xf32>, %g: memref<?xf32>, %dx: memref<?x?xf32>) {
  // expected-error @+1 {{gradient element type 'f32' differs from the logits element type 'bf16'}}
  ce.backward %x, %y, %e, %g into %dx layout = flat : memref<?x?xbf16>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xf32>
  return
}

// -----

func.func @grad_shape(%x: memref<8x7xf32>, %y: memref<8xi64>, %e: memref<8xf32>, %g: memref<8xf32>, %dx: memref<8x6xf32>) {
  // expected-error @+1 {{gradient shape [8, 6] does not match the logits shape [8, 7]}}
  ce.backward %x, %y, %e, %g into %dx layout = flat : memref<8x7xf32>, memref<8xi64>, memref<8xf32>, memref<8xf32> into memref<8x6xf32>
  return
}

// -----

func.func @grad_stride(%x: memref<?x?xf32>, %y: memref<?xi64>, %e: memref<?xf32>, %g: memref<?xf32>, %dx: memref<?x?xf32, strided<[1, ?]>>) {
  // expected-error @+1 {{gradient must have a static unit stride in the vocabulary dimension}}
  ce.backward %x, %y, %e, %g into %dx layout = flat : memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xf32, strided<[1, ?]>>
  return
}

// -----

func.func @status_shape(%x: memref<?x?xf32>, %y: memref<?xi64>, %l: memref<?xf32>, %e: memref<?xf32>, %st: memref<2xi64>) {
  // expected-error @+1 {{status must be a memref<1xi64>, got 'memref<2xi64>'}}
  ce.forward %x, %y into %l, %e status(%st : memref<2xi64>) layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}

// -----

func.func @smoothing_negative(%x: memref<?x?xf32>, %y: memref<?xi64>, %l: memref<?xf32>, %e: memref<?xf32>) {
  // expected-error @+1 {{label_smoothing must be in [0, 1), got -1.000000e-01}}
  ce.forward %x, %y into %l, %e layout = flat {label_smoothing = -0.1 : f32} : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}

// -----

func.func @smoothing_one(%x: memref<?x?xf32>, %y: memref<?xi64>, %l: memref<?xf32>, %e: memref<?xf32>) {
  // expected-error @+1 {{label_smoothing must be in [0, 1), got 1.000000e+00}}
  ce.forward %x, %y into %l, %e layout = flat {label_smoothing = 1.0 : f32} : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}

// -----

func.func @z_loss_negative(%x: memref<?x?xf32>, %y: memref<?xi64>, %l: memref<?xf32>, %e: memref<?xf32>) {
  // expected-error @+1 {{z_loss must be finite and non-negative, got -1.000000e+00}}
  ce.forward %x, %y into %l, %e layout = flat {z_loss = -1.0 : f32} : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}

// -----

func.func @z_loss_inf(%x: memref<?x?xf32>, %y: memref<?xi64>, %l: memref<?xf32>, %e: memref<?xf32>) {
  // expected-error @+1 {{z_loss must be finite and non-negative}}
  ce.forward %x, %y into %l, %e layout = flat {z_loss = 0x7F800000 : f32} : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}

// -----

func.func @shard_outside_vocab(%x: memref<?x64xf32>, %y: memref<?xi64>, %s: memref<?x4xf32>) {
  // expected-error @+1 {{shard [96, 160) of the logits exceeds the vocabulary of 128}}
  ce.shard_stats %x, %y into %s layout = flat {shard = #ce.shard<start = 96, vocab = 128>} : memref<?x64xf32>, memref<?xi64> into memref<?x4xf32>
  return
}

// -----

func.func @sharded_forward(%x: memref<?x64xf32>, %y: memref<?xi64>, %l: memref<?xf32>, %e: memref<?xf32>) {
  // expected-error @+1 {{a vocab-parallel forward yields partial statistics: use ce.shard_stats}}
  ce.forward %x, %y into %l, %e layout = flat {shard = #ce.shard<start = 64, vocab = 128>} : memref<?x64xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}

// -----

func.func @sharded_fused(%x: memref<?x64xf32>, %y: memref<?xi64>, %w: memref<f32>, %l: memref<?xf32>, %e: memref<?xf32>) {
  // expected-error @+1 {{cannot fuse a vocab-parallel shard}}
  ce.fused %x, %y, %w into %l, %e, %x layout = flat {overwrite_input, shard = #ce.shard<start = 0, vocab = 128>} : memref<?x64xf32>, memref<?xi64>, memref<f32> into memref<?xf32>, memref<?xf32>, memref<?x64xf32>
  return
}

// -----

func.func @stats_without_shard(%x: memref<?x64xf32>, %y: memref<?xi64>, %s: memref<?x4xf32>) {
  // expected-error @+1 {{requires a 'shard' attribute}}
  ce.shard_stats %x, %y into %s layout = flat : memref<?x64xf32>, memref<?xi64> into memref<?x4xf32>
  return
}

// -----

func.func @stats_with_z_loss(%x: memref<?x64xf32>, %y: memref<?xi64>, %s: memref<?x4xf32>) {
  // expected-error @+1 {{z_loss applies to the combined log-sum-exp}}
  ce.shard_stats %x, %y into %s layout = flat {z_loss = 1.0e-4 : f32, shard = #ce.shard<start = 0, vocab = 128>} : memref<?x64xf32>, memref<?xi64> into memref<?x4xf32>
  return
}

// -----

func.func @stats_shape(%x: memref<?x?x64xf32>, %y: memref<?x?xi64>, %s: memref<?x?x3xf32>) {
  // expected-error @+1 {{'stats' shape [?, ?, 3] does not match [?, ?, 4] (the token shape followed by 4) of layout 'sbv_bs'}}
  ce.shard_stats %x, %y into %s layout = sbv_bs {shard = #ce.shard<start = 0, vocab = 128>} : memref<?x?x64xf32>, memref<?x?xi64> into memref<?x?x3xf32>
  return
}

// -----

func.func @stats_token_shape(%x: memref<8x2x64xf32>, %y: memref<2x8xi64>, %s: memref<8x2x4xf32>) {
  // expected-error @+1 {{'stats' shape [8, 2, 4] does not match [2, 8, 4]}}
  ce.shard_stats %x, %y into %s layout = sbv_bs {shard = #ce.shard<start = 0, vocab = 128>} : memref<8x2x64xf32>, memref<2x8xi64> into memref<8x2x4xf32>
  return
}

// -----

// Neither bound (`#ce.shard<>`, start and vocab 0) means run-time bounds;
// a start without a vocabulary is an error.
// expected-error @+1 {{shard vocabulary size must be positive, got 0}}
func.func private @shard_empty() attributes {s = #ce.shard<start = 5, vocab = 0>}

// -----

// expected-error @+1 {{shard vocabulary size must be positive, got -1}}
func.func private @shard_negative() attributes {s = #ce.shard<vocab = -1>}

// -----

// expected-error @+1 {{shard start 8 is outside the vocabulary [0, 8)}}
func.func private @shard_start() attributes {s = #ce.shard<start = 8, vocab = 8>}

// -----

func.func @outputs_alias(%x: memref<?x?xf32>, %y: memref<?xi64>, %l: memref<?xf32>) {
  // expected-error @+1 {{outputs 'loss' and 'lse' are the same buffer}}
  ce.forward %x, %y into %l, %l layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}

// -----

func.func @output_is_input(%x: memref<?x?xf32>, %y: memref<?xi64>, %w: memref<?xf32>, %e: memref<?xf32>, %dx: memref<?x?xf32>) {
  // expected-error @+1 {{output 'loss' is the same buffer as input 'weights'}}
  ce.fused %x, %y, %w into %w, %e, %dx layout = flat : memref<?x?xf32>, memref<?xi64>, memref<?xf32> into memref<?xf32>, memref<?xf32>, memref<?x?xf32>
  return
}

// -----

func.func @overwrite_needs_logits(%x: memref<?x?xf32>, %y: memref<?xi64>, %e: memref<?xf32>, %g: memref<?xf32>, %dx: memref<?x?xf32>) {
  // expected-error @+1 {{overwrite_input requires the gradient buffer to be the logits buffer}}
  ce.backward %x, %y, %e, %g into %dx layout = flat {overwrite_input} : memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xf32>
  return
}

// -----

func.func @aliasing_without_overwrite(%x: memref<?x?xf32>, %y: memref<?xi64>, %w: memref<f32>, %l: memref<?xf32>, %e: memref<?xf32>) {
  // expected-error @+1 {{gradient buffer is the logits buffer; set overwrite_input to write the gradient over the logits}}
  ce.fused %x, %y, %w into %l, %e, %x layout = flat : memref<?x?xf32>, memref<?xi64>, memref<f32> into memref<?xf32>, memref<?xf32>, memref<?x?xf32>
  return
}

// -----

func.func @logits_type(%x: memref<?x?xi32>, %y: memref<?xi64>, %l: memref<?xf32>, %e: memref<?xf32>) {
  // expected-error @+1 {{operand #0 must be memref of bfloat16 type or 16-bit float or 32-bit float values}}
  ce.forward %x, %y into %l, %e layout = flat : memref<?x?xi32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}

// -----

func.func @labels_type(%x: memref<?x?xf32>, %y: memref<?xf32>, %l: memref<?xf32>, %e: memref<?xf32>) {
  // expected-error @+1 {{operand #1 must be memref of 32-bit signless integer or 64-bit signless integer values}}
  ce.forward %x, %y into %l, %e layout = flat : memref<?x?xf32>, memref<?xf32> into memref<?xf32>, memref<?xf32>
  return
}

// -----

func.func @loss_type(%x: memref<?x?xf32>, %y: memref<?xi64>, %l: memref<?xf16>, %e: memref<?xf32>) {
  // expected-error @+1 {{operand #2 must be memref of 32-bit float values}}
  ce.forward %x, %y into %l, %e layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf16>, memref<?xf32>
  return
}

// -----

func.func @unknown_layout(%x: memref<?x?xf32>, %y: memref<?xi64>, %l: memref<?xf32>, %e: memref<?xf32>) {
  // expected-error @+1 {{unknown layout 'bsv'; expected flat, sbv_bs or sbv_sb}}
  ce.forward %x, %y into %l, %e layout = bsv : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}

// -----

// Run-time option operands: each option is an attribute or an operand.

func.func @ignore_index_twice(%x: memref<?x?xf32>, %y: memref<?xi64>, %l: memref<?xf32>, %e: memref<?xf32>, %i: i64) {
  // expected-error @+1 {{ignore_index is given both as an attribute and as an operand}}
  ce.forward %x, %y into %l, %e ignore_index(%i) layout = flat {ignore_index = -100 : i64} : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}

// -----

func.func @label_smoothing_twice(%x: memref<?x?xf32>, %y: memref<?xi64>, %e: memref<?xf32>, %g: memref<?xf32>, %a: f32) {
  // expected-error @+1 {{label_smoothing is given both as an attribute and as an operand}}
  ce.backward %x, %y, %e, %g into %x label_smoothing(%a) layout = flat {overwrite_input, label_smoothing = 0.1 : f32} : memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xf32>
  return
}

// -----

func.func @z_loss_twice(%x: memref<?x?xf32>, %y: memref<?xi64>, %w: memref<f32>, %l: memref<?xf32>, %e: memref<?xf32>, %z: f32) {
  // expected-error @+1 {{z_loss is given both as an attribute and as an operand}}
  ce.fused %x, %y, %w into %l, %e, %x z_loss(%z) layout = flat {overwrite_input, z_loss = 1.0e-4 : f32} : memref<?x?xf32>, memref<?xi64>, memref<f32> into memref<?xf32>, memref<?xf32>, memref<?x?xf32>
  return
}

// -----

func.func @stats_z_loss_operand(%x: memref<?x64xf32>, %y: memref<?xi64>, %s: memref<?x4xf32>, %z: f32, %b: i64, %v: i64) {
  // expected-error @+1 {{z_loss applies to the combined log-sum-exp}}
  ce.shard_stats %x, %y into %s z_loss(%z) shard_bounds(%b, %v) layout = flat {shard = #ce.shard<>} : memref<?x64xf32>, memref<?xi64> into memref<?x4xf32>
  return
}

// -----

func.func @smoothing_operand_type(%x: memref<?x?xf32>, %y: memref<?xi64>, %l: memref<?xf32>, %e: memref<?xf32>, %a: i64) {
  // expected-error @+1 {{operand #4 must be 32-bit float, but got 'i64'}}
  "ce.forward"(%x, %y, %l, %e, %a) <{label_smoothing = 0.0 : f32, layout = #ce<layout flat>, operandSegmentSizes = array<i32: 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0>, z_loss = 0.0 : f32}> : (memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32>, i64) -> ()
  return
}

// -----

func.func @shard_bounds_without_shard(%x: memref<?x?x?xf32>, %y: memref<?x?xi64>, %e: memref<?x?xf32>, %g: memref<?x?xf32>, %b: i64, %v: i64) {
  // expected-error @+1 {{shard_bounds needs a 'shard' attribute}}
  ce.backward %x, %y, %e, %g into %x shard_bounds(%b, %v) layout = sbv_bs {overwrite_input} : memref<?x?x?xf32>, memref<?x?xi64>, memref<?x?xf32>, memref<?x?xf32> into memref<?x?x?xf32>
  return
}

// -----

func.func @shard_without_bounds(%x: memref<?x64xf32>, %y: memref<?xi64>, %s: memref<?x4xf32>) {
  // expected-error @+1 {{a shard without start and vocab needs shard_bounds operands}}
  ce.shard_stats %x, %y into %s layout = flat {shard = #ce.shard<>} : memref<?x64xf32>, memref<?xi64> into memref<?x4xf32>
  return
}

// -----

func.func @global_shard_without_bounds(%x: memref<?x?xf32>, %y: memref<?xi64>, %e: memref<?xf32>, %g: memref<?xf32>) {
  // expected-error @+1 {{a shard without start and vocab needs shard_bounds operands}}
  ce.backward %x, %y, %e, %g into %x layout = flat {overwrite_input, shard = #ce.shard<global_smoothing = true>} : memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xf32>
  return
}

// -----

func.func @shard_bounds_twice(%x: memref<?x64xf32>, %y: memref<?xi64>, %s: memref<?x4xf32>, %b: i64, %v: i64) {
  // expected-error @+1 {{a shard with run-time bounds must not give start and vocab in its attribute}}
  ce.shard_stats %x, %y into %s shard_bounds(%b, %v) layout = flat {shard = #ce.shard<start = 64, vocab = 128>} : memref<?x64xf32>, memref<?xi64> into memref<?x4xf32>
  return
}

// -----

func.func @shard_bounds_half(%x: memref<?x64xf32>, %y: memref<?xi64>, %s: memref<?x4xf32>, %b: i64) {
  // expected-error @+1 {{shard_bounds needs both start and vocab}}
  "ce.shard_stats"(%x, %y, %s, %b) <{label_smoothing = 0.0 : f32, layout = #ce<layout flat>, operandSegmentSizes = array<i32: 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0>, shard = #ce.shard<>, z_loss = 0.0 : f32}> : (memref<?x64xf32>, memref<?xi64>, memref<?x4xf32>, i64) -> ()
  return
}

// -----

func.func @shard_bounds_type(%x: memref<?x64xf32>, %y: memref<?xi64>, %s: memref<?x4xf32>, %b: i32, %v: i64) {
  // expected-error @+1 {{operand #3 must be 64-bit signless integer, but got 'i32'}}
  "ce.shard_stats"(%x, %y, %s, %b, %v) <{label_smoothing = 0.0 : f32, layout = #ce<layout flat>, operandSegmentSizes = array<i32: 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0>, shard = #ce.shard<>, z_loss = 0.0 : f32}> : (memref<?x64xf32>, memref<?xi64>, memref<?x4xf32>, i32, i64) -> ()
  return
}

// -----

// lse's low part has the token shape and is a buffer of its own.
func.func @lse_low_shape(%x: memref<5x7xf32>, %y: memref<5xi64>, %l: memref<5xf32>, %e: memref<5xf32>, %lo: memref<4xf32>) {
  // expected-error @+1 {{'lse_low' shape [4] does not match the token shape [5] of layout 'flat'}}
  ce.forward %x, %y into %l, %e lse_low(%lo : memref<4xf32>) layout = flat : memref<5x7xf32>, memref<5xi64> into memref<5xf32>, memref<5xf32>
  return
}

// -----

func.func @lse_low_is_lse(%x: memref<?x?xf32>, %y: memref<?xi64>, %l: memref<?xf32>, %e: memref<?xf32>) {
  // expected-error @+1 {{outputs 'lse' and 'lse_low' are the same buffer}}
  ce.forward %x, %y into %l, %e lse_low(%e : memref<?xf32>) layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}

// -----

func.func @backward_lse_low_shape(%x: memref<4x2x7xf32>, %y: memref<2x4xi64>, %e: memref<2x4xf32>, %g: memref<2x4xf32>, %d: memref<4x2x7xf32>, %lo: memref<4x2xf32>) {
  // expected-error @+1 {{'lse_low' shape [4, 2] does not match the token shape [2, 4] of layout 'sbv_bs'}}
  ce.backward %x, %y, %e, %g into %d lse_low(%lo : memref<4x2xf32>) layout = sbv_bs : memref<4x2x7xf32>, memref<2x4xi64>, memref<2x4xf32>, memref<2x4xf32> into memref<4x2x7xf32>
  return
}

// -----

// A constant logit scale must be one the runtime accepts: finite and > 0.
func.func @logit_scale_zero(%x: memref<?x?xf32>, %y: memref<?xi64>, %l: memref<?xf32>, %e: memref<?xf32>) {
  %s = arith.constant 0.0 : f32
  // expected-error @+1 {{logit_scale must be finite and positive, got 0}}
  ce.forward %x, %y into %l, %e logit_scale(%s) layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}

// -----

func.func @logit_scale_negative(%x: memref<?x?xf32>, %y: memref<?xi64>, %e: memref<?xf32>, %g: memref<?xf32>, %d: memref<?x?xf32>) {
  %s = arith.constant -2.0 : f32
  // expected-error @+1 {{logit_scale must be finite and positive, got -2}}
  ce.backward %x, %y, %e, %g into %d logit_scale(%s) layout = flat : memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xf32>
  return
}

// -----

func.func @logit_scale_inf(%x: memref<?x64xf32>, %y: memref<?xi64>, %st: memref<?x4xf32>) {
  %s = arith.constant 0x7F800000 : f32
  // expected-error @+1 {{logit_scale must be finite and positive, got INF}}
  ce.shard_stats %x, %y into %st logit_scale(%s) layout = flat {shard = #ce.shard<start = 0, vocab = 128>} : memref<?x64xf32>, memref<?xi64> into memref<?x4xf32>
  return
}

// -----

func.func @logit_scale_nan(%x: memref<?x?xf32>, %y: memref<?xi64>, %w: memref<f32>, %l: memref<?xf32>, %e: memref<?xf32>, %d: memref<?x?xf32>) {
  %s = arith.constant 0x7FC00000 : f32
  // expected-error @+1 {{logit_scale must be finite and positive, got nan}}
  ce.fused %x, %y, %w into %l, %e, %d logit_scale(%s) layout = flat : memref<?x?xf32>, memref<?xi64>, memref<f32> into memref<?xf32>, memref<?xf32>, memref<?x?xf32>
  return
}

// -----

func.func @logit_scale_type(%x: memref<?x?xf32>, %y: memref<?xi64>, %l: memref<?xf32>, %e: memref<?xf32>, %s: f64) {
  // expected-error @+1 {{operand #4 must be 32-bit float, but got 'f64'}}
  "ce.forward"(%x, %y, %l, %e, %s) <{label_smoothing = 0.0 : f32, layout = #ce<layout flat>, operandSegmentSizes = array<i32: 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0>, z_loss = 0.0 : f32}> : (memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32>, f64) -> ()
  return
}

// -----

func.func @entropy_shape(%x: memref<4x8xf32>, %y: memref<4xi64>, %l: memref<4xf32>, %e: memref<4xf32>, %h: memref<3xf32>) {
  // expected-error @+1 {{'entropy' shape [3] does not match the token shape [4] of layout 'flat'}}
  ce.forward %x, %y into %l, %e entropy(%h : memref<3xf32>) layout = flat : memref<4x8xf32>, memref<4xi64> into memref<4xf32>, memref<4xf32>
  return
}

// -----

func.func @argmax_type(%x: memref<?x?xf32>, %y: memref<?xi64>, %l: memref<?xf32>, %e: memref<?xf32>, %a: memref<?xi32>) {
  // expected-error @+1 {{must be memref of 64-bit signless integer values, but got 'memref<?xi32>'}}
  ce.forward %x, %y into %l, %e argmax(%a : memref<?xi32>) layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}

// -----

func.func @entropy_aliases_lse(%x: memref<?x?xf32>, %y: memref<?xi64>, %l: memref<?xf32>, %e: memref<?xf32>) {
  // expected-error @+1 {{outputs 'lse' and 'entropy' are the same buffer}}
  ce.forward %x, %y into %l, %e entropy(%e : memref<?xf32>) layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}

// -----

// A constant logit softcap must be one the runtime accepts: finite and > 0.
func.func @logit_softcap_zero(%x: memref<?x?xf32>, %y: memref<?xi64>, %l: memref<?xf32>, %e: memref<?xf32>) {
  %c = arith.constant 0.0 : f32
  // expected-error @+1 {{logit_softcap must be finite and positive, got 0}}
  ce.forward %x, %y into %l, %e logit_softcap(%c) layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}

// -----

func.func @logit_softcap_infinite(%x: memref<?x?xf32>, %y: memref<?xi64>, %e: memref<?xf32>, %g: memref<?xf32>, %d: memref<?x?xf32>) {
  %c = arith.constant 0x7F800000 : f32
  // expected-error @+1 {{logit_softcap must be finite and positive, got INF}}
  ce.backward %x, %y, %e, %g into %d logit_softcap(%c) layout = flat : memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xf32>
  return
}
