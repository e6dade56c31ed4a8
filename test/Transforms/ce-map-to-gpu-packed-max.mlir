// RUN: ce-opt %s --pass-pipeline='builtin.module(gpu.module(ce-map-to-gpu{target=nvvm block-size=64 subgroup-size=32 unroll=2 packed-max=1},canonicalize,cse))' | FileCheck %s --check-prefix=PACKED
// RUN: ce-opt %s --pass-pipeline='builtin.module(gpu.module(ce-map-to-gpu{target=nvvm block-size=64 subgroup-size=32 unroll=2},canonicalize,cse))' | FileCheck %s --check-prefix=WIDE

// The packed maximum (NVIDIA's max.NaN.bf16x2, the TargetInfo feature
// `hasPackedMax`): a statistics step of bf16 logits takes the maximum of
// its loaded vectors before widening them (exact: the maximum of bf16
// values is one of them); without the option every lane is widened first.

// PACKED-LABEL: gpu.func @forward
// PACKED: %[[A:.*]] = vector.load {{.*}} vector<8xbf16>
// PACKED-NEXT: %[[B:.*]] = vector.load {{.*}} vector<8xbf16>
// PACKED-NEXT: %[[M:.*]] = arith.maximumf %[[A]], %[[B]] : vector<8xbf16>
// PACKED-NEXT: %[[R:.*]] = vector.reduction <maximumf>, %[[M]] : vector<8xbf16> into bf16
// PACKED-NEXT: arith.extf %[[R]] : bf16 to f32

// WIDE-LABEL: gpu.func @forward
// WIDE-NOT: arith.maximumf %{{.*}}, %{{.*}} : vector<8xbf16>
// WIDE: gpu.return

gpu.module @kernels {
  gpu.func @forward(%x: memref<?x?xbf16, #gpu.address_space<global>>, %y: memref<?xi64, #gpu.address_space<global>>, %loss: memref<?xf32, #gpu.address_space<global>>, %lse: memref<?xf32, #gpu.address_space<global>>) kernel {
    ce.forward %x, %y into %loss, %lse layout = flat : memref<?x?xbf16, #gpu.address_space<global>>, memref<?xi64, #gpu.address_space<global>> into memref<?xf32, #gpu.address_space<global>>, memref<?xf32, #gpu.address_space<global>>
    gpu.return
  }
}
