//===- TargetInfo.h - What the GPU mapping asks of a target -----*- C++ -*-===//
//
// The target features the generic GPU mapping (ce-map-to-gpu) may use, behind
// one interface with an implementation per target, as Triton's
// TargetInfoBase: the mapping asks "can you stage a chunk asynchronously?"
// and the target builds the ops. NVVMTargetInfo.cpp and ROCDLTargetInfo.cpp
// hold the implementations; no NVVM or nvgpu op is built outside the NVIDIA
// one and the conversion to LLVM.
//
//===----------------------------------------------------------------------===//

#ifndef CE_TRANSFORMS_TARGETINFO_H
#define CE_TRANSFORMS_TARGETINFO_H

#include "mlir/IR/Builders.h"
#include "mlir/IR/ImplicitLocOpBuilder.h"
#include "mlir/IR/Value.h"

#include <optional>

namespace mlir::ce {

/// NVIDIA's getSoftcapFmaReciprocalEighths(), which the host kernels take
/// too: CI's host numerics then run the code of the NVIDIA kernels.
inline constexpr unsigned kSoftcapFmaReciprocalEighths = 4;

class TargetInfo {
public:
  virtual ~TargetInfo();

  /// The name the passes' `target` options use ("nvvm", "rocdl").
  virtual StringRef getName() const = 0;

  /// Asynchronous global-to-workgroup copies, completed in groups
  /// (NVIDIA cp.async, sm_80+).
  virtual bool hasAsyncCopy() const = 0;
  /// A maximum of two packed bf16/f16 values per instruction (NVIDIA
  /// max.NaN.bf16x2 / f16x2, sm_80+), taken before widening.
  virtual bool hasPackedMax() const = 0;
  /// A bulk prefetch of a global memory range into L2 (NVIDIA sm_90).
  virtual bool hasL2Prefetch() const = 0;
  /// A per-kernel cap on the registers per thread that the target's
  /// compiler honours (NVIDIA `.maxnreg`).
  virtual bool hasRegisterBudget() const { return false; }
  /// The share, in eighths of each vector, of a softcap kernel's
  /// reciprocals 1 / (1 + 2^(x k)) built from FMAs (RowSoftcap.cpp) instead
  /// of the transcendental unit. Where that unit is what limits the sweep
  /// (NVIDIA's MUFU: 16 results a clock per SM against 128 FMAs), moving
  /// part of its work to the FMA pipe balances the two. 0: none.
  virtual unsigned getSoftcapFmaReciprocalEighths() const { return 0; }

  /// Caps `kernel`'s registers per thread at `registers`. Only when
  /// hasRegisterBudget().
  virtual void setRegisterBudget(Operation *kernel, unsigned registers) const;

  /// Starts an asynchronous copy of `elements` elements from
  /// `src[srcIndices...]` to workgroup memory `dst[dstIndices...]`, bypassing
  /// L1. Only when hasAsyncCopy().
  virtual void buildAsyncCopy(ImplicitLocOpBuilder &b, Value dst,
                              ValueRange dstIndices, Value src,
                              ValueRange srcIndices, int64_t elements) const;
  /// Closes the asynchronous copies issued so far by this thread into a
  /// group (an empty one if there are none); returns its token.
  virtual Value buildCommitGroup(ImplicitLocOpBuilder &b) const;
  /// Waits until at most `pending` of this thread's groups are in flight
  /// (none left without a count); `group` is the newest group's token.
  virtual void buildWaitGroups(ImplicitLocOpBuilder &b, Value group,
                               std::optional<int32_t> pending) const;
  /// Starts a prefetch of `bytes` bytes at the global `pointer` (an LLVM
  /// pointer in address space 1) into L2. Only when hasL2Prefetch().
  virtual void buildL2Prefetch(ImplicitLocOpBuilder &b, Value pointer,
                               Value bytes) const;
};

/// The target info for `name` ("nvvm", "rocdl"), or null if there is none.
const TargetInfo *getTargetInfo(StringRef name);

/// The NVIDIA (NVVM) and AMD (ROCDL) implementations.
const TargetInfo &getNVVMTargetInfo();
const TargetInfo &getROCDLTargetInfo();

} // namespace mlir::ce

#endif // CE_TRANSFORMS_TARGETINFO_H
