// A backward without a vocabulary slice: every backward kernel for a bundle
// takes one (an unsharded call passes [0, V) of V).
func.func @k(%x: memref<?x?xf32>, %y: memref<?xi64>, %lse: memref<?xf32>, %lo: memref<?xf32>, %g: memref<?xf32>, %d: memref<?x?xf32>, %st: memref<1xi64>, %flags: i64, %ignore: i64, %alpha: f32, %z: f32, %start: i64, %vocab: i64, %scale: f32, %cap: f32) {
  ce.backward %x, %y, %lse, %g into %d lse_low(%lo : memref<?xf32>) status(%st : memref<1xi64>) flags(%flags) ignore_index(%ignore) label_smoothing(%alpha) logit_scale(%scale) layout = flat : memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xf32>
  return
}
