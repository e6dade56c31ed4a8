// No logit_scale operand: the runtime passes every kernel the logit scale
// (1 when the caller gives none).
func.func @k(%x: memref<?x?xf32>, %y: memref<?xi64>, %loss: memref<?xf32>, %lse: memref<?xf32>, %lo: memref<?xf32>, %ent: memref<?xf32>, %am: memref<?xi64>, %st: memref<1xi64>, %flags: i64, %ignore: i64, %alpha: f32, %z: f32, %start: i64, %vocab: i64, %scale: f32, %cap: f32) {
  ce.forward %x, %y into %loss, %lse lse_low(%lo : memref<?xf32>) entropy(%ent : memref<?xf32>) argmax(%am : memref<?xi64>) status(%st : memref<1xi64>) flags(%flags) ignore_index(%ignore) layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}
