func.func @f(%x: memref<?x?xf64>, %y: memref<?xi64>, %l: memref<?xf32>, %e: memref<?xf32>) {
  ce.forward %x, %y into %l, %e layout = flat : memref<?x?xf64>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}
