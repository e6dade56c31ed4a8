func.func @f(%x: memref<?x?xf32>, %y: memref<?xi64>, %l: memref<?xf32>, %e: memref<?xf32>) {
  ce.forward %x, %y into %l, %e layout = flat
      {shard = #ce.shard<begin = 0, vocab = 8>} : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}
