//===- ROCDLTargetInfo.cpp - AMD features of the GPU mapping --------------===//
//
// CDNA (gfx90a, gfx942, gfx950) as the mapping sees it: no asynchronous
// global-to-workgroup copies (the row cache is filled by ordinary loads and
// stores), no packed bf16 maximum and no L2 prefetch; everything else is
// target-neutral gpu/vector code that the ROCDL conversion lowers.
//
//===----------------------------------------------------------------------===//

#include "TargetInfo.h"

using namespace mlir;
using namespace mlir::ce;

namespace {
class ROCDLTargetInfo final : public TargetInfo {
public:
  StringRef getName() const override { return "rocdl"; }
  bool hasAsyncCopy() const override { return false; }
  bool hasPackedMax() const override { return false; }
  bool hasL2Prefetch() const override { return false; }
};
} // namespace

const TargetInfo &mlir::ce::getROCDLTargetInfo() {
  static const ROCDLTargetInfo info;
  return info;
}
