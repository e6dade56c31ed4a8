// A slice with compiled-in bounds: a bundle's kernels take them at run time.
func.func @k(%x: memref<?x?xf32>, %y: memref<?xi64>, %s: memref<?x4xf32>, %st: memref<1xi64>, %flags: i64, %ignore: i64, %alpha: f32, %z: f32, %start: i64, %vocab: i64, %scale: f32, %cap: f32) {
  ce.shard_stats %x, %y into %s status(%st : memref<1xi64>) flags(%flags) ignore_index(%ignore) logit_scale(%scale) layout = flat {shard = #ce.shard<start = 0, vocab = 128>} : memref<?x?xf32>, memref<?xi64> into memref<?x4xf32>
  return
}
