// RUN: ce-opt %s --ce-lower-to-loops="vector-width=3" -verify-diagnostics
// RUN: ce-opt %s --ce-lower-to-loops="vector-width=128" -verify-diagnostics

// expected-error @+1 {{vector-width must be a power of two in [1, 64], got}}
func.func @bad_width(%x: memref<?x?xf32>, %y: memref<?xi64>, %l: memref<?xf32>, %e: memref<?xf32>) {
  ce.forward %x, %y into %l, %e layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}
