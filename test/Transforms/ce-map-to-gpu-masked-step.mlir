// RUN: ce-opt %s --pass-pipeline='builtin.module(gpu.module(ce-map-to-gpu{target=nvvm block-size=64 subgroup-size=32 unroll=2 async-copy=1},canonicalize,cse))' | FileCheck %s --check-prefix=NVVM
// RUN: ce-opt %s --pass-pipeline='builtin.module(gpu.module(ce-map-to-gpu{target=rocdl block-size=64 subgroup-size=64 unroll=2},canonicalize,cse))' | FileCheck %s --check-prefix=ROCDL

// The masked last step of a row (the vectors after its last whole chunk,
// at most `unroll` per thread) reads only what the thread owns (issue 23,
// item 13): only a thread whose first vector FIRST is in the row takes part
// (`FIRST < END`), and its other vectors past the row are clamped to FIRST,
// not to the row's last vector. A lane clamped to the row's last vector read
// the row-cache slot that another thread's cp.async fills, with no barrier
// between (compute-sanitizer's racecheck: WAR hazards in the fused sm_90
// kernel), and under overwrite a logit that another thread overwrites.

// NVVM-LABEL: gpu.func @fused
// NVVM: %[[CACHE:.*]] = memref.view
// The statistics sweep's remainder, from the row cache once this thread's
// own copies have landed (no barrier: it must read only its own slots).
// NVVM: nvgpu.device_async_wait %{{[0-9]+}}{{$}}
// NVVM-NEXT: scf.if %{{.*}} -> (f32, vector<8xf32>, f32) {
// NVVM-NEXT: %[[FIRST:.*]] = arith.addi %{{.*}}, %{{.*}} : index
// NVVM-NEXT: %[[OWNS:.*]] = arith.cmpi ult, %[[FIRST]], %[[END:.*]] : index
// NVVM-NEXT: scf.if %[[OWNS]] -> (f32, vector<8xf32>, f32) {
// NVVM-NEXT: %[[SECOND:.*]] = arith.addi %[[FIRST]], %c512 : index
// NVVM-NEXT: %[[IN:.*]] = arith.cmpi ult, %[[SECOND]], %[[END]] : index
// NVVM-NEXT: %[[CLAMPED:.*]] = arith.select %[[IN]], %[[SECOND]], %[[FIRST]] : index
// NVVM-NEXT: %[[SLOT0:.*]] = arith.subi %[[FIRST]], %[[HEAD:.*]] : index
// NVVM-NEXT: vector.load %[[CACHE]][%[[SLOT0]]]
// NVVM-NEXT: %[[SLOT1:.*]] = arith.subi %[[CLAMPED]], %[[HEAD]] : index
// NVVM-NEXT: vector.load %[[CACHE]][%[[SLOT1]]]
// No offset is clamped to the row's last vector anywhere after this.
// NVVM-NOT: arith.minui
// NVVM: gpu.return

// ROCDL-LABEL: gpu.func @fused
// The gradient sweep's remainder over the logits it overwrites (the part of
// the row the cache does not hold), after thread 0's loss store: loads of
// FIRST and the clamped offset, then the stores of the vectors in the row.
// ROCDL: memref.store %{{.*}}, %arg3[
// ROCDL: } else {
// ROCDL-NEXT: %[[FIRST:.*]] = arith.addi %{{.*}}, %{{.*}} : index
// ROCDL-NEXT: %[[OWNS:.*]] = arith.cmpi ult, %[[FIRST]], %[[END:.*]] : index
// ROCDL-NEXT: scf.if %[[OWNS]] {
// ROCDL-NEXT: %[[SECOND:.*]] = arith.addi %[[FIRST]], %c512 : index
// ROCDL-NEXT: %[[IN:.*]] = arith.cmpi ult, %[[SECOND]], %[[END]] : index
// ROCDL-NEXT: %[[CLAMPED:.*]] = arith.select %[[IN]], %[[SECOND]], %[[FIRST]] : index
// ROCDL-NEXT: vector.load %arg0[%{{.*}}, %[[FIRST]]]
// ROCDL: vector.load %arg0[%{{.*}}, %[[CLAMPED]]]
// ROCDL: vector.store %{{.*}}, %arg0[%{{.*}}, %[[FIRST]]]
// ROCDL-NEXT: scf.if %[[IN]] {
// ROCDL: vector.store %{{.*}}, %arg0[%{{.*}}, %[[CLAMPED]]]
// ROCDL-NOT: arith.minui
// ROCDL: gpu.return

gpu.module @kernels {
  gpu.func @fused(%x: memref<?x?xbf16, #gpu.address_space<global>>, %y: memref<?xi64, #gpu.address_space<global>>, %w: memref<?xf32, #gpu.address_space<global>>, %loss: memref<?xf32, #gpu.address_space<global>>, %lse: memref<?xf32, #gpu.address_space<global>>) kernel attributes {ce.tuning = #ce.tuning<block_size = 64, unroll = 2, row_cache_bytes = 4096>} {
    ce.fused %x, %y, %w into %loss, %lse, %x layout = flat {overwrite_input} : memref<?x?xbf16, #gpu.address_space<global>>, memref<?xi64, #gpu.address_space<global>>, memref<?xf32, #gpu.address_space<global>> into memref<?xf32, #gpu.address_space<global>>, memref<?xf32, #gpu.address_space<global>>, memref<?x?xbf16, #gpu.address_space<global>>
    gpu.return
  }
}
