// RUN: ce-opt %s --pass-pipeline='builtin.module(gpu.module(ce-convert-gpu-to-target{target=nvvm}))' | FileCheck %s --check-prefix=NVVM
// RUN: ce-opt %s --pass-pipeline='builtin.module(gpu.module(ce-convert-gpu-to-target{target=rocdl chipset=gfx942}))' | FileCheck %s --check-prefix=ROCDL

// ce-convert-gpu-to-target on its own: a mapped kernel becomes an llvm.func
// with the target's kernel attribute and its `ce.tuning` kept (codegen reads
// the denormal flush from it); the thread id and the subgroup shuffle become
// the target's intrinsics; math.exp2/log2 stay LLVM intrinsics (no
// libdevice or ocml call); global memory is LLVM address space 1.

// NVVM-LABEL: llvm.func @k(%{{.*}}: !llvm.ptr<1>
// NVVM-SAME: ce.tuning = #ce.tuning<block_size = 64, unroll = 1, flush_denormals = true>
// NVVM-SAME: nvvm.kernel
// NVVM: nvvm.read.ptx.sreg.tid.x
// NVVM: llvm.load %{{.*}} : !llvm.ptr<1> -> f32
// NVVM: llvm.intr.exp2(%{{.*}}) : (f32) -> f32
// NVVM: llvm.intr.log2(%{{.*}}) : (f32) -> f32
// NVVM: nvvm.shfl.sync  bfly
// NVVM-NOT: llvm.call
// NVVM: llvm.return

// ROCDL-LABEL: llvm.func @k(%{{.*}}: !llvm.ptr<1>
// ROCDL-SAME: ce.tuning = #ce.tuning<block_size = 64, unroll = 1, flush_denormals = true>
// ROCDL-SAME: rocdl.kernel
// ROCDL: rocdl.workitem.id.x
// ROCDL: llvm.intr.exp2(%{{.*}}) : (f32) -> f32
// ROCDL: llvm.intr.log2(%{{.*}}) : (f32) -> f32
// ROCDL: rocdl.ds_bpermute
// ROCDL-NOT: llvm.call
// ROCDL: llvm.return

gpu.module @kernels {
  gpu.func @k(%x: memref<?xf32, #gpu.address_space<global>>, %out: memref<1xf32, #gpu.address_space<global>>) kernel attributes {ce.tuning = #ce.tuning<block_size = 64, unroll = 1, flush_denormals = true>} {
    %tid = gpu.thread_id x
    %v = memref.load %x[%tid] : memref<?xf32, #gpu.address_space<global>>
    %e = math.exp2 %v : f32
    %l = math.log2 %e : f32
    %c1 = arith.constant 1 : i32
    %c32 = arith.constant 32 : i32
    %s, %valid = gpu.shuffle xor %l, %c1, %c32 : f32
    %c0 = arith.constant 0 : index
    memref.store %s, %out[%c0] : memref<1xf32, #gpu.address_space<global>>
    gpu.return
  }
}
