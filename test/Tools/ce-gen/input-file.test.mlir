func.func @train_step(%x: memref<?x?xf32>, %y: memref<?xi64>, %g: memref<?xf32>, %loss: memref<?xf32>, %lse: memref<?xf32>, %st: memref<1xi64>) {
  ce.forward %x, %y into %loss, %lse status(%st : memref<1xi64>) layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  ce.backward %x, %y, %lse, %g into %x layout = flat {overwrite_input} : memref<?x?xf32>, memref<?xi64>, memref<?xf32>, memref<?xf32> into memref<?x?xf32>
  return
}
