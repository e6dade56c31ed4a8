//===- HostBackend.h - Calling host kernels ---------------------*- C++ -*-===//
//
// Internal to the runtime (not installed). Host kernels are C functions that
// take one pointer per argument, each to an MLIR strided memref descriptor
// (docs/bundle-format.md, "Kernel ABI"). This is where those descriptors are
// built from validated tensors and the call is made.
//
//===----------------------------------------------------------------------===//

#ifndef CE_RUNTIME_HOSTBACKEND_H
#define CE_RUNTIME_HOSTBACKEND_H

#include "KernelCache.h"
#include "Status.h"
#include "Validation.h"

#include <cstdint>

namespace ce {

/// MLIR's strided memref descriptor of rank `Rank` (what
/// `-finalize-memref-to-llvm` with `llvm.emit_c_interface` expects behind
/// each pointer argument of an `_mlir_ciface_` function).
template <int Rank> struct StridedMemRef {
  void *allocated;
  void *aligned;
  int64_t offset;
  int64_t sizes[Rank];
  int64_t strides[Rank];
};

/// The rank-0 descriptor has no size or stride arrays.
template <> struct StridedMemRef<0> {
  void *allocated;
  void *aligned;
  int64_t offset;
};

/// Calls a host kernel on the plan's tensors, in the order of the kernel's
/// manifest `args`. `status` is the kernel's status word; the caller zeroes
/// it and reads it afterwards. The plan must have at least one token.
Status launchHostKernel(const LoadedKernel &kernel, const LaunchPlan &plan,
                        int64_t &status);

} // namespace ce

#endif // CE_RUNTIME_HOSTBACKEND_H
