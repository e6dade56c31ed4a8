func.func @f(%x: memref<?x?xf32>, %y: memref<?xi64>, %l: memref<?xf32>, %e: memref<?xf32>) {
  ce.forward %x, %y into %l, %e layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?x
