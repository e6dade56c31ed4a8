// A training step as a user writes it: forward and backward with the option
// values as run-time operands, lse's low part and the entropy and argmax
// outputs (bundle format version 5), the function's
// arguments in the bundle ABI's order (the tensors, then flags,
// ignore_index, label_smoothing, z_loss, shard_start, shard_vocab,
// logit_scale, logit_softcap; the
// shard bounds are unused arguments of a kernel that takes no slice).
func.func @train_step(%x: memref<?x?xf32>, %y: memref<?xi64>, %g: memref<?xf32>, %loss: memref<?xf32>, %lse: memref<?xf32>, %lo: memref<?xf32>, %ent: memref<?xf32>, %am: memref<?xi64>, %st: memref<1xi64>, %flags: i64, %ignore: i64, %alpha: f32, %z: f32, %start: i64, %vocab: i64, %scale: f32, %cap: f32) {
  ce.forward %x, %y into %loss, %lse lse_low(%lo : memref<?xf32>) entropy(%ent : memref<?xf32>) argmax(%am : memref<?xi64>) status(%st : memref<1xi64>) flags(%flags) ignore_index(%ignore) label_smoothing(%alpha) z_loss(%z) logit_scale(%scale) layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  ce.backward %x, %y, %lse, %g into %x lse_low(%lo : memref<?xf32>) flags(%flags) ignore_index(%ignore) label_smoothing(%alpha) z_loss(%z) logit_scale(%scale) layout = flat {overwrite_input} : memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xf32>
  return
}

// A vocabulary slice whose bounds are run-time operands.
func.func @slice_stats(%x: memref<?x?xf32>, %y: memref<?xi64>, %s: memref<?x4xf32>, %ent: memref<?xf32>, %am: memref<?xi64>, %st: memref<1xi64>, %flags: i64, %ignore: i64, %alpha: f32, %z: f32, %start: i64, %vocab: i64, %scale: f32, %cap: f32) {
  ce.shard_stats %x, %y into %s entropy(%ent : memref<?xf32>) argmax(%am : memref<?xi64>) status(%st : memref<1xi64>) flags(%flags) ignore_index(%ignore) label_smoothing(%alpha) shard_bounds(%start, %vocab) logit_scale(%scale) layout = flat {shard = #ce.shard<>} : memref<?x?xf32>, memref<?xi64> into memref<?x4xf32>
  return
}

// A backward on its own takes a vocabulary slice, as every backward kernel
// for a bundle does (an unsharded call is passed [0, V) of V).
func.func @grad_slice(%x: memref<?x?xf32>, %y: memref<?xi64>, %lse: memref<?xf32>, %lo: memref<?xf32>, %g: memref<?xf32>, %d: memref<?x?xf32>, %st: memref<1xi64>, %flags: i64, %ignore: i64, %alpha: f32, %z: f32, %start: i64, %vocab: i64, %scale: f32, %cap: f32) {
  ce.backward %x, %y, %lse, %g into %d lse_low(%lo : memref<?xf32>) status(%st : memref<1xi64>) flags(%flags) ignore_index(%ignore) z_loss(%z) shard_bounds(%start, %vocab) logit_scale(%scale) layout = flat {shard = #ce.shard<>} : memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xf32>
  return
}
