// A compiled-in smoothing coefficient: a bundle's kernels take it at run time.
func.func @k(%x: memref<?x?xf32>, %y: memref<?xi64>, %loss: memref<?xf32>, %lse: memref<?xf32>, %lo: memref<?xf32>, %ent: memref<?xf32>, %am: memref<?xi64>, %st: memref<1xi64>, %flags: i64, %ignore: i64, %alpha: f32, %z: f32, %start: i64, %vocab: i64, %scale: f32, %cap: f32) {
  ce.forward %x, %y into %loss, %lse lse_low(%lo : memref<?xf32>) entropy(%ent : memref<?xf32>) argmax(%am : memref<?xi64>) status(%st : memref<1xi64>) flags(%flags) ignore_index(%ignore) logit_scale(%scale) layout = flat {label_smoothing = 0.1 : f32} : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}
