// RUN: ce-opt %s --ce-lower-to-loops="unroll=0" -verify-diagnostics
// RUN: ce-opt %s --ce-lower-to-loops="unroll=17" -verify-diagnostics
// RUN: ce-opt %s --ce-lower-to-loops="unroll=1000000" -verify-diagnostics

// unroll is bounded: the loop nest grows with it.
// expected-error @+1 {{unroll must be in [1, 16], got}}
func.func @bad_unroll(%x: memref<?x?xf32>, %y: memref<?xi64>, %l: memref<?xf32>, %e: memref<?xf32>) {
  ce.forward %x, %y into %l, %e layout = flat : memref<?x?xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}
