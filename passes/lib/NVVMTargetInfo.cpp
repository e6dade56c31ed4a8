//===- NVVMTargetInfo.cpp - NVIDIA features of the GPU mapping ------------===//
//
// cp.async copies and groups (nvgpu.device_async_*), the packed bf16/f16
// maximum and the sm_90 bulk L2 prefetch (nvvm.cp.async.bulk.prefetch).
// Also holds the interface's defaults and the lookup by name.
//
//===----------------------------------------------------------------------===//

#include "TargetInfo.h"

#include "mlir/Dialect/LLVMIR/NVVMDialect.h"
#include "mlir/Dialect/NVGPU/IR/NVGPUDialect.h"
#include "llvm/Support/ErrorHandling.h"

using namespace mlir;
using namespace mlir::ce;

TargetInfo::~TargetInfo() = default;

void TargetInfo::buildAsyncCopy(ImplicitLocOpBuilder &, Value, ValueRange,
                                Value, ValueRange, int64_t) const {
  llvm_unreachable("the target has no asynchronous copies");
}

Value TargetInfo::buildCommitGroup(ImplicitLocOpBuilder &) const {
  llvm_unreachable("the target has no asynchronous copies");
}

void TargetInfo::buildWaitGroups(ImplicitLocOpBuilder &, Value,
                                 std::optional<int32_t>) const {
  llvm_unreachable("the target has no asynchronous copies");
}

void TargetInfo::setRegisterBudget(Operation *, unsigned) const {
  llvm_unreachable("the target has no register budget");
}

void TargetInfo::buildL2Prefetch(ImplicitLocOpBuilder &, Value, Value) const {
  llvm_unreachable("the target has no L2 prefetch");
}

namespace {
class NVVMTargetInfo final : public TargetInfo {
public:
  StringRef getName() const override { return "nvvm"; }
  bool hasAsyncCopy() const override { return true; }
  bool hasPackedMax() const override { return true; }
  bool hasL2Prefetch() const override { return true; }
  bool hasRegisterBudget() const override { return true; }
  unsigned getSoftcapFmaReciprocalEighths() const override {
    return kSoftcapFmaReciprocalEighths;
  }

  void setRegisterBudget(Operation *kernel, unsigned registers) const override {
    // Kept through the lowering to llvm.func; the NVVM translation makes it
    // the kernel's `.maxnreg`.
    kernel->setAttr(NVVM::NVVMDialect::getMaxnregAttrName(),
                    IntegerAttr::get(IntegerType::get(kernel->getContext(), 32),
                                     registers));
  }

  void buildAsyncCopy(ImplicitLocOpBuilder &b, Value dst, ValueRange dstIndices,
                      Value src, ValueRange srcIndices,
                      int64_t elements) const override {
    nvgpu::DeviceAsyncCopyOp::create(
        b, nvgpu::DeviceAsyncTokenType::get(b.getContext()), dst, dstIndices,
        src, srcIndices, b.getIndexAttr(elements), /*srcElements=*/Value(),
        /*bypassL1=*/b.getUnitAttr());
  }

  Value buildCommitGroup(ImplicitLocOpBuilder &b) const override {
    return nvgpu::DeviceAsyncCreateGroupOp::create(
        b, nvgpu::DeviceAsyncTokenType::get(b.getContext()), ValueRange{});
  }

  void buildWaitGroups(ImplicitLocOpBuilder &b, Value group,
                       std::optional<int32_t> pending) const override {
    nvgpu::DeviceAsyncWaitOp::create(
        b, group, pending ? b.getI32IntegerAttr(*pending) : IntegerAttr());
  }

  void buildL2Prefetch(ImplicitLocOpBuilder &b, Value pointer,
                       Value bytes) const override {
    NVVM::CpAsyncBulkPrefetchOp::create(b, pointer, bytes, Value());
  }
};
} // namespace

const TargetInfo &mlir::ce::getNVVMTargetInfo() {
  static const NVVMTargetInfo info;
  return info;
}

const TargetInfo *mlir::ce::getTargetInfo(StringRef name) {
  if (name == getNVVMTargetInfo().getName())
    return &getNVVMTargetInfo();
  if (name == getROCDLTargetInfo().getName())
    return &getROCDLTargetInfo();
  return nullptr;
}
