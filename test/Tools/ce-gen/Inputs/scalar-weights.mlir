// A fused kernel with a 0-d weight: a bundle's fused kernels take per-token
// weights (the runtime passes a scalar weight with stride 0).
func.func @k(%x: memref<?x?xf32>, %y: memref<?xi64>, %w: memref<f32>, %loss: memref<?xf32>, %lse: memref<?xf32>, %lo: memref<?xf32>, %ent: memref<?xf32>, %am: memref<?xi64>, %d: memref<?x?xf32>, %st: memref<1xi64>, %flags: i64, %ignore: i64, %alpha: f32, %z: f32, %start: i64, %vocab: i64, %scale: f32, %cap: f32) {
  ce.fused %x, %y, %w into %loss, %lse, %d lse_low(%lo : memref<?xf32>) entropy(%ent : memref<?xf32>) argmax(%am : memref<?xi64>) status(%st : memref<1xi64>) flags(%flags) ignore_index(%ignore) logit_scale(%scale) layout = flat : memref<?x?xf32>, memref<?xi64>, memref<f32> into memref<?xf32>, memref<?xf32>, memref<?x?xf32>
  return
}
