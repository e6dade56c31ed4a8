// RUN: ce-opt %s --ce-lower-to-loops -verify-diagnostics

func.func @shard(%x: memref<?x64xf32>, %y: memref<?xi64>, %l: memref<?xf32>, %e: memref<?xf32>) {
  // expected-error @+1 {{lowering of vocab-parallel shards to loops is not supported yet}}
  ce.forward %x, %y into %l, %e layout = flat {shard = #ce.shard<start = 64, vocab = 128>} : memref<?x64xf32>, memref<?xi64> into memref<?xf32>, memref<?xf32>
  return
}
