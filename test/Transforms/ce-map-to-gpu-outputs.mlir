// RUN: ce-opt %s --pass-pipeline='builtin.module(gpu.module(ce-map-to-gpu{block-size=128 subgroup-size=32 unroll=2},canonicalize,cse))' | FileCheck %s

// The entropy and argmax outputs on GPUs. Where flag bit 4 or 5 is set the
// statistics sweep is the one that also accumulates them (the other branch
// is the plain sweep): per vector the entropy's sum e a by one FMA (the
// exponent clamped only in masked steps: a -inf logit elsewhere makes the
// sum NaN, and its row takes the separate sweep), and per step, by scalar
// selects (no branch), the thread's best step: the step's first offset
// where its maximum grew, the lower one on a tie. Once the row's maximum is
// known, a thread that holds it in its vectors reads its best step again
// (a branch) for the lowest lane index equal to it (vector minsi). The
// threads' sums and smallest indices are combined (xor shuffles of the i32,
// workgroup slots by its bits). After the loss and lse stores, a row the
// statistics swept again exactly takes the separate outputs sweep (p log2 p
// terms, -1 for a NaN); every other row's entropy is log1p(rest) - U ln 2 /
// (1 + rest). No index found (an all -inf row) gives 0.

// CHECK-LABEL: gpu.func @forward
// CHECK-DAG: %[[MINUS1:.*]] = arith.constant dense<-1> : vector<8xi32>
// CHECK-DAG: %[[NONE:.*]] = arith.constant 2147483647 : i32
// CHECK: %[[B4:.*]] = arith.andi %arg6, %c16_i64 : i64
// CHECK: %[[B5:.*]] = arith.andi %arg6, %c32_i64 : i64
// CHECK: %[[WANT:.*]] = arith.ori
// CHECK: %[[STATS:.*]]:5 = scf.if %[[WANT]] -> (f32, f32, f32, i32, i1) {
// CHECK: scf.for {{.*}} -> (f32, vector<8xf32>, vector<8xf32>, i32, f32) {
// CHECK: %[[STEPMAX:.*]] = vector.reduction <maximumf>
// CHECK-NEXT: %[[FIRST:.*]] = arith.index_cast %{{.*}} : index to i32
// CHECK-NEXT: %[[GREW:.*]] = arith.cmpf ogt, %[[STEPMAX]], %[[OLD:.*]] : f32
// CHECK-NEXT: %[[TIE:.*]] = arith.cmpf oeq, %[[STEPMAX]], %[[OLD]] : f32
// CHECK-NEXT: %[[LOWER:.*]] = arith.minsi %[[BEST:.*]], %[[FIRST]] : i32
// CHECK-NEXT: %[[KEPT:.*]] = arith.select %[[TIE]], %[[LOWER]], %[[BEST]] : i32
// CHECK-NEXT: %[[STEP:.*]] = arith.select %[[GREW]], %[[FIRST]], %[[KEPT]] : i32
// CHECK-NOT: scf.if
// CHECK-NOT: vector<8xi32>
// The entropy sum's FMA takes each exponent unclamped (no maximumf between)
// in the main loop's steps:
// CHECK: %[[A:.*]] = math.fma %{{.*}} : vector<8xf32>
// CHECK-NEXT: %[[E:.*]] = math.exp2 %[[A]] : vector<8xf32>
// CHECK-NEXT: %[[W:.*]] = arith.mulf %[[E]], %[[A]] : vector<8xf32>
// CHECK: %[[A2:.*]] = math.fma %{{.*}} : vector<8xf32>
// CHECK-NEXT: %[[E2:.*]] = math.exp2 %[[A2]] : vector<8xf32>
// CHECK-NEXT: math.fma %[[E2]], %[[A2]], %[[W]] : vector<8xf32>
// CHECK: scf.yield %{{.*}}, %{{.*}}, %{{.*}}, %[[STEP]], %{{.*}} : f32, vector<8xf32>, vector<8xf32>, i32, f32
// and clamped in a masked step (lanes past the row are -inf):
// CHECK: %[[ME:.*]] = math.exp2 %[[MA:[0-9]+]] : vector<8xf32>
// CHECK-NEXT: %[[CLAMPED:.*]] = arith.maximumf %[[MA]], %{{.*}} : vector<8xf32>
// CHECK-NEXT: arith.mulf %[[ME]], %[[CLAMPED]] : vector<8xf32>
// The best step read again where the thread holds the row's maximum:
// CHECK: %[[HOLDS:.*]] = arith.andi %{{.*}}, %{{.*}} : i1
// CHECK-NEXT: %[[SEARCHED:.*]] = scf.if %[[HOLDS]] -> (i32) {
// CHECK: vector.load %arg0
// CHECK: arith.cmpf oeq, %{{.*}} : vector<8xf32>
// CHECK: arith.minsi %{{.*}} : vector<8xi32>
// CHECK: vector.reduction <minsi>, %{{.*}} : vector<8xi32> into i32
// CHECK: } else {
// CHECK-NEXT: scf.yield %[[NONE]] : i32
// CHECK: arith.minsi %[[SEARCHED]], %{{.*}} : i32
// CHECK-NEXT: %[[SH:.*]], %{{.*}} = gpu.shuffle  xor %{{.*}} : i32
// CHECK: arith.minsi %{{.*}}, %[[SH]] : i32
// CHECK: } else {
// CHECK-NOT: gpu.shuffle  xor %{{.*}} : i32
// CHECK: scf.yield %{{.*}}, %{{.*}}, %{{.*}}, %[[NONE]], %false
// CHECK: memref.store %{{.*}}, %arg3[%block_id_x]
// CHECK: scf.if %[[WANT]] {
// CHECK: %[[OUT:.*]]:2 = scf.if %[[STATS]]#4 -> (f32, i64) {
// CHECK: %[[NAN:.*]] = arith.cmpf uno, %{{.*}} : vector<8xf32>
// CHECK: arith.select %[[NAN]], %[[MINUS1]], %{{.*}} : vector<8xi1>, vector<8xi32>
// CHECK: } else {
// CHECK: %[[RATIO:.*]] = arith.divf %[[STATS]]#2, %{{.*}} : f32
// CHECK: math.fma %{{.*}}, %[[RATIO]], %{{.*}} : f32
// CHECK: %[[FOUND:.*]] = arith.cmpi ne, %[[STATS]]#3, %[[NONE]] : i32
// CHECK: arith.select %[[FOUND]], %{{.*}}, %{{.*}} : i64
// CHECK: memref.store %[[OUT]]#0, %arg4[%block_id_x] : memref<?xf32
// CHECK: memref.store %[[OUT]]#1, %arg5[%block_id_x] : memref<?xi64
gpu.module @kernels {
  gpu.func @forward(%x: memref<?x?xbf16, #gpu.address_space<global>>, %y: memref<?xi64, #gpu.address_space<global>>, %loss: memref<?xf32, #gpu.address_space<global>>, %lse: memref<?xf32, #gpu.address_space<global>>, %h: memref<?xf32, #gpu.address_space<global>>, %a: memref<?xi64, #gpu.address_space<global>>, %flags: i64) kernel {
    ce.forward %x, %y into %loss, %lse entropy(%h : memref<?xf32, #gpu.address_space<global>>) argmax(%a : memref<?xi64, #gpu.address_space<global>>) flags(%flags) layout = flat : memref<?x?xbf16, #gpu.address_space<global>>, memref<?xi64, #gpu.address_space<global>> into memref<?xf32, #gpu.address_space<global>>, memref<?xf32, #gpu.address_space<global>>
    gpu.return
  }
}
